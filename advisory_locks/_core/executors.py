"""Run statements on a driver's own connection object, and read its state.

Bindings hand the lock an executor instead of an ORM connection: the lock's few
statements then cost one driver call each, with no ORM statement compilation on the hot
path. Most drivers follow DB-API closely enough for one executor; asyncio drivers have
their own, next to their binding.
"""

from __future__ import annotations

import inspect
import os
import socket
import threading
from typing import Any, Final

from advisory_locks._core.libpq import NOT_SENT, LibpqStatements, libpq_statements
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement
from advisory_locks._dialects.base import SERVER_VERSION_STATE
from advisory_locks.errors import LockUsageError

__all__ = [
    "DBAPIExecutor",
    "StatementRefused",
    "claim_idle_autocommit",
    "detach_inherited_connection",
    "driver_autocommit",
    "driver_in_transaction",
    "from_psycopg3",
    "pipeline_refusal",
    "protocol_session_id",
    "psycopg_cursor",
    "restore_driver_autocommit",
    "set_driver_autocommit",
    "socket_descriptor",
]

# psycopg 3 TransactionStatus.IDLE (libpq's PQTRANS_IDLE); psycopg2 uses the same numbers.
PQTRANS_IDLE: Final = 0
PQTRANS_UNKNOWN: Final = 4
# MySQL's SERVER_STATUS_IN_TRANS flag in the status word of every OK packet.
SERVER_STATUS_IN_TRANS: Final = 1


class StatementRefused(LockUsageError):
    """A lock statement refused by its executor before anything was sent, the lock's
    state untouched: a release refused so leaves the lock held, to be released later."""


PIPELINE_REFUSED: Final = (
    "advisory locks are not taken, released or checked while this psycopg connection is "
    "in pipeline mode: a lock statement must have its answer before the code it guards "
    "runs, and a lock wait that failed would abort the statements queued with it. Take "
    "the lock before `with conn.pipeline():` and release it after that block"
)


def pipeline_refusal() -> StatementRefused:
    """The error for a lock statement on a psycopg 3 connection in pipeline mode."""
    return StatementRefused(PIPELINE_REFUSED)


class DBAPIExecutor:
    """Executor for DB-API drivers with the ``%s`` paramstyle (psycopg 3, psycopg2, PyMySQL,
    mysqlclient), and for sqlite3, whose backend runs no parameterised SQL.

    One cursor serves every statement for the life of the connection: making a cursor
    costs more client time than a lock's whole Python path (psycopg 3 builds its adapter
    maps per cursor). Reuse is safe because every method reads its whole result before
    returning, and each driver's ``execute()`` discards whatever an earlier statement left
    behind; a cursor shared by threads would mix up results, so a mutex brackets each
    statement and its fetch. The cursor dies with its connection, as does this executor.
    """

    __slots__ = (
        "_check_closed",
        "_cursor",
        "_libpq",
        "_mutex",
        "_pipelines",
        "_script_options",
        "connection",
        "state",
    )

    def __init__(self, connection: Any, state: dict[str, Any] | None = None) -> None:
        self.connection = connection
        self.state: dict[str, Any] = {} if state is None else state
        self._cursor: Any = None
        self._mutex = threading.Lock()
        # psycopg 3 prepares statements it sees often, and every statement with
        # prepare_threshold=0; a prepared statement holds one command, so a script
        # (several commands in one round trip) must never be prepared.
        psycopg3 = from_psycopg3(type(connection))
        self._script_options: dict[str, Any] = {"prepare": False} if psycopg3 else {}
        # Whether the connection has psycopg 3's pipeline mode (see pipeline_refusal).
        self._pipelines = psycopg3
        # Made with the cursor: psycopg 3 sends value statements in autocommit without
        # one (see libpq).
        self._libpq: LibpqStatements | None = None
        # Set for each new cursor: whether it is asked before each statement if it is
        # closed (see _closes_with_connection).
        self._check_closed = False
        server_info = getattr(connection, "get_server_info", None)
        if callable(server_info) and SERVER_VERSION_STATE not in self.state:
            # PyMySQL and mysqlclient know the version from the handshake.
            version = server_info()
            if isinstance(version, str):
                self.state[SERVER_VERSION_STATE] = version

    def new_cursor(self) -> Any:
        """A cursor that returns rows as sequences, whatever row type the application made
        the connection's default (psycopg's ``row_factory=dict_row``, psycopg2's
        ``cursor_factory=RealDictCursor``); a binding may override this for its driver."""
        module = type(self.connection).__module__
        # The driver is imported already: it made this connection.
        if module.startswith("psycopg2"):
            import psycopg2.extensions
            import psycopg2.extras

            # Only rows that cannot be indexed by position need another cursor; any other
            # factory the application set (one that logs or traces) stays in use.
            factory = getattr(self.connection, "cursor_factory", None)
            if isinstance(factory, type) and issubclass(factory, psycopg2.extras.RealDictCursor):
                return self.connection.cursor(cursor_factory=psycopg2.extensions.cursor)
            return self.connection.cursor()
        if from_psycopg3(type(self.connection)):
            return psycopg_cursor(self.connection)
        return self.connection.cursor()

    def execute(self, statement: Statement) -> object:
        if self._pipelines and self.connection._pipeline is not None:
            raise pipeline_refusal()
        libpq = self._libpq
        if libpq is not None and statement.kind == VALUE:
            # Without the cursor, so without its mutex (see libpq).
            try:
                value = libpq.value(statement)
            except Exception:
                self.failed()
                raise
            if value is not NOT_SENT:
                return value
        with self._mutex:
            try:
                cursor = self._cursor
                if cursor is None or (self._check_closed and cursor.closed is True):
                    cursor = self._cursor = self.new_cursor()
                    self._check_closed = _closes_with_connection(cursor)
                    if self._pipelines:
                        self._libpq = libpq_statements(cursor, self.state)
                kind = statement.kind
                if kind == VALUE:
                    cursor.execute(statement.sql, tuple(statement.params))
                    row = cursor.fetchone()
                    return None if row is None else row[0]
                if kind == SCRIPT:
                    # Without parameters psycopg 3 and psycopg2 use the simple query
                    # protocol, which accepts several statements in one round trip.
                    cursor.execute(statement.sql, **self._script_options)
                    return None
                assert kind == ROWS
                if statement.params:
                    cursor.execute(statement.sql, tuple(statement.params))
                else:
                    # Without parameters no driver reads "%" in the text as a placeholder.
                    cursor.execute(statement.sql)
                # A statement without a result (MySQL's UPDATE) gives no description.
                if cursor.description is None:
                    return []
                return [tuple(row) for row in cursor.fetchall()]
            except Exception:
                self.failed()
                raise

    def failed(self) -> None:
        """Called inside the ``except`` block of a statement that raised, before the
        error propagates: a binding may raise its framework's error in its place."""


def psycopg_cursor(connection: Any) -> Any:
    """A cursor on a psycopg 3 connection (blocking or asyncio) that returns rows as tuples
    and takes ``%s`` placeholders, whatever ``row_factory`` and ``cursor_factory`` the
    application gave the connection. A raw-query cursor (``RawCursor``, psycopg >= 3.2)
    takes ``$1`` placeholders instead, so psycopg's own cursor class stands in for it;
    any other factory (``ClientCursor``, one that logs or traces) stays in use."""
    from psycopg.rows import tuple_row

    try:
        from psycopg.raw_cursor import RawCursorMixin
    except ImportError:  # psycopg < 3.2 has no raw-query cursors
        return connection.cursor(row_factory=tuple_row)
    factory = getattr(connection, "cursor_factory", None)
    if isinstance(factory, type) and issubclass(factory, RawCursorMixin):
        import psycopg

        if isinstance(connection, psycopg.AsyncConnection):
            return psycopg.AsyncCursor(connection, row_factory=tuple_row)
        return psycopg.Cursor(connection, row_factory=tuple_row)
    return connection.cursor(row_factory=tuple_row)


def _closes_with_connection(cursor: Any) -> bool:
    """Whether a cursor may be closed under its user, so that it must be replaced before a
    statement: psycopg2 closes a connection's cursors with it, and the old cursor's error
    would then not say the connection is gone, where a new cursor's does. A psycopg 3
    cursor is closed only by its own close(), never called on an executor's private one;
    sqlite3's, PyMySQL's and mysqlclient's have no ``closed`` to ask. Asking cost a
    Python call at every statement on psycopg 3, and a raised and caught AttributeError
    on mysqlclient (whose cursors' ``__getattr__`` raises)."""
    return not from_psycopg3(type(cursor)) and hasattr(cursor, "closed")


def from_psycopg3(cls: type) -> bool:
    """Whether ``cls`` is one of psycopg 3's classes (a connection, a cursor). psycopg >=
    3.2 names their module "psycopg", older releases "psycopg.connection" and the like."""
    module = cls.__module__
    return module == "psycopg" or module.startswith("psycopg.")


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


# What a driver connection's class offers, found once per class: the readers below run
# for every lock statement, and a chain of getattr probes each time cost more than the
# rest of the check. A class never changes which of these it is.
_SQLITE3: Final = 1
_AUTOCOMMIT_METHOD: Final = 2  # PyMySQL, mysqlclient: autocommit(value) / get_autocommit()
_IN_TRANSACTION_METHOD: Final = 4  # asyncpg: is_in_transaction()
# psycopg 3: its public ``pgconn`` tells libpq's transaction status as an int, without the
# ConnectionInfo object and enum that ``info.transaction_status`` builds on every read.
_PGCONN: Final = 8
# psycopg 3's blocking Connection, whose autocommit switch can skip its wait loop (see
# _switch_psycopg_autocommit).
_PSYCOPG_BLOCKING: Final = 16
# SQLAlchemy's asyncio adapter of a psycopg 3 AsyncConnection, which it keeps as _connection.
_ADAPTED_PSYCOPG: Final = 32
_kinds: dict[type, int] = {}


def _kind(connection: Any) -> int:
    cls = type(connection)
    kind = _kinds.get(cls)
    if kind is None:
        kind = 0
        if cls.__module__ in ("sqlite3", "_sqlite3"):
            kind |= _SQLITE3
        if callable(getattr(cls, "get_autocommit", None)):
            kind |= _AUTOCOMMIT_METHOD
        if callable(getattr(cls, "is_in_transaction", None)):
            kind |= _IN_TRANSACTION_METHOD
        # pgconn is set per instance (no class attribute): ask the connection.
        if from_psycopg3(cls) and hasattr(connection, "pgconn"):
            kind |= _PGCONN
            if "_autocommit" in getattr(connection, "__dict__", ()) and not (
                inspect.iscoroutinefunction(getattr(cls, "set_autocommit", None))
            ):
                kind |= _PSYCOPG_BLOCKING
        elif cls.__module__.startswith("sqlalchemy.") and from_psycopg3(
            type(getattr(connection, "_connection", None))
        ):
            kind |= _ADAPTED_PSYCOPG
        _kinds[cls] = kind
    return kind


def driver_autocommit(dbapi_connection: Any) -> bool:
    """Whether the driver runs each statement in its own transaction right now."""
    if dbapi_connection is None:
        return False
    kind = _kinds.get(type(dbapi_connection))
    if kind is None:
        kind = _kind(dbapi_connection)
    if not kind & (_SQLITE3 | _AUTOCOMMIT_METHOD):
        return bool(getattr(dbapi_connection, "autocommit", False))
    if kind & _SQLITE3:
        # Legacy transaction control (every Python version's default): None means
        # the module never sends BEGIN. (Python 3.12's `autocommit` attribute is -1 then,
        # which is truthy, so it must not be read as a bool.)
        return dbapi_connection.isolation_level is None
    if kind & _AUTOCOMMIT_METHOD:  # PyMySQL, mysqlclient: autocommit is a method there
        return bool(dbapi_connection.get_autocommit())
    return bool(getattr(dbapi_connection, "autocommit", False))


def set_driver_autocommit(dbapi_connection: Any, value: bool) -> object:
    """Switch the driver's autocommit mode; return what ``restore_driver_autocommit`` needs
    to put back exactly the mode the application had configured."""
    kind = _kind(dbapi_connection)
    if value and kind & (_PGCONN | _ADAPTED_PSYCOPG) and in_pipeline(dbapi_connection):
        # Switched for a lock statement, which would be refused after a switch that
        # psycopg makes with a Sync in the middle of the application's pipeline.
        raise pipeline_refusal()
    if kind & _SQLITE3:
        previous = dbapi_connection.isolation_level  # "", "DEFERRED", "IMMEDIATE", ...
        dbapi_connection.isolation_level = None if value else (previous or "")
        return previous
    previous_mode = driver_autocommit(dbapi_connection)
    if kind & _PSYCOPG_BLOCKING:
        _switch_psycopg_autocommit(dbapi_connection, value)
    elif kind & _AUTOCOMMIT_METHOD:
        dbapi_connection.autocommit(value)
    else:
        dbapi_connection.autocommit = value
    return previous_mode


def in_pipeline(connection: Any) -> bool:
    """Whether a psycopg 3 connection (or SQLAlchemy's adapter of an ``AsyncConnection``)
    is in pipeline mode; False for every other driver."""
    kind = _kinds.get(type(connection))
    if kind is None:
        kind = _kind(connection)
    if kind & _PGCONN:
        return connection._pipeline is not None
    if kind & _ADAPTED_PSYCOPG:
        return connection._connection._pipeline is not None
    return False


def restore_driver_autocommit(dbapi_connection: Any, previous: object) -> None:
    """Undo ``set_driver_autocommit`` with the value it returned."""
    kind = _kinds.get(type(dbapi_connection))
    if kind is None:
        kind = _kind(dbapi_connection)
    if kind & _SQLITE3:
        dbapi_connection.isolation_level = previous
    elif kind & _PSYCOPG_BLOCKING:
        _switch_psycopg_autocommit(dbapi_connection, bool(previous))
    elif kind & _AUTOCOMMIT_METHOD:
        dbapi_connection.autocommit(bool(previous))
    else:
        dbapi_connection.autocommit = bool(previous)


def claim_idle_autocommit(connection: Any) -> bool | None:
    """Switch an idle psycopg 3 connection to autocommit and return the mode it had.

    One read of the connection answers what ``driver_in_transaction``,
    ``driver_autocommit`` and ``set_driver_autocommit`` would each ask again: on a
    blocking psycopg 3 connection outside a pipeline with no transaction open, the switch
    is the flag (see ``_switch_psycopg_autocommit``). None, with nothing changed, for any
    other connection or state: the caller then asks the general questions.
    """
    kind = _kinds.get(type(connection))
    if (
        kind is None
        or not kind & _PSYCOPG_BLOCKING
        or connection._pipeline is not None
        or connection.pgconn.transaction_status != PQTRANS_IDLE
    ):
        return None
    previous: bool = connection._autocommit
    connection._autocommit = True
    return previous


def _switch_psycopg_autocommit(connection: Any, value: bool) -> None:
    # psycopg 3's setter runs a generator under the connection's lock through its wait
    # loop, which costs more than everything else a lock does to switch the mode. On an
    # idle connection outside a pipeline all that loop does is check the status (as
    # here) and store the flag (psycopg 3.3 checked); anything else goes through the setter.
    if connection._pipeline is None and connection.pgconn.transaction_status == PQTRANS_IDLE:
        connection._autocommit = value
    else:
        connection.autocommit = value


def libpq_connection(driver_connection: Any) -> Any:
    """A psycopg 3 connection's ``pgconn`` (one object for the connection's whole life),
    whose ``transaction_status`` answers ``driver_in_transaction`` without the questions
    about the driver; None for every other driver."""
    if driver_connection is None:
        return None
    kind = _kinds.get(type(driver_connection))
    if kind is None:
        kind = _kind(driver_connection)
    return driver_connection.pgconn if kind & _PGCONN else None


def driver_in_transaction(driver_connection: Any) -> bool | None:
    """Whether the driver connection is inside a transaction (None where it cannot tell,
    a closed or broken connection included)."""
    if driver_connection is None:
        return None
    try:
        return _driver_transaction_status(driver_connection)
    except Exception:  # sqlite3 raises on a closed connection; others may too
        return None


def _driver_transaction_status(driver_connection: Any) -> bool | None:
    kind = _kinds.get(type(driver_connection))
    if kind is None:
        kind = _kind(driver_connection)
    if kind & _PGCONN:
        status = driver_connection.pgconn.transaction_status
        return None if status == PQTRANS_UNKNOWN else status != PQTRANS_IDLE
    if kind & _SQLITE3:
        return bool(driver_connection.in_transaction)
    if kind & _IN_TRANSACTION_METHOD:  # asyncpg
        return bool(driver_connection.is_in_transaction())
    info = getattr(driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)  # psycopg 3, psycopg2 >= 2.8
    if status is not None:
        # libpq's PQTRANS_UNKNOWN: the connection is bad, which says nothing either way.
        return None if int(status) == PQTRANS_UNKNOWN else int(status) != PQTRANS_IDLE
    server_status = getattr(driver_connection, "server_status", None)  # PyMySQL
    if isinstance(server_status, int):
        return bool(server_status & SERVER_STATUS_IN_TRANS)
    return None


def _is_sqlite3(dbapi_connection: Any) -> bool:
    return bool(_kind(dbapi_connection) & _SQLITE3)


def detach_inherited_connection(driver_connection: Any) -> None:
    """In a forked child, cut a connection inherited from the parent off the server.

    The child's copy shares the parent's socket: closing it sends the protocol's goodbye
    (PostgreSQL's Terminate, MySQL's COM_QUIT), the server ends the PARENT's session and
    frees the parent's locks. The socket's descriptor is pointed at a dead socket instead,
    so whatever the child's copy does next (close, a query) fails or goes nowhere, and the
    parent's session is untouched. A connection without a socket (sqlite3) is left alone.
    """
    descriptor = socket_descriptor(driver_connection)
    if descriptor is None:
        return
    dead, peer = socket.socketpair()
    try:
        os.dup2(dead.fileno(), descriptor)
    finally:
        dead.close()
        peer.close()


def socket_descriptor(driver_connection: Any) -> int | None:
    """The descriptor of the socket a blocking driver connection talks to its server on
    (None: no socket, as sqlite3's, or closed)."""
    fileno = getattr(driver_connection, "fileno", None)  # psycopg 3, psycopg2, mysqlclient
    if not callable(fileno):
        # PyMySQL keeps its socket object in _sock (private, 1.0 to 1.1 checked).
        fileno = getattr(getattr(driver_connection, "_sock", None), "fileno", None)
    if not callable(fileno):
        return None
    try:
        descriptor = fileno()
    except Exception:  # closed already: nothing left to protect
        return None
    return descriptor if isinstance(descriptor, int) and descriptor >= 0 else None
