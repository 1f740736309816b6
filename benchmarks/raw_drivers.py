"""Raw-driver binds against the raw driver doing the same statements (their twins).

psycopg 3 (a connection, and psycopg_pool) and asyncpg (a connection, and its pool). Each
case takes a lock nobody else holds and gives it back. The asyncpg cases run on one event
loop in this thread; the stopwatch brackets the work inside the coroutine, so the cost of
entering the loop is in neither side of a ratio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from typing import Any

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL

from advisory_locks import advisory_lock
from advisory_locks.keys import derive_key
from benchmarks import floors
from benchmarks.measure import Case, Stopwatch
from benchmarks.postgres import libpq_dsn, raw_connection

__all__ = ["raw_driver_cases"]

TIMEOUT_SECONDS = 5
# The statements our PostgreSQL backend sends for an uncontended acquire + release, as the
# raw twins send them by hand.
PSYCOPG_TIMEOUT_LOCK = (
    "SELECT pg_advisory_lock(%s) FROM (SELECT pg_catalog.set_config('lock_timeout', %s, true)) "
    "AS timeout"
)
ASYNCPG_TIMEOUT_LOCK = floors.ASYNCPG_TIMEOUT_LOCK_SQL
RAW_KEY_BASE = 7_247_000


def _timed(body: Callable[[], object]) -> Callable[[Stopwatch], None]:
    def operation(watch: Stopwatch) -> None:
        watch.start()
        body()
        watch.stop()

    return operation


def _timed_async(
    loop: asyncio.AbstractEventLoop, body: Callable[[], Awaitable[object]]
) -> Callable[[Stopwatch], None]:
    async def timed(watch: Stopwatch) -> None:
        watch.start()
        await body()
        watch.stop()

    return lambda watch: loop.run_until_complete(timed(watch))


def _psycopg_socket(connection: psycopg.Connection[TupleRow]) -> Callable[[], list[int]]:
    return lambda: [connection.pgconn.socket]


def _asyncpg_socket(connection: Any) -> Callable[[], list[int]]:
    # Benchmark-only: the socket of asyncpg's transport, for the kernel's segment count.
    return lambda: [connection._transport.get_extra_info("socket").fileno()]


def psycopg_cases(url: URL, stack: ExitStack) -> list[Case]:
    from psycopg_pool import ConnectionPool

    cases: list[Case] = []
    timeout_ms = str(TIMEOUT_SECONDS * 1000)

    for autocommit in (True, False):
        connection = raw_connection(url, stack, autocommit=autocommit)
        name = "ours.psycopg.timeout" + ("" if autocommit else ".not_autocommit")

        def lock(connection: Any = connection, name: str = name) -> None:
            with advisory_lock(connection, name, timeout=TIMEOUT_SECONDS):
                pass

        cases.append(
            Case(
                name,
                "raw-driver",
                f"advisory_lock(psycopg_connection, timeout=5) on a connection "
                f"{'in autocommit' if autocommit else 'not in autocommit (idle)'}",
                _timed(lock),
                twin="raw.timeout_lock+unlock",
                sockets=_psycopg_socket(connection),
            )
        )

    floor_connection = raw_connection(url, stack)
    cases.append(floors.psycopg_contract_floor(floor_connection, _psycopg_socket(floor_connection)))

    connection = raw_connection(url, stack)

    def wait_forever() -> None:
        with advisory_lock(connection, "ours.psycopg"):
            pass

    cases.append(
        Case(
            "ours.psycopg",
            "raw-driver",
            "advisory_lock(psycopg_connection) (waits forever) in autocommit",
            _timed(wait_forever),
            twin="raw.lock+unlock",
            sockets=_psycopg_socket(connection),
        )
    )

    pool: ConnectionPool[Any] = ConnectionPool(libpq_dsn(url), min_size=1, max_size=1, open=True)
    stack.callback(pool.close)
    key = RAW_KEY_BASE

    def raw_pooled() -> None:
        with pool.connection() as connection:
            connection.autocommit = True
            cursor = connection.cursor()
            cursor.execute(PSYCOPG_TIMEOUT_LOCK, (key, timeout_ms))
            cursor.fetchone()
            cursor.execute("SELECT pg_advisory_unlock(%s)", (key,))
            cursor.fetchone()
            connection.autocommit = False

    def ours_pooled() -> None:
        with advisory_lock(pool, "ours.psycopg_pool.timeout", timeout=TIMEOUT_SECONDS):
            pass

    cases.append(
        Case(
            "raw.psycopg_pool.timeout_lock+unlock",
            "reference",
            "psycopg_pool checkout, the timeout lock statement + unlock in autocommit, checkin",
            _timed(raw_pooled),
        )
    )
    cases.append(
        Case(
            "ours.psycopg_pool.timeout",
            "raw-driver",
            "advisory_lock(psycopg_pool, timeout=5): checkout + acquire + release + checkin",
            _timed(ours_pooled),
            twin="raw.psycopg_pool.timeout_lock+unlock",
        )
    )
    return cases


def asyncpg_cases(url: URL, stack: ExitStack) -> list[Case]:
    import asyncpg

    loop = asyncio.new_event_loop()
    # asyncpg's pool asks for the current loop while it connects.
    asyncio.set_event_loop(loop)
    stack.callback(loop.close)
    stack.callback(asyncio.set_event_loop, None)
    dsn = libpq_dsn(url)
    connection = loop.run_until_complete(asyncpg.connect(dsn))
    stack.callback(lambda: loop.run_until_complete(connection.close()))
    ours_connection = loop.run_until_complete(asyncpg.connect(dsn))
    stack.callback(lambda: loop.run_until_complete(ours_connection.close()))
    pool = loop.run_until_complete(asyncpg.create_pool(dsn, min_size=1, max_size=1))
    stack.callback(lambda: loop.run_until_complete(pool.close()))
    floor_connection = loop.run_until_complete(asyncpg.connect(dsn))
    stack.callback(lambda: loop.run_until_complete(floor_connection.close()))
    floor_pool = loop.run_until_complete(asyncpg.create_pool(dsn, min_size=1, max_size=1))
    stack.callback(lambda: loop.run_until_complete(floor_pool.close()))
    timeout_ms = str(TIMEOUT_SECONDS * 1000)
    key = derive_key("raw.asyncpg").ints[0]
    pool_key = derive_key("raw.asyncpg_pool").ints[0]

    async def raw_timeout() -> None:
        await connection.fetchval(ASYNCPG_TIMEOUT_LOCK, key, timeout_ms)
        await connection.fetchval("SELECT pg_advisory_unlock($1)", key)

    async def raw_forever() -> None:
        await connection.fetchval("SELECT pg_advisory_lock($1)", key)
        await connection.fetchval("SELECT pg_advisory_unlock($1)", key)

    async def ours_timeout() -> None:
        async with advisory_lock(ours_connection, "ours.asyncpg.timeout", timeout=5):
            pass

    async def ours_forever() -> None:
        async with advisory_lock(ours_connection, "ours.asyncpg"):
            pass

    async def raw_pooled() -> None:
        async with pool.acquire() as pooled:
            await pooled.fetchval(ASYNCPG_TIMEOUT_LOCK, pool_key, timeout_ms)
            await pooled.fetchval("SELECT pg_advisory_unlock($1)", pool_key)

    async def ours_pooled() -> None:
        async with advisory_lock(pool, "ours.asyncpg_pool.timeout", timeout=5):
            pass

    async def floor_timeout() -> None:
        async with floors.AsyncpgContractFloorLock(
            floor_connection, "floor.asyncpg.contract", TIMEOUT_SECONDS
        ):
            pass

    async def floor_pooled() -> None:
        async with floors.AsyncpgPoolContractFloorLock(
            floor_pool, "floor.asyncpg_pool.contract", TIMEOUT_SECONDS
        ):
            pass

    return [
        Case(
            "raw.asyncpg.timeout_lock+unlock",
            "reference",
            "asyncpg: the timeout lock statement (lock_timeout set in it) + unlock",
            _timed_async(loop, raw_timeout),
            sockets=_asyncpg_socket(connection),
        ),
        Case(
            "raw.asyncpg.lock+unlock",
            "reference",
            "asyncpg: pg_advisory_lock (waits forever) + unlock",
            _timed_async(loop, raw_forever),
            sockets=_asyncpg_socket(connection),
        ),
        Case(
            "ours.asyncpg.timeout",
            "raw-driver",
            "async with advisory_lock(asyncpg_connection, timeout=5)",
            _timed_async(loop, ours_timeout),
            twin="raw.asyncpg.timeout_lock+unlock",
            sockets=_asyncpg_socket(ours_connection),
        ),
        Case(
            "ours.asyncpg",
            "raw-driver",
            "async with advisory_lock(asyncpg_connection) (waits forever)",
            _timed_async(loop, ours_forever),
            twin="raw.asyncpg.lock+unlock",
            sockets=_asyncpg_socket(ours_connection),
        ),
        Case(
            "floor.asyncpg.contract",
            "floor",
            "by hand on an asyncpg connection: every rule of floor.psycopg.contract (holders "
            "kept by the connection's id, the object claimed by its task) around the twin's "
            "two statements",
            _timed_async(loop, floor_timeout),
            twin="raw.asyncpg.timeout_lock+unlock",
            sockets=_asyncpg_socket(floor_connection),
        ),
        Case(
            "raw.asyncpg_pool.timeout_lock+unlock",
            "reference",
            "asyncpg pool.acquire(), the timeout lock statement + unlock, release (the "
            "pool's reset query included)",
            _timed_async(loop, raw_pooled),
        ),
        Case(
            "ours.asyncpg_pool.timeout",
            "raw-driver",
            "async with advisory_lock(asyncpg_pool, timeout=5): acquire + lock + unlock + release",
            _timed_async(loop, ours_pooled),
            twin="raw.asyncpg_pool.timeout_lock+unlock",
        ),
        Case(
            "floor.asyncpg_pool.contract",
            "floor",
            "by hand on an asyncpg pool: a connection acquired per lock object, "
            "floor.asyncpg.contract's rules on it, filed for current_advisory_locks while "
            "held, released after the unlock",
            _timed_async(loop, floor_pooled),
            twin="raw.asyncpg_pool.timeout_lock+unlock",
        ),
    ]


def raw_driver_cases(url: URL, stack: ExitStack) -> list[Case]:
    return [*psycopg_cases(url, stack), *asyncpg_cases(url, stack)]
