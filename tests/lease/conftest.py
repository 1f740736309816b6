"""Lease specs run on PostgreSQL, MariaDB and SQLite alike: the ``lease_db`` fixture.

Each database is looked at from outside the library through an admin engine: the row of
a lease as the database's own clock sees it, and plain tables the specs write to.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url

from advisory_locks.sqlalchemy import create_lease_table
from tests.helpers import wait_for

# Seconds until expiry by the database's clock, NULL for a free row.
EXPIRES_IN = {
    "postgresql": "EXTRACT(EPOCH FROM expires_at - clock_timestamp())::float8",
    "mariadb": "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1000000.0",
    "sqlite": "(julianday(expires_at) - julianday('now')) * 86400.0",
}
RENEWED_AT = {
    "postgresql": "renewed_at",
    "mariadb": "renewed_at",
    "sqlite": "renewed_at",
}
# The server's id of the session a query runs in, and how another session ends it.
SESSION_ID_SQL = {"postgresql": "SELECT pg_backend_pid()", "mariadb": "SELECT CONNECTION_ID()"}
_SESSION_ALIVE = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE pid = :id",
    "mariadb": "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = :id",
}
_END_SESSION = {"postgresql": "SELECT pg_terminate_backend(:id)", "mariadb": "KILL CONNECTION :id"}
WRITES_DDL = (
    "CREATE TABLE IF NOT EXISTS lease_test_writes "
    "(name VARCHAR(255) NOT NULL, token BIGINT NOT NULL, writer VARCHAR(64) NOT NULL, "
    "value INTEGER NOT NULL)"
)

_created: set[str] = set()
_created_lock = threading.Lock()


@dataclass(frozen=True)
class Row:
    holder: str | None
    token: int
    expires_in: float
    renewed_at: Any


@dataclass
class LeaseDatabase:
    kind: str
    url: URL
    engine: Engine
    admin: Engine

    def row(self, name: str) -> Row | None:
        with self.admin.connect() as connection:
            found = connection.execute(
                text(
                    f"SELECT holder, token, {EXPIRES_IN[self.kind]}, renewed_at "
                    "FROM advisory_locks_lease WHERE name = :name"
                ),
                {"name": name},
            ).first()
        if found is None:
            return None
        return Row(found[0], int(found[1]), float(found[2]), found[3])

    def end_session(self, session_id: int) -> None:
        """End the server session ``session_id`` from another one, as an idle-session
        timeout, a restart or a failover would, and wait until the server has."""
        with self.admin.connect() as admin:
            admin.execute(text(_END_SESSION[self.kind]), {"id": session_id})

            def ended() -> bool:
                return (
                    admin.execute(text(_SESSION_ALIVE[self.kind]), {"id": session_id}).scalar() == 0
                )

            wait_for(ended, "the server ended the session")

    def writes(self, name: str) -> list[tuple[int, str, int]]:
        with self.admin.connect() as connection:
            return [
                (int(token), str(writer), int(value))
                for token, writer, value in connection.execute(
                    text(
                        "SELECT token, writer, value FROM lease_test_writes "
                        "WHERE name = :name ORDER BY value, token"
                    ),
                    {"name": name},
                )
            ]


def fenced_write(lease: Any, engine: Engine, writer: str, value: int = 0) -> None:
    """Insert a row into lease_test_writes in a transaction guarded by ``lease.fence``."""
    with engine.begin() as connection:
        lease.fence(connection)
        connection.execute(
            text(
                "INSERT INTO lease_test_writes (name, token, writer, value) "
                "VALUES (:name, :token, :writer, :value)"
            ),
            {"name": lease.lease_name, "token": lease.token, "writer": writer, "value": value},
        )


def _prepare(kind: str, engine: Engine) -> None:
    with _created_lock:
        if kind in _created and kind != "sqlite":
            return
        create_lease_table(engine)
        with engine.begin() as connection:
            connection.exec_driver_sql(WRITES_DDL)
        _created.add(kind)


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def lease_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LeaseDatabase]:
    """A database with the lease table, an engine for the library and one for looking."""
    kind: str = request.param
    if kind == "postgresql":
        url: URL = request.getfixturevalue("postgres_url")
    elif kind == "mariadb":
        url = request.getfixturevalue("mysql_url")
    else:
        url = make_url(f"sqlite:///{tmp_path / 'leases.sqlite'}")
    engine = create_engine(url)
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    _prepare(kind, engine)
    yield LeaseDatabase(kind, url, engine, admin)
    engine.dispose()
    admin.dispose()
