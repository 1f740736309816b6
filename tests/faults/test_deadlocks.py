"""Deadlocks between two holders, and taking several locks in one canonical order.

Crossed requests (A then B against B then A) make PostgreSQL pick a victim, which gets
``LockDeadlock``. ``advisory_lock_set`` takes every set in key order, so the same two
requests queue behind each other instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from advisory_locks import (
    LockDeadlock,
    LockNotAcquired,
    LockTimeout,
    advisory_lock,
    advisory_lock_set,
    lock_key,
)
from tests.faults.conftest import inject
from tests.helpers import (
    advisory_statements,
    holder_pids,
    lock_rows,
    record_statements,
    run_crossed,
    unique_name,
    wait_for,
    waiter_pids,
)

pytestmark = pytest.mark.faults

Admin = psycopg.Connection[TupleRow]
JOIN_SECONDS = 30.0


def crossed(
    engine: Engine, take: Callable[[Session, str, str, threading.Barrier], str]
) -> list[str]:
    """Two threads take (A, B) and (B, A) with ``take``; return their sorted outcomes."""
    barrier = threading.Barrier(2, timeout=JOIN_SECONDS)
    outcomes: list[str] = []

    def run(mine: str, theirs: str) -> None:
        with Session(engine) as session:
            outcomes.append(take(session, mine, theirs, barrier))

    run_crossed(run, join_seconds=JOIN_SECONDS)
    return sorted(outcomes)


def test_crossed_transaction_locks_raise_lock_deadlock_in_one_session(
    make_engine: Callable[..., Engine],
) -> None:
    def take(session: Session, mine: str, theirs: str, barrier: threading.Barrier) -> str:
        with session.begin():
            advisory_lock(session, mine, transaction=True).acquire()
            barrier.wait()
            try:
                advisory_lock(session, theirs, transaction=True).acquire()
            except LockDeadlock:
                inject("deadlock")
                # The wait ran in a savepoint: the transaction is still usable.
                assert session.scalar(text("SELECT 1")) == 1
                return "deadlock"
            return "granted"

    assert crossed(make_engine(), take) == ["deadlock", "granted"]


def test_crossed_names_taken_as_lock_sets_never_deadlock(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(pool_size=4)
    rounds = 25

    def take(session: Session, mine: str, theirs: str, barrier: threading.Barrier) -> str:
        for _ in range(rounds):
            barrier.wait()
            with advisory_lock_set(session, [mine, theirs], timeout=None) as locks:
                assert locks.held
        return "done"

    assert crossed(engine, take) == ["done", "done"]


def test_lock_set_waits_behind_a_holder_of_its_first_key_instead_of_crossing(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    # The interleaving that deadlocks crossed requests, forced: one side holds the lower
    # key and is about to take the higher one while the other side asks for its set.
    engine = make_engine()
    low, high = sorted([unique_name(), unique_name()], key=lambda name: lock_key(name))
    granted = threading.Event()

    def other_side() -> None:
        with Session(engine) as session, advisory_lock_set(session, [high, low]):
            granted.set()

    with Session(engine) as session:
        holding_low = advisory_lock(session, low)
        holding_low.acquire()
        thread = threading.Thread(target=other_side, daemon=True)
        thread.start()
        wait_for(lambda: len(waiter_pids(pg_admin, low)) == 1, "the set waits for the low key")
        # It asked for the low key first, so it holds nothing we could deadlock on.
        assert holder_pids(pg_admin, high) == []
        with advisory_lock(session, high, timeout=5):
            pass
        holding_low.release()
    thread.join(JOIN_SECONDS)
    assert granted.is_set()


def test_lock_set_takes_its_locks_in_key_order_whatever_the_listed_order(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    statements = record_statements(engine)
    names = [unique_name() for _ in range(5)]
    with engine.connect() as connection, advisory_lock_set(connection, names) as locks:
        assert locks.names == sorted(names, key=lambda name: lock_key(name))
    taken = [s for s in advisory_statements(statements) if "unlock" not in s]
    keys_in_sql_order = [int(s.split("(")[1].split(")")[0]) for s in taken]
    assert keys_in_sql_order == sorted(lock_key(name) for name in names)


def test_lock_set_gives_back_what_it_took_when_a_later_lock_is_busy(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine()
    low, high = sorted([unique_name(), unique_name()], key=lambda name: lock_key(name))
    with engine.connect() as rival, advisory_lock(rival, high), engine.connect() as connection:
        lock_set = advisory_lock_set(connection, [low, high], timeout=0)
        assert lock_set.acquire() is False
        assert lock_rows(pg_admin, low) == []
        assert not lock_set.held


def test_lock_set_with_block_raises_lock_timeout_naming_the_busy_lock(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    free, busy = unique_name("free"), unique_name("busy")
    with (
        engine.connect() as rival,
        advisory_lock(rival, busy),
        engine.connect() as connection,
        pytest.raises(LockTimeout, match="busy"),
        advisory_lock_set(connection, [free, busy], timeout=0.2),
    ):
        pass


def test_lock_set_with_zero_timeout_raises_lock_not_acquired_when_one_is_busy(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    busy = unique_name()
    with (
        engine.connect() as rival,
        advisory_lock(rival, busy),
        engine.connect() as connection,
        pytest.raises(LockNotAcquired),
        advisory_lock_set(connection, [unique_name(), busy], timeout=0),
    ):
        pass


def test_lock_set_takes_a_name_listed_twice_once(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    name = unique_name()
    with make_engine().connect() as connection:
        with advisory_lock_set(connection, [name, name, lock_key(name)]) as locks:
            assert len(locks.locks) == 1
            assert len(holder_pids(pg_admin, name)) == 1
        assert holder_pids(pg_admin, name) == []


def test_lock_set_of_transaction_locks_lives_until_the_transaction_ends(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    names = [unique_name(), unique_name()]
    with make_engine().connect() as connection:
        with connection.begin():
            with advisory_lock_set(connection, names, transaction=True):
                pass
            assert all(holder_pids(pg_admin, name) for name in names)
        assert not any(holder_pids(pg_admin, name) for name in names)


@pytest.mark.parametrize("names", ["one-string", b"bytes", 42])
def test_lock_set_rejects_a_single_name_in_place_of_a_collection(
    names: object, make_engine: Callable[..., Engine]
) -> None:
    with make_engine().connect() as connection, pytest.raises(TypeError, match="collection"):
        advisory_lock_set(connection, names)  # type: ignore[call-overload]


def test_lock_set_rejects_a_bad_name_before_any_sql(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    statements = record_statements(engine)
    with engine.connect() as connection, pytest.raises(TypeError):
        advisory_lock_set(connection, [unique_name(), 1.5])  # type: ignore[list-item]
    assert advisory_statements(statements) == []


async def test_async_lock_set_takes_and_releases_every_lock(
    postgres_url: URL, pg_admin: Admin
) -> None:
    engine = create_async_engine(postgres_url.set(drivername="postgresql+asyncpg"))
    names = [unique_name(), unique_name()]
    try:
        async with engine.connect() as connection:
            async with advisory_lock_set(connection, names) as locks:
                assert all(holder_pids(pg_admin, name) for name in names)
                await locks.ensure_held()
            assert not any(holder_pids(pg_admin, name) for name in names)
    finally:
        await engine.dispose()


def test_lock_set_on_an_engine_holds_all_its_locks_on_one_connection(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    names = [unique_name() for _ in range(3)]
    engine = make_engine(pool_size=1, max_overflow=0, pool_timeout=5)
    with advisory_lock_set(engine, names):
        assert len({pid for name in names for pid in holder_pids(pg_admin, name)}) == 1
    assert not any(holder_pids(pg_admin, name) for name in names)
    # Its connection went back to the pool: the one-connection pool lends it again.
    with advisory_lock_set(engine, names):
        pass
