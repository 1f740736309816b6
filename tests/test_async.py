"""``async with advisory_lock(...)`` on SQLAlchemy's asyncio binds, for both async drivers.

Every test runs once with asyncpg and once with psycopg's async connection. pg_locks, read
over a separate synchronous admin connection, is the witness of what the server holds.
Each engine's connections carry their own application_name, so the teardown can check
that no connection of that engine still holds an advisory lock.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from advisory_locks import (
    AdvisoryLockError,
    AsyncAdvisoryLock,
    LockDeadlock,
    LockLost,
    LockTimeout,
    UnsupportedFeature,
    advisory_lock,
    current_advisory_locks,
)
from advisory_locks.keys import LockName, derive_key
from advisory_locks.sqlalchemy import AsyncAdvisoryLockSession
from tests.databases import AdvisoryLockRow, PostgresDriver, advisory_locks_held

ASYNC_DRIVERS: list[PostgresDriver] = ["asyncpg", "psycopg_async"]
# Upper bound for events that should happen at once; only reached when a test fails.
WAIT_SECONDS = 10.0


def connect_arguments(driver: PostgresDriver, application_name: str) -> dict[str, Any]:
    if driver == "asyncpg":
        return {"server_settings": {"application_name": application_name}}
    return {"application_name": application_name}


def advisory_locks_of_application(
    admin: psycopg.Connection[TupleRow], application_name: str
) -> list[tuple[int, bool]]:
    rows = admin.execute(
        """
        SELECT l.pid, l.granted
        FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND a.application_name = %s
        """,
        [application_name],
    ).fetchall()
    return [(int(pid), bool(granted)) for pid, granted in rows]


@pytest.fixture
def application_name() -> str:
    """Marks the test engine's connections in pg_stat_activity."""
    return f"advisory-locks-test-async-{uuid.uuid4().hex[:16]}"


@pytest.fixture(params=ASYNC_DRIVERS)
async def async_engine(
    request: pytest.FixtureRequest,
    postgres_url_for: Callable[[PostgresDriver], URL],
    pg_admin: psycopg.Connection[TupleRow],
    application_name: str,
) -> AsyncIterator[AsyncEngine]:
    driver: PostgresDriver = request.param
    engine = create_async_engine(
        postgres_url_for(driver), connect_args=connect_arguments(driver, application_name)
    )
    yield engine
    left_behind = advisory_locks_of_application(pg_admin, application_name)
    await engine.dispose()
    assert left_behind == [], "a pooled connection still holds an advisory lock"


@pytest.fixture
def name() -> str:
    # Other test runs may share the server: a fresh name per test keeps pg_locks readable.
    return f"test_async-{uuid.uuid4()}"


@pytest.fixture
async def holder(async_engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A second connection of the same driver, to hold locks against the one under test."""
    async with async_engine.connect() as connection:
        yield connection


def rows_for(admin: psycopg.Connection[TupleRow], name: LockName) -> list[AdvisoryLockRow]:
    classid, objid, objsubid = derive_key(name).pg_locks_ids()
    return [
        row
        for row in advisory_locks_held(admin)
        if (row.classid, row.objid, row.objsubid) == (classid, objid, objsubid)
    ]


async def until_waiting(admin: psycopg.Connection[TupleRow], name: LockName, pid: int) -> None:
    """Return once backend ``pid`` is queued for the lock, as pg_locks reports it."""
    deadline = time.monotonic() + WAIT_SECONDS
    while (pid, False) not in [(row.pid, row.granted) for row in rows_for(admin, name)]:
        if time.monotonic() > deadline:
            raise AssertionError(f"backend {pid} never started waiting for {name!r}")
        await asyncio.sleep(0.005)


async def backend_pid(bind: AsyncConnection | AsyncSession) -> int:
    return int((await bind.execute(text("SELECT pg_backend_pid()"))).scalar_one())


# -- acquire and release on each kind of bind ----------------------------------------------


async def test_lock_through_an_async_engine_is_held_inside_the_block_and_released_after(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with advisory_lock(async_engine, name) as lock:
        inside = rows_for(pg_admin, name)
        assert lock.held
    assert [row.granted for row in inside] == [True]
    assert rows_for(pg_admin, name) == []


async def test_lock_through_an_async_connection_is_held_by_that_connection(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with async_engine.connect() as connection:
        pid = await backend_pid(connection)
        async with advisory_lock(connection, name):
            inside = rows_for(pg_admin, name)
        assert [(row.pid, row.granted) for row in inside] == [(pid, True)]
        assert rows_for(pg_admin, name) == []


async def test_lock_through_an_async_session_is_held_inside_the_block_and_released_after(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with AsyncSession(async_engine) as session:
        async with advisory_lock(session, name):
            inside = rows_for(pg_admin, name)
        assert [row.granted for row in inside] == [True]
        assert rows_for(pg_admin, name) == []


async def test_advisory_lock_on_an_async_bind_is_an_async_advisory_lock(
    async_engine: AsyncEngine, name: str
) -> None:
    async with async_engine.connect() as connection, AsyncSession(async_engine) as session:
        for bind in (async_engine, connection, session):
            assert isinstance(advisory_lock(bind, name), AsyncAdvisoryLock)


async def test_one_lock_object_shared_by_two_tasks_refuses_the_second(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    # Counted per object, a second task would count itself in without any lock of its own.
    lock = advisory_lock(async_engine, name)
    holding = asyncio.Event()
    done = asyncio.Event()

    async def hold() -> None:
        async with lock:
            holding.set()
            await done.wait()

    holder_task = asyncio.create_task(hold())
    await holding.wait()
    try:
        with pytest.raises(AdvisoryLockError, match="another thread or task"):
            await lock.acquire()
        assert len(rows_for(pg_admin, name)) == 1
    finally:
        done.set()
        await holder_task
    assert rows_for(pg_admin, name) == []


async def test_exception_in_the_block_releases_the_lock(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with AsyncSession(async_engine) as session:
        with pytest.raises(LookupError):
            async with advisory_lock(session, name):
                raise LookupError("the block failed")
        assert rows_for(pg_admin, name) == []


async def test_shared_locks_on_two_async_binds_admit_each_other(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with (
        async_engine.connect() as connection,
        advisory_lock(connection, name, shared=True),
        advisory_lock(async_engine, name, shared=True, timeout=0),
    ):
        modes = [(row.mode, row.granted) for row in rows_for(pg_admin, name)]
    assert modes == [("ShareLock", True), ("ShareLock", True)]


async def test_transaction_lock_on_an_autocommit_async_connection_is_refused(
    async_engine: AsyncEngine, name: str
) -> None:
    async with async_engine.connect() as connection:
        autocommit = await connection.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(UnsupportedFeature):
            await advisory_lock(autocommit, name, transaction=True).acquire()


# -- busy locks: timeout 0, timeout t, and a waiter that wakes -------------------------------


async def test_busy_lock_with_timeout_zero_is_not_acquired(
    async_engine: AsyncEngine, holder: AsyncConnection, name: str
) -> None:
    async with advisory_lock(holder, name), AsyncSession(async_engine) as session:
        lock = advisory_lock(session, name, timeout=0)
        assert await lock.acquire() is False
        assert not lock.held


async def test_busy_lock_with_timeout_raises_lock_timeout_after_about_that_long(
    async_engine: AsyncEngine, holder: AsyncConnection, name: str
) -> None:
    timeout = 0.5
    async with advisory_lock(holder, name), async_engine.connect() as connection:
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            async with advisory_lock(connection, name, timeout=timeout):
                pass
        waited = time.monotonic() - started
    assert 0.8 * timeout <= waited <= timeout + 2


async def test_blocked_waiter_is_granted_the_lock_when_the_holder_releases_it(
    async_engine: AsyncEngine,
    holder: AsyncConnection,
    pg_admin: psycopg.Connection[TupleRow],
    name: str,
) -> None:
    held = advisory_lock(holder, name)
    assert await held.acquire()
    granted = asyncio.Event()

    async with async_engine.connect() as waiter_connection:
        waiter_pid = await backend_pid(waiter_connection)

        async def wait_for_the_lock() -> list[AdvisoryLockRow]:
            async with advisory_lock(waiter_connection, name):
                granted.set()
                return rows_for(pg_admin, name)

        waiter = asyncio.create_task(wait_for_the_lock())
        await until_waiting(pg_admin, name, waiter_pid)
        assert not granted.is_set()
        await held.release()
        rows_while_waiter_held = await asyncio.wait_for(waiter, WAIT_SECONDS)
    assert [(row.pid, row.granted) for row in rows_while_waiter_held] == [(waiter_pid, True)]


async def test_deadlock_between_two_async_connections_raises_lock_deadlock_in_one(
    async_engine: AsyncEngine, name: str
) -> None:
    async def hold_then_want(
        connection: AsyncConnection,
        held: str,
        wanted: str,
        mine: asyncio.Event,
        theirs: asyncio.Event,
    ) -> bool:
        async with advisory_lock(connection, held):
            mine.set()
            await theirs.wait()
            lock = advisory_lock(connection, wanted)
            granted = await lock.acquire()
            await lock.release()
            return granted

    first_holds, second_holds = asyncio.Event(), asyncio.Event()
    async with async_engine.connect() as first, async_engine.connect() as second:
        outcomes = await asyncio.gather(
            hold_then_want(first, name + "-a", name + "-b", first_holds, second_holds),
            hold_then_want(second, name + "-b", name + "-a", second_holds, first_holds),
            return_exceptions=True,
        )
    # The server picks one victim; leaving its block freed what it held for the other.
    victims = [outcome for outcome in outcomes if isinstance(outcome, LockDeadlock)]
    assert len(victims) == 1
    assert [outcome for outcome in outcomes if outcome is not victims[0]] == [True]


# -- session locks and transactions ----------------------------------------------------------


async def test_session_lock_on_an_async_session_survives_commit_and_rollback_in_its_block(
    async_engine: AsyncEngine,
    holder: AsyncConnection,
    pg_admin: psycopg.Connection[TupleRow],
    name: str,
) -> None:
    async with AsyncSession(async_engine) as session, advisory_lock(session, name):
        await session.execute(text("SELECT 1"))
        await session.commit()
        after_commit = rows_for(pg_admin, name)
        await session.execute(text("SELECT 1"))
        await session.rollback()
        after_rollback = rows_for(pg_admin, name)
        assert await advisory_lock(holder, name, timeout=0).acquire() is False
    assert len(after_commit) == 1
    assert after_rollback == after_commit
    assert rows_for(pg_admin, name) == []


async def test_transaction_lock_on_an_async_session_lives_until_commit(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with AsyncSession(async_engine) as session:
        async with advisory_lock(session, name, transaction=True):
            pass
        after_block = rows_for(pg_admin, name)
        await session.commit()
    assert len(after_block) == 1
    assert rows_for(pg_admin, name) == []


async def test_transaction_lock_on_an_async_connection_lives_until_commit(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with async_engine.connect() as connection:
        pid = await backend_pid(connection)
        async with advisory_lock(connection, name, transaction=True):
            pass
        after_block = rows_for(pg_admin, name)
        await connection.commit()
        assert [(row.pid, row.granted) for row in after_block] == [(pid, True)]
        assert rows_for(pg_admin, name) == []


@pytest.mark.parametrize("timeout", [None, 0, 5.0], ids=["wait", "try", "timeout"])
async def test_transaction_lock_taken_as_the_first_statement_belongs_to_that_transaction(
    async_engine: AsyncEngine,
    pg_admin: psycopg.Connection[TupleRow],
    name: str,
    timeout: float | None,
) -> None:
    # The driver adapter begins its transaction lazily, before its own first statement;
    # a lock sent before any statement of SQLAlchemy's must still be inside it, or the
    # server would drop the transaction lock as soon as the lock statement ended.
    async with AsyncSession(async_engine) as session:
        lock = advisory_lock(session, name, transaction=True, timeout=timeout)
        assert await lock.acquire()
        after_acquire = rows_for(pg_admin, name)
        pid = await backend_pid(session)
        after_next_statement = rows_for(pg_admin, name)
        await session.rollback()
        assert [(row.pid, row.granted) for row in after_acquire] == [(pid, True)]
        assert after_next_statement == after_acquire
        assert rows_for(pg_admin, name) == []
        assert not lock.held


async def test_transaction_lock_as_the_first_statement_on_an_async_connection_is_inside_it(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with async_engine.connect() as connection:
        assert await advisory_lock(connection, name, transaction=True, timeout=5).acquire()
        after_acquire = rows_for(pg_admin, name)
        pid = await backend_pid(connection)
        await connection.rollback()
        assert [(row.pid, row.granted) for row in after_acquire] == [(pid, True)]
        assert rows_for(pg_admin, name) == []


async def test_timed_out_acquire_inside_an_async_session_transaction_leaves_it_usable(
    async_engine: AsyncEngine, holder: AsyncConnection, name: str
) -> None:
    async with advisory_lock(holder, name), AsyncSession(async_engine) as session:
        await session.execute(text("CREATE TEMPORARY TABLE work (n int)"))
        await session.execute(text("INSERT INTO work VALUES (1)"))
        with pytest.raises(LockTimeout):
            async with advisory_lock(session, name, transaction=True, timeout=0.2):
                pass
        assert (await session.execute(text("SELECT 1"))).scalar_one() == 1
        await session.execute(text("INSERT INTO work VALUES (2)"))
        await session.commit()
        assert (await session.execute(text("SELECT count(*) FROM work"))).scalar_one() == 2


async def test_timed_out_acquire_inside_an_async_connection_transaction_leaves_it_usable(
    async_engine: AsyncEngine, holder: AsyncConnection, name: str
) -> None:
    async with advisory_lock(holder, name), async_engine.connect() as connection:
        await connection.execute(text("SELECT 1"))
        lock = advisory_lock(connection, name, transaction=True, timeout=0.2)
        assert await lock.acquire() is False
        assert (await connection.execute(text("SELECT 1"))).scalar_one() == 1
        await connection.commit()


# -- re-entrancy, the session class, bookkeeping ---------------------------------------------


async def test_reentering_a_lock_on_the_same_async_session_releases_it_at_the_outer_exit(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with AsyncSession(async_engine) as session:
        async with advisory_lock(session, name):
            async with advisory_lock(session, name, timeout=0):
                assert current_advisory_locks(session) == [name]
            after_inner_exit = rows_for(pg_admin, name)
        assert len(after_inner_exit) == 1
        assert rows_for(pg_admin, name) == []
        assert current_advisory_locks(session) == []


async def test_current_advisory_locks_of_a_begun_async_session_needs_no_connection(
    async_engine: AsyncEngine, name: str
) -> None:
    # session.begin() opens no connection yet; looking must not try to open one, which
    # an AsyncSession could not do from synchronous code.
    async with (
        AsyncSession(async_engine) as session,
        session.begin(),
        advisory_lock(session, name),
    ):
        assert current_advisory_locks(session) == [name]


async def test_async_sessionmaker_with_the_session_class_gives_an_advisory_lock_method(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    make_session = async_sessionmaker(async_engine, class_=AsyncAdvisoryLockSession)
    async with make_session() as session:
        async with session.advisory_lock(name, timeout=1):
            inside = rows_for(pg_admin, name)
        assert len(inside) == 1
        assert rows_for(pg_admin, name) == []


# -- lost locks, and the engine afterwards ---------------------------------------------------


async def test_release_on_an_async_connection_whose_backend_was_terminated_raises_lock_lost(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with async_engine.connect() as connection:
        lock = advisory_lock(connection, name)
        assert await lock.acquire()
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [rows_for(pg_admin, name)[0].pid])
        with pytest.raises(LockLost):
            await lock.release()
        assert connection.invalidated


async def test_release_on_an_async_session_whose_backend_was_terminated_raises_lock_lost(
    async_engine: AsyncEngine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    async with AsyncSession(async_engine) as session:
        lock = advisory_lock(session, name)
        assert await lock.acquire()
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [rows_for(pg_admin, name)[0].pid])
        with pytest.raises(LockLost):
            await lock.release()
        # The dead connection went nowhere near the pool: the session locks again at once.
        async with advisory_lock(session, name, timeout=0):
            assert len(rows_for(pg_admin, name)) == 1


async def test_engine_holds_no_advisory_locks_after_mixed_use_and_disposes(
    async_engine: AsyncEngine,
    pg_admin: psycopg.Connection[TupleRow],
    application_name: str,
    name: str,
) -> None:
    async with AsyncSession(async_engine) as session, async_engine.connect() as connection:
        async with advisory_lock(session, name), advisory_lock(connection, name + "-c"):
            await session.commit()
            await connection.rollback()
        async with advisory_lock(session, name, transaction=True):
            pass
        await session.rollback()
        async with advisory_lock(async_engine, name):
            pass
        with pytest.raises(LookupError):
            async with advisory_lock(connection, name + "-c"):
                raise LookupError("the block failed")
        async with advisory_lock(connection, name + "-t", transaction=True):
            pass
        await connection.commit()
    assert advisory_locks_of_application(pg_admin, application_name) == []
    await async_engine.dispose()
    assert advisory_locks_of_application(pg_admin, application_name) == []


# -- a waiting acquire that is cancelled -----------------------------------------------------


async def until_not_held(admin: psycopg.Connection[TupleRow], name: LockName) -> None:
    """Return once no backend holds or awaits the lock (a closed backend may linger)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while rows_for(admin, name):
        if time.monotonic() > deadline:
            raise AssertionError(f"{name!r} is still held: {rows_for(admin, name)}")
        await asyncio.sleep(0.005)


async def cancel_while_waiting(
    admin: psycopg.Connection[TupleRow], lock: AsyncAdvisoryLock, holder_pid: int
) -> None:
    waiter = asyncio.create_task(lock.acquire())
    deadline = time.monotonic() + WAIT_SECONDS
    while not [row for row in rows_for(admin, lock.name) if row.pid != holder_pid]:
        if time.monotonic() > deadline:
            raise AssertionError("the waiter never reached the server")
        await asyncio.sleep(0.005)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_cancelled_wait_on_an_engine_leaves_no_pooled_connection_holding_the_lock(
    async_engine: AsyncEngine,
    holder: AsyncConnection,
    pg_admin: psycopg.Connection[TupleRow],
    name: str,
) -> None:
    # asyncio.timeout()/wait_for() cancel the task; the server may still grant the
    # lock to the connection after the client stopped listening for the answer.
    async with advisory_lock(holder, name):
        await cancel_while_waiting(
            pg_admin, advisory_lock(async_engine, name), await backend_pid(holder)
        )
    await until_not_held(pg_admin, name)
    async with advisory_lock(async_engine, name, timeout=0):
        assert len(rows_for(pg_admin, name)) == 1


async def test_cancelled_wait_on_an_async_connection_leaves_it_holding_nothing(
    async_engine: AsyncEngine,
    holder: AsyncConnection,
    pg_admin: psycopg.Connection[TupleRow],
    name: str,
) -> None:
    async with async_engine.connect() as connection:
        async with advisory_lock(holder, name):
            lock = advisory_lock(connection, name)
            await cancel_while_waiting(pg_admin, lock, await backend_pid(holder))
        await until_not_held(pg_admin, name)
        assert not lock.held
        # Its state on the server was unknown, so it was discarded, not reused.
        assert connection.invalidated
