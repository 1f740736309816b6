"""Run backend SQL on a driver's own connection object.

Bindings hand the backend an executor instead of an ORM connection: the lock's few
statements then cost one driver call each, with no ORM statement compilation on the hot
path. Most drivers follow DB-API closely enough for one executor; asyncpg does not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "AsyncpgExecutor",
    "DBAPIExecutor",
    "driver_autocommit",
    "executor_for",
    "protocol_session_id",
    "set_driver_autocommit",
]

# Key in a pooled connection's info dict (it lives and dies with the DB-API connection).
STATE_INFO_KEY: Final = "advisory_locks.backend_state"
EXECUTOR_INFO_KEY: Final = "advisory_locks.executor"


class DBAPIExecutor:
    """Executor for DB-API drivers with the ``%s`` paramstyle (psycopg 3, psycopg2, PyMySQL,
    mysqlclient), and for sqlite3, whose backend runs no parameterised SQL.

    One cursor serves every statement for the life of the connection: making a cursor
    costs more client time than a lock's whole Python path (psycopg 3 builds its adapter
    maps per cursor). Reuse is safe because every method reads its whole result before
    returning, and each driver's ``execute()`` discards whatever an earlier statement left
    behind; a cursor shared by threads would mix up results, so a mutex brackets each
    statement and its fetch. The cursor dies with its connection, as does this executor
    (it is kept in the connection's ``info``; see ``executor_for()``).
    """

    __slots__ = ("_cursor", "_mutex", "connection", "state")

    def __init__(self, connection: Any, state: dict[str, Any] | None = None) -> None:
        self.connection = connection
        self.state: dict[str, Any] = {} if state is None else state
        self._cursor: Any = None
        self._mutex = threading.Lock()

    def fetch_value(self, sql: str, params: Sequence[object]) -> object:
        with self._mutex:
            cursor = self._cursor_for_statement()
            cursor.execute(sql, tuple(params))
            row = cursor.fetchone()
        return None if row is None else row[0]

    def run_script(self, sql: str) -> None:
        # Without parameters psycopg 3 and psycopg2 use the simple query protocol, which
        # accepts several statements in one round trip.
        with self._mutex:
            self._cursor_for_statement().execute(sql)

    def fetch_rows(self, sql: str) -> list[tuple[object, ...]]:
        with self._mutex:
            cursor = self._cursor_for_statement()
            cursor.execute(sql)
            return [tuple(row) for row in cursor.fetchall()]

    def _cursor_for_statement(self) -> Any:
        cursor = self._cursor
        if cursor is None or getattr(cursor, "closed", False) is True:
            cursor = self._cursor = self.connection.cursor()
        return cursor


class AsyncpgExecutor:
    """Executor for SQLAlchemy's asyncpg adapter, run inside SQLAlchemy's greenlet.

    The adapter's cursor prepares every statement, which rejects multi-statement
    scripts, so statements go to the asyncpg connection itself.
    """

    __slots__ = ("_adapter", "_await", "_driver", "state")

    def __init__(
        self,
        adapter: Any,
        driver: Any,
        await_: Callable[[Any], Any],
        state: dict[str, Any] | None = None,
    ) -> None:
        self._adapter = adapter
        self._driver = driver
        self._await = await_
        self.state: dict[str, Any] = {} if state is None else state

    @property
    def connection(self) -> Any:
        return self._adapter

    def fetch_value(self, sql: str, params: Sequence[object]) -> object:
        self._join_adapter_transaction()
        numbered = sql
        for position in range(1, len(params) + 1):
            numbered = numbered.replace("%s", f"${position}", 1)
        return self._await(self._driver.fetchval(numbered, *params))

    def run_script(self, sql: str) -> None:
        self._join_adapter_transaction()
        self._await(self._driver.execute(sql))

    def fetch_rows(self, sql: str) -> list[tuple[object, ...]]:
        self._join_adapter_transaction()
        return [tuple(row) for row in self._await(self._driver.fetch(sql))]

    def _join_adapter_transaction(self) -> None:
        # The adapter sends BEGIN lazily, before its own first statement. Statements sent
        # straight to asyncpg would run outside the transaction SQLAlchemy thinks is
        # open, so open it the way the adapter's cursor would.
        if not self._adapter.autocommit and self._adapter._transaction is None:
            self._await(self._adapter._start_transaction())


def protocol_session_id(driver_connection: Any) -> int | None:
    """The server process id the driver was told at connect (None if it does not say).

    A pooler or proxy answers the connect itself and makes one up, so it differs from
    what the server reports for the session the statements really run in.
    """
    info = getattr(driver_connection, "info", None)
    pid = getattr(info, "backend_pid", None)  # psycopg 3, psycopg2 >= 2.8
    if pid is None and hasattr(driver_connection, "get_server_pid"):  # asyncpg
        pid = driver_connection.get_server_pid()
    if pid is None:
        # MySQL/MariaDB tell the connection id (CONNECTION_ID()) in the handshake:
        # PyMySQL keeps it as server_thread_id = (id,), mysqlclient returns it from thread_id().
        thread_id = getattr(driver_connection, "server_thread_id", None)
        if isinstance(thread_id, tuple) and thread_id:
            pid = thread_id[0]
        elif callable(getattr(driver_connection, "thread_id", None)):
            pid = driver_connection.thread_id()
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def executor_for(
    dbapi_connection: Any, driver_connection: Any, info: dict[Any, Any] | None = None
) -> DBAPIExecutor | AsyncpgExecutor:
    """Pick the executor for a DB-API connection (or SQLAlchemy async adapter).

    ``info`` is a dict that lives exactly as long as the DB-API connection (a pool
    entry's ``info``); backends that hold locks client-side keep them in it, so they go
    when the connection goes.
    """
    if info is not None:
        # One executor (and so one cursor) per DB-API connection: ``info`` lives and dies
        # with that connection, and the identity check covers a caller that hands the
        # same dict with another connection.
        cached = info.get(EXECUTOR_INFO_KEY)
        if cached is not None and cached.connection is dbapi_connection:
            return cached  # type: ignore[no-any-return]
    state = None if info is None else info.setdefault(STATE_INFO_KEY, {})
    executor: DBAPIExecutor | AsyncpgExecutor
    if type(driver_connection).__module__.startswith("asyncpg"):
        from sqlalchemy.util import await_only

        executor = AsyncpgExecutor(dbapi_connection, driver_connection, await_only, state)
    else:
        executor = DBAPIExecutor(dbapi_connection, state)
    if info is not None:
        info[EXECUTOR_INFO_KEY] = executor
    return executor


def driver_autocommit(dbapi_connection: Any) -> bool:
    """Whether the driver runs each statement in its own transaction right now."""
    if dbapi_connection is None:
        return False
    if _is_sqlite3(dbapi_connection):
        # Legacy transaction control (every Python version's default): None means
        # the module never sends BEGIN. (Python 3.12's `autocommit` attribute is -1 then,
        # which is truthy, so it must not be read as a bool.)
        return dbapi_connection.isolation_level is None
    get_autocommit = getattr(dbapi_connection, "get_autocommit", None)
    if callable(get_autocommit):  # PyMySQL, mysqlclient: autocommit is a method there
        return bool(get_autocommit())
    return bool(getattr(dbapi_connection, "autocommit", False))


def set_driver_autocommit(dbapi_connection: Any, value: bool) -> None:
    """Switch the driver's autocommit mode, whichever way this driver spells it."""
    if _is_sqlite3(dbapi_connection):
        # "" is the module's default: BEGIN (deferred) before data-changing statements.
        dbapi_connection.isolation_level = None if value else ""
    elif callable(getattr(dbapi_connection, "get_autocommit", None)):
        dbapi_connection.autocommit(value)
    else:
        dbapi_connection.autocommit = value


def _is_sqlite3(dbapi_connection: Any) -> bool:
    return type(dbapi_connection).__module__ in ("sqlite3", "_sqlite3")
