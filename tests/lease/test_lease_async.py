"""Lease locks on asyncio binds: SQLAlchemy's AsyncEngine (asyncpg, psycopg), asyncpg's
Pool and Connection, psycopg's AsyncConnectionPool and AsyncConnection, on PostgreSQL
(the only database with asyncio drivers among the test dependencies).

The same rules as the blocking lease (they are one implementation, run by awaiting):
exclusion across processes and bindings, a token that only grows, a paused holder that
learns of its loss within one renewal period, fences; plus what only asyncio has: the
renewer is a task of the running loop, ``lost`` is an ``asyncio.Event``, and
``cancel_on_loss=True`` cancels the body.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from advisory_locks import (
    AsyncLeaseLock,
    LeaseTableMissing,
    LockConnectionLost,
    LockLost,
    LockStolen,
    UnsupportedFeature,
    lease_lock,
)
from tests.helpers import EventRecorder
from tests.lease.async_binds import KINDS, POOLS, AsyncBind
from tests.lease.conftest import LeaseDatabase, fenced_write
from tests.lease.test_lease_locks import (
    drop_missing_table_database,
    expire_now,
    missing_table_url,
    unique,
    url_text,
)
from tests.lease.workers import async_hold, async_hold_until_resumed

SPAWN = multiprocessing.get_context("spawn")
START_SECONDS = 60.0
PREFIX = os.environ.get("ADVISORY_LOCKS_PREFIX", "")

pytestmark = pytest.mark.parametrize("lease_db", ["postgresql"], indirect=True)


@pytest.fixture(params=KINDS)
async def bind(request: pytest.FixtureRequest, lease_db: LeaseDatabase) -> AsyncIterator[AsyncBind]:
    opened = await AsyncBind(request.param, lease_db.url).open()
    yield opened
    await opened.close()


@pytest.fixture(params=sorted(POOLS))
async def pool_bind(
    request: pytest.FixtureRequest, lease_db: LeaseDatabase
) -> AsyncIterator[AsyncBind]:
    opened = await AsyncBind(request.param, lease_db.url).open()
    yield opened
    await opened.close()


def steal(
    lease_db: LeaseDatabase, name: str, got: threading.Event, release: threading.Event
) -> Any:
    """A thread that takes ``name`` over once it expires and holds it until ``release``."""
    thief: list[Any] = []

    def run() -> None:
        with lease_lock(lease_db.engine, name, ttl=30, timeout=20) as lease:
            thief.append(lease)
            fenced_write(lease, lease_db.engine, "thief")
            got.set()
            release.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, thief


# -- exclusion and tokens ------------------------------------------------------------------


async def test_a_lease_held_in_another_process_excludes_this_one_and_the_token_grows(
    bind: AsyncBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    report = SPAWN.Queue()
    release = SPAWN.Event()
    child = SPAWN.Process(
        target=async_hold, args=(bind.kind, url_text(lease_db), name, report, release)
    )
    child.start()
    try:
        kind, held_token = await asyncio.to_thread(report.get, timeout=START_SECONDS)
        assert kind == "acquired"
        assert not await bind.lease(name, timeout=0).acquire()
        waiter = asyncio.create_task(_take(bind, name))
        release.set()
        tokens = [held_token, await waiter]
        for _ in range(2):
            async with bind.lease(name, timeout=0) as lease:
                tokens.append(lease.token)
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == 4
        assert await asyncio.to_thread(report.get, timeout=START_SECONDS) == ("released", None)
    finally:
        release.set()
        await asyncio.to_thread(child.join, 30)
    assert child.exitcode == 0


async def _take(bind: AsyncBind, name: str) -> int:
    async with bind.lease(name, timeout=20) as lease:
        assert lease.held
        assert lease.token is not None
        return lease.token


async def test_holding_a_lease_pins_no_pooled_connection(pool_bind: AsyncBind) -> None:
    async with pool_bind.lease(unique(), ttl=3) as lease:
        await pool_bind.use_a_pooled_connection()  # the pool has one connection, and it is free
        assert lease.held


async def test_a_blocked_waiter_gets_the_lease_when_the_holder_releases(bind: AsyncBind) -> None:
    name = unique()
    holder = bind.lease(name, ttl=30)
    assert await holder.acquire()
    waiter = asyncio.create_task(_take(bind, name))
    await asyncio.sleep(0)  # the waiter makes its first (failed) attempt
    assert not waiter.done()
    await holder.release()
    # A release NOTIFYs the waiter; without it the waiter sleeps at most 2 s at a time.
    token = await asyncio.wait_for(waiter, 30)
    assert token == holder.token + 1  # type: ignore[operator]


# -- renewal and loss ----------------------------------------------------------------------


async def test_an_async_lease_is_renewed_by_a_task_of_the_running_loop(
    bind: AsyncBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    async with bind.lease(name, ttl=1.0) as lease:
        renewed = lease_db.row(lease.lease_name).renewed_at  # type: ignore[union-attr]
        while lease_db.row(lease.lease_name).renewed_at == renewed:  # type: ignore[union-attr]
            await asyncio.sleep(0.05)
        assert "advisory-locks-renewer" in {task.get_name() for task in asyncio.all_tasks()}
        assert not await bind.lease(name, timeout=0).acquire()
        await lease.ensure_held()
        assert not lease.lost.is_set()


async def test_a_paused_holder_process_learns_it_was_stolen_and_its_fenced_write_is_refused(
    bind: AsyncBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    ttl, period = 1.5, 0.4
    report = SPAWN.Queue()
    resumed = SPAWN.Event()
    child = SPAWN.Process(
        target=async_hold_until_resumed,
        args=(bind.kind, url_text(lease_db), name, ttl, period, report, resumed),
    )
    child.start()
    try:
        kind, stale_token = await asyncio.to_thread(report.get, timeout=START_SECONDS)
        assert kind == "acquired"
        os.kill(child.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        thief = bind.lease(name, ttl=30, timeout=10)
        async with thief:
            assert thief.token == stale_token + 1
            await bind.fenced_write(thief, "thief")
            os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
            resumed.set()
            kind, outcome = await asyncio.to_thread(report.get, timeout=START_SECONDS)
        await asyncio.to_thread(child.join, 30)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
            child.kill()
    assert kind == "done"
    assert outcome["lost_after"] is not None
    assert outcome["lost_after"] <= period
    assert outcome == {
        "lost_after": outcome["lost_after"],
        "held": False,
        "ensure_held": "LockStolen",
        "fence": "LockStolen",
        "exit": "LockStolen",
    }
    assert lease_db.writes(PREFIX + name) == [(stale_token + 1, "thief", 0)]


async def test_a_blocked_event_loop_learns_within_one_period_that_its_lease_was_stolen(
    bind: AsyncBind, lease_db: LeaseDatabase, lock_events: EventRecorder
) -> None:
    name = unique()
    ttl, period = 1.5, 0.4
    got, release = threading.Event(), threading.Event()
    lease = bind.lease(name, ttl=ttl, renew_every=period, timeout=0)
    assert await lease.acquire()
    thread, thief = steal(lease_db, name, got, release)
    try:
        # CPU-bound code that never awaits: the renewer task cannot run until it ends.
        assert got.wait(30)
        resumed = time.monotonic()
        await asyncio.wait_for(lease.lost.wait(), period)
        assert time.monotonic() - resumed <= period
        assert not lease.held
        with pytest.raises(LockStolen) as raised:
            await lease.ensure_held()
        assert raised.value.token == thief[0].token
        with pytest.raises(LockStolen):
            await bind.fenced_write(lease, "stale")
        with pytest.raises(LockStolen):
            await lease.release()
    finally:
        release.set()
        thread.join(30)
    assert lease_db.writes(PREFIX + name) == [(lease.token + 1, "thief", 0)]  # type: ignore[operator]
    kinds = lock_events.kinds(name)
    assert kinds[0] == "acquired"
    assert "stolen" in kinds
    stolen = lock_events.one(name, "stolen")
    assert (stolen.scope, stolen.token, stolen.system) == ("lease", lease.token, "postgresql")


async def test_cancel_on_loss_cancels_the_body_and_the_block_raises_the_loss(
    bind: AsyncBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    finished: list[bool] = []
    thief = lease_lock(lease_db.engine, name, ttl=30, timeout=0)

    async def block() -> None:
        async with bind.lease(name, ttl=3.0, cancel_on_loss=True) as lease:
            expire_now(lease_db, lease.lease_name)
            assert await asyncio.to_thread(thief.acquire)
            await asyncio.sleep(30)  # cancelled by the renewal that finds it taken
            finished.append(True)

    with pytest.raises(LockStolen) as raised:
        await block()
    assert not finished
    assert raised.value.token == thief.token
    task = asyncio.current_task()
    assert task is not None
    assert not task.cancelled()
    if hasattr(task, "cancelling"):
        assert task.cancelling() == 0  # the cancellation was the lease's, and it is over
    thief.release()


async def test_without_cancel_on_loss_the_body_runs_on_and_the_block_raises_at_exit(
    bind: AsyncBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    thief = lease_lock(lease_db.engine, name, ttl=30, timeout=0)
    ran_on: list[bool] = []

    async def block() -> None:
        async with bind.lease(name, ttl=3.0) as lease:
            expire_now(lease_db, lease.lease_name)
            assert await asyncio.to_thread(thief.acquire)
            await asyncio.wait_for(lease.lost.wait(), lease.options.period + 0.5)
            ran_on.append(True)

    with pytest.raises(LockStolen):
        await block()
    assert ran_on == [True]
    thief.release()


# -- events --------------------------------------------------------------------------------


async def test_an_async_lease_reports_its_grant_and_release_with_its_token(
    bind: AsyncBind, lock_events: EventRecorder
) -> None:
    name = unique()
    async with bind.lease(name, ttl=10) as lease:
        assert not await bind.lease(name, timeout=0).acquire()
    acquired, refused, released = lock_events.about(name)
    assert (acquired.kind, refused.kind, released.kind) == ("acquired", "not_acquired", "released")
    binding = "sqlalchemy" if bind.kind.startswith("sqlalchemy") else bind.kind.partition("-")[0]
    for event in (acquired, released):
        assert (event.scope, event.token, event.system) == ("lease", lease.token, "postgresql")
        assert event.binding == binding
    assert refused.reason == "busy"


# -- bad input and a missing table ---------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"ttl": 0}, ValueError),
        ({"ttl": math.nan}, ValueError),
        ({"ttl": 30, "renew_every": 30}, ValueError),
        ({"timeout": -1}, ValueError),
        ({"cancel_on_loss": "yes"}, TypeError),
        ({"connect": "postgresql://"}, TypeError),
    ],
)
async def test_bad_options_are_refused_before_any_sql(
    bind: AsyncBind, lease_db: LeaseDatabase, options: dict[str, Any], error: type
) -> None:
    name = unique()
    with pytest.raises(error):
        bind.lease(name, **options)
    assert lease_db.row(PREFIX + name) is None


async def test_a_single_asyncpg_connection_without_connect_is_refused_before_any_sql(
    lease_db: LeaseDatabase,
) -> None:
    connection = await asyncpg.connect(
        lease_db.url.set(drivername="postgresql").render_as_string(hide_password=False)
    )
    try:
        with pytest.raises(UnsupportedFeature, match="connect="):
            lease_lock(connection, unique())
    finally:
        await connection.close()


async def test_cancel_on_loss_needs_an_async_bind(lease_db: LeaseDatabase) -> None:
    with pytest.raises(UnsupportedFeature, match="async bind"):
        lease_lock(lease_db.engine, unique(), cancel_on_loss=True)


async def test_connect_is_for_raw_connections_not_sqlalchemy_binds(
    lease_db: LeaseDatabase,
) -> None:
    engine = create_async_engine(lease_db.url.set(drivername="postgresql+asyncpg"))
    try:
        with pytest.raises(TypeError, match="connect="):
            lease_lock(engine, unique(), connect=lambda: None)
        assert isinstance(lease_lock(engine, unique()), AsyncLeaseLock)
    finally:
        await engine.dispose()


async def test_a_missing_table_is_an_error_that_says_how_to_create_it(
    bind: AsyncBind, lease_db: LeaseDatabase, tmp_path: Any
) -> None:
    url = missing_table_url(lease_db, tmp_path)
    scratch = url.query["options"].split("=")[1]
    empty = await AsyncBind(bind.kind, lease_db.url, search_path=scratch).open()
    try:
        with pytest.raises(LeaseTableMissing) as raised:
            await empty.lease(unique(), timeout=0).acquire()
        assert "advisory_locks_lease" in str(raised.value)
        assert "create_lease_table(engine)" in str(raised.value)
        assert "migrate" in str(raised.value)
    finally:
        await empty.close()
        drop_missing_table_database(lease_db, url)


async def test_a_lease_across_bindings_excludes_a_blocking_holder(
    bind: AsyncBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    engine = create_engine(lease_db.url)
    try:
        with lease_lock(engine, name, timeout=0) as blocking:
            assert not await bind.lease(name, timeout=0).acquire()
        async with bind.lease(name, timeout=0) as lease:
            assert lease.token == blocking.token + 1  # type: ignore[operator]
            assert not lease_lock(engine, name, timeout=0).acquire()
    finally:
        engine.dispose()


async def test_a_lease_on_a_pooled_connection_the_server_ended_raises_no_driver_error(
    pool_bind: AsyncBind, lease_db: LeaseDatabase
) -> None:
    """A pool's idle connection ended by the server: the acquire on it is
    ``LockConnectionLost`` and the next acquire takes a fresh connection; the release on
    one is sent again on a fresh one. (asyncpg's own pool may notice the end first, in
    the loop, and replace the connection: then the acquire succeeds.)"""
    name = unique()
    lease = pool_bind.lease(name, ttl=30, timeout=0)
    lease_db.end_session(await pool_bind.pooled_session_id())
    lost: list[LockConnectionLost] = []
    try:
        assert await lease.acquire()
    except LockConnectionLost as error:
        lost.append(error)
    if pool_bind.kind != "asyncpg-pool":
        assert len(lost) == 1
    for error in lost:
        assert error.name == name
        assert error.__cause__ is not None
        assert not lease.held
        assert await lease.acquire()  # on a fresh connection
    lease_db.end_session(await pool_bind.pooled_session_id())
    await lease.release()
    row = lease_db.row(lease.lease_name)
    assert row is not None
    assert row.holder is None
    assert not lease.lost.is_set()


@pytest.mark.parametrize("kind", ["asyncpg-connection", "psycopg-connection"])
async def test_an_async_lease_whose_database_stops_answering_is_lost_in_time(
    kind: str, lease_db: LeaseDatabase
) -> None:
    """The loop's renewer awaits a renewal that is neither answered nor refused (a
    partition, a hung server): it gives up on it at the lease's deadline, declares the
    lease lost before the database may let it expire, and renews the other database's
    leases and those still in time on a new connection."""
    from tests.lease.proxy import TcpProxy

    with TcpProxy(lease_db.url.host or "127.0.0.1", lease_db.url.port or 0) as proxy:
        # connect= opens a connection per statement: none the stall froze is used again.
        far = await AsyncBind(kind, lease_db.url.set(host="127.0.0.1", port=proxy.port)).open()
        near = await AsyncBind(kind, lease_db.url).open()
        ttl, period = 5.0, 0.5
        # timeout=0: a waiting acquire would open a LISTEN connection through the proxy,
        # which the stall would leave hanging too (psycopg 3.1 cancels it, at the loop's
        # end, with a blocking cancel request that the closed proxy never answers).
        short = far.lease(unique(), ttl=ttl, renew_every=period, timeout=0)
        long = far.lease(unique(), ttl=8.0, renew_every=1.0, timeout=0)
        other = near.lease(unique(), ttl=8.0, renew_every=period, timeout=0)
        try:
            assert await short.acquire()
            assert await long.acquire()
            assert await other.acquire()
            acquired = lease_db.row(short.lease_name).renewed_at  # type: ignore[union-attr]
            while lease_db.row(short.lease_name).renewed_at == acquired:  # type: ignore[union-attr]
                await asyncio.sleep(0.05)  # until the renewer has its connection
            proxy.stall()
            stalled = time.monotonic()
            long_renewed = lease_db.row(long.lease_name).renewed_at  # type: ignore[union-attr]
            other_renewed = lease_db.row(other.lease_name).renewed_at  # type: ignore[union-attr]

            await asyncio.wait_for(short.lost.wait(), ttl + 2)
            assert time.monotonic() - stalled <= ttl  # before the database may expire it
            with pytest.raises(LockLost) as raised:
                await short.ensure_held()
            assert type(raised.value) is LockLost

            deadline = time.monotonic() + 10
            while lease_db.row(long.lease_name).renewed_at == long_renewed:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the far lease still in time was renewed"
                await asyncio.sleep(0.05)
            assert lease_db.row(other.lease_name).renewed_at != other_renewed  # type: ignore[union-attr]
            await asyncio.sleep(max(0.0, stalled + 8.5 - time.monotonic()))
            assert not long.lost.is_set()
            assert not other.lost.is_set()
            await long.ensure_held()
            await other.ensure_held()
        finally:
            await long.release()
            await other.release()
            with pytest.raises(LockLost):
                await short.release()
            proxy.cut()  # the bind's own connection is stalled too: end it
            await far.close()
            await near.close()
