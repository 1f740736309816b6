"""A lock the server stopped holding is reported: at release at the latest, and while the
block runs whenever it calls ``ensure_held()``.

Faults: the holder's connection killed (PostgreSQL ``pg_terminate_backend``, MariaDB
``KILL CONNECTION``, SQLite's DB-API connection closed under the library); the lock dropped
on its own connection behind the library's back (``pg_advisory_unlock_all()``); a
transaction lock whose transaction ended inside the block.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from advisory_locks import LockLost, LockUsageError, advisory_lock
from tests.faults.conftest import inject
from tests.faults.servers import FaultDatabase, opened_connections
from tests.helpers import backend_alive, holder_pids, open_bind, unique_name, wait_for

pytestmark = pytest.mark.faults

Admin = psycopg.Connection[TupleRow]
BINDS = ["engine", "connection", "session"]


def terminate_holder(admin: Admin, name: str) -> int:
    (pid,) = holder_pids(admin, name)
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    inject("backend terminated")
    wait_for(lambda: not backend_alive(admin, pid), "the backend has exited")
    return pid


@pytest.mark.parametrize("kind", BINDS)
def test_ensure_held_passes_while_the_server_holds_the_lock(
    kind: str, make_engine: Callable[..., Engine]
) -> None:
    with open_bind(kind, make_engine()) as bind, advisory_lock(bind, unique_name()) as lock:
        lock.ensure_held()
        assert lock.held


@pytest.mark.parametrize("kind", BINDS)
def test_ensure_held_raises_lock_lost_after_the_connection_was_killed(
    kind: str, make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    # PostgreSQL: pg_terminate_backend; MariaDB: KILL CONNECTION; SQLite: the DB-API
    # connection closed under the library.
    name = unique_name()
    engine = make_engine(database.url)
    opened = opened_connections(engine)
    with open_bind(kind, engine) as bind:
        lock = advisory_lock(bind, name)
        lock.acquire()
        lock.ensure_held()
        database.kill(opened)
        with pytest.raises(LockLost) as raised:
            lock.ensure_held()
        assert raised.value.name == name
        assert not lock.held
        assert database.holder(name) is None


@pytest.mark.parametrize("kind", BINDS)
def test_release_after_a_loss_seen_by_ensure_held_still_raises_lock_lost(
    kind: str, make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    name = unique_name()
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


def test_with_block_reports_a_loss_seen_by_ensure_held_once(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    name = unique_name()
    engine = make_engine()
    with (  # noqa: PT012
        engine.connect() as connection,
        pytest.raises(LockLost) as raised,
        advisory_lock(connection, name) as lock,
    ):
        terminate_holder(pg_admin, name)
        lock.ensure_held()
    # The loss ensure_held() raised is the one the caller sees, not buried under a
    # second LockLost from the release at block exit.
    assert not isinstance(raised.value.__context__, LockLost)
    assert "connection failed" in str(raised.value)


@pytest.mark.parametrize("kind", BINDS)
def test_block_that_never_checks_learns_the_loss_at_release(
    kind: str, make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    name = unique_name()
    engine = make_engine(database.url)
    opened = opened_connections(engine)
    reached_end_of_block = False
    with (  # noqa: PT012
        open_bind(kind, engine) as bind,
        pytest.raises(LockLost),
        advisory_lock(bind, name),
    ):
        database.kill(opened)
        reached_end_of_block = True
    assert reached_end_of_block
    assert database.holder(name) is None


def test_ensure_held_raises_lock_lost_when_the_lock_was_unlocked_behind_its_back(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    name = unique_name()
    with make_engine().connect() as connection:
        lock = advisory_lock(connection, name)
        lock.acquire()
        # Raw SQL on the holding connection, as a careless library or DISCARD ALL would.
        connection.exec_driver_sql("SELECT pg_advisory_unlock_all()")
        connection.commit()
        inject("lock dropped behind the library's back")
        assert holder_pids(pg_admin, name) == []
        with pytest.raises(LockLost, match="no longer holds"):
            lock.ensure_held()


def test_ensure_held_raises_lock_lost_for_a_transaction_lock_whose_transaction_ended(
    make_engine: Callable[..., Engine],
) -> None:
    with make_engine().connect() as connection:
        connection.begin()
        lock = advisory_lock(connection, unique_name(), transaction=True)
        lock.acquire()
        lock.ensure_held()
        connection.commit()
        inject("transaction ended inside a transaction-lock block")
        with pytest.raises(LockLost, match="transaction ended"):
            lock.ensure_held()


def test_ensure_held_passes_for_a_transaction_lock_inside_its_transaction(
    make_engine: Callable[..., Engine],
) -> None:
    with (
        make_engine().connect() as connection,
        connection.begin(),
        advisory_lock(connection, unique_name(), transaction=True) as lock,
    ):
        connection.execute(text("SELECT 1"))
        lock.ensure_held()


def test_ensure_held_on_a_lock_that_is_not_held_is_a_usage_error(
    make_engine: Callable[..., Engine],
) -> None:
    with make_engine().connect() as connection:
        lock = advisory_lock(connection, unique_name())
        with pytest.raises(LockUsageError, match="not held by this lock object"):
            lock.ensure_held()


def test_ensure_held_passes_for_a_shared_lock(make_engine: Callable[..., Engine]) -> None:
    with (
        make_engine().connect() as connection,
        advisory_lock(connection, unique_name(), shared=True) as lock,
    ):
        lock.ensure_held()


async def test_async_ensure_held_raises_lock_lost_after_the_backend_was_terminated(
    postgres_url: URL, pg_admin: Admin
) -> None:
    engine = create_async_engine(postgres_url.set(drivername="postgresql+asyncpg"))
    name = unique_name()
    try:
        async with engine.connect() as connection:
            lock = advisory_lock(connection, name)
            assert await lock.acquire()
            await lock.ensure_held()
            terminate_holder(pg_admin, name)
            with pytest.raises(LockLost):
                await lock.ensure_held()
    finally:
        await engine.dispose()


def test_django_lock_reports_its_killed_connection_at_ensure_held_and_release(
    django_alias: str, database: FaultDatabase
) -> None:
    from django.db import connections

    from advisory_locks_django import advisory_lock as django_advisory_lock

    name = unique_name("django-killed")
    lock = django_advisory_lock(name, using=django_alias)
    lock.acquire()
    lock.ensure_held()
    database.kill([connections[django_alias].connection])
    with pytest.raises(LockLost):
        lock.ensure_held()
    with pytest.raises(LockLost):
        lock.release()
    # Django reconnects for the next lock; the killed session's lock is gone.
    again = django_advisory_lock(name, using=django_alias, timeout=0)
    assert again.acquire() is True
    again.release()
