"""The server ends the session under a lock: every driver's way of saying so is typed, and
the application's pool recovers exactly as it does without this library.

Faults: ``idle_session_timeout`` (PostgreSQL 14+) and ``idle_in_transaction_session_timeout``
ending the holder's session, MariaDB's ``wait_timeout``, and a restart (every pooled
connection of an engine terminated -- ``pg_terminate_backend``, ``KILL CONNECTION``, SQLite
connections closed -- with no ``pool_pre_ping``). A lock that was held reports
``LockLost`` from ``ensure_held()``, ``release()`` and the end of its block; an acquire on a
dead connection raises ``LockConnectionLost`` once, SQLAlchemy's ``handle_error`` sees a
disconnect, and the next attempt (and the application's next statement) runs on a fresh
connection.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy import exc as sqlalchemy_errors
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

from advisory_locks import LockConnectionLost, LockLost, advisory_lock
from advisory_locks._dialects import backend_for_dialect
from tests.databases import PostgresDriver, import_mysqlclient, pymysql_connect
from tests.faults.conftest import inject
from tests.faults.servers import FaultDatabase, opened_connections, postgres_kill
from tests.helpers import holder_pids, open_bind, unique_name, wait_for

pytestmark = pytest.mark.faults

BINDS = ["engine", "connection", "session"]
IDLE_TIMEOUT_MS = 400


def disconnects_seen(engine: Engine) -> list[bool]:
    """What SQLAlchemy's ``handle_error`` event is told of each error on ``engine``:
    whether it is a disconnect."""
    seen: list[bool] = []
    event.listen(engine, "handle_error", lambda context: seen.append(context.is_disconnect))
    return seen


def idle_timeout_options(database: FaultDatabase) -> dict[str, Any]:
    """connect_args making the server end every session of the engine once idle."""
    if database.name == "postgresql":
        return {"options": f"-c idle_session_timeout={IDLE_TIMEOUT_MS}"}
    return {"init_command": "SET SESSION wait_timeout = 1"}


@pytest.mark.parametrize("database", ["postgresql", "mariadb"], indirect=True)
@pytest.mark.parametrize("kind", BINDS)
def test_a_session_the_server_ended_for_idling_is_lock_lost_everywhere(
    kind: str, database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    # Three locks on three connections, one per way of learning of the loss.
    engine = make_engine(database.url, connect_args=idle_timeout_options(database))
    seen = disconnects_seen(engine)
    checked, released, exited = (unique_name(label) for label in ("ensure", "release", "exit"))
    with contextlib.ExitStack() as binds:
        checked_lock = advisory_lock(binds.enter_context(open_bind(kind, engine)), checked)
        released_lock = advisory_lock(binds.enter_context(open_bind(kind, engine)), released)
        assert checked_lock.acquire()
        assert released_lock.acquire()
        inject("session ended by an idle timeout")
        with (
            pytest.raises(LockLost) as at_exit,
            advisory_lock(binds.enter_context(open_bind(kind, engine)), exited),
        ):
            # The server frees the locks as it ends the sessions.
            wait_for(
                lambda: database.leaked([checked, released, exited]) == [],
                "the server ended the idle sessions",
            )
        assert at_exit.value.name == exited
        with pytest.raises(LockLost) as at_check:
            checked_lock.ensure_held()
        assert at_check.value.name == checked
        with pytest.raises(LockLost) as at_release:
            released_lock.release()
        assert at_release.value.name == released
        assert not checked_lock.held
        assert not released_lock.held
    # SQLAlchemy was told of each, as a disconnect ...
    assert seen == [True, True, True]
    # ... and replaced the dead connections: the next lock and the application's next
    # statement run on fresh ones (they would hit a dead pooled connection otherwise).
    with advisory_lock(engine, unique_name("after"), timeout=0) as lock:
        assert lock.held
    with engine.connect() as connection:
        assert connection.execute(text("SELECT 1")).scalar() == 1


def test_a_transaction_lock_whose_session_idled_in_its_transaction_is_lock_lost(
    make_engine: Callable[..., Engine], pg_admin: psycopg.Connection[Any]
) -> None:
    # idle_in_transaction_session_timeout (SQLSTATE 25P03) ends the session, and with it
    # the transaction and its lock.
    engine = make_engine(
        connect_args={"options": f"-c idle_in_transaction_session_timeout={IDLE_TIMEOUT_MS}"}
    )
    seen = disconnects_seen(engine)
    name = unique_name("idle-in-transaction")
    with engine.connect() as connection:
        connection.begin()
        lock = advisory_lock(connection, name, transaction=True)
        assert lock.acquire()
        inject("session ended by an idle timeout")
        wait_for(lambda: not holder_pids(pg_admin, name), "the server ended the idle transaction")
        with pytest.raises(LockLost):
            lock.ensure_held()
        assert connection.invalidated
    assert seen == [True]
    with engine.connect() as connection:
        assert connection.execute(text("SELECT 1")).scalar() == 1


def warm_pool(engine: Engine, size: int) -> None:
    """Open ``size`` connections at once and give them back, one having taken a lock (so
    the stale pool holds connections the library has used and ones it has not)."""
    with contextlib.ExitStack() as stack:
        connections = [stack.enter_context(engine.connect()) for _ in range(size)]
        for connection in connections:
            connection.execute(text("SELECT 1"))
        with advisory_lock(connections[0], unique_name("warm")):
            pass
        for connection in connections:
            connection.rollback()


@pytest.mark.parametrize("kind", BINDS)
def test_a_restarted_server_fails_one_lock_then_the_pool_recovers(
    kind: str, database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    # A restart, as the pool sees it: every connection in it is dead, and nothing pings
    # them at checkout. Without this library, the first statement fails and SQLAlchemy
    # replaces the rest; a lock must do the same.
    engine = make_engine(database.url, pool_size=3, max_overflow=0)
    opened = opened_connections(engine)
    seen = disconnects_seen(engine)
    warm_pool(engine, 3)
    database.kill(opened)
    name = unique_name("after-restart")

    with pytest.raises(LockConnectionLost) as raised, open_bind(kind, engine) as bind:
        advisory_lock(bind, name).acquire()
    assert raised.value.name == name
    assert isinstance(raised.value, ConnectionError)
    assert seen == [True]
    assert database.holder(name) is None

    with open_bind(kind, engine) as bind, advisory_lock(bind, name, timeout=0) as lock:
        assert lock.held
        assert database.holder(name) is not None
    for _ in range(3):  # every pooled connection, the application's statements too
        with engine.connect() as connection:
            assert connection.execute(text("SELECT 1")).scalar() == 1
    assert seen == [True]


@pytest.mark.parametrize("database", ["postgresql", "mariadb"], indirect=True)
@pytest.mark.parametrize("kind", ["engine", "session"])
def test_a_lock_that_cannot_open_a_connection_raises_what_connect_raises(
    kind: str, database: FaultDatabase, make_engine: Callable[..., Engine]
) -> None:
    # The server down, as an Engine sees it: opening a connection is refused. The
    # application's engine.connect() raises SQLAlchemy's error, after the handle_error
    # hooks; a lock that opens a connection of its own must raise that, not the driver's.
    engine = make_engine(database.url.set(host="127.0.0.1", port=1))
    seen = disconnects_seen(engine)
    with pytest.raises(sqlalchemy_errors.OperationalError) as connecting:
        engine.connect()
    with pytest.raises(sqlalchemy_errors.OperationalError) as raised:
        advisory_lock(engine if kind == "engine" else Session(engine), unique_name()).acquire()
    assert type(raised.value) is type(connecting.value)
    assert type(raised.value.orig) is type(connecting.value.orig)
    assert raised.value.__cause__ is raised.value.orig
    assert len(seen) == 2


def test_a_restarted_server_fails_one_lock_then_the_pool_recovers_on_psycopg2(
    postgres_url_for: Callable[[PostgresDriver], URL],
    make_engine: Callable[..., Engine],
    pg_admin: psycopg.Connection[Any],
) -> None:
    engine = make_engine(postgres_url_for("psycopg2"), pool_size=2, max_overflow=0)
    opened = opened_connections(engine)
    seen = disconnects_seen(engine)
    warm_pool(engine, 2)
    postgres_kill(pg_admin)(opened)
    name = unique_name("after-restart")
    with pytest.raises(LockConnectionLost):
        advisory_lock(engine, name).acquire()
    assert seen == [True]
    with advisory_lock(engine, name, timeout=0) as lock:
        assert lock.held


@pytest.fixture
def async_engines(postgres_url_for: Callable[[PostgresDriver], URL]) -> Iterator[list[Any]]:
    engines: list[AsyncEngine] = []
    yield engines
    for engine in engines:
        engine.sync_engine.dispose()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async"])
async def test_a_restarted_server_fails_one_async_lock_then_the_pool_recovers(
    driver: PostgresDriver,
    postgres_url_for: Callable[[PostgresDriver], URL],
    pg_admin: psycopg.Connection[Any],
    async_engines: list[AsyncEngine],
) -> None:
    engine = create_async_engine(postgres_url_for(driver), pool_size=2, max_overflow=0)
    async_engines.append(engine)
    opened = opened_connections(engine.sync_engine)
    seen = disconnects_seen(engine.sync_engine)
    async with engine.connect() as first, engine.connect() as second:
        for connection in (first, second):
            await connection.execute(text("SELECT 1"))
    pids = [_driver_pid(connection) for connection in opened]
    for pid in pids:
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        inject("backend terminated")
    wait_for(
        lambda: (
            not pg_admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", [pids]
            ).fetchone()[0]
        ),  # type: ignore[index]
        "the backends have exited",
    )
    name = unique_name("after-restart")
    with pytest.raises(LockConnectionLost):
        await advisory_lock(engine, name).acquire()
    assert seen == [True]
    async with advisory_lock(engine, name, timeout=0) as lock:
        assert lock.held
    async with engine.connect() as connection:
        assert (await connection.execute(text("SELECT 1"))).scalar() == 1


def _driver_pid(adapted: Any) -> int:
    driver = getattr(adapted, "driver_connection", None) or getattr(adapted, "_connection", None)
    if hasattr(driver, "get_server_pid"):
        return int(driver.get_server_pid())
    return int(driver.info.backend_pid)


# -- every driver's words for "the session is gone" ---------------------------------------------


def _pg_terminate(admin: psycopg.Connection[Any], pid: int) -> None:
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    inject("backend terminated")
    wait_for(
        lambda: (
            not admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]
            ).fetchone()[0]
        ),  # type: ignore[index]
        "the backend has exited",
    )


def _errors_after_loss(run: Callable[[], object]) -> list[BaseException]:
    """The errors of two statements on a connection whose session is gone: the first
    reads the server's last words, the second finds the connection closed."""
    errors: list[BaseException] = []
    for _ in range(2):
        try:
            run()
        except Exception as error:
            errors.append(error)
        else:
            raise AssertionError("a statement on a lost session succeeded")
    return errors


@pytest.mark.parametrize("how", ["terminated", "idle_session_timeout"])
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_every_postgres_driver_says_gone_in_words_the_backend_knows(
    driver: str, how: str, postgres_url: URL, pg_admin: psycopg.Connection[Any]
) -> None:
    backend = backend_for_dialect("postgresql")
    dsn = postgres_url.set(drivername="postgresql").render_as_string(hide_password=False)
    if driver == "psycopg":
        connection: Any = psycopg.connect(dsn, autocommit=True)
        pid = connection.info.backend_pid
    else:
        import psycopg2

        connection = psycopg2.connect(dsn)
        connection.autocommit = True
        pid = connection.info.backend_pid
    try:
        cursor = connection.cursor()
        if how == "terminated":
            _pg_terminate(pg_admin, pid)
        else:
            cursor.execute(f"SET idle_session_timeout = {IDLE_TIMEOUT_MS}")
            inject("session ended by an idle timeout")
            wait_for(
                lambda: (
                    not pg_admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]
                    ).fetchone()[0]
                ),  # type: ignore[index]
                "the server ended the idle session",
            )
        errors = _errors_after_loss(lambda: connection.cursor().execute("SELECT 1"))
        assert [backend.is_connection_failure(error) for error in errors] == [True, True], errors
    finally:
        with contextlib.suppress(Exception):
            connection.close()


async def test_asyncpg_says_gone_in_words_the_backend_knows(
    postgres_url: URL, pg_admin: psycopg.Connection[Any]
) -> None:
    import asyncpg

    backend = backend_for_dialect("postgresql")
    connection = await asyncpg.connect(
        postgres_url.set(drivername="postgresql").render_as_string(hide_password=False)
    )
    try:
        pid = connection.get_server_pid()
        await connection.execute(f"SET idle_session_timeout = {IDLE_TIMEOUT_MS}")
        inject("session ended by an idle timeout")
        wait_for(
            lambda: (
                not pg_admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone()[0]
            ),  # type: ignore[index]
            "the server ended the idle session",
        )
        errors: list[BaseException] = []
        for _ in range(2):
            with pytest.raises(Exception) as raised:  # noqa: PT011 - any driver error
                await connection.fetchval("SELECT 1")
            errors.append(raised.value)
        assert [backend.is_connection_failure(error) for error in errors] == [True, True], errors
    finally:
        connection.terminate()


@pytest.mark.parametrize("how", ["KILL CONNECTION", "wait_timeout"])
@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_every_mysql_driver_says_gone_in_words_the_backend_knows(
    driver: str, how: str, mysql_url: URL
) -> None:
    backend = backend_for_dialect("mysql")
    if driver == "mysqldb":
        mysqldb = import_mysqlclient(os.environ)
        connection = mysqldb.connect(
            host=mysql_url.host,
            port=mysql_url.port or 3306,
            user=mysql_url.username,
            password=mysql_url.password or "",
            database=mysql_url.database,
        )
    else:
        connection = pymysql_connect(mysql_url)
    admin = pymysql_connect(mysql_url)
    try:
        cursor = connection.cursor()
        cursor.execute("SELECT CONNECTION_ID()")
        (connection_id,) = cursor.fetchone()

        def alive() -> bool:
            with admin.cursor() as watch:
                watch.execute(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s",
                    (connection_id,),
                )
                return bool(watch.fetchone()[0])

        if how == "KILL CONNECTION":
            with admin.cursor() as killer:
                killer.execute(f"KILL CONNECTION {int(connection_id)}")
            inject("MySQL connection killed")
        else:
            cursor.execute("SET SESSION wait_timeout = 1")
            inject("session ended by an idle timeout")
        wait_for(lambda: not alive(), "the server ended the session")
        errors = _errors_after_loss(lambda: connection.cursor().execute("SELECT 1"))
        assert [backend.is_connection_failure(error) for error in errors] == [True, True], errors
    finally:
        admin.close()
        with contextlib.suppress(Exception):
            connection.close()


def test_sqlite3_says_gone_in_words_the_backend_knows(tmp_path: Path) -> None:
    backend = backend_for_dialect("sqlite")
    connection = sqlite3.connect(tmp_path / "closed.sqlite")
    connection.close()
    inject("SQLite connection closed")
    errors = _errors_after_loss(lambda: connection.execute("SELECT 1"))
    assert [backend.is_connection_failure(error) for error in errors] == [True, True], errors
