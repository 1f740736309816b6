"""Lock events beyond the contract suite: the listener API, transaction locks, lock sets,
asyncio binds, deadlocks and errors (PostgreSQL through SQLAlchemy)."""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from advisory_locks import (
    LockDeadlock,
    UnsupportedFeature,
    advisory_lock,
    advisory_lock_set,
    events,
)
from advisory_locks.events import LockEvent
from tests.helpers import EventRecorder, run_crossed, unique_name

pytestmark = pytest.mark.timeout(60)

JOIN_SECONDS = 30.0


# -- the listener API ---------------------------------------------------------------------


def test_a_listener_subscribed_twice_is_called_once(pg_engine: Engine) -> None:
    name = unique_name()
    heard: list[str] = []

    def listener(event: LockEvent) -> None:
        if event.name == name:
            heard.append(event.kind)

    events.subscribe(listener)
    events.subscribe(listener)
    try:
        with advisory_lock(pg_engine, name):
            pass
    finally:
        events.unsubscribe(listener)
    assert heard == ["acquired", "released"]


def test_an_unsubscribed_listener_hears_nothing_more(pg_engine: Engine) -> None:
    name = unique_name()
    heard: list[str] = []
    listener = events.subscribe(lambda event: heard.append(event.kind))
    events.unsubscribe(listener)
    with advisory_lock(pg_engine, name):
        pass
    assert heard == []


def test_subscribe_refuses_what_cannot_be_called() -> None:
    with pytest.raises(TypeError, match="callable"):
        events.subscribe("print")  # type: ignore[arg-type]


def test_a_failing_listener_is_logged_and_neither_stops_the_lock_nor_the_others(
    pg_engine: Engine, lock_events: EventRecorder, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique_name()

    def broken(event: LockEvent) -> None:
        raise RuntimeError("metrics client down")

    events.subscribe(broken)
    try:
        with (
            caplog.at_level(logging.ERROR, logger="advisory_locks"),
            advisory_lock(pg_engine, name) as lock,
        ):
            assert lock.held
    finally:
        events.unsubscribe(broken)
    assert lock_events.kinds(name) == ["acquired", "released"]
    assert not lock.held
    assert any(
        "metrics client down" in record.exc_text for record in caplog.records if record.exc_text
    )


def test_a_listener_subscribed_while_a_lock_is_held_hears_no_release_of_it(
    pg_engine: Engine,
) -> None:
    # Every release a listener hears follows a grant it heard, so a count of held locks
    # kept from the events never goes below zero.
    name = unique_name()
    with advisory_lock(pg_engine, name):
        late = EventRecorder()
        events.subscribe(late)
    events.unsubscribe(late)
    assert late.kinds(name) == []


# -- transaction locks and modes ----------------------------------------------------------


def test_a_transaction_lock_is_reported_released_at_the_commit(
    pg_engine: Engine, lock_events: EventRecorder
) -> None:
    name = unique_name()
    with Session(pg_engine) as session:
        with advisory_lock(session, name, transaction=True):
            pass
        assert lock_events.kinds(name) == ["acquired"]
        session.commit()
    released = lock_events.one(name, "released")
    assert (released.reason, released.scope) == ("commit", "transaction")
    assert released.held is not None
    assert released.held >= 0


def test_a_transaction_lock_is_reported_released_at_the_rollback(
    pg_engine: Engine, lock_events: EventRecorder
) -> None:
    name = unique_name()
    with Session(pg_engine) as session:
        advisory_lock(session, name, transaction=True).acquire()
        session.rollback()
    assert lock_events.one(name, "released").reason == "rollback"


def test_a_savepoint_rollback_reports_the_locks_taken_inside_it_at_once(
    pg_engine: Engine, lock_events: EventRecorder
) -> None:
    outer, inner = unique_name("outer"), unique_name("inner")
    with Session(pg_engine) as session, session.begin():
        advisory_lock(session, outer, transaction=True).acquire()
        savepoint = session.begin_nested()
        advisory_lock(session, inner, transaction=True).acquire()
        savepoint.rollback()
        assert lock_events.kinds(inner) == ["acquired", "released"]
        assert lock_events.one(inner, "released").reason == "rollback"
        assert lock_events.kinds(outer) == ["acquired"]
    assert lock_events.one(outer, "released").reason == "commit"


def test_a_shared_lock_is_reported_shared(pg_engine: Engine, lock_events: EventRecorder) -> None:
    name = unique_name()
    with advisory_lock(pg_engine, name, shared=True):
        pass
    assert {event.mode for event in lock_events.about(name)} == {"shared"}


def test_a_connection_invalidated_under_a_lock_reports_its_release(
    pg_engine: Engine, lock_events: EventRecorder
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        advisory_lock(connection, name).acquire()
        connection.invalidate()
    released = lock_events.one(name, "released")
    assert released.reason == "connection_closed"


def test_every_lock_of_a_set_is_reported(pg_engine: Engine, lock_events: EventRecorder) -> None:
    names = [unique_name("set-a"), unique_name("set-b")]
    with advisory_lock_set(pg_engine, names):
        pass
    for name in names:
        assert lock_events.kinds(name) == ["acquired", "released"]


# -- failures and asyncio -----------------------------------------------------------------


def test_a_refusal_before_the_wait_is_reported_with_its_error(
    pg_engine: Engine, lock_events: EventRecorder
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(UnsupportedFeature):
            advisory_lock(connection, name, transaction=True).acquire()
    refused = lock_events.one(name, "not_acquired")
    assert refused.reason == "error"
    assert isinstance(refused.error, UnsupportedFeature)


def test_a_deadlock_victim_is_reported_not_acquired_for_a_deadlock(
    pg_engine: Engine, lock_events: EventRecorder
) -> None:
    barrier = threading.Barrier(2, timeout=JOIN_SECONDS)

    def take(mine: str, theirs: str) -> None:
        with Session(pg_engine) as session, session.begin():
            advisory_lock(session, mine, transaction=True).acquire()
            barrier.wait()
            with contextlib.suppress(LockDeadlock):
                advisory_lock(session, theirs, transaction=True).acquire()

    run_crossed(take, join_seconds=JOIN_SECONDS)
    refusals = [
        event
        for event in lock_events.all()
        if event.kind == "not_acquired" and event.reason == "deadlock"
    ]
    assert len(refusals) == 1
    assert isinstance(refusals[0].error, LockDeadlock)


async def test_an_asyncio_bind_reports_like_a_blocking_one(
    postgres_url_for: object, lock_events: EventRecorder
) -> None:
    url: URL = postgres_url_for("asyncpg")  # type: ignore[operator]
    engine = create_async_engine(url)
    name = unique_name()
    try:
        async with AsyncSession(engine) as session, advisory_lock(session, name):
            result = await session.execute(text("SELECT 1"))
            assert result.scalar() == 1
    finally:
        await engine.dispose()
    acquired, released = lock_events.about(name)
    assert (acquired.kind, released.kind, released.reason) == ("acquired", "released", "unlock")
    assert acquired.binding == "sqlalchemy"
    assert acquired.system == "postgresql"


async def test_a_cancelled_wait_is_reported_cancelled(
    pg_engine: Engine, postgres_url_for: object, lock_events: EventRecorder
) -> None:
    import asyncio

    url: URL = postgres_url_for("asyncpg")  # type: ignore[operator]
    engine = create_async_engine(url)
    name = unique_name()
    try:
        with advisory_lock(pg_engine, name), pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(advisory_lock(engine, name).acquire(), 0.2)
    finally:
        await engine.dispose()
    refusal = lock_events.one(name, "not_acquired")
    assert refusal.reason == "cancelled"
    assert isinstance(refusal.error, asyncio.CancelledError)
