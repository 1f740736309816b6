"""The blocking raw driver binds a lease can be held through, made the same way in the
test process and in spawned workers: psycopg's ConnectionPool and Connection, a psycopg2
connection (PostgreSQL), a PyMySQL connection (MariaDB), a ``sqlite3`` connection.

A single connection needs ``connect=`` (the lease's statements and its renewer run on
connections of their own); every kind can make a fenced write in its own transaction.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg2
import pymysql
from psycopg_pool import ConnectionPool
from sqlalchemy.engine import URL

from advisory_locks import LeaseLock, lease_lock

# (database, kind): each driver on the database it speaks to.
PAIRS = [
    ("postgresql", "psycopg-pool"),
    ("postgresql", "psycopg-connection"),
    ("postgresql", "psycopg2-connection"),
    ("mariadb", "pymysql-connection"),
    ("sqlite", "sqlite3-connection"),
]

INSERT = "INSERT INTO lease_test_writes (name, token, writer, value) VALUES ({0}, {0}, {0}, {0})"


@dataclass
class RawBind:
    """One blocking raw bind of one kind, on the database at ``url``."""

    kind: str
    url: URL
    bind: Any = None

    def open(self) -> RawBind:
        if self.kind == "psycopg-pool":
            self.bind = ConnectionPool(self._dsn(), min_size=1, max_size=1, timeout=10, open=True)
        else:
            self.bind = self.connect()
        return self

    def _dsn(self) -> str:
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    def connect(self) -> Any:
        """A new connection of this kind's driver (what ``connect=`` returns)."""
        if self.kind.startswith("psycopg2"):
            return psycopg2.connect(self._dsn())
        if self.kind.startswith("psycopg"):
            return psycopg.connect(self._dsn())
        if self.kind.startswith("pymysql"):
            return pymysql.connect(
                host=self.url.host,
                port=self.url.port or 3306,
                user=self.url.username,
                password=self.url.password or "",
                database=self.url.database,
            )
        assert self.url.database is not None
        return sqlite3.connect(self.url.database)

    def lease(self, name: str, **options: Any) -> LeaseLock:
        if self.kind.endswith("-connection"):
            options.setdefault("connect", self.connect)
        lease = lease_lock(self.bind, name, **options)
        assert isinstance(lease, LeaseLock)
        return lease

    def fenced_write(self, lease: LeaseLock, writer: str, value: int = 0) -> None:
        """Insert a row into lease_test_writes in a transaction guarded by ``lease.fence``."""
        values = (lease.lease_name, lease.token, writer, value)
        mark = "?" if self.kind.startswith("sqlite3") else "%s"
        if self.kind == "psycopg-pool":
            with self.bind.connection() as connection:  # commits at the end
                lease.fence(connection)
                connection.execute(INSERT.format(mark), values)
            return
        connection = self.connect()
        try:
            lease.fence(connection)
            cursor = connection.cursor()
            cursor.execute(INSERT.format(mark), values)
            cursor.close()
            connection.commit()
        except BaseException:
            connection.rollback()
            raise
        finally:
            connection.close()

    def use_a_pooled_connection(self) -> None:
        with self.bind.connection(timeout=10) as connection:
            connection.execute("SELECT 1")

    def close(self) -> None:
        self.bind.close()
