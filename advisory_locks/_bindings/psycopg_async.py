"""psycopg 3 ``AsyncConnection`` and ``psycopg_pool.AsyncConnectionPool`` as binds.

Native asyncio: every statement is awaited on the driver (no greenlet, no SQLAlchemy).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import Any

from psycopg import AsyncConnection

from advisory_locks._bindings import _psycopg_pool_compat
from advisory_locks._bindings._psycopg_pool_compat import pool_of
from advisory_locks._bindings._raw import (
    IDLE,
    AsyncRawDriver,
    RawBinding,
    holds_at_checkin,
    release_at_checkin,
)
from advisory_locks._bindings.psycopg import OPEN_TRANSACTION, psycopg_pool_refusal
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.executors import pipeline_refusal, psycopg_cursor
from advisory_locks._core.libpq import NOT_SENT, LibpqStatements, libpq_statements
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement, arun_steps
from advisory_locks.errors import UnsupportedFeature
from advisory_locks.keys import LockName

__all__ = [
    "AsyncPsycopgDriver",
    "AsyncPsycopgExecutor",
    "AsyncPsycopgLeaseDriver",
]


class AsyncPsycopgExecutor:
    """Runs statements on an ``AsyncConnection`` with one reused cursor.

    A script (several statements) is never prepared, also with ``prepare_threshold=0``:
    a prepared statement holds one command. Two tasks sharing the connection never share
    the cursor: the second gets one of its own for that statement.
    """

    __slots__ = ("_busy", "_cursor", "_libpq", "connection", "state")

    def __init__(self, connection: Any, state: dict[str, Any]) -> None:
        self.connection = connection
        self.state = state
        self._cursor: Any = None
        self._busy = False
        # Made with the cursor: value statements in autocommit go without it (see
        # libpq), under the connection's own lock.
        self._libpq: LibpqStatements | None = None

    async def execute(self, statement: Statement) -> object:
        if self.connection._pipeline is not None:
            raise pipeline_refusal()
        cursor = self._cursor
        if cursor is None or cursor.closed:
            cursor = self._cursor = psycopg_cursor(self.connection)
            self._libpq = libpq_statements(cursor, self.state)
        libpq = self._libpq
        if libpq is not None and statement.kind == VALUE:
            value = await libpq.avalue(statement)
            if value is not NOT_SENT:
                return value
        if self._busy:
            return await self._run(psycopg_cursor(self.connection), statement)
        self._busy = True
        try:
            return await self._run(cursor, statement)
        finally:
            self._busy = False

    @staticmethod
    async def _run(cursor: Any, statement: Statement) -> object:
        kind = statement.kind
        if kind == VALUE:
            await cursor.execute(statement.sql, tuple(statement.params))
            row = await cursor.fetchone()
            return None if row is None else row[0]
        if kind == SCRIPT:
            await cursor.execute(statement.sql, prepare=False)
            return None
        assert kind == ROWS
        await cursor.execute(statement.sql, tuple(statement.params) if statement.params else None)
        return [tuple(row) for row in await cursor.fetchall()]


class AsyncPsycopgDriver(AsyncRawDriver):
    """psycopg 3's asyncio connections; libpq tells the transaction status."""

    name = "psycopg"

    open_transaction = OPEN_TRANSACTION.replace("`with ", "`async with ")

    def is_closed(self, connection: Any) -> bool:
        return bool(connection.closed)

    def status(self, connection: Any) -> int:
        return int(connection.pgconn.transaction_status)

    def autocommit(self, connection: Any) -> bool:
        return bool(connection.autocommit)

    def pool_of(self, connection: Any) -> Any:
        return pool_of(connection)

    def executor(self, connection: Any, scratch: dict[str, Any]) -> Any:
        return AsyncPsycopgExecutor(connection, scratch)

    async def aset_autocommit(self, connection: Any, value: bool) -> None:
        if value and connection._pipeline is not None:
            # Switched for a lock statement, which is refused in a pipeline (and psycopg
            # would switch with a Sync in the middle of the application's pipeline).
            raise pipeline_refusal()
        # No round trip: psycopg only checks that no transaction is open.
        await connection.set_autocommit(value)

    async def adiscard(self, bind: Any) -> None:
        await bind.close()

    async def acheckout(self, pool: Any) -> Any:
        return await pool.getconn()

    def pool_refusal(
        self, pool: Any, error: Exception, names: tuple[LockName, ...], *, lease: bool = False
    ) -> Exception | None:
        return psycopg_pool_refusal(pool, error, names, lease=lease)

    async def acheckin(self, pool: Any, bind: Any) -> None:
        await pool.putconn(bind)

    def abandon(self, pool: Any, bind: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        # Closed by libpq at once (close() is awaited), then handed back in the loop.
        bind.pgconn.finish()
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_put_back, pool, bind)

    def guard_checkin(self, connection: Any) -> None:
        pool = pool_of(connection)
        if pool is not None:
            _psycopg_pool_compat.guard_checkin(pool, self._checked_in)

    async def _checked_in(self, connection: Any, reset: Any) -> None:
        if holds_at_checkin(self, connection):
            await arun_steps(release_at_checkin(self, connection))
        if reset is not None:
            await reset(connection)


class AsyncPsycopgLeaseDriver:
    """psycopg's asyncio connections for lease locks (``raw_lease``): a pool lends a
    connection per statement, in autocommit; a connection checked out of a pool stands
    for its pool."""

    name = "psycopg"
    dialect = "postgresql"

    def __init__(self) -> None:
        # The autocommit mode a borrowed pool connection had, put back at check-in.
        self._autocommit: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def pool_of(self, bind: Any) -> Any:
        if not isinstance(bind, AsyncConnection):
            return bind
        return pool_of(bind)

    async def checkout(self, pool: Any) -> Any:
        try:
            connection = await pool.getconn()
        except Exception as error:
            refusal = psycopg_pool_refusal(pool, error, (), lease=True)
            if refusal is None:
                raise
            raise refusal from error
        try:
            if not connection.autocommit:
                await connection.set_autocommit(True)
                self._autocommit[connection] = False
        except BaseException:
            await pool.putconn(connection)
            raise
        return connection

    async def checkin(self, pool: Any, connection: Any, *, broken: bool) -> None:
        try:
            if not broken and self._autocommit.pop(connection, True) is False:
                try:
                    await connection.set_autocommit(False)
                except BaseException:
                    broken = True  # its mode unknown: replaced (see RawLeaseSite.give_back)
                    raise
        finally:
            if broken:
                with contextlib.suppress(Exception):
                    await connection.close()
            await pool.putconn(connection)  # a closed one is replaced by the pool

    async def open_like(self, pool: Any) -> Any:
        return await _psycopg_pool_compat.aconnect_like(pool)

    async def close(self, connection: Any) -> None:
        await connection.close()

    def executor(self, connection: Any) -> Any:
        return AsyncPsycopgExecutor(connection, {})

    def fence_executor(self, bind: Any) -> Any:
        if not isinstance(bind, AsyncConnection):
            raise TypeError(
                "fence() runs inside your transaction: pass the psycopg AsyncConnection "
                f"that makes the protected writes, not {type(bind).__name__}"
            )
        if bind.autocommit and bind.pgconn.transaction_status == IDLE:
            raise UnsupportedFeature(
                "fence() needs a transaction, but this connection is in autocommit mode: "
                "call it inside `async with conn.transaction():`"
            )
        return AsyncPsycopgExecutor(bind, {})


# The put-backs under way (the loop keeps only a weak reference to a task).
_putting_back: set[asyncio.Task[None]] = set()


def _put_back(pool: Any, connection: Any) -> None:
    """Return an abandoned connection (closed) to its pool, which replaces it."""
    task = asyncio.ensure_future(pool.putconn(connection))
    _putting_back.add(task)
    task.add_done_callback(_putting_back.discard)


def _register() -> None:
    types: list[type] = [AsyncConnection]
    try:
        from psycopg_pool import AsyncConnectionPool
    except ImportError:  # psycopg_pool is optional
        pool_types: tuple[type, ...] = ()
    else:
        pool_types = (AsyncConnectionPool,)
        types.append(AsyncConnectionPool)
    register_binding(
        types,
        RawBinding(
            AsyncPsycopgDriver(),
            is_pool=lambda bind: isinstance(bind, pool_types),
            lease=AsyncPsycopgLeaseDriver(),
        ),
    )


_register()
