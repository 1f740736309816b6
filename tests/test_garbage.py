"""What a lock leaves for the garbage collector, and what it keeps alive.

A lock that builds a reference cycle (an object whose method another of its objects
keeps) leaves garbage that only the cyclic collector frees: on a hot path that is a
collection every few hundred locks, a cost the raw driver never pays. And what a lock
keeps with a pooled connection outlives the application's Connection: it must not keep
the pool's checkout alive, or a Connection dropped unclosed never goes back to its pool.
"""

from __future__ import annotations

import gc
import sqlite3
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, exc, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import create_async_engine

from advisory_locks import advisory_lock
from tests.databases import postgres_url_with_driver, psycopg_connect, pymysql_connect
from tests.helpers import open_bind, unique_name

OPERATIONS = 30


def _ours(garbage: list[Any]) -> list[str]:
    """The library's objects among the collector's finds (a bound method counts as its
    object's): other garbage in the process (the test runner's) is not the lock's."""
    found = []
    for item in garbage:
        owner = getattr(item, "__self__", item)
        module = type(owner).__module__
        if module.startswith("advisory_locks"):
            found.append(f"{type(owner).__qualname__} ({type(item).__name__})")
    return sorted(set(found))


class _Collector:
    """Names the library's objects in the cyclic garbage made between ``start`` and
    ``stop`` (the collector runs only at those two points in between)."""

    def start(self) -> None:
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)

    def stop(self) -> list[str]:
        try:
            gc.collect()
            return _ours(gc.garbage)
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            gc.enable()


def _assert_no_cycles(operation: Callable[[], None]) -> None:
    for _ in range(3):
        operation()  # first-use work (server check, executors) is not per lock
    collector = _Collector()
    collector.start()
    try:
        for _ in range(OPERATIONS):
            operation()
    finally:
        found = collector.stop()
    assert found == [], f"each lock left these in reference cycles: {found}"


def _database_url(request: pytest.FixtureRequest, database: str, tmp_path: Path) -> URL:
    if database == "postgresql":
        url: URL = request.getfixturevalue("postgres_url")
        return url
    if database == "mariadb":
        url = request.getfixturevalue("mysql_url")
        return url
    return make_url(f"sqlite:///{tmp_path / 'garbage.sqlite'}")


@pytest.mark.parametrize(
    ("database", "kind", "transaction"),
    [
        *(
            (database, kind, False)
            for database in ("postgresql", "mariadb", "sqlite")
            for kind in ("connection", "engine", "session")
        ),
        # Transaction locks: PostgreSQL's, on a bind that has a transaction.
        ("postgresql", "connection", True),
        ("postgresql", "session", True),
    ],
)
def test_a_sqlalchemy_lock_leaves_no_reference_cycles(
    request: pytest.FixtureRequest, tmp_path: Path, database: str, kind: str, transaction: bool
) -> None:
    database_url = _database_url(request, database, tmp_path)
    engine = create_engine(database_url)
    name = unique_name("garbage")
    try:
        with open_bind(kind, engine) as bind:

            def operation() -> None:
                if transaction:
                    with bind.begin(), advisory_lock(bind, name, transaction=True):
                        pass
                else:
                    with advisory_lock(bind, name, timeout=5):
                        pass

            _assert_no_cycles(operation)
    finally:
        engine.dispose()


async def test_an_async_connection_lock_leaves_no_reference_cycles(postgres_url: URL) -> None:
    engine = create_async_engine(postgres_url_with_driver(postgres_url, "psycopg_async"))
    name = unique_name("garbage.async")
    try:
        async with engine.connect() as connection:
            for _ in range(3):
                async with advisory_lock(connection, name, timeout=5):
                    pass
            collector = _Collector()
            collector.start()
            try:
                for _ in range(OPERATIONS):
                    async with advisory_lock(connection, name, timeout=5):
                        pass
            finally:
                found = collector.stop()
            assert found == [], f"each lock left these in reference cycles: {found}"
    finally:
        await engine.dispose()


@pytest.fixture(params=["psycopg", "psycopg2", "pymysql", "sqlite3"])
def raw_connection(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "psycopg":
        connection: Any = psycopg_connect(request.getfixturevalue("postgres_url"))
    elif request.param == "psycopg2":
        import psycopg2

        url = request.getfixturevalue("postgres_url")
        connection = psycopg2.connect(
            **url.translate_connect_args(username="user", database="dbname")
        )
    elif request.param == "pymysql":
        connection = pymysql_connect(request.getfixturevalue("mysql_url"))
    else:
        connection = sqlite3.connect(tmp_path / "garbage-raw.sqlite")
    yield connection
    connection.close()


def test_a_raw_driver_lock_leaves_no_reference_cycles(raw_connection: Any) -> None:
    name = unique_name("garbage.raw")

    def operation() -> None:
        with advisory_lock(raw_connection, name, timeout=5):
            pass

    _assert_no_cycles(operation)


def test_a_connection_dropped_unclosed_after_its_locks_goes_back_to_the_pool(
    postgres_url: URL,
) -> None:
    # One connection in the pool: the second connect() gets it back only if nothing the
    # lock kept holds the first Connection's checkout.
    engine = create_engine(postgres_url, pool_size=1, max_overflow=0, pool_timeout=2)
    try:
        connection = engine.connect()
        for _ in range(2):
            with advisory_lock(connection, unique_name("garbage.dropped"), timeout=5):
                pass
        with warnings.catch_warnings():
            # SQLAlchemy warns that a connection was collected unclosed: that is this test.
            warnings.simplefilter("ignore", exc.SAWarning)
            del connection
            gc.collect()
        try:
            with engine.connect() as again:
                assert again.execute(text("SELECT 1")).scalar() == 1
        except exc.TimeoutError:
            pytest.fail("the dropped Connection's pooled connection never went back")
    finally:
        engine.dispose()
