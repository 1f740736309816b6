"""Cancellation on SQLAlchemy's asyncio binds, with asyncpg and with psycopg's async
connection.

What holds: a task cancelled while it waits for a lock (``asyncio.wait_for``,
``asyncio.timeout``, ``task.cancel()``) stops waiting at once, and the abandoned wait is
never granted afterwards: the server's answer to it is unknown, so its connection is
discarded. A task cancelled over and over while it leaves a lock's block (a cancel storm:
a supervisor cancelling a stuck task in a loop, nested timeouts) still gives the lock's
connection back to the pool explicitly, never through SQLAlchemy's garbage-collector
fallback (whose SAWarning blames the application), and leaves the lock free.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from advisory_locks import AsyncAdvisoryLock, advisory_lock
from tests.databases import PostgresDriver
from tests.faults.conftest import inject
from tests.helpers import engine_backends_with_advisory_locks, holder_pids, lock_rows, unique_name

pytestmark = pytest.mark.faults

Admin = psycopg.Connection[TupleRow]
ASYNC_DRIVERS: list[PostgresDriver] = ["asyncpg", "psycopg_async"]
BINDS = ["engine", "connection", "session"]
WAIT_SECONDS = 10.0
# wait_for(..., ABANDON_AFTER) must be back well before a human would notice.
ABANDON_AFTER = 0.2
PROMPT_SECONDS = 1.0


@pytest.fixture
def application_name() -> str:
    return f"al-async-cancel-{uuid.uuid4().hex[:16]}"


@pytest.fixture(params=ASYNC_DRIVERS)
async def async_engine(
    request: pytest.FixtureRequest,
    postgres_url_for: Callable[[PostgresDriver], URL],
    application_name: str,
) -> AsyncIterator[AsyncEngine]:
    driver: PostgresDriver = request.param
    arguments: dict[str, Any] = (
        {"server_settings": {"application_name": application_name}}
        if driver == "asyncpg"
        else {"application_name": application_name}
    )
    engine = create_async_engine(postgres_url_for(driver), connect_args=arguments)
    yield engine
    await engine.dispose()


@contextlib.asynccontextmanager
async def opened(kind: str, engine: AsyncEngine) -> AsyncIterator[Any]:
    if kind == "engine":
        yield engine
    elif kind == "connection":
        async with engine.connect() as connection:
            yield connection
    else:
        async with AsyncSession(engine) as session:
            yield session


async def storm(task: asyncio.Task[Any]) -> int:
    """Cancel ``task`` at every turn of the event loop until it ends; the cancel count."""
    cancels = 0
    while not task.done():
        task.cancel()
        cancels += 1
        await asyncio.sleep(0)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    inject("asyncio cancel storm")
    return cancels


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


def collector_fallbacks(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "garbage collector" in str(w.message)]


@pytest.mark.parametrize("kind", BINDS)
async def test_cancel_storm_while_leaving_the_block_gives_the_connection_back_explicitly(
    kind: str, async_engine: AsyncEngine, pg_admin: Admin, application_name: str
) -> None:
    name = unique_name()
    holding = asyncio.Event()

    async def hold() -> None:
        async with opened(kind, async_engine) as bind, advisory_lock(bind, name):
            holding.set()
            await asyncio.sleep(WAIT_SECONDS)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = asyncio.create_task(hold())
        await asyncio.wait_for(holding.wait(), WAIT_SECONDS)
        cancels = await storm(task)
        gc.collect()
    assert cancels >= 2, "no cancellation reached the block's exit"
    assert collector_fallbacks(caught) == []
    assert async_engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    await until(lambda: lock_rows(pg_admin, name) == [], "the lock is free")
    assert engine_backends_with_advisory_locks(pg_admin, application_name) == []


@pytest.mark.parametrize("kind", BINDS)
async def test_cancel_storm_while_waiting_abandons_the_wait_and_gives_the_connection_back(
    kind: str, async_engine: AsyncEngine, pg_admin: Admin, application_name: str
) -> None:
    name = unique_name()
    async with async_engine.connect() as holder:
        async with advisory_lock(holder, name):
            (holder_pid,) = holder_pids(pg_admin, name)
            waiting: list[AsyncAdvisoryLock] = []

            async def wait() -> None:
                async with opened(kind, async_engine) as bind:
                    lock = advisory_lock(bind, name)
                    waiting.append(lock)
                    await lock.acquire()

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                task = asyncio.create_task(wait())
                await until(
                    lambda: any(not row.granted for row in lock_rows(pg_admin, name)),
                    "the waiter is queued on the server",
                )
                await storm(task)
                gc.collect()
            assert collector_fallbacks(caught) == []
            assert not waiting[0].held
        # The holder released: the abandoned wait must not be granted now.
        await until(lambda: holder_pid not in holder_pids(pg_admin, name), "the holder let go")
        await asyncio.sleep(0.2)
        assert lock_rows(pg_admin, name) == []
    assert async_engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert engine_backends_with_advisory_locks(pg_admin, application_name) == []


@pytest.mark.parametrize("kind", BINDS)
async def test_wait_for_abandons_a_blocked_acquire_promptly_and_it_is_never_granted_later(
    kind: str, async_engine: AsyncEngine, pg_admin: Admin, application_name: str
) -> None:
    name = unique_name()
    async with async_engine.connect() as holder:
        async with advisory_lock(holder, name):
            (holder_pid,) = holder_pids(pg_admin, name)
            async with opened(kind, async_engine) as bind:
                lock = advisory_lock(bind, name)
                started = time.monotonic()
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(lock.acquire(), ABANDON_AFTER)
                waited = time.monotonic() - started
                inject("asyncio.wait_for on a blocked acquire")
                assert ABANDON_AFTER <= waited < PROMPT_SECONDS
                assert not lock.held
                # Nothing of this engine is still queued for the lock.
                await until(
                    lambda: [row.pid for row in lock_rows(pg_admin, name)] == [holder_pid],
                    "only the holder is left on the lock",
                )
        await until(lambda: lock_rows(pg_admin, name) == [], "the holder let go")
        await asyncio.sleep(0.2)
        assert lock_rows(pg_admin, name) == []
        # The lock is free for anyone, at once.
        async with advisory_lock(async_engine, name, timeout=0) as taken:
            assert taken.held
    assert engine_backends_with_advisory_locks(pg_admin, application_name) == []
