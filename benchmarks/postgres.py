"""The PostgreSQL server to measure against and the connections the cases run on."""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url

__all__ = [
    "URL_VARIABLE",
    "TrackedEngine",
    "database_url",
    "libpq_dsn",
    "raw_connection",
    "server_version",
]

# The same discovery the tests use, minus containers: a benchmark needs a server that
# stays put for the whole run.
URL_VARIABLE = "ADVISORY_LOCKS_TEST_POSTGRES_URL"
LOCAL_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def database_url() -> URL:
    """The server to measure, always through psycopg 3 so raw and ours share a driver."""
    url = make_url(os.environ.get(URL_VARIABLE) or LOCAL_DEFAULT)
    return url.set(drivername="postgresql+psycopg")


def libpq_dsn(url: URL) -> str:
    """``url`` as a libpq connection string, for drivers given one (psycopg, asyncpg)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def raw_connection(
    url: URL, stack: ExitStack, *, autocommit: bool = True, **options: Any
) -> psycopg.Connection[TupleRow]:
    """A psycopg connection to ``url``, closed with ``stack``; ``options`` go to
    ``psycopg.connect`` (``prepare_threshold=None``, say)."""
    arguments: dict[str, Any] = url.translate_connect_args(username="user", database="dbname")
    arguments.update((key, value) for key, value in url.query.items() if isinstance(value, str))
    connection = psycopg.connect(**arguments, **options, autocommit=autocommit)
    stack.callback(connection.close)
    return connection


class TrackedEngine:
    """An engine that remembers the DB-API connections its pool opened (for round trips)."""

    def __init__(self, url: URL, stack: ExitStack) -> None:
        self.engine: Engine = create_engine(url)
        self.opened: list[Any] = []
        event.listen(self.engine, "connect", self._connected)
        stack.callback(self.engine.dispose)

    def _connected(self, dbapi_connection: Any, record: object) -> None:
        self.opened.append(dbapi_connection)

    def sockets(self) -> list[int]:
        return [connection.pgconn.socket for connection in self.opened if not connection.closed]


def server_version(url: URL) -> str:
    with ExitStack() as stack:
        row = raw_connection(url, stack).execute("SHOW server_version").fetchone()
    return "unknown" if row is None else str(row[0])
