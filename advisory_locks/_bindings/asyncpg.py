"""asyncpg ``Connection``, pool connections (``pool.acquire()``) and ``Pool`` as binds.

Native asyncio: statements are awaited on the driver (no greenlet, no SQLAlchemy).
asyncpg prepares every statement that has parameters (cached per connection); scripts
(several statements) go through ``Connection.execute()`` without arguments, which uses
the simple query protocol.

asyncpg's pool resets a connection when it comes back (``pg_advisory_unlock_all()``
among others): a lock still held on it is lost. The binding notices through the
connection's release count (``_asyncpg_compat``): ``held`` turns False, and ``release()``
and ``ensure_held()`` raise ``LockLost``. A pool made with a ``reset=`` of the
application's runs that instead of its own reset: the binding then makes the pool unlock
what the library still holds on a returning connection first, as it does for
psycopg_pool.
"""

from __future__ import annotations

import asyncio
import weakref
from functools import cache
from typing import Any, Final

from asyncpg.connection import Connection
from asyncpg.exceptions import InterfaceError
from asyncpg.pool import Pool, PoolConnectionProxy

from advisory_locks._bindings import _asyncpg_compat as compat
from advisory_locks._bindings._raw import (
    IDLE,
    IN_TRANSACTION,
    AsyncRawDriver,
    ConnectionGone,
    RawBinding,
    holds_at_checkin,
    locks_named,
    release_at_checkin,
    translate_error,
)
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.executors import StatementRefused
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement, arun_steps
from advisory_locks._dialects import Backend
from advisory_locks.errors import LockUsageError, UnsupportedFeature
from advisory_locks.keys import LockName

__all__ = [
    "AsyncpgDriver",
    "AsyncpgExecutor",
    "AsyncpgLeaseDriver",
    "AsyncpgLockExecutor",
    "LockPoolClosed",
]

# How long a discarded connection may take to close gracefully before its socket is cut.
CLOSE_TIMEOUT_SECONDS: Final = 5.0


class LockPoolClosed(LockUsageError, InterfaceError):  # type: ignore[misc]  # asyncpg: untyped
    """A lock was taken on an asyncpg ``Pool`` that is closed or closing, or not
    initialized yet (made by ``asyncpg.create_pool()`` without an ``await``).

    Raised instead of the ``InterfaceError`` asyncpg's ``Pool.acquire()`` raises then,
    which it also is; ``__cause__`` is asyncpg's error. ``name`` is the lock's name (None
    for a lock set, whose names the message gives).
    """

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        # asyncpg's __init__ sets what its __str__ reads (detail, hint); in this class's
        # order of bases RuntimeError's would run instead of it.
        InterfaceError.__init__(self, message)
        self.name = name


LockPoolClosed.__module__ = "advisory_locks.asyncpg"


@cache
def numbered(sql: str, count: int) -> str:
    """``%s`` placeholders as asyncpg's ``$1, $2, ...`` (a handful of texts, built once)."""
    for position in range(1, count + 1):
        sql = sql.replace("%s", f"${position}", 1)
    return sql


class AsyncpgExecutor:
    """Runs statements on an asyncpg ``Connection``."""

    __slots__ = ("connection", "state")

    def __init__(self, connection: Any, state: dict[str, Any]) -> None:
        self.connection = connection
        self.state = state

    async def execute(self, statement: Statement) -> object:
        kind = statement.kind
        if kind == VALUE:
            params = statement.params
            return await self.connection.fetchval(numbered(statement.sql, len(params)), *params)
        if kind == SCRIPT:
            await self.connection.execute(statement.sql)
            return None
        assert kind == ROWS
        params = statement.params
        if params:
            rows = await self.connection.fetch(numbered(statement.sql, len(params)), *params)
        else:
            rows = await self.connection.fetch(statement.sql)
        return [tuple(row) for row in rows]


class AsyncpgLockExecutor:
    """``AsyncpgExecutor`` for lock statements, made once per connection: a lost
    connection raised as ``ConnectionGone`` (``AsyncRaisingExecutor``'s work) in the same
    call, and the connection referred to weakly, so that the connection's state (kept in
    a weak mapping: asyncpg connections have no ``__dict__``) can keep this executor
    without keeping the connection alive."""

    __slots__ = ("_backend", "_connection", "state")

    def __init__(self, connection: Any, state: dict[str, Any], backend: Backend) -> None:
        self._connection = weakref.ref(connection)
        self.state = state
        self._backend = backend

    async def execute(self, statement: Statement) -> object:
        connection = self._connection()
        if connection is None:
            raise ConnectionGone("the database connection is gone")
        try:
            if statement.kind == VALUE:
                params = statement.params
                return await connection.fetchval(numbered(statement.sql, len(params)), *params)
            return await AsyncpgExecutor(connection, self.state).execute(statement)
        except Exception as error:
            if compat.busy_refusal(error, connection):
                # Another task's statement runs on this connection: nothing was sent,
                # and the connection lives (it is no lost one, to be closed under the
                # other task). Raised without its cause, whose class says "gone".
                raise StatementRefused(
                    f"{error}: an asyncpg connection runs one statement at a time; give "
                    "each task its own connection (take the lock on the pool, or on a "
                    "connection of its own)"
                ) from None
            raise translate_error(error, self._backend) from error


class AsyncpgDriver(AsyncRawDriver):
    """asyncpg's connections: autocommit outside ``conn.transaction()``."""

    name = "asyncpg"
    always_autocommit = True
    weak_lock_executors = True

    open_transaction = "open one with `async with conn.transaction():`"

    def physical(self, bind: Any) -> Any:
        return compat.physical_connection(bind)

    def pool_of(self, connection: Any) -> Any:
        return compat.pool_of(connection)

    def is_closed(self, connection: Any) -> bool:
        return bool(connection.is_closed())

    def socket_of(self, connection: Any) -> int | None:
        return compat.socket_of(connection)

    def status(self, connection: Any) -> int:
        return IN_TRANSACTION if connection.is_in_transaction() else IDLE

    def autocommit(self, connection: Any) -> bool:
        return True

    def epoch(self, connection: Any) -> object:
        return compat.release_count(connection)

    def executor(self, connection: Any, scratch: dict[str, Any]) -> Any:
        return AsyncpgExecutor(connection, scratch)

    def lock_executor(self, connection: Any, scratch: dict[str, Any], backend: Backend) -> Any:
        return AsyncpgLockExecutor(connection, scratch, backend)

    async def aset_autocommit(self, connection: Any, value: bool) -> None:
        raise AssertionError("asyncpg connections are always in autocommit")

    async def adiscard(self, bind: Any) -> None:
        # A pool connection goes back to its pool, which replaces it; one whose socket
        # already closed went back by itself.
        connection = compat.physical_connection(bind)
        if connection is None or connection.is_closed():
            return
        try:
            # A cancelled statement leaves asyncpg sending a cancel request; the server
            # ends a lock wait only when that arrives, or when the lock is granted to it
            # (a backend blocked in a wait does not notice its client went away). A
            # graceful close waits for the cancellation first (asyncpg >= 0.30), so the
            # abandoned wait ends now instead of taking the lock from the next waiter.
            await connection.close(timeout=CLOSE_TIMEOUT_SECONDS)
        except Exception:
            connection.terminate()

    async def acheckout(self, pool: Any) -> Any:
        # Without a timeout, as the application's own pool.acquire() calls are: asyncpg's
        # pool has no time limit of its own to keep to (psycopg_pool's and SQLAlchemy's
        # do). An application bounds the wait with asyncio.timeout(), a cancellation.
        return await pool.acquire()

    def pool_refusal(
        self, pool: Any, error: Exception, names: tuple[LockName, ...], *, lease: bool = False
    ) -> Exception | None:
        # asyncpg raises InterfaceError, its class for any misuse of its API, for a pool
        # that is closed ("pool is closed"), closing, or not initialized yet (made by
        # create_pool() without an await); the pool itself tells these cases from the
        # others (is_closing(), public since asyncpg 0.28), not the message.
        if not isinstance(error, InterfaceError):
            return None
        if pool.is_closing():
            state, advice = "closed or closing", "before its close()"
        elif not compat.pool_initialized(pool):
            state = "not initialized yet"
            advice = "once `await asyncpg.create_pool(...)` (or `await pool`) has returned"
        else:
            return None
        what = "a lease lock" if lease else locks_named(names)
        return LockPoolClosed(
            f"{what} needs a connection from an asyncpg pool that is {state}: {error}. "
            f"Take locks on a pool {advice}.",
            name=names[0] if len(names) == 1 else None,
        )

    async def acheckin(self, pool: Any, bind: Any) -> None:
        # Returns at once for a terminated connection (already back in the pool).
        await pool.release(bind)

    def guard_checkin(self, connection: Any) -> None:
        # asyncpg's own reset unlocks everything (the release count tells); a reset=
        # of the application's replaces it, and then the guard unlocks what is left.
        pool = compat.pool_of_connection(connection)
        if pool is not None:
            compat.guard_own_reset(pool, self._checked_in)

    async def _checked_in(self, connection: Any, reset: Any) -> None:
        if holds_at_checkin(self, connection):
            # asyncpg counted this check-in before its reset ran: the locks still
            # recorded were not ended by asyncpg's reset, which did not run, and are
            # unlocked here instead.
            state = self.find_state(connection)
            assert state is not None
            state.epoch = self.epoch(connection)
            await arun_steps(release_at_checkin(self, connection))
        await reset(connection)

    def abandon(self, pool: Any, bind: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        # terminate() cuts the socket (the server session ends, its locks with it) and
        # gives the connection's place back to its pool, which opens a new one; in the
        # loop that runs the connection.
        connection = compat.physical_connection(bind)
        if connection is None or loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(connection.terminate)


class AsyncpgLeaseDriver:
    """asyncpg for lease locks (``raw_lease``): a pool lends a connection per statement;
    a connection checked out of a pool stands for its pool."""

    name = "asyncpg"
    dialect = "postgresql"

    def __init__(self, driver: AsyncpgDriver) -> None:
        self._driver = driver

    def pool_of(self, bind: Any) -> Any:
        if isinstance(bind, Pool):
            return bind
        return compat.pool_of(bind)

    async def checkout(self, pool: Any) -> Any:
        try:
            return await pool.acquire()
        except Exception as error:
            refusal = self._driver.pool_refusal(pool, error, (), lease=True)
            if refusal is None:
                raise
            raise refusal from error

    async def checkin(self, pool: Any, connection: Any, *, broken: bool) -> None:
        if broken:
            await self._driver.adiscard(connection)
        await pool.release(connection)

    async def open_like(self, pool: Any) -> Any:
        return await compat.new_pool_connection(pool)

    async def close(self, connection: Any) -> None:
        try:
            await connection.close(timeout=CLOSE_TIMEOUT_SECONDS)
        except Exception:
            connection.terminate()

    def executor(self, connection: Any) -> Any:
        return AsyncpgExecutor(connection, {})

    def fence_executor(self, bind: Any) -> Any:
        if not isinstance(bind, (Connection, PoolConnectionProxy)):
            raise TypeError(
                "fence() runs inside your transaction: pass the asyncpg connection that "
                f"makes the protected writes, not {type(bind).__name__}"
            )
        if not bind.is_in_transaction():
            raise UnsupportedFeature(
                "fence() needs a transaction: call it inside `async with conn.transaction():`, "
                "where the fence lasts until the transaction ends"
            )
        return AsyncpgExecutor(bind, {})


_driver = AsyncpgDriver()

register_binding(
    [Connection, PoolConnectionProxy, Pool],
    RawBinding(
        _driver, is_pool=lambda bind: isinstance(bind, Pool), lease=AsyncpgLeaseDriver(_driver)
    ),
)
