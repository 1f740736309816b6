"""Raw asyncio PostgreSQL drivers as binds: psycopg 3 AsyncConnection and
AsyncConnectionPool, asyncpg Connection, pool connections and Pool.

Native asyncio, no SQLAlchemy or greenlet in the path. pg_locks, read over a separate
admin connection, is the witness of what the server holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import asyncpg
import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolClosed
from sqlalchemy.engine import URL

from advisory_locks import (
    AdvisoryLockError,
    AsyncAdvisoryLock,
    LockLost,
    LockNotAcquired,
    LockTimeout,
    LockUsageError,
    UnsupportedFeature,
    advisory_lock,
    advisory_lock_set,
    current_advisory_locks,
)
from advisory_locks._bindings import _asyncpg_compat, _psycopg_pool_compat
from advisory_locks.asyncpg import LockPoolClosed as AsyncpgPoolClosed
from advisory_locks.psycopg_pool import LockConnectionTimeout, LockPoolClosed
from tests.helpers import (
    assert_refused_by_an_asyncpg_pool,
    assert_refused_by_an_exhausted_pool,
    backend_alive,
    holder_pids,
    lock_rows,
    needs_raw_cursors,
    unique_name,
    waiter_pids,
)
from tests.test_raw_postgres import held, libpq_url

pytestmark = pytest.mark.timeout(60)

Admin = psycopg.Connection[TupleRow]

ASYNC_KINDS = [
    "psycopg_async",
    "psycopg_async.autocommit",
    "psycopg_async_pool",
    "asyncpg",
    "asyncpg.pool_connection",
    "asyncpg_pool",
]
CONNECTION_KINDS = [kind for kind in ASYNC_KINDS if not kind.endswith("_pool")]
POOL_KINDS = ["psycopg_async_pool", "asyncpg_pool"]


class AsyncRawTarget:
    """One kind of asyncio raw bind: makes connections (or the pool) and closes them."""

    def __init__(self, kind: str, dsn: str) -> None:
        self.kind = kind
        self.dsn = dsn
        self._closers: list[Callable[[], Awaitable[Any]]] = []
        self._pool: Any = None

    async def pool(self) -> Any:
        if self._pool is None:
            if self.kind.startswith("psycopg"):
                self._pool = AsyncConnectionPool(self.dsn, min_size=1, max_size=3, open=False)
                await self._pool.open()
            else:
                self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=3)
            self._closers.append(self._pool.close)
        return self._pool

    async def connect(self, **options: Any) -> Any:
        """A connection of this kind (from the pool for the pool kinds)."""
        if self.kind.startswith("psycopg"):
            if self.kind == "psycopg_async_pool":
                pool = await self.pool()
                connection = await pool.getconn()
                self._closers.insert(0, lambda: pool.putconn(connection))
                return connection
            options.setdefault("autocommit", self.kind.endswith("autocommit"))
            connection = await psycopg.AsyncConnection.connect(self.dsn, **options)
            self._closers.append(connection.close)
            return connection
        if self.kind == "asyncpg":
            connection = await asyncpg.connect(self.dsn)
            self._closers.append(connection.close)
            return connection
        pool = await self.pool()
        proxy = await pool.acquire()
        self._closers.insert(0, lambda: pool.release(proxy))
        return proxy

    async def bind(self) -> Any:
        return await self.pool() if self.kind.endswith("_pool") else await self.connect()

    async def close(self) -> None:
        for close in self._closers:
            await close()


@pytest.fixture
def dsn(postgres_url: URL) -> str:
    return libpq_url(postgres_url)


@pytest.fixture(params=ASYNC_KINDS)
async def target(request: pytest.FixtureRequest, dsn: str) -> AsyncIterator[AsyncRawTarget]:
    target = AsyncRawTarget(request.param, dsn)
    yield target
    await target.close()


@pytest.fixture(params=CONNECTION_KINDS)
async def connection_target(
    request: pytest.FixtureRequest, dsn: str
) -> AsyncIterator[AsyncRawTarget]:
    target = AsyncRawTarget(request.param, dsn)
    yield target
    await target.close()


def is_free(dsn: str, name: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as other:
        row = other.execute("SELECT pg_try_advisory_lock(%s)", [unique_key(name)]).fetchone()
        assert row is not None
        if row[0]:
            other.execute("SELECT pg_advisory_unlock(%s)", [unique_key(name)])
        return bool(row[0])


class RolledBack(Exception):
    """Raised to roll a savepoint back."""


def unique_key(name: str) -> int:
    from advisory_locks import lock_key

    key = lock_key(name)
    assert isinstance(key, int)
    return key


def gone(admin: Admin, pid: int) -> bool:
    return not backend_alive(admin, pid)


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


MODES = [
    pytest.param({"timeout": None}, id="wait"),
    pytest.param({"timeout": 0}, id="try"),
    pytest.param({"timeout": 2.5}, id="timeout"),
    pytest.param({"shared": True}, id="shared"),
    pytest.param({"shared": True, "timeout": 0}, id="shared-try"),
    pytest.param({"shared": True, "timeout": 2.5}, id="shared-timeout"),
]


# -- every bind, every mode -----------------------------------------------------------------


@pytest.mark.parametrize("options", MODES)
async def test_a_session_lock_is_held_in_its_block_and_released_after(
    target: AsyncRawTarget, pg_admin: Admin, options: dict[str, Any]
) -> None:
    name = unique_name("async-session")
    bind = await target.bind()
    lock = advisory_lock(bind, name, **options)
    assert isinstance(lock, AsyncAdvisoryLock)
    async with lock:
        assert lock.held
        rows = [row for row in lock_rows(pg_admin, name) if row.granted]
        assert [row.mode for row in rows] == [
            "ShareLock" if options.get("shared") else "ExclusiveLock"
        ]
        assert current_advisory_locks(bind) == [name]
    assert not held(lock)
    assert holder_pids(pg_admin, name) == []
    assert current_advisory_locks(bind) == []


@pytest.mark.parametrize("options", MODES)
async def test_a_transaction_lock_lives_in_the_drivers_transaction(
    connection_target: AsyncRawTarget, pg_admin: Admin, options: dict[str, Any]
) -> None:
    name = unique_name("async-xact")
    connection = await connection_target.connect()
    async with connection.transaction():
        async with advisory_lock(connection, name, transaction=True, **options) as lock:
            assert lock.held
            assert len(holder_pids(pg_admin, name)) == 1
        assert len(holder_pids(pg_admin, name)) == 1
        assert current_advisory_locks(connection) == [name]
    assert holder_pids(pg_admin, name) == []
    assert current_advisory_locks(connection) == []
    assert not lock.held


@pytest.mark.parametrize("kind", ["asyncpg", "asyncpg.pool_connection", "psycopg_async.autocommit"])
async def test_a_transaction_lock_outside_a_transaction_is_refused(
    dsn: str, pg_admin: Admin, kind: str
) -> None:
    target = AsyncRawTarget(kind, dsn)
    try:
        connection = await target.connect()
        name = unique_name("async-refused")
        with pytest.raises(UnsupportedFeature, match="transaction"):
            async with advisory_lock(connection, name, transaction=True):
                pytest.fail("the block must not run")
        assert holder_pids(pg_admin, name) == []
    finally:
        await target.close()


@pytest.mark.parametrize("kind", POOL_KINDS)
async def test_a_transaction_lock_on_a_pool_is_refused(dsn: str, kind: str) -> None:
    target = AsyncRawTarget(kind, dsn)
    try:
        with pytest.raises(UnsupportedFeature, match="a pool has none"):
            advisory_lock(await target.pool(), unique_name(), transaction=True)
    finally:
        await target.close()


# -- how people write it today ----------------------------------------------------------------


async def test_the_cron_job_pattern_runs_the_job_once(dsn: str) -> None:
    ran: list[int] = []
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=2)
    name = unique_name("daily_report_job")
    tried: list[int] = []
    both_tried = asyncio.Event()

    async def tried_once(worker: int) -> None:
        # Neither leaves its block before both asked for the lock.
        tried.append(worker)
        if len(tried) == 2:
            both_tried.set()
        await both_tried.wait()

    async def job(worker: int) -> None:
        async with pool.acquire() as conn:
            try:
                async with advisory_lock(conn, name, timeout=0):
                    await tried_once(worker)
                    ran.append(worker)
            except LockNotAcquired:
                await tried_once(worker)

    try:
        await asyncio.wait_for(asyncio.gather(job(1), job(2)), 20)
    finally:
        await pool.close()
    assert len(ran) == 1
    assert is_free(dsn, name)


async def test_the_payment_pattern_holds_the_lock_until_the_transaction_ends(
    dsn: str, pg_admin: Admin
) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    name = unique_name("payment-42")
    try:
        async with pool.acquire() as conn:
            async with conn.transaction():
                async with advisory_lock(conn, name, transaction=True):
                    await conn.execute("SELECT 1")
                assert not is_free(dsn, name)
            assert is_free(dsn, name)
            assert not conn.is_in_transaction()
    finally:
        await pool.close()
    assert holder_pids(pg_admin, name) == []


# -- exclusion, timeouts, waiting --------------------------------------------------------------


async def test_a_held_lock_excludes_another_connection_and_a_waiter_wakes(
    target: AsyncRawTarget, dsn: str
) -> None:
    name = unique_name("async-exclusion")
    other = AsyncRawTarget(target.kind, dsn)
    try:
        holder = advisory_lock(await target.bind(), name)
        assert await holder.acquire()
        assert not is_free(dsn, name)
        other_bind = await other.bind()
        assert await advisory_lock(other_bind, name, timeout=0).acquire() is False
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            async with advisory_lock(other_bind, name, timeout=0.4):
                pytest.fail("the block must not run")
        assert 0.35 <= time.monotonic() - started < 5

        granted = asyncio.Event()

        async def wait() -> None:
            async with advisory_lock(other_bind, name, timeout=None):
                granted.set()

        waiter = asyncio.create_task(wait())
        with psycopg.connect(dsn, autocommit=True) as admin:
            await wait_until(lambda: bool(waiter_pids(admin, name)), "the waiter is queued")
        assert not granted.is_set()
        await holder.release()
        await asyncio.wait_for(waiter, 10)
        assert granted.is_set()
    finally:
        await other.close()
    assert is_free(dsn, name)


async def test_retaking_a_name_on_one_connection_is_counted(
    connection_target: AsyncRawTarget, dsn: str
) -> None:
    name = unique_name("async-reentrant")
    connection = await connection_target.connect()
    async with advisory_lock(connection, name):
        async with advisory_lock(connection, name, timeout=0) as inner:
            assert inner.held
        assert not is_free(dsn, name)
    assert is_free(dsn, name)


async def test_another_task_cannot_claim_an_object_whose_unlock_is_on_its_way(
    dsn: str, pg_admin: Admin
) -> None:
    # The await of the unlock lets other tasks run: had the object let go before it, a
    # second task would count itself into the holding that unlock is about to end.
    name = unique_name("async-unlock-on-its-way")
    unlock_sent = asyncio.Event()
    unlock_may_run = asyncio.Event()

    class HeldBackUnlocks(psycopg.AsyncCursor[Any]):
        async def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            if "unlock" in str(query):
                unlock_sent.set()
                await unlock_may_run.wait()
            return await super().execute(query, *args, **kwargs)

    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, cursor_factory=HeldBackUnlocks
    ) as connection:
        lock = advisory_lock(connection, name)

        async def hold_and_release() -> None:
            await lock.acquire()
            await lock.release()

        holder = asyncio.create_task(hold_and_release())
        try:
            await asyncio.wait_for(unlock_sent.wait(), 10)
            with pytest.raises(LockUsageError, match="another thread or task"):
                await lock.acquire()
        finally:
            unlock_may_run.set()
            await asyncio.wait_for(holder, 10)
        assert is_free(dsn, name)
        # Released whole: this task may take it now, with a request of its own.
        assert await lock.acquire()
        assert holder_pids(pg_admin, name) == [connection.info.backend_pid]
        await lock.release()
    assert is_free(dsn, name)


async def test_a_session_lock_on_an_idle_psycopg_connection_opens_no_transaction(
    dsn: str,
) -> None:
    name = unique_name("async-idle")
    async with await psycopg.AsyncConnection.connect(dsn) as connection:
        lock = advisory_lock(connection, name, timeout=1)
        assert await lock.acquire()
        assert connection.info.transaction_status == TransactionStatus.IDLE
        await lock.release()
        assert connection.info.transaction_status == TransactionStatus.IDLE
        assert connection.autocommit is False
    assert is_free(dsn, name)


async def test_a_transaction_lock_is_taken_again_in_the_next_transaction(
    connection_target: AsyncRawTarget, dsn: str
) -> None:
    name = unique_name("async-next-transaction")
    connection = await connection_target.connect()
    for _ in range(2):
        async with (
            connection.transaction(),
            advisory_lock(connection, name, transaction=True, timeout=0),
        ):
            assert not is_free(dsn, name)
        async with connection.transaction():
            await connection.execute("SELECT 1")
            async with advisory_lock(connection, name, transaction=True, timeout=0):
                assert not is_free(dsn, name)
        assert is_free(dsn, name)


async def test_one_lock_object_taken_again_in_a_later_transaction_excludes_others(
    connection_target: AsyncRawTarget, dsn: str
) -> None:
    # The commit and the next transaction's first statement happen between two calls of
    # the library: the object's holding of the first transaction must not stand for the
    # next one.
    name = unique_name("async-later-transaction")
    connection = await connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    for _ in range(3):
        async with connection.transaction():
            await connection.execute("SELECT 1")
            assert await lock.acquire()
            assert held(lock)
            assert not is_free(dsn, name)
        assert is_free(dsn, name)


async def test_one_lock_object_taken_again_after_its_savepoint_rolled_back_excludes_others(
    connection_target: AsyncRawTarget, dsn: str
) -> None:
    name = unique_name("async-savepoint-again")
    connection = await connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    async with connection.transaction():
        await connection.execute("SELECT 1")
        with contextlib.suppress(RolledBack):
            async with connection.transaction():  # a savepoint
                assert await lock.acquire()
                raise RolledBack
        assert is_free(dsn, name)  # the rollback to the savepoint released it
        assert await lock.acquire()
        assert held(lock)
        assert not is_free(dsn, name)


async def test_a_transaction_lock_taken_twice_in_one_transaction_is_counted_twice(
    connection_target: AsyncRawTarget, dsn: str
) -> None:
    name = unique_name("async-xact-twice")
    connection = await connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    async with connection.transaction():
        assert await lock.acquire()
        assert await lock.acquire()
        await lock.release()
        assert held(lock)
        await lock.release()
        assert not held(lock)
        assert not is_free(dsn, name)  # a transaction lock stays with its transaction
    assert is_free(dsn, name)
    assert current_advisory_locks(connection) == []


async def test_a_lock_set_on_a_pool_uses_one_connection(dsn: str, pg_admin: Admin) -> None:
    for kind in POOL_KINDS:
        target = AsyncRawTarget(kind, dsn)
        names = [unique_name("aset-a"), unique_name("aset-b")]
        try:
            async with advisory_lock_set(await target.pool(), names, timeout=1):
                pids = {pid for name in names for pid in holder_pids(pg_admin, name)}
                assert len(pids) == 1
            assert all(is_free(dsn, name) for name in names)
        finally:
            await target.close()


async def test_a_lock_set_that_meets_a_busy_lock_gives_back_what_it_took(
    target: AsyncRawTarget, dsn: str
) -> None:
    # The lock taken last (the highest key) is held elsewhere: the set takes the others
    # first, waits out its timeout, gives them back, and holds nothing.
    names = sorted(
        (unique_name("aset-x"), unique_name("aset-y"), unique_name("aset-z")), key=unique_key
    )
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [unique_key(names[-1])])
        locks = advisory_lock_set(await target.bind(), names, timeout=0.2)
        assert not await locks.acquire()
        assert not locks.held
        assert [is_free(dsn, name) for name in names[:-1]] == [True, True]
        with pytest.raises(LockNotAcquired):
            async with locks:
                pass
        other.execute("SELECT pg_advisory_unlock(%s)", [unique_key(names[-1])])
    assert await locks.acquire()
    assert locks.held
    assert not any(is_free(dsn, name) for name in names)
    await locks.release()
    assert all(is_free(dsn, name) for name in names)


# -- asyncpg's pool resets a returned connection ----------------------------------------------


async def test_a_lock_left_on_a_returned_asyncpg_connection_is_lost(
    dsn: str, pg_admin: Admin
) -> None:
    name = unique_name("asyncpg-reset")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        async with pool.acquire() as conn:
            lock = advisory_lock(conn, name, timeout=0)
            assert await lock.acquire()
            assert lock.held
        # The pool ran pg_advisory_unlock_all() as it took the connection back.
        assert holder_pids(pg_admin, name) == []
        assert not lock.held
        with pytest.raises(LockLost):
            await lock.ensure_held()
        with pytest.raises(LockLost):
            await lock.release()
        # The same physical connection, handed out again, takes the name for real.
        async with pool.acquire() as again:
            assert current_advisory_locks(again) == []
            async with advisory_lock(again, name, timeout=0):
                assert not is_free(dsn, name)
    finally:
        await pool.close()


async def test_a_lock_on_a_reused_asyncpg_connection_is_lost_for_its_first_holder(
    dsn: str,
) -> None:
    name = unique_name("asyncpg-reused")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        async with pool.acquire() as conn:
            first = advisory_lock(conn, name, timeout=0)
            assert await first.acquire()
        async with pool.acquire() as again:
            second = advisory_lock(again, name, timeout=0)
            assert await second.acquire()  # not counted on the first holder's lost lock
            assert not first.held
            with pytest.raises(LockLost):
                await first.release()
            assert second.held
            assert not is_free(dsn, name)
            await second.release()
        assert is_free(dsn, name)
    finally:
        await pool.close()


@pytest.mark.parametrize("with_reset", [False, True])
async def test_a_lock_left_on_a_psycopg_pool_connection_is_released_at_checkin(
    dsn: str, pg_admin: Admin, with_reset: bool
) -> None:
    name = unique_name("async-pool-checkin")
    resets: list[object] = []

    async def reset(connection: Any) -> None:
        resets.append(connection)

    pool = AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, reset=reset if with_reset else None
    )
    await pool.open()
    try:
        async with pool.connection() as connection:
            first = advisory_lock(connection, name, timeout=0)
            assert await first.acquire()
            assert len(holder_pids(pg_admin, name)) == 1
        if not with_reset:
            # Returned without the pool's worker task, the guard included.
            assert holder_pids(pg_admin, name) == []
        async with pool.connection(timeout=10) as again:
            assert again is connection
            assert holder_pids(pg_admin, name) == []
            second = advisory_lock(again, name, timeout=0)
            assert await second.acquire()
            assert not first.held
            with pytest.raises(LockLost):
                await first.ensure_held()
            assert not is_free(dsn, name)
            await second.release()
        if with_reset:
            # The pool runs reset callables in a task, after putconn() returned.
            await wait_until(lambda: len(resets) == 2, "the pool reset the connection twice")
        assert resets == ([connection, connection] if with_reset else [])
    finally:
        await pool.close()
    assert is_free(dsn, name)


async def test_a_lock_left_on_a_connection_of_an_asyncpg_pool_with_its_own_reset_is_released(
    dsn: str, pg_admin: Admin
) -> None:
    # A reset= of the application's replaces asyncpg's reset, pg_advisory_unlock_all()
    # with it: without the guard the lock stayed with the connection and its next user.
    name = unique_name("asyncpg-own-reset")
    resets: list[object] = []

    async def reset(connection: Any) -> None:
        resets.append(connection)

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1, reset=reset)
    try:
        async with pool.acquire() as connection:
            first = advisory_lock(connection, name, timeout=0)
            assert await first.acquire()
            assert len(holder_pids(pg_admin, name)) == 1
        assert holder_pids(pg_admin, name) == []
        assert not first.held
        with pytest.raises(LockLost):
            await first.release()
        async with pool.acquire() as again:
            assert (
                await again.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND pid = pg_backend_pid()"
                )
                == 0
            )
        assert len(resets) == 2  # the application's reset still runs, after the guard
    finally:
        await pool.close()
    assert is_free(dsn, name)


def test_the_private_psycopg_pool_apis_the_binding_uses_exist() -> None:
    import psycopg_pool

    version = ".".join(psycopg_pool.__version__.split(".")[:2])
    assert version in _psycopg_pool_compat.CHECKED_VERSIONS
    sync_pool = psycopg_pool.ConnectionPool("", open=False)
    async_pool = AsyncConnectionPool("", open=False)
    assert sync_pool._reset is None
    assert async_pool._reset is None
    for pool in (sync_pool, async_pool):
        for method in ("_putconn", "_return_connection"):
            parameters = list(inspect.signature(getattr(pool, method)).parameters)
            assert parameters == ["conn", "from_getconn"], (type(pool).__name__, method)


async def test_the_library_keeps_no_dropped_asyncpg_connection_alive(dsn: str) -> None:
    # asyncpg's connections have no attributes of their own: the library's state for one
    # lives in a weak mapping, and nothing in it may refer back to the connection.
    import gc
    import weakref

    name = unique_name("asyncpg-dropped")
    connection = await asyncpg.connect(dsn)
    try:
        lock = advisory_lock(connection, name)
        assert await lock.acquire()
        await lock.ensure_held()
        await lock.release()
    finally:
        await connection.close()
    collected = weakref.ref(connection)
    del connection, lock
    gc.collect()
    assert collected() is None


@pytest.mark.parametrize("kind", POOL_KINDS)
async def test_a_lock_dropped_while_held_gives_its_pool_connection_back(
    kind: str, dsn: str
) -> None:
    # As an Engine's pool takes back a checkout whose lock object was collected: else a
    # pool of one would lend nothing again (and asyncpg's would keep the lock).
    import gc
    import warnings

    name = unique_name("async-pool-dropped")
    if kind == "psycopg_async_pool":
        pool: Any = AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False)
        await pool.open()
    else:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        lock = advisory_lock(pool, name)
        assert await lock.acquire()
        del lock
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()

        async def next_checkout() -> object:
            if kind == "psycopg_async_pool":
                async with pool.connection() as connection:
                    cursor = await connection.execute("SELECT 1")
                    return await cursor.fetchone()
            async with pool.acquire() as connection:
                return (await connection.fetchval("SELECT 1"),)

        assert await asyncio.wait_for(next_checkout(), 5) == (1,)
        assert is_free(dsn, name)
        assert current_advisory_locks(pool) == []
    finally:
        await pool.close()


async def test_a_second_tasks_lock_on_a_busy_asyncpg_connection_is_refused_not_lost(
    dsn: str, pg_admin: Admin
) -> None:
    # asyncpg runs one statement at a time per connection and refuses another with the
    # InterfaceError it also raises for a closed connection: the second task's lock must
    # not take that for a lost connection and close it under the first task's wait.
    waited, other = unique_name("busy-waited"), unique_name("busy-other")
    connection = await asyncpg.connect(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", [unique_key(waited)])
            waiting = asyncio.ensure_future(advisory_lock(connection, waited).acquire())
            await wait_until(lambda: bool(waiter_pids(pg_admin, waited)), "the first task waits")
            with pytest.raises(LockUsageError, match="one statement at a time"):
                await advisory_lock(connection, other, timeout=0).acquire()
            assert not connection.is_closed()
            holder.execute("SELECT pg_advisory_unlock(%s)", [unique_key(waited)])
            assert await asyncio.wait_for(waiting, 10) is True
        assert current_advisory_locks(connection) == [waited]
        assert is_free(dsn, other)
    finally:
        await connection.close()


def test_the_private_asyncpg_apis_the_binding_reads_exist() -> None:
    assert _asyncpg_compat.missing_private_apis() == []
    version = ".".join(asyncpg.__version__.split(".")[:2])
    assert version in _asyncpg_compat.CHECKED_VERSIONS


# -- cancellation ---------------------------------------------------------------------------------


async def test_a_cancelled_wait_is_never_granted_later(
    target: AsyncRawTarget, dsn: str, pg_admin: Admin
) -> None:
    name = unique_name("async-cancelled")
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [unique_key(name)])
        bind = await target.bind()
        lock = advisory_lock(bind, name, timeout=None)
        waiting = asyncio.create_task(asyncio.wait_for(lock.acquire(), 1.0))
        await wait_until(lambda: bool(waiter_pids(pg_admin, name)), "the wait is queued")
        [waiter] = waiter_pids(pg_admin, name)
        with pytest.raises(asyncio.TimeoutError):
            await waiting
        assert not lock.held
        # The server may still grant an abandoned wait; closing its connection is what
        # makes sure nobody inherits the grant.
        await wait_until(lambda: not backend_alive(pg_admin, waiter), "the waiter's backend ends")
        holder.execute("SELECT pg_advisory_unlock(%s)", [unique_key(name)])
    await asyncio.sleep(0.1)
    assert holder_pids(pg_admin, name) == []
    # The pool recovers (a fresh connection for the pool kinds, a new one otherwise).
    fresh = bind if target.kind.endswith("_pool") else await target.connect()
    async with advisory_lock(fresh, name, timeout=1):
        assert not is_free(dsn, name)


@pytest.mark.parametrize("kind", POOL_KINDS)
async def test_a_cancelled_wait_puts_no_locked_connection_back_in_the_pool(
    dsn: str, pg_admin: Admin, kind: str
) -> None:
    name = unique_name("async-cancelled-pool")
    target = AsyncRawTarget(kind, dsn)
    try:
        pool = await target.pool()
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", [unique_key(name)])
            for _ in range(3):
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(advisory_lock(pool, name).acquire(), 0.2)
            holder.execute("SELECT pg_advisory_unlock(%s)", [unique_key(name)])
        await wait_until(lambda: not waiter_pids(pg_admin, name), "the waiters are gone")
        assert holder_pids(pg_admin, name) == []
        # Every connection the pool hands out now can take the name.
        async with (
            advisory_lock(pool, name, timeout=1),
            advisory_lock(pool, unique_name(), timeout=1),
        ):
            assert len(holder_pids(pg_admin, name)) == 1
    finally:
        await target.close()


# -- prepared statements, lost connections ---------------------------------------------------------


@pytest.mark.parametrize("autocommit", [True, False])
async def test_every_mode_works_with_prepare_threshold_zero(dsn: str, autocommit: bool) -> None:
    name = unique_name("async-prepared")
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=autocommit, prepare_threshold=0
    ) as connection:
        for options in (
            {"timeout": None},
            {"timeout": 0},
            {"timeout": 1.5},
            {"shared": True, "timeout": 1.5},
        ):
            for _ in range(2):
                async with advisory_lock(connection, name, **options):
                    assert not is_free(dsn, name)
        for options in ({"timeout": None}, {"timeout": 0}, {"timeout": 1.5}):
            for _ in range(2):
                async with (
                    connection.transaction(),
                    advisory_lock(connection, name, transaction=True, **options),
                ):
                    assert not is_free(dsn, name)
    assert is_free(dsn, name)


async def test_a_terminated_backend_makes_release_and_ensure_held_report_lock_lost(
    target: AsyncRawTarget, pg_admin: Admin
) -> None:
    name = unique_name("async-terminated")
    for check in ("release", "ensure_held"):
        bind = await target.bind()
        lock = advisory_lock(bind, name, timeout=1)
        assert await lock.acquire()
        pid = holder_pids(pg_admin, name)[0]
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        await wait_until(partial(gone, pg_admin, pid), "the backend is gone")
        with pytest.raises(LockLost):
            await (lock.release() if check == "release" else lock.ensure_held())
        assert not lock.held
    if target.kind.endswith("_pool"):
        async with advisory_lock(await target.bind(), name, timeout=1) as again:
            assert again.held


async def test_acquire_on_a_dead_connection_raises_a_typed_error(
    connection_target: AsyncRawTarget, pg_admin: Admin
) -> None:
    connection = await connection_target.connect()
    async with advisory_lock(connection, unique_name("async-pid"), timeout=0):
        pid = holder_pids(pg_admin, current_advisory_locks(connection)[0])[0]
    pg_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    await wait_until(lambda: not backend_alive(pg_admin, pid), "the backend is gone")
    with pytest.raises(AdvisoryLockError, match=r"gone|closed|released"):
        await advisory_lock(connection, unique_name("async-dead"), timeout=1).acquire()


# -- a pool that lends no connection ---------------------------------------------------------

# How long the exhausted pool below waits for a connection before it gives up.
POOL_TIMEOUT_SECONDS = 0.2


async def test_an_exhausted_psycopg_pool_refuses_a_lock_with_lock_connection_timeout(
    dsn: str,
) -> None:
    name = unique_name("async-pool-exhausted")
    async with AsyncConnectionPool(
        dsn, min_size=1, max_size=1, timeout=POOL_TIMEOUT_SECONDS, open=False
    ) as pool:
        await pool.wait()
        lock = advisory_lock(pool, name)
        async with pool.connection():  # another checkout holds the pool's only connection
            with pytest.raises(LockConnectionTimeout) as raised:
                await lock.acquire()
        assert_refused_by_an_exhausted_pool(raised.value, name, pool)
        assert not lock.held
        assert current_advisory_locks(pool) == []
        # A pool with room lends the next lock a connection, the refused object included.
        async with lock:
            assert not is_free(dsn, name)
        assert is_free(dsn, name)


async def test_a_closed_psycopg_pool_refuses_a_lock_with_lock_pool_closed(dsn: str) -> None:
    name = unique_name("async-pool-closed")
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False)
    await pool.open()
    await pool.close()
    lock = advisory_lock(pool, name)
    with pytest.raises(LockPoolClosed) as raised:
        await lock.acquire()
    error = raised.value
    assert isinstance(error, PoolClosed)  # psycopg_pool's own class, too
    assert isinstance(error, LockUsageError)
    assert type(error.__cause__) is PoolClosed
    assert error.name == name
    assert f"advisory lock {name!r} needs a connection" in str(error)
    assert f"the pool {pool.name!r} is already closed" in str(error)
    assert "while it is open" in str(error)
    assert not lock.held
    assert current_advisory_locks(pool) == []
    assert is_free(dsn, name)


async def test_a_closed_asyncpg_pool_refuses_a_lock_with_lock_pool_closed(dsn: str) -> None:
    name = unique_name("asyncpg-pool-closed")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    await pool.close()
    lock = advisory_lock(pool, name)
    with pytest.raises(AsyncpgPoolClosed) as raised:
        await lock.acquire()
    assert_refused_by_an_asyncpg_pool(
        raised.value,
        name,
        f"advisory lock {name!r} needs a connection from an asyncpg pool that is closed or "
        "closing: pool is closed. Take locks on a pool before its close().",
    )
    assert not lock.held
    assert current_advisory_locks(pool) == []
    assert is_free(dsn, name)


async def test_an_asyncpg_pool_not_awaited_yet_refuses_a_lock_with_lock_pool_closed(
    dsn: str,
) -> None:
    name = unique_name("asyncpg-pool-not-initialized")
    pool = asyncpg.create_pool(dsn, min_size=1, max_size=1)  # not awaited (a common slip)
    lock = advisory_lock(pool, name)
    with pytest.raises(AsyncpgPoolClosed) as raised:
        await lock.acquire()
    assert_refused_by_an_asyncpg_pool(
        raised.value,
        name,
        f"advisory lock {name!r} needs a connection from an asyncpg pool that is not "
        "initialized yet: pool is not initialized. Take locks on a pool once `await "
        "asyncpg.create_pool(...)` (or `await pool`) has returned.",
    )
    assert not lock.held
    await pool  # the same pool, initialized, lends the same lock object a connection
    try:
        async with lock:
            assert not is_free(dsn, name)
        assert is_free(dsn, name)
    finally:
        await pool.close()


async def test_a_closing_asyncpg_pool_refuses_a_lock_with_lock_pool_closed(dsn: str) -> None:
    # close() waits for the connections checked out; a lock meanwhile gets none.
    name = unique_name("asyncpg-pool-closing")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    connection = await pool.acquire()
    closing = asyncio.ensure_future(pool.close())
    try:
        await wait_until(pool.is_closing, "the pool is closing")
        with pytest.raises(AsyncpgPoolClosed, match="closed or closing: pool is closing"):
            await advisory_lock(pool, name).acquire()
    finally:
        await pool.release(connection)
        await asyncio.wait_for(closing, 10)
    assert is_free(dsn, name)


# -- no ORM, no greenlet ---------------------------------------------------------------------


def test_the_asyncio_binds_need_neither_sqlalchemy_nor_greenlet(dsn: str) -> None:
    code = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.modules["sqlalchemy"] = None  # importing either would fail
        sys.modules["greenlet"] = None
        import asyncpg, psycopg
        from advisory_locks import advisory_lock

        async def main():
            pool = await asyncpg.create_pool({dsn!r}, min_size=1, max_size=1)
            async with pool.acquire() as conn:
                async with advisory_lock(conn, "no-orm-a", timeout=0) as lock:
                    assert lock.held
            await pool.close()
            async with await psycopg.AsyncConnection.connect({dsn!r}) as conn:
                async with advisory_lock(conn, "no-orm-b", timeout=1) as lock:
                    assert lock.held
            print("ok")

        asyncio.run(main())
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "ok"


@needs_raw_cursors
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transactional"])
async def test_an_async_psycopg_connection_with_raw_query_cursors_locks_like_any_other(
    postgres_url: URL, pg_admin: Admin, autocommit: bool
) -> None:
    # An AsyncRawCursor takes $1 placeholders, where the library's statements have %s.
    name = unique_name()
    conn = await psycopg.AsyncConnection.connect(
        libpq_url(postgres_url), autocommit=autocommit, cursor_factory=psycopg.AsyncRawCursor
    )
    try:
        for timeout in (0, None, 5.0):
            async with advisory_lock(conn, name, timeout=timeout) as lock:
                await lock.ensure_held()
                assert holder_pids(pg_admin, name) == [conn.info.backend_pid]
            assert holder_pids(pg_admin, name) == []
        cursor = await conn.execute("SELECT $1::int", [7])
        assert await cursor.fetchone() == (7,)
    finally:
        await conn.close()
