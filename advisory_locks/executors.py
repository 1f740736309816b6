"""Run backend SQL on a driver's own connection object.

Bindings hand the backend an executor instead of an ORM connection: the lock's few
statements then cost one driver call each, with no ORM statement compilation on the hot
path. Most drivers follow DB-API closely enough for one executor; asyncpg does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["AsyncpgExecutor", "DBAPIExecutor", "executor_for", "protocol_session_id"]


class DBAPIExecutor:
    """Executor for DB-API drivers with the ``%s`` paramstyle (psycopg 3, psycopg2)."""

    __slots__ = ("connection",)

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def fetch_value(self, sql: str, params: Sequence[int]) -> object:
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

    __slots__ = ("_adapter", "_await", "_driver")

    def __init__(self, adapter: Any, driver: Any, await_: Callable[[Any], Any]) -> None:
        self._adapter = adapter
        self._driver = driver
        self._await = await_

    def fetch_value(self, sql: str, params: Sequence[int]) -> object:
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


def executor_for(dbapi_connection: Any, driver_connection: Any) -> DBAPIExecutor | AsyncpgExecutor:
    """Pick the executor for a DB-API connection (or SQLAlchemy async adapter)."""
    if type(driver_connection).__module__.startswith("asyncpg"):
        from sqlalchemy.util import await_only

        return AsyncpgExecutor(dbapi_connection, driver_connection, await_only)
    return DBAPIExecutor(dbapi_connection)
