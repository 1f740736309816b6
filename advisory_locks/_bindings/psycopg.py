"""psycopg 3 ``Connection`` and ``psycopg_pool.ConnectionPool`` as binds (blocking).

The asyncio ones (``AsyncConnection``, ``AsyncConnectionPool``) are in ``psycopg_async``.
What a raw bind means (transactions, pools, poolers) is in ``_raw``.
"""

from __future__ import annotations

import threading
from typing import Any

from psycopg import Connection

from advisory_locks._bindings import _psycopg_pool_compat
from advisory_locks._bindings._psycopg_pool_compat import pool_of
from advisory_locks._bindings._raw import (
    IDLE,
    RawBinding,
    RawDriver,
    execute_in_autocommit,
    holds_at_checkin,
    release_at_checkin,
    translate_error,
)
from advisory_locks._bindings.raw_lease import LeaseDriver
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.executors import pipeline_refusal, psycopg_cursor
from advisory_locks._core.libpq import NOT_SENT, LibpqStatements, libpq_statements
from advisory_locks._core.steps import SCRIPT, VALUE, Statement, run_steps
from advisory_locks._dialects import Backend
from advisory_locks.keys import LockName

__all__ = ["PsycopgDriver", "PsycopgLockExecutor", "psycopg_pool_refusal"]

OPEN_TRANSACTION = (
    "open one with `with conn.transaction():`, or use a connection that is not in "
    "autocommit mode (its first statement begins a transaction)"
)


class PsycopgLockExecutor:
    """Runs lock statements on a psycopg 3 ``Connection``, in one call per statement:
    ``DBAPIExecutor``'s statement handling for psycopg 3 alone, with the binding's
    translation of a lost connection into ``ConnectionGone`` (``RaisingExecutor``).

    One cursor, made on first use with rows as tuples whatever row factory the
    connection has, serves every statement of the executor's life (a connection has
    two executors: its session locks' and its transaction locks'); a mutex keeps two
    threads from mixing up a statement and its fetch. A script (several statements) is
    never prepared, also with ``prepare_threshold=0``: a prepared statement holds one
    command. (psycopg closes no cursor when its connection closes: a statement on a
    closed connection fails, and that error says the connection is gone.)
    """

    __slots__ = (
        "_backend",
        "_cursor",
        "_libpq",
        "_mutex",
        "connection",
        "session_driver",
        "state",
    )

    def __init__(
        self,
        connection: Any,
        state: dict[str, Any],
        backend: Backend,
        *,
        session_driver: RawDriver | None = None,
    ) -> None:
        self.connection = connection
        self.state = state
        self._backend = backend
        self._cursor: Any = None
        self._mutex = threading.Lock()
        # Made with the cursor: value statements in autocommit go without it (see libpq).
        self._libpq: LibpqStatements | None = None
        # Given for a session lock's executor: a statement on an idle connection that is
        # not in autocommit runs switched to autocommit by this driver, so it begins no
        # transaction (the rule of _raw.SyncAutocommitExecutor, asked here in the same
        # call).
        self.session_driver = session_driver

    def execute(self, statement: Statement) -> object:
        kind = statement.kind
        libpq = self._libpq
        if libpq is not None and kind == VALUE:
            # First: it sends only on a connection idle in autocommit outside a pipeline
            # (asked under the connection's lock), where the questions below have their
            # answers. Without the cursor, so without its mutex (see libpq).
            try:
                value = libpq.value(statement)
            except Exception as error:
                raise translate_error(error, self._backend) from error
            if value is not NOT_SENT:
                return value
        connection = self.connection
        if connection._pipeline is not None:
            raise pipeline_refusal()
        driver = self.session_driver
        if (
            driver is not None
            and connection.pgconn.transaction_status == IDLE
            and not connection.autocommit
        ):
            return execute_in_autocommit(driver, connection, self.execute, statement)
        try:
            with self._mutex:
                cursor = self._cursor
                if cursor is None:
                    cursor = self._cursor = psycopg_cursor(connection)
                    self._libpq = libpq_statements(cursor, self.state)
                if kind == VALUE:
                    cursor.execute(statement.sql, statement.params)
                    row = cursor.fetchone()
                    return None if row is None else row[0]
                if kind == SCRIPT:
                    cursor.execute(statement.sql, prepare=False)
                    return None
                # ROWS; without parameters no "%" in the text is read as a placeholder.
                cursor.execute(statement.sql, statement.params or None)
                # A statement without a result gives no description.
                return [] if cursor.description is None else cursor.fetchall()
        except Exception as error:
            raise translate_error(error, self._backend) from error


class PsycopgDriver(RawDriver):
    """psycopg 3's blocking connections; libpq tells the transaction status."""

    name = "psycopg"

    open_transaction = OPEN_TRANSACTION

    def is_closed(self, connection: Any) -> bool:
        return bool(connection.closed)

    def status(self, connection: Any) -> int:
        return int(connection.pgconn.transaction_status)

    def autocommit(self, connection: Any) -> bool:
        return bool(connection.autocommit)

    def set_autocommit(self, connection: Any, value: bool) -> None:
        connection.autocommit = value

    def lock_executor(self, connection: Any, scratch: dict[str, Any], backend: Backend) -> Any:
        return PsycopgLockExecutor(connection, scratch, backend)

    def session_lock_executor(
        self, connection: Any, scratch: dict[str, Any], backend: Backend
    ) -> Any:
        return PsycopgLockExecutor(connection, scratch, backend, session_driver=self)

    def pool_of(self, connection: Any) -> Any:
        return pool_of(connection)

    def checkout(self, pool: Any) -> Any:
        return pool.getconn()

    def pool_refusal(
        self, pool: Any, error: Exception, names: tuple[LockName, ...], *, lease: bool = False
    ) -> Exception | None:
        return psycopg_pool_refusal(pool, error, names, lease=lease)

    def checkin(self, pool: Any, bind: Any) -> None:
        # A closed connection is replaced by the pool.
        pool.putconn(bind)

    def guard_checkin(self, connection: Any) -> None:
        pool = pool_of(connection)
        if pool is not None:
            _psycopg_pool_compat.guard_checkin(pool, self._checked_in)

    def _checked_in(self, connection: Any, reset: Any) -> None:
        if holds_at_checkin(self, connection):
            run_steps(release_at_checkin(self, connection))
        if reset is not None:
            reset(connection)


def psycopg_pool_refusal(
    pool: Any, error: Exception, names: tuple[LockName, ...], *, lease: bool = False
) -> Exception | None:
    """``RawDriver.pool_refusal`` for the psycopg_pool pools (``_bindings.psycopg_pool``,
    which needs psycopg_pool: only its pools are checked out of)."""
    from advisory_locks._bindings.psycopg_pool import pool_refusal

    return pool_refusal(pool, error, names, lease=lease)


def _register() -> None:
    types: list[type] = [Connection]
    try:
        from psycopg_pool import ConnectionPool
    except ImportError:  # psycopg_pool is optional
        pool_types: tuple[type, ...] = ()
    else:
        pool_types = (ConnectionPool,)
        types.append(ConnectionPool)

    def is_pool(bind: object) -> bool:
        return isinstance(bind, pool_types)

    driver = PsycopgDriver()
    lease = LeaseDriver(driver, "postgresql", is_pool=is_pool, open_like=_open_like, notifies=True)
    register_binding(types, RawBinding(driver, is_pool=is_pool, lease=lease))


def _open_like(pool: Any) -> Any:
    """A connection made the way ``pool`` makes its own, in autocommit."""
    return _psycopg_pool_compat.connect_like(pool)


_register()
