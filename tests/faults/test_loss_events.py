"""A lost lock is reported to event listeners: its end (``released``, reason ``"lost"``)
and the loss (``lost``) once each, however many times the holder learns of it.

Faults as in test_lost_locks.py: the holder's connection killed (PostgreSQL
``pg_terminate_backend``, MariaDB ``KILL CONNECTION``, SQLite's DB-API connection closed
under the library), and the lock dropped on its own connection behind the library's back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text

from advisory_locks import LockLost, advisory_lock
from tests.faults.servers import FaultDatabase, opened_connections
from tests.helpers import EventRecorder, open_bind, unique_name

pytestmark = pytest.mark.faults

BINDS = ["engine", "connection", "session"]


@pytest.mark.parametrize("kind", BINDS)
def test_a_killed_connection_found_by_ensure_held_is_reported_lost_once(
    kind: str,
    make_engine: Callable[..., Engine],
    database: FaultDatabase,
    lock_events: EventRecorder,
) -> None:
    name = unique_name("lost-event")
    engine = make_engine(database.url)
    opened = opened_connections(engine)
    with open_bind(kind, engine) as bind:
        lock = advisory_lock(bind, name)
        lock.acquire()
        database.kill(opened)
        with pytest.raises(LockLost):
            lock.ensure_held()
        with pytest.raises(LockLost):
            lock.release()
    assert lock_events.kinds(name) == ["acquired", "released", "lost"]
    acquired, released, lost = lock_events.about(name)
    assert released.reason == "lost"
    assert lost.reason == "connection_failed"
    assert lost.error is not None
    assert lost.system == database.name
    assert lost.held is not None
    assert lost.held >= 0
    assert acquired.granted_at == released.granted_at == lost.granted_at


@pytest.mark.parametrize("kind", BINDS)
def test_a_killed_connection_found_at_release_is_reported_lost(
    kind: str,
    make_engine: Callable[..., Engine],
    database: FaultDatabase,
    lock_events: EventRecorder,
) -> None:
    name = unique_name("lost-at-release")
    engine = make_engine(database.url)
    opened = opened_connections(engine)
    with open_bind(kind, engine) as bind, pytest.raises(LockLost), advisory_lock(bind, name):
        database.kill(opened)
    assert lock_events.kinds(name) == ["acquired", "released", "lost"]
    assert lock_events.one(name, "released").reason == "lost"
    assert lock_events.one(name, "lost").reason == "connection_failed"


def test_a_lock_unlocked_behind_the_librarys_back_is_reported_not_held(
    make_engine: Callable[..., Engine], lock_events: EventRecorder
) -> None:
    name = unique_name("unlocked-behind")
    with make_engine().connect() as connection:
        lock = advisory_lock(connection, name)
        lock.acquire()
        connection.execute(text("SELECT pg_advisory_unlock_all()"))
        with pytest.raises(LockLost):
            lock.ensure_held()
    assert lock_events.kinds(name) == ["acquired", "released", "lost"]
    assert lock_events.one(name, "released").reason == "lost"
    lost = lock_events.one(name, "lost")
    assert (lost.reason, lost.error) == ("not_held", None)


def test_a_transaction_lock_whose_transaction_ended_in_the_block_is_reported_lost(
    make_engine: Callable[..., Engine], lock_events: EventRecorder
) -> None:
    name = unique_name("lost-transaction")
    with make_engine().connect() as connection:
        lock = advisory_lock(connection, name, transaction=True)
        lock.acquire()
        connection.commit()
        with pytest.raises(LockLost):
            lock.ensure_held()
    assert lock_events.kinds(name) == ["acquired", "released", "lost"]
    assert lock_events.one(name, "released").reason == "commit"
    assert lock_events.one(name, "lost").reason == "transaction_ended"


@pytest.mark.django_db(transaction=True)
def test_a_django_connection_closed_under_a_lock_is_reported_when_django_reconnects(
    lock_events: EventRecorder,
) -> None:
    from django.db import connection

    from advisory_locks_django import advisory_lock as django_advisory_lock

    name, other = unique_name("lost-django"), unique_name("lost-django-next")
    lock = django_advisory_lock(name)
    lock.acquire()
    connection.close()
    # The next lock on the alias reconnects, and finds the first one gone with its
    # connection.
    with django_advisory_lock(other):
        assert lock_events.kinds(name) == ["acquired", "released"]
    with pytest.raises(LockLost):
        lock.release()
    assert lock_events.kinds(name) == ["acquired", "released", "lost"]
    released, lost = lock_events.about(name)[1:]
    assert (released.reason, released.database) == ("connection_closed", "default")
    assert (lost.reason, lost.binding) == ("connection_closed", "django")
