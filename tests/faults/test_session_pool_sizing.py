"""Sessions taking session locks on a bounded pool, on PostgreSQL, MariaDB and SQLite.

What holds: a Session holding session locks uses one pooled connection, its lock
connection, on which its transactions run too. So any number of threads with Sessions
queue for the pool but never time out because of each other; a Session never waits for
a lock it holds itself; and when the pool really is too small, the error says that the
lock needed a connection and how to size the pool.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text
from sqlalchemy import exc as sqlalchemy_errors
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from advisory_locks import LockUsageError, advisory_lock, current_advisory_locks
from advisory_locks.sqlalchemy import (
    AdvisoryLockSession,
    AsyncAdvisoryLockSession,
    LockConnectionTimeout,
)
from tests.databases import PostgresDriver
from tests.faults.conftest import inject
from tests.faults.servers import FaultDatabase
from tests.helpers import holder_pids, unique_name

pytestmark = pytest.mark.faults

THREADS = 32
OPERATIONS_PER_THREAD = 5
NAMES = 7
POOL_SIZE, MAX_OVERFLOW = 5, 10
POOL_TIMEOUT = 5.0
JOIN_SECONDS = 120.0


def run_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Run ``work(index)`` in ``count`` threads released together; their errors."""
    start = threading.Barrier(count, timeout=JOIN_SECONDS)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            start.wait()
            work(index)
        except BaseException as error:  # reported by the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert not any(thread.is_alive() for thread in threads)
    return errors


def test_threads_with_sessions_queue_for_a_small_pool_without_timing_out(
    database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(
        database.url, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW, pool_timeout=POOL_TIMEOUT
    )
    make_session = sessionmaker(engine, class_=AdvisoryLockSession)
    names = [unique_name(f"queue-{index}") for index in range(NAMES)]
    done: list[int] = []

    def work(index: int) -> None:
        for operation in range(OPERATIONS_PER_THREAD):
            with (
                make_session() as session,
                session.advisory_lock(names[(index + operation) % NAMES]),
            ):
                session.execute(text("SELECT 1"))
                done.append(index)

    inject(f"{THREADS} threads with Sessions on a pool of {POOL_SIZE}+{MAX_OVERFLOW}")
    # A thread that waited out pool_timeout would have raised LockConnectionTimeout.
    errors = run_threads(THREADS, work)
    assert errors == []
    assert len(done) == THREADS * OPERATIONS_PER_THREAD
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert database.leaked(names) == []


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async"])
async def test_tasks_with_async_sessions_queue_for_a_small_pool_without_timing_out(
    driver: PostgresDriver,
    postgres_url_for: Callable[[PostgresDriver], URL],
    pg_admin: psycopg.Connection[TupleRow],
) -> None:
    engine = create_async_engine(
        postgres_url_for(driver),
        pool_size=POOL_SIZE,
        max_overflow=MAX_OVERFLOW,
        pool_timeout=POOL_TIMEOUT,
    )
    make_session = async_sessionmaker(engine, class_=AsyncAdvisoryLockSession)
    names = [unique_name(f"queue-{index}") for index in range(NAMES)]
    start = asyncio.Event()

    async def work(index: int) -> int:
        await start.wait()
        for operation in range(OPERATIONS_PER_THREAD):
            name = names[(index + operation) % NAMES]
            async with make_session() as session, session.advisory_lock(name):
                await session.execute(text("SELECT 1"))
        return OPERATIONS_PER_THREAD

    inject(f"{THREADS} tasks with AsyncSessions on a pool of {POOL_SIZE}+{MAX_OVERFLOW}")
    try:
        tasks = [asyncio.create_task(work(index)) for index in range(THREADS)]
        start.set()
        done = await asyncio.wait_for(asyncio.gather(*tasks), JOIN_SECONDS)
        assert sum(done) == THREADS * OPERATIONS_PER_THREAD
        assert engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        await engine.dispose()
    assert [name for name in names if holder_pids(pg_admin, name)] == []


def test_session_holding_a_session_lock_uses_one_connection(
    database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(database.url, pool_size=1, max_overflow=0, pool_timeout=1)
    name = unique_name()
    inject("pool of one connection")
    with Session(engine) as session, advisory_lock(session, name) as lock:
        for _ in range(2):
            session.execute(text("SELECT 1"))
            session.commit()
        session.execute(text("SELECT 1"))
        lock.ensure_held()
        assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert database.holder(name) is None


def test_session_locking_inside_its_transaction_keeps_that_one_connection(
    database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(database.url, pool_size=1, max_overflow=0, pool_timeout=1)
    name = unique_name()
    inject("pool of one connection")
    with Session(engine) as session:
        session.execute(text("SELECT 1"))
        with advisory_lock(session, name) as lock:
            holder = database.holder(name)
            session.commit()  # the Session gives its connection back; the lock keeps it
            session.execute(text("SELECT 1"))
            session.rollback()
            assert database.holder(name) == holder is not None
            lock.ensure_held()
        assert database.holder(name) is None
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_lock_connection_goes_back_when_the_transaction_on_it_ends_after_the_release(
    database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(database.url, pool_size=1, max_overflow=0, pool_timeout=1)
    name = unique_name()
    with Session(engine) as session:
        with advisory_lock(session, name):
            session.execute(text("SELECT 1"))
        # The Session's transaction still runs on the lock connection.
        assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]
        session.execute(text("SELECT 1"))
        session.commit()
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert session.get_bind() is engine
    assert database.holder(name) is None


def test_sessions_transactions_on_its_lock_connection_are_real_transactions(
    database: FaultDatabase, make_engine: Callable[..., Engine], notes_table: str
) -> None:
    # The lock statements may leave the connection in autocommit between transactions;
    # the Session's own statements must never run that way.
    engine = make_engine(database.url)
    insert = text(f"INSERT INTO {notes_table} (note) VALUES (:note)")
    count = text(f"SELECT COUNT(*) FROM {notes_table}")
    with Session(engine) as session, advisory_lock(session, unique_name()):
        session.execute(insert, {"note": "rolled back"})
        with advisory_lock(session, unique_name()):
            pass
        session.rollback()
        assert session.execute(count).scalar_one() == 0
        with advisory_lock(session, unique_name()):
            session.execute(insert, {"note": "kept"})
        session.commit()
    with engine.connect() as connection:
        assert connection.execute(count).scalar_one() == 1


def test_session_bind_is_its_lock_connection_only_while_it_holds_session_locks(
    database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(database.url)
    with Session(engine) as session:
        with advisory_lock(session, unique_name()):
            lock_connection = session.get_bind()
            assert lock_connection is not engine
            assert session.connection() is lock_connection
        session.commit()
        assert session.bind is engine


def test_session_lock_and_transaction_lock_on_one_name_do_not_wait_for_each_other(
    make_engine: Callable[..., Engine], postgres_url: URL
) -> None:
    # Transaction locks are PostgreSQL's; MariaDB and SQLite refuse them.
    engine = make_engine(postgres_url, pool_size=1, max_overflow=0, pool_timeout=1)
    name = unique_name()
    # Waiting for itself, either lock would raise LockTimeout after 5 s.
    with Session(engine) as session:
        with (
            advisory_lock(session, name),
            advisory_lock(session, name, transaction=True, timeout=5),
        ):
            assert sorted(current_advisory_locks(session)) == [name, name]
        session.commit()
        # And the other way round: the transaction lock first.
        with (
            advisory_lock(session, name, transaction=True),
            advisory_lock(session, name, timeout=5),
        ):
            assert sorted(current_advisory_locks(session)) == [name, name]
        session.commit()


class RoutingSession(Session):
    """A Session that picks its bind itself (read replicas, sharding)."""

    def get_bind(self, *arguments: Any, **options: Any) -> Any:
        return super().get_bind(*arguments, **options)


def test_routing_session_refuses_to_wait_for_a_lock_it_holds_itself(
    make_engine: Callable[..., Engine], postgres_url: URL
) -> None:
    # Such a Session keeps its session locks on a connection of their own: a transaction
    # lock on the same name would wait for it forever.
    engine = make_engine(postgres_url)
    name = unique_name()
    with RoutingSession(engine) as session:
        with advisory_lock(session, name):
            with pytest.raises(LockUsageError, match="wait for itself"):
                advisory_lock(session, name, transaction=True).acquire()
            assert advisory_lock(session, unique_name(), transaction=True).acquire()
        session.rollback()
        with advisory_lock(session, name, transaction=True), pytest.raises(LockUsageError):
            advisory_lock(session, name, timeout=0).acquire()
        session.rollback()


def test_routing_session_lets_shared_locks_of_both_scopes_share_a_name(
    make_engine: Callable[..., Engine], postgres_url: URL
) -> None:
    engine = make_engine(postgres_url)
    name = unique_name()
    with (
        RoutingSession(engine) as session,
        advisory_lock(session, name, shared=True),
        advisory_lock(session, name, shared=True, transaction=True, timeout=0) as inner,
    ):
        assert inner.held


def test_pool_too_small_for_the_lock_says_so(
    database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(database.url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    name = unique_name()
    inject("pool exhausted")
    with engine.connect() as busy:
        busy.execute(text("SELECT 1"))
        for bind in (engine, Session(engine)):
            with pytest.raises(LockConnectionTimeout) as raised:
                advisory_lock(bind, name).acquire()
            message = str(raised.value)
            assert name in message
            assert raised.value.name == name
            assert "pool_size + max_overflow" in message
            assert isinstance(raised.value, sqlalchemy_errors.TimeoutError)
    assert database.holder(name) is None


def test_transaction_lock_that_cannot_get_the_sessions_connection_says_so(
    make_engine: Callable[..., Engine], postgres_url: URL
) -> None:
    engine = make_engine(postgres_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    name = unique_name()
    with engine.connect() as busy, Session(engine) as session:
        busy.execute(text("SELECT 1"))
        with pytest.raises(LockConnectionTimeout, match="pool_size \\+ max_overflow") as raised:
            advisory_lock(session, name, transaction=True).acquire()
        assert raised.value.name == name
