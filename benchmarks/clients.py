"""Lock clients by name, buildable in any process: raw SQL, ours (SQLAlchemy, Django), peers.

Handoff waiters and throughput workers run in their own processes (a thread would share
the GIL with the holder and inflate every figure), so a client is named by a string and
built where it runs. ``take()`` acquires (waiting in the server) and returns the function
that releases.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import struct
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from advisory_locks.keys import derive_key
from advisory_locks.sqlalchemy import advisory_lock
from benchmarks import floors
from benchmarks.postgres import libpq_dsn, raw_connection
from benchmarks.uncontended import TIMEOUT_LOCK_SQL, UNLOCK_SQL

__all__ = ["CLIENTS", "Client", "Take", "make_client", "setup_django"]

Take = Callable[[], Callable[[], None]]

WAIT_SECONDS = 30
PALS_APP = "bench"
POLL_MIN_SECONDS = 0.05
POLL_MAX_SECONDS = 0.15

# name -> what it is (for the tables)
CLIENTS = {
    "raw": "raw psycopg: pg_advisory_lock (the server waits) + pg_advisory_unlock",
    "raw.timeout": "raw psycopg: pg_advisory_lock with lock_timeout set in the same statement",
    "ours.engine": "advisory_lock(engine, name)",
    "ours.engine.timeout": f"advisory_lock(engine, name, timeout={WAIT_SECONDS})",
    "ours.connection.timeout": f"advisory_lock(connection, name, timeout={WAIT_SECONDS})",
    "ours.session.timeout": f"advisory_lock(session, name, timeout={WAIT_SECONDS})",
    "ours.psycopg.timeout": (
        f"advisory_lock(psycopg_connection, name, timeout={WAIT_SECONDS}) (raw driver bind)"
    ),
    "ours.psycopg_pool.timeout": (
        f"advisory_lock(psycopg_pool, name, timeout={WAIT_SECONDS}) (raw driver bind, a pool "
        "of one)"
    ),
    "raw.psycopg_pool.timeout": (
        "psycopg_pool by hand (the twin of ours.psycopg_pool.timeout): pool.connection(), "
        "the timeout lock statement + unlock in autocommit, checkin"
    ),
    "ours.django.timeout": f"advisory_locks_django.advisory_lock(name, timeout={WAIT_SECONDS})",
    "pglock.timeout": f"django-pglock: pglock.advisory(name, timeout={WAIT_SECONDS})",
    "pals.timeout": f"pals: Locker.lock(name, acquire_timeout={WAIT_SECONDS * 1000})",
    "raw.client_polling": "pg_try_advisory_lock every 50-150 ms (the Rails gem's way)",
    "floor.engine.timeout": "the Engine's bind floor (benchmarks.floors.EngineFloor)",
    "floor.connection.timeout": "the Connection's bind floor (benchmarks.floors.ConnectionFloor)",
    "floor.session.timeout": "the Session's bind floor (benchmarks.floors.SessionFloor)",
    "floor.django.timeout": "Django's bind floor (benchmarks.floors.DjangoFloor)",
    "floor.psycopg.contract": (
        "the contract floor on a raw psycopg connection (benchmarks.floors._ContractFloorLock)"
    ),
    "floor.connection.contract": (
        "the contract floor on a SQLAlchemy Connection "
        "(benchmarks.floors._ConnectionContractFloorLock)"
    ),
    "floor.engine.contract": (
        "the contract floor on an Engine (benchmarks.floors._EngineContractFloorLock)"
    ),
    "floor.session.contract": (
        "the contract floor on a Session (benchmarks.floors._SessionContractFloorLock)"
    ),
    "floor.django.contract": (
        "the contract floor on Django's connection (benchmarks.floors._DjangoContractFloorLock)"
    ),
    # asyncio clients (Client.operation): throughput only.
    "raw.asyncpg.timeout": (
        "asyncpg by hand: the timeout lock statement + unlock (fetchval), in one task"
    ),
    "ours.asyncpg.timeout": f"async with advisory_lock(asyncpg_connection, timeout={WAIT_SECONDS})",
    "floor.asyncpg.contract": (
        "the contract floor on an asyncpg connection (benchmarks.floors.AsyncpgContractFloorLock)"
    ),
    "raw.asyncpg_pool.timeout": (
        "asyncpg pool by hand (a pool of one): pool.acquire(), the timeout lock statement + "
        "unlock, release"
    ),
    "ours.asyncpg_pool.timeout": (
        f"async with advisory_lock(asyncpg_pool, timeout={WAIT_SECONDS}) (a pool of one)"
    ),
    "floor.asyncpg_pool.contract": (
        "the contract floor on an asyncpg pool (benchmarks.floors.AsyncpgPoolContractFloorLock)"
    ),
}
WAIT_MS = str(WAIT_SECONDS * 1000)


@dataclass
class Client:
    take: Take
    # (classid, objid, objsubid) of the lock in pg_locks, to see a waiter queue.
    pg_ids: tuple[int, int, int]
    # A polling client never queues in the server; it calls on_busy instead.
    polls: bool = False
    # An asyncio client's whole operation (acquire and release, in one coroutine) and the
    # event loop it runs on: a throughput worker runs its slots in that loop, as an
    # application's tasks would. Its take() runs one operation and hands back a release
    # with nothing left to do, so it is for throughput, not for a handoff.
    operation: Callable[[], Awaitable[None]] | None = None
    loop: asyncio.AbstractEventLoop | None = None


def setup_django(url: URL) -> None:
    """Configure Django in this process for the same server (once)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "HOST": url.host or "",
                "PORT": url.port or "",
                "USER": url.username or "",
                "PASSWORD": url.password or "",
                "NAME": url.database or "postgres",
            }
        },
        INSTALLED_APPS=["advisory_locks_django"],
        USE_TZ=True,
    )
    django.setup()


def _ids(key: int) -> tuple[int, int, int]:
    return derive_key(key).pg_locks_ids()


def pals_key(name: str) -> int:
    """The bigint pals sends for ``name`` under app ``PALS_APP`` (sha1, native order)."""
    digest = hashlib.sha1(f"{PALS_APP}.{name}".encode()).digest()
    return int(struct.unpack("q", digest[:8])[0])


def make_client(
    kind: str,
    name: str,
    url: URL,
    stack: ExitStack,
    on_busy: Callable[[], None] = lambda: None,
) -> Client:
    """Build client ``kind`` for the lock called ``name`` (raw clients use its key)."""
    key = derive_key(name).ints[0]
    if kind in ("raw", "raw.timeout"):
        cursor = raw_connection(url, stack).cursor()
        sql = "SELECT pg_advisory_lock(%s)" if kind == "raw" else TIMEOUT_LOCK_SQL
        params: tuple[object, ...] = (key,) if kind == "raw" else (key, str(WAIT_SECONDS * 1000))

        def release_raw() -> None:
            cursor.execute(UNLOCK_SQL, (key,))

        def take_raw() -> Callable[[], None]:
            cursor.execute(sql, params)
            return release_raw

        return Client(take_raw, _ids(key))
    if kind == "raw.client_polling":
        return _polling_client(url, stack, key, on_busy)
    if kind.endswith("psycopg_pool.timeout"):
        return _psycopg_pool_client(kind, name, key, url, stack)
    if ".asyncpg" in kind:
        return _asyncpg_client(kind, name, key, url, stack)
    if kind.startswith("floor."):
        return Client(_floor_take(kind, name, key, url, stack), _ids(key))
    if kind.startswith("ours.") and "django" not in kind:
        engine = create_engine(url)
        stack.callback(engine.dispose)
        timeout = WAIT_SECONDS if kind.endswith(".timeout") else None
        bind: Any = engine
        if kind.startswith("ours.connection"):
            bind = engine.connect()
            stack.callback(bind.close)
        elif kind.startswith("ours.session"):
            bind = Session(engine)
            stack.callback(bind.close)
        elif kind.startswith("ours.psycopg"):
            bind = raw_connection(url, stack)
        return Client(_take_ours(bind, name, timeout), _ids(key))
    if kind == "ours.django.timeout":
        setup_django(url)
        from advisory_locks_django import advisory_lock as django_lock

        def take_django() -> Callable[[], None]:
            lock = django_lock(name, timeout=WAIT_SECONDS)
            if not lock.acquire():
                raise RuntimeError(f"{name}: not granted")
            return lock.release

        return Client(take_django, _ids(key))
    if kind == "pglock.timeout":
        setup_django(url)
        import pglock

        def take_pglock() -> Callable[[], None]:
            lock = pglock.advisory(name, timeout=WAIT_SECONDS)
            if not lock.acquire():
                raise RuntimeError(f"{name}: not granted")
            release: Callable[[], None] = lock.release
            return release

        return Client(take_pglock, derive_key(name, scheme="pglock").pg_locks_ids())
    if kind == "pals.timeout":
        import pals  # type: ignore[import-untyped]

        engine = create_engine(url)
        stack.callback(engine.dispose)
        locker = pals.Locker(PALS_APP, create_engine_callable=lambda: engine)

        def take_pals() -> Callable[[], None]:
            lock = locker.lock(name, blocking=True, acquire_timeout=WAIT_SECONDS * 1000)
            if not lock.acquire():
                raise RuntimeError(f"{name}: not granted")
            release: Callable[[], None] = lock.release
            return release

        return Client(take_pals, _ids(pals_key(name)))
    raise ValueError(f"unknown client {kind!r}; one of {sorted(CLIENTS)}")


def _take_ours(bind: Any, name: str, timeout: float | None) -> Take:
    """One of our locks on ``bind``, taken and handed back by the client's loop."""

    def take_ours() -> Callable[[], None]:
        lock = advisory_lock(bind, name, timeout=timeout)
        if not lock.acquire():
            raise RuntimeError(f"{name}: not granted within {timeout} s")
        release: Callable[[], None] = lock.release
        return release

    return take_ours


def _psycopg_pool_client(kind: str, name: str, key: int, url: URL, stack: ExitStack) -> Client:
    """A psycopg_pool of one connection: ours, or its twin by hand (the twin
    ``benchmarks.raw_drivers`` times: a checkout, the connection switched to autocommit
    for the two statements and back, a checkin)."""
    from psycopg_pool import ConnectionPool

    conninfo = libpq_dsn(url)
    pool: ConnectionPool[Any] = ConnectionPool(conninfo, min_size=1, max_size=1, open=True)
    stack.callback(pool.close)
    if kind.startswith("ours."):
        return Client(_take_ours(pool, name, WAIT_SECONDS), _ids(key))
    params = (key, str(WAIT_SECONDS * 1000))

    def take_raw() -> Callable[[], None]:
        checkout = pool.connection()
        connection = checkout.__enter__()
        connection.autocommit = True
        cursor = connection.cursor()
        cursor.execute(TIMEOUT_LOCK_SQL, params)

        def release_raw() -> None:
            cursor.execute(UNLOCK_SQL, (key,))
            connection.autocommit = False
            checkout.__exit__(None, None, None)

        return release_raw

    return Client(take_raw, _ids(key))


def _asyncpg_client(kind: str, name: str, key: int, url: URL, stack: ExitStack) -> Client:
    """asyncpg, on a connection or a pool of one: ours, its contract floor, or the twin by
    hand, on an event loop of the client's own."""
    import asyncpg

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # asyncpg's pool asks for the current loop while it connects
    stack.callback(loop.close)
    stack.callback(asyncio.set_event_loop, None)
    dsn = libpq_dsn(url)
    bind: Any
    if "asyncpg_pool" in kind:
        bind = loop.run_until_complete(asyncpg.create_pool(dsn, min_size=1, max_size=1))
    else:
        bind = loop.run_until_complete(asyncpg.connect(dsn))
    stack.callback(lambda: loop.run_until_complete(bind.close()))
    operation: Callable[[], Awaitable[None]]
    if kind.startswith("ours."):

        async def operation() -> None:
            async with advisory_lock(bind, name, timeout=WAIT_SECONDS):
                pass

    elif kind.startswith("floor."):
        floor = (
            floors.AsyncpgPoolContractFloorLock
            if "asyncpg_pool" in kind
            else floors.AsyncpgContractFloorLock
        )

        async def operation() -> None:
            async with floor(bind, name, WAIT_SECONDS):
                pass

    elif "asyncpg_pool" in kind:

        async def operation() -> None:
            async with bind.acquire() as connection:
                await connection.fetchval(floors.ASYNCPG_TIMEOUT_LOCK_SQL, key, WAIT_MS)
                await connection.fetchval(floors.ASYNCPG_UNLOCK_SQL, key)

    else:

        async def operation() -> None:
            await bind.fetchval(floors.ASYNCPG_TIMEOUT_LOCK_SQL, key, WAIT_MS)
            await bind.fetchval(floors.ASYNCPG_UNLOCK_SQL, key)

    def released() -> None:
        pass

    def take() -> Callable[[], None]:
        loop.run_until_complete(operation())
        return released

    return Client(take, _ids(key), operation=operation, loop=loop)


def _contract_bind(kind: str, url: URL, stack: ExitStack) -> Any:
    """What contract floor ``kind`` locks on, opened for one client."""
    if kind == floors.PSYCOPG_CONTRACT:
        return raw_connection(url, stack)
    if kind == floors.DJANGO_CONTRACT:
        setup_django(url)
        return "default"
    engine = floors.guard_engine(create_engine(url))
    stack.callback(engine.dispose)
    if kind == floors.CONNECTION_CONTRACT:
        connection = engine.connect()
        stack.callback(connection.close)
        return connection
    if kind == floors.ENGINE_CONTRACT:
        return engine
    session = Session(engine)
    stack.callback(session.close)
    return session


def _floor_take(kind: str, name: str, key: int, url: URL, stack: ExitStack) -> Take:
    """A bind floor as a client, waiting in the server as ours does, on the same key."""
    if kind.endswith(".contract"):
        return floors.contract_floor_take(
            kind, _contract_bind(kind, url, stack), name, WAIT_SECONDS
        )
    floor: floors.FloorLock
    if kind == "floor.django.timeout":
        setup_django(url)
        floor = floors.DjangoFloor(key, WAIT_MS)
    else:
        engine = create_engine(url)
        stack.callback(engine.dispose)
        if kind == "floor.engine.timeout":
            floor = floors.EngineFloor(engine, key, WAIT_MS)
        elif kind == "floor.connection.timeout":
            connection = engine.connect()
            stack.callback(connection.close)
            floor = floors.ConnectionFloor(connection, key, WAIT_MS)
        elif kind == "floor.session.timeout":
            session = Session(engine)
            stack.callback(session.close)
            floor = floors.SessionFloor(session, key, WAIT_MS)
        else:
            raise ValueError(f"unknown client {kind!r}; one of {sorted(CLIENTS)}")
    acquire, release = floor.acquire, floor.release

    def take() -> Callable[[], None]:
        acquire()
        return release

    return take


def _polling_client(url: URL, stack: ExitStack, key: int, on_busy: Callable[[], None]) -> Client:
    cursor = raw_connection(url, stack).cursor()
    chance = random.Random(key)

    def release() -> None:
        cursor.execute("SELECT pg_advisory_unlock(%s)", (key,))

    def take() -> Callable[[], None]:
        while True:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            row = cursor.fetchone()
            if row is not None and row[0]:
                return release
            on_busy()
            time.sleep(chance.uniform(POLL_MIN_SECONDS, POLL_MAX_SECONDS))

    return Client(take, _ids(key), polls=True)
