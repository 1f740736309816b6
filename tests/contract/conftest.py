"""The databases and bindings the contract suite runs against.

Every test in tests/contract takes a ``target``: one database reached through one ORM
binding. Databases: PostgreSQL and MariaDB (the servers of tests/databases.py) and
SQLite (a file in the test's temporary directory). Bindings: SQLAlchemy. The Django
binding joins by adding one entry to ``BINDINGS`` and a ``Client`` for it.

A test sees the database only through the target: ``target.client()`` gives a client on
its own connection, ``target.waiting(name)`` says whether the server (or, for SQLite, the
operating system) has queued a waiter for a name, and ``target.hold_in_process(name)``
starts another process that takes the lock and keeps it until it is killed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

from advisory_locks import advisory_lock
from advisory_locks.backends.mysql import server_lock_name
from advisory_locks.backends.sqlite import lock_file_path
from advisory_locks.keys import derive_key
from tests.databases import pymysql_connect
from tests.helpers import lock_rows

DATABASES = ("postgresql", "mariadb", "sqlite")
BINDINGS = ("sqlalchemy",)

# What each database refuses with UnsupportedFeature (everything else it must honour).
REFUSES: dict[str, frozenset[str]] = {
    "postgresql": frozenset(),
    "mariadb": frozenset({"shared", "transaction"}),
    "sqlite": frozenset({"transaction"}),
}

# Run in a child process: take the lock, say so, and hold it until killed.
HOLDER_SCRIPT = """
import sys
from sqlalchemy import create_engine
from advisory_locks import advisory_lock
engine = create_engine(sys.argv[1])
with engine.connect() as connection, advisory_lock(connection, sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


class Client:
    """One SQLAlchemy Session on its own connection, the way an application holds locks."""

    def __init__(self, engine: Engine) -> None:
        self.session = Session(engine)

    def lock(self, name: object, **options: Any) -> Any:
        return advisory_lock(self.session, name, **options)  # type: ignore[arg-type]

    def commit(self) -> None:
        self.session.commit()

    def rollback(self) -> None:
        self.session.rollback()

    def close(self) -> None:
        self.session.close()


@dataclass
class Target:
    database: str
    binding: str
    url: URL
    refuses: frozenset[str]
    waiting: Callable[[str], bool]
    engines: list[Engine] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)

    def engine(self) -> Engine:
        engine = create_engine(self.url)
        self.engines.append(engine)

        @event.listens_for(engine, "connect")
        def _connected(dbapi_connection: Any, record: Any) -> None:
            self.statements.append("<connect>")

        return engine

    @contextlib.contextmanager
    def client(self) -> Iterator[Client]:
        client = Client(self.engine())
        try:
            yield client
        finally:
            client.close()

    def is_free(self, name: str) -> bool:
        """Whether a fresh connection can take ``name`` at once (and it gives it back)."""
        with self.client() as other:
            lock = other.lock(name, timeout=0)
            if not lock.acquire():
                return False
            lock.release()
            return True

    @contextlib.contextmanager
    def hold_in_process(self, name: str) -> Iterator[subprocess.Popen[str]]:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER_SCRIPT, self.url.render_as_string(False), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "held"
            yield holder
        finally:
            holder.kill()
            holder.wait()

    def dispose(self) -> None:
        for engine in self.engines:
            engine.dispose()


def _postgres_waiting(url: URL) -> Callable[[str], bool]:
    from tests.databases import psycopg_connect

    def waiting(name: str) -> bool:
        with psycopg_connect(url, autocommit=True) as admin:
            return any(not row.granted for row in lock_rows(admin, name))

    return waiting


def _mysql_waiting(url: URL) -> Callable[[str], bool]:
    def waiting(name: str) -> bool:
        server_name = server_lock_name(derive_key(name))
        admin = pymysql_connect(url)
        try:
            with admin.cursor() as cursor:
                # PyMySQL sends parameters inlined, so the waiting statement's text holds
                # the server-side name.
                cursor.execute(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                    "WHERE STATE = 'User lock' AND INFO LIKE %s",
                    ("%" + server_name + "%",),
                )
                return bool(cursor.fetchone()[0])
        finally:
            admin.close()

    return waiting


def _sqlite_waiting(database: Path) -> Callable[[str], bool]:
    def waiting(name: str) -> bool:
        # Linux lists blocked flock requests in /proc/locks with "->", by inode.
        inode = os.stat(lock_file_path(database, derive_key(name))).st_ino
        return any(
            "->" in line and line.split()[-3].endswith(f":{inode}")
            for line in Path("/proc/locks").read_text().splitlines()
        )

    return waiting


@pytest.fixture(params=[(d, b) for d in DATABASES for b in BINDINGS], ids="-".join)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    database, binding = request.param
    if database == "postgresql":
        url = request.getfixturevalue("postgres_url")
        waiting = _postgres_waiting(url)
    elif database == "mariadb":
        url = request.getfixturevalue("mysql_url")
        waiting = _mysql_waiting(url)
    else:
        if not sys.platform.startswith("linux"):
            pytest.skip("observing SQLite file-lock waiters needs Linux's /proc/locks")
        path = tmp_path / "contract.sqlite"
        url = make_url(f"sqlite:///{path}")
        waiting = _sqlite_waiting(path)
    result = Target(database, binding, url, REFUSES[database], waiting)
    yield result
    result.dispose()
