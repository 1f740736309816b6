"""Run backend SQL on a driver's own connection object.

Bindings hand the backend an executor instead of an ORM connection: the lock's few
statements then cost one driver call each, with no ORM statement compilation on the hot
path. Most drivers follow DB-API closely enough for one executor; asyncpg does not.
"""

from __future__ import annotations

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


class DBAPIExecutor:
    """Executor for DB-API drivers with the ``%s`` paramstyle (psycopg 3, psycopg2, PyMySQL,
    mysqlclient), and for sqlite3, whose backend runs no parameterised SQL."""

    __slots__ = ("connection", "state")

    def __init__(self, connection: Any, state: dict[str, Any] | None = None) -> None:
        self.connection = connection
        self.state: dict[str, Any] = {} if state is None else state

    def fetch_value(self, sql: str, params: Sequence[object]) -> object:
        cursor = self.connection.cursor()
        try:
            cursor.execute(sql, tuple(params))
            row = cursor.fetchone()
        finally:
            cursor.close()
        return None if row is None else row[0]

    def run_script(self, sql: str) -> None:
        # Without parameters psycopg 3 and psycopg2 use the simple query protocol, which
        # accepts several statements in one round trip.
        cursor = self.connection.cursor()
        try:
            cursor.execute(sql)
        finally:
            cursor.close()

    def fetch_rows(self, sql: str) -> list[tuple[object, ...]]:
        cursor = self.connection.cursor()
        try:
            cursor.execute(sql)
            return [tuple(row) for row in cursor.fetchall()]
        finally:
            cursor.close()


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
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def executor_for(
    dbapi_connection: Any, driver_connection: Any, info: dict[Any, Any] | None = None
) -> DBAPIExecutor | AsyncpgExecutor:
    """Pick the executor for a DB-API connection (or SQLAlchemy async adapter).

    ``info`` is a dict that lives exactly as long as the DB-API connection (a pool
    entry's ``info``); backends that hold locks client-side keep them in it, so they go
    when the connection goes.
    """
    state = None if info is None else info.setdefault(STATE_INFO_KEY, {})
    if type(driver_connection).__module__.startswith("asyncpg"):
        from sqlalchemy.util import await_only

        return AsyncpgExecutor(dbapi_connection, driver_connection, await_only, state)
    return DBAPIExecutor(dbapi_connection, state)


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
