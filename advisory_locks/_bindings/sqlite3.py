"""``sqlite3.Connection`` as a bind: file locks next to the database file (blocking).

What SQLite can lock (file locks, shared and exclusive, no transaction locks, no
in-memory databases) is in ``_dialects.sqlite``; what a raw bind means is in ``_raw``.

The caller's transaction and its ``isolation_level`` / ``autocommit`` are never touched:
the locks are held by this process, and the only statements sent (``PRAGMA
database_list`` once, ``SELECT 1`` to see that the connection is still open) begin no
transaction in any of sqlite3's transaction modes. Switching to autocommit for them, as
on PostgreSQL, would commit the caller's transaction (setting ``isolation_level = None``
does).

A ``sqlite3.Connection`` can neither be weakly referenced nor given an attribute, so its
state is kept by ``id()``, and its end is learnt another way: a small object is
registered on the connection as a SQL function (``advisory_locks_lifetime()``, returning
NULL); sqlite3 lets go of it when the connection is closed or garbage collected, and a
weak reference to it then ends the state, whose lock files close at once, as a server
frees a closed session's locks. The state refers to nothing of the connection (its
executors, which do, are made per lock), so it never keeps a connection alive.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import weakref
from typing import Any, Final

from advisory_locks._bindings._raw import (
    IDLE,
    IN_TRANSACTION,
    UNKNOWN,
    RawBinding,
    RawConnectionState,
    RawDriver,
)
from advisory_locks._bindings.raw_lease import LeaseDriver
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.executors import DBAPIExecutor
from advisory_locks._core.steps import ROWS, Statement

__all__ = ["SQLite3Driver"]

LIFETIME_FUNCTION: Final = "advisory_locks_lifetime"


class _Lifetime:
    """Lives exactly as long as the connection it is registered on stays open."""

    __slots__ = ("__weakref__",)

    def __call__(self) -> None:
        return None


# id(connection) -> (a weak reference to its lifetime object, its state). An entry goes
# when its connection closes or is collected, before the id can be reused.
_kept: dict[int, tuple[weakref.ReferenceType[_Lifetime], RawConnectionState]] = {}
# Reentrant: a collection inside a locked section may close another connection, whose
# lifetime callback takes it too.
_kept_mutex = threading.RLock()


class SQLite3State(RawConnectionState):
    """The state of one sqlite3 connection: told when it closes, so it reads nothing."""

    def observe(self) -> None:
        # The close arrives as an event (the lifetime object); SQLite has neither
        # transaction locks nor a pool that resets sessions.
        pass

    # Executors are made for each borrow, never kept here: an executor refers to its
    # connection, and this state lives as long as the connection does.
    keeps_executors = False


class SQLite3Executor(DBAPIExecutor):
    """Statements on a cursor that returns tuples of ``str``, whatever ``row_factory``
    and ``text_factory`` the application gave the connection."""

    __slots__ = ()

    def new_cursor(self) -> Any:
        cursor = self.connection.cursor()
        cursor.row_factory = None
        return cursor

    def execute(self, statement: Statement) -> object:
        result = super().execute(statement)
        if statement.kind == ROWS:
            # text_factory=bytes gives PRAGMA database_list's file name as bytes.
            return [
                tuple(os.fsdecode(value) if isinstance(value, bytes) else value for value in row)
                for row in result  # type: ignore[attr-defined]
            ]
        return result


class SQLite3Driver(RawDriver):
    """The standard library's sqlite3 connections."""

    dialect = "sqlite"
    name = "sqlite3"
    autocommit_for_session_locks = False

    def is_closed(self, connection: Any) -> bool:
        try:
            connection.in_transaction  # noqa: B018 - raises on a closed connection only
        except sqlite3.ProgrammingError:
            return True
        return False

    def status(self, connection: Any) -> int:
        try:
            return IN_TRANSACTION if connection.in_transaction else IDLE
        except sqlite3.ProgrammingError:
            return UNKNOWN

    def executor(self, connection: Any, scratch: dict[str, Any]) -> Any:
        return SQLite3Executor(connection, scratch)

    def new_state(self, backend: Any) -> RawConnectionState:
        return SQLite3State(backend=backend)

    def find_state(self, connection: Any) -> RawConnectionState | None:
        kept = _kept.get(id(connection))
        if kept is None or kept[0]() is None:
            return None
        return kept[1]

    def keep_state(self, connection: Any, state: RawConnectionState) -> None:
        key = id(connection)

        def closed(lifetime: weakref.ReferenceType[_Lifetime]) -> None:
            with _kept_mutex:
                kept = _kept.get(key)
                if kept is None or kept[0] is not lifetime:
                    return
                del _kept[key]
            kept[1].connection_gone()

        lifetime = _Lifetime()
        connection.create_function(LIFETIME_FUNCTION, 0, lifetime)
        with _kept_mutex:
            _kept[key] = (weakref.ref(lifetime, closed), state)


_DRIVER = SQLite3Driver()
register_binding([sqlite3.Connection], RawBinding(_DRIVER, lease=LeaseDriver(_DRIVER, "sqlite")))
