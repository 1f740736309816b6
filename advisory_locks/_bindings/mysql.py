"""PyMySQL and mysqlclient (``MySQLdb``) connections as binds (blocking).

What a raw bind means (re-entrancy, lost connections, poolers) is in ``_raw``; what MySQL
and MariaDB can lock (session locks only, exclusive only) is in ``_dialects.mysql``.

The caller's transaction is never touched. ``GET_LOCK`` and ``RELEASE_LOCK`` are not
transactional: they begin no transaction on a connection that is not in autocommit mode
(the server opens no read view for them, ``@@in_transaction`` stays 0), and they run as
they are inside one. So the lock statements are sent as they are, never with autocommit
switched on for them as on PostgreSQL: ``SET autocommit=1`` would commit the caller's
transaction, and neither driver can tell an idle connection from one whose transaction
only read so far (the server leaves SERVER_STATUS_IN_TRANS unset for those), so a switch
could end the caller's snapshot behind its back.

A connection that reconnected (PyMySQL's ``ping(reconnect=True)``) is a new server session
that holds none of the old one's locks: the connection id it was given at connect tells
(``epoch``), so its locks report ``LockLost`` instead of passing for held.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

from advisory_locks._bindings._raw import IN_TRANSACTION, UNKNOWN, RawBinding, RawDriver
from advisory_locks._bindings.raw_lease import LeaseDriver
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.executors import DBAPIExecutor

__all__ = ["MySQLDriver"]

# MySQL's SERVER_STATUS_IN_TRANS flag in the status word of every OK and EOF packet.
SERVER_STATUS_IN_TRANS: Final = 1


class MySQLExecutor(DBAPIExecutor):
    """Statements on a plain (tuple) cursor, whatever ``cursorclass`` the application
    gave the connection (a DictCursor would return rows the backend cannot read)."""

    __slots__ = ("_cursor_class",)

    def __init__(self, connection: Any, state: dict[str, Any], cursor_class: type) -> None:
        super().__init__(connection, state)
        self._cursor_class = cursor_class

    def new_cursor(self) -> Any:
        return self.connection.cursor(self._cursor_class)


class MySQLDriver(RawDriver):
    """PyMySQL's and mysqlclient's connections."""

    dialect = "mysql"
    autocommit_for_session_locks = False

    def __init__(self, cursor_class: type, name: str) -> None:
        self.cursor_class = cursor_class
        self.name = name

    def is_closed(self, connection: Any) -> bool:
        # PyMySQL: a property, False once closed or after the connection broke under a
        # statement; mysqlclient: 1 until close() (a killed session shows at its next use).
        return not connection.open

    def status(self, connection: Any) -> int:
        # Nothing here depends on it (no transaction locks, no autocommit switch), so it
        # only needs to be safe: UNKNOWN counts as "maybe inside the caller's transaction".
        # PyMySQL keeps the server's status word; its IN_TRANS flag is set only once a
        # transaction wrote, so unset does not mean idle. mysqlclient does not expose it.
        server_status = getattr(connection, "server_status", None)
        if isinstance(server_status, int) and server_status & SERVER_STATUS_IN_TRANS:
            return IN_TRANSACTION
        return UNKNOWN

    def autocommit(self, connection: Any) -> bool:
        return bool(connection.get_autocommit())

    def set_autocommit(self, connection: Any, value: bool) -> None:
        connection.autocommit(value)

    def epoch(self, connection: Any) -> object:
        # The connection id the server gave at connect: a reconnect is a new session.
        thread_id = getattr(connection, "server_thread_id", None)  # PyMySQL: (id,)
        if isinstance(thread_id, tuple):
            return thread_id[0] if thread_id else None
        try:
            return connection.thread_id()  # mysqlclient
        except Exception:  # closed: the caller sees that through is_closed()
            return None

    def executor(self, connection: Any, scratch: dict[str, Any]) -> Any:
        return MySQLExecutor(connection, scratch, self.cursor_class)

    def discard(self, bind: Any) -> None:
        # PyMySQL raises "Already closed" and mysqlclient error 2006 on a second close.
        with contextlib.suppress(Exception):
            bind.close()


def _binding(driver: MySQLDriver) -> RawBinding:
    return RawBinding(driver, lease=LeaseDriver(driver, "mysql"))


def _register() -> None:
    try:
        from pymysql.connections import Connection as PyMySQLConnection
        from pymysql.cursors import Cursor as PyMySQLCursor
    except ImportError:  # only one of the two drivers need be installed
        pass
    else:
        register_binding([PyMySQLConnection], _binding(MySQLDriver(PyMySQLCursor, "pymysql")))
    try:
        import MySQLdb
    except ImportError:
        return
    if MySQLdb.__name__ != "MySQLdb":
        return  # PyMySQL installed as MySQLdb (pymysql.install_as_MySQLdb()): done above
    from MySQLdb.connections import Connection as MySQLdbConnection
    from MySQLdb.cursors import Cursor as MySQLdbCursor

    register_binding([MySQLdbConnection], _binding(MySQLDriver(MySQLdbCursor, "mysqlclient")))


_register()
