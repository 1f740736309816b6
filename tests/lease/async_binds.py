"""The asyncio binds a lease can be held through, made the same way in the test process
and in spawned workers: SQLAlchemy's AsyncEngine (asyncpg and psycopg drivers), asyncpg's
Pool and Connection, psycopg's AsyncConnectionPool and AsyncConnection.

A single connection needs ``connect=`` (the lease's statements and its renewer run on
connections of their own); every kind can make a fenced write in its own transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import psycopg
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import create_async_engine

from advisory_locks import AsyncLeaseLock, lease_lock

KINDS = [
    "sqlalchemy-asyncpg",
    "sqlalchemy-psycopg",
    "asyncpg-pool",
    "asyncpg-connection",
    "psycopg-pool",
    "psycopg-connection",
]
POOLS = {"sqlalchemy-asyncpg", "sqlalchemy-psycopg", "asyncpg-pool", "psycopg-pool"}

INSERT = "INSERT INTO lease_test_writes (name, token, writer, value) VALUES ({}, {}, {}, {})"


@dataclass
class AsyncBind:
    """One async bind of one kind, on the database at ``url``."""

    kind: str
    url: URL
    search_path: str | None = None
    bind: Any = None
    _closers: list[Callable[[], Any]] = field(default_factory=list)

    @property
    def dsn(self) -> str:
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def open(self) -> AsyncBind:
        kind = self.kind
        if kind.startswith("sqlalchemy-"):
            driver = kind.partition("-")[2]
            url = self.url.set(drivername=f"postgresql+{driver}")
            connect_args: dict[str, Any] = {}
            if self.search_path is not None:
                if driver == "asyncpg":
                    connect_args["server_settings"] = {"search_path": self.search_path}
                else:
                    connect_args["options"] = f"-csearch_path={self.search_path}"
            # A pool of one: holding a lease must leave it free for the application.
            engine = create_async_engine(
                url, pool_size=1, max_overflow=0, pool_timeout=10, connect_args=connect_args
            )
            self.bind = engine
            self._closers.append(engine.dispose)
        elif kind == "asyncpg-pool":
            pool = await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=1, **self._asyncpg_settings()
            )
            self.bind = pool
            self._closers.append(pool.close)
        elif kind == "asyncpg-connection":
            connection = await self.connect()
            self.bind = connection
            self._closers.append(connection.close)
        elif kind == "psycopg-pool":
            pool = AsyncConnectionPool(
                self.dsn, min_size=1, max_size=1, kwargs=self._psycopg_settings(), open=False
            )
            await pool.open()
            self.bind = pool
            self._closers.append(pool.close)
        else:
            assert kind == "psycopg-connection"
            connection = await self.connect()
            self.bind = connection
            self._closers.append(connection.close)
        return self

    def _asyncpg_settings(self) -> dict[str, Any]:
        if self.search_path is None:
            return {}
        return {"server_settings": {"search_path": self.search_path}}

    def _psycopg_settings(self) -> dict[str, Any]:
        if self.search_path is None:
            return {}
        return {"options": f"-csearch_path={self.search_path}"}

    async def connect(self) -> Any:
        """A new raw connection of this kind's driver (what ``connect=`` returns)."""
        if self.kind.startswith("asyncpg"):
            return await asyncpg.connect(self.dsn, **self._asyncpg_settings())
        return await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, **self._psycopg_settings()
        )

    def lease(self, name: str, **options: Any) -> AsyncLeaseLock:
        if self.kind.endswith("-connection"):
            options.setdefault("connect", self.connect)
        lease = lease_lock(self.bind, name, **options)
        assert isinstance(lease, AsyncLeaseLock)
        return lease

    async def fenced_write(self, lease: AsyncLeaseLock, writer: str, value: int = 0) -> None:
        """Insert a row into lease_test_writes in a transaction guarded by ``lease.fence``."""
        values = (lease.lease_name, lease.token, writer, value)
        if self.kind.startswith("sqlalchemy-"):
            async with self.bind.begin() as connection:
                await lease.fence(connection)
                await connection.execute(
                    text(INSERT.format(":name", ":token", ":writer", ":value")),
                    dict(zip(("name", "token", "writer", "value"), values, strict=True)),
                )
        elif self.kind.startswith("asyncpg"):
            connection = await self.connect()
            try:
                async with connection.transaction():
                    await lease.fence(connection)
                    await connection.execute(INSERT.format("$1", "$2", "$3", "$4"), *values)
            finally:
                await connection.close()
        else:
            connection = await self.connect()
            try:
                async with connection.transaction():
                    await lease.fence(connection)
                    await connection.execute(INSERT.format("%s", "%s", "%s", "%s"), values)
            finally:
                await connection.close()

    async def use_a_pooled_connection(self) -> None:
        """Run a statement on a connection of the bind's pool (of one)."""
        if self.kind.startswith("sqlalchemy-"):
            async with self.bind.connect() as connection:
                await connection.execute(text("SELECT 1"))
        elif self.kind == "asyncpg-pool":
            async with self.bind.acquire(timeout=10) as connection:
                await connection.fetchval("SELECT 1")
        elif self.kind == "psycopg-pool":
            async with self.bind.connection(timeout=10) as connection:
                await connection.execute("SELECT 1")
        else:
            raise AssertionError(f"{self.kind} has no pool")

    async def pooled_session_id(self) -> int:
        """The server process of the connection idle in the bind's pool (of one)."""
        if self.kind.startswith("sqlalchemy-"):
            async with self.bind.connect() as connection:
                pid = await connection.exec_driver_sql("SELECT pg_backend_pid()")
                return int(pid.scalar())
        if self.kind == "asyncpg-pool":
            async with self.bind.acquire(timeout=10) as connection:
                return int(connection.get_server_pid())
        if self.kind == "psycopg-pool":
            async with self.bind.connection(timeout=10) as connection:
                return int(connection.info.backend_pid)  # read locally: nothing sent
        raise AssertionError(f"{self.kind} has no pool")

    async def close(self) -> None:
        for close in reversed(self._closers):
            result = close()
            if asyncio.iscoroutine(result):
                await result


def url_of(text_url: str) -> URL:
    return make_url(text_url)
