"""The databases the fault suite injects faults into, each seen from outside the library.

A fault spec that holds on several databases takes the ``database`` fixture (PostgreSQL,
MariaDB, SQLite) instead of one server's admin connection. What it needs to know from
outside is the same everywhere: who holds a name right now, if anyone. PostgreSQL says it
in ``pg_locks``, MariaDB in ``IS_USED_LOCK()``; for SQLite the operating system says
whether the lock file can be locked exclusively by someone else (``flock`` locks of one
process conflict too when they are taken on separately opened files).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import portalocker
from sqlalchemy import Engine, event
from sqlalchemy.engine import URL

from advisory_locks._core.executors import protocol_session_id
from advisory_locks._dialects.mysql import server_lock_name
from advisory_locks._dialects.sqlite import lock_file_path
from advisory_locks.keys import derive_key
from tests.helpers import backend_alive, holder_pids, wait_for

__all__ = [
    "FaultDatabase",
    "mysql_holder",
    "mysql_kill",
    "opened_connections",
    "postgres_holder",
    "postgres_kill",
    "sqlite_holder",
    "sqlite_kill",
]

# What "held" means when the OS can say only that some open file holds it.
HELD_IN_THIS_HOST = "held by some process on this host"


@dataclass(frozen=True)
class FaultDatabase:
    name: str  # "postgresql", "mariadb" or "sqlite"
    url: URL
    # Who holds the name (server session id, or HELD_IN_THIS_HOST), None when nobody.
    holder: Callable[[str], object | None]
    refuses: frozenset[str]  # options it refuses with UnsupportedFeature
    # Kill these DB-API connections' sessions (the server ends them), or, SQLite having
    # no server, close the connections under the library.
    kill: Callable[[list[Any]], None]

    def leaked(self, names: list[str]) -> list[str]:
        """The names among ``names`` that someone still holds."""
        return [name for name in names if self.holder(name) is not None]


def inject(kind: str) -> None:
    # Imported when a fault happens: the suite's conftest imports this module.
    from tests.faults.conftest import inject as count

    count(kind)


def opened_connections(engine: Engine) -> list[Any]:
    """The DB-API connections ``engine`` opens from now on (call before its first one)."""
    opened: list[Any] = []
    event.listen(
        engine, "connect", lambda dbapi_connection, record: opened.append(dbapi_connection)
    )
    return opened


def postgres_kill(admin: Any) -> Callable[[list[Any]], None]:
    def kill(opened: list[Any]) -> None:
        for pid in _session_ids(opened):
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
            inject("backend terminated")
            wait_for(lambda pid=pid: not backend_alive(admin, pid), "the backend has exited")

    return kill


def mysql_kill(admin: Any) -> Callable[[list[Any]], None]:
    def alive(connection_id: int) -> bool:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s",
                (connection_id,),
            )
            return bool(cursor.fetchone()[0])

    def kill(opened: list[Any]) -> None:
        for connection_id in _session_ids(opened):
            with admin.cursor() as cursor:
                cursor.execute(f"KILL CONNECTION {connection_id}")
            inject("MySQL connection killed")
            wait_for(lambda c=connection_id: not alive(c), "the server ended the session")

    return kill


def sqlite_kill(opened: list[Any]) -> None:
    assert opened, "no connection to close"
    for dbapi_connection in opened:
        dbapi_connection.close()
        inject("SQLite connection closed")


def _session_ids(opened: list[Any]) -> list[int]:
    ids = [protocol_session_id(dbapi_connection) for dbapi_connection in opened]
    assert ids, "no connection to kill"
    assert None not in ids, "the driver does not say which server session it has"
    return [int(session_id) for session_id in ids if session_id is not None]


def postgres_holder(admin: Any) -> Callable[[str], object | None]:
    def holder(name: str) -> object | None:
        pids = holder_pids(admin, name)
        return pids[0] if pids else None

    return holder


def mysql_holder(admin: Any) -> Callable[[str], object | None]:
    def holder(name: str) -> object | None:
        with admin.cursor() as cursor:
            cursor.execute("SELECT IS_USED_LOCK(%s)", (server_lock_name(derive_key(name)),))
            (connection_id,) = cursor.fetchone()
        return None if connection_id is None else int(connection_id)

    return holder


def sqlite_holder(database: Path) -> Callable[[str], object | None]:
    def holder(name: str) -> object | None:
        path = lock_file_path(database, derive_key(name))
        if not path.exists():
            return None
        with open(path, "a+b") as handle:
            try:
                portalocker.lock(
                    handle, portalocker.LockFlags.EXCLUSIVE | portalocker.LockFlags.NON_BLOCKING
                )
            except portalocker.AlreadyLocked:
                return HELD_IN_THIS_HOST
            portalocker.unlock(handle)
        return None

    return holder
