"""Single-connection pools (``StaticPool``, ``SingletonThreadPool``), on PostgreSQL,
MariaDB and SQLite: the connection a lock gets is the one the application is using.

What holds: taking and releasing a lock never commits, rolls back or otherwise alters
the transaction the application has open on that connection, and never changes the mode
the application configured for it (autocommit, SQLite's ``isolation_level``). The lock
still excludes other connections for the whole block, through the Session's commits.

The application's transaction is the witness: a row it wrote before the lock is still
there (uncommitted, so its rollback removes it) after the lock's block.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool, Pool, SingletonThreadPool, StaticPool

from advisory_locks import advisory_lock
from advisory_locks._core.executors import driver_autocommit
from tests.faults.conftest import inject
from tests.faults.servers import FaultDatabase
from tests.helpers import unique_name

pytestmark = pytest.mark.faults

POOLS: dict[str, type[Pool]] = {
    "StaticPool": StaticPool,
    "SingletonThreadPool": SingletonThreadPool,
}


@pytest.fixture(params=list(POOLS))
def single(
    request: pytest.FixtureRequest, database: FaultDatabase, make_engine: Callable[..., Engine]
) -> Callable[..., Engine]:
    """Engines on ``database`` whose pool hands every checkout the same connection."""

    def make(**options: Any) -> Engine:
        inject(f"{request.param} shared with the application")
        return make_engine(database.url, poolclass=POOLS[request.param], **options)

    return make


@pytest.fixture
def rival(database: FaultDatabase, make_engine: Callable[..., Engine]) -> Engine:
    """An engine with connections of its own, to try the lock from elsewhere."""
    return make_engine(database.url, poolclass=NullPool)


def write(bind: Session | Connection, table: str, note: str) -> None:
    bind.execute(text(f"INSERT INTO {table} (note) VALUES (:note)"), {"note": note})


def read(bind: Session | Connection, table: str) -> list[str]:
    return [row[0] for row in bind.execute(text(f"SELECT note FROM {table} ORDER BY note"))]


def busy_elsewhere(rival: Engine, name: str) -> bool:
    lock = advisory_lock(rival, name, timeout=0)
    if lock.acquire():
        lock.release()
        return False
    return True


def test_session_lock_leaves_the_sessions_open_transaction_uncommitted_and_in_place(
    single: Callable[..., Engine], rival: Engine, notes_table: str
) -> None:
    name = unique_name()
    with Session(single()) as session:
        write(session, notes_table, "before the lock")
        with advisory_lock(session, name):
            assert busy_elsewhere(rival, name)
            write(session, notes_table, "inside the lock")
        assert read(session, notes_table) == ["before the lock", "inside the lock"]
        session.rollback()
        assert read(session, notes_table) == []
    assert not busy_elsewhere(rival, name)


def test_session_lock_released_inside_the_transaction_leaves_it_to_the_session(
    single: Callable[..., Engine], rival: Engine, notes_table: str
) -> None:
    name = unique_name()
    with Session(single()) as session:
        lock = advisory_lock(session, name)
        assert lock.acquire()
        write(session, notes_table, "written under the lock")
        lock.release()
        assert not busy_elsewhere(rival, name)
        assert read(session, notes_table) == ["written under the lock"]
        session.commit()
    with rival.connect() as connection:
        assert read(connection, notes_table) == ["written under the lock"]


def test_session_lock_survives_the_sessions_commits_on_the_shared_connection(
    single: Callable[..., Engine], rival: Engine, notes_table: str
) -> None:
    name = unique_name()
    with Session(single()) as session, advisory_lock(session, name) as lock:
        for note in ("first", "second"):
            write(session, notes_table, note)
            session.commit()
            assert busy_elsewhere(rival, name)
        lock.ensure_held()
    assert not busy_elsewhere(rival, name)


def test_engine_lock_leaves_the_open_transaction_of_the_shared_connection_alone(
    single: Callable[..., Engine], rival: Engine, notes_table: str
) -> None:
    engine = single()
    name = unique_name()
    with engine.connect() as connection:
        write(connection, notes_table, "before the lock")
        with advisory_lock(engine, name):
            assert busy_elsewhere(rival, name)
            assert read(connection, notes_table) == ["before the lock"]
        assert read(connection, notes_table) == ["before the lock"]
        connection.rollback()
        assert read(connection, notes_table) == []
    assert not busy_elsewhere(rival, name)


def test_engine_lock_taken_first_does_not_reset_a_transaction_begun_inside_its_block(
    single: Callable[..., Engine], rival: Engine, notes_table: str
) -> None:
    engine = single()
    name = unique_name()
    lock = advisory_lock(engine, name)
    assert lock.acquire()
    with engine.connect() as connection:
        write(connection, notes_table, "inside the lock")
        lock.release()
        assert not busy_elsewhere(rival, name)
        assert read(connection, notes_table) == ["inside the lock"]
        connection.commit()
    with rival.connect() as connection:
        assert read(connection, notes_table) == ["inside the lock"]


def test_engine_lock_dropped_unreleased_is_released_when_the_shared_connection_goes_back(
    single: Callable[..., Engine], database: FaultDatabase
) -> None:
    engine = single()
    name = unique_name()
    connection = engine.connect()
    connection.execute(text("SELECT 1"))
    lock = advisory_lock(engine, name)
    assert lock.acquire()
    del lock
    gc.collect()
    assert database.holder(name) is not None  # the application still has the connection
    connection.close()
    assert database.holder(name) is None


def test_session_bound_to_a_connection_in_a_transaction_leaves_it_in_place(
    single: Callable[..., Engine], rival: Engine, notes_table: str
) -> None:
    # The test-suite pattern: one outer transaction, rolled back at the end of a test.
    name = unique_name()
    with single().connect() as connection:
        outer = connection.begin()
        write(connection, notes_table, "outer")
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        with advisory_lock(session, name):
            write(session, notes_table, "session")
            session.commit()
            assert busy_elsewhere(rival, name)
        session.close()
        assert read(connection, notes_table) == ["outer", "session"]
        outer.rollback()
        assert read(connection, notes_table) == []
    assert not busy_elsewhere(rival, name)


def test_pool_handing_out_a_connection_inside_a_transaction_keeps_that_transaction(
    database: FaultDatabase, make_engine: Callable[..., Engine], rival: Engine, notes_table: str
) -> None:
    # Some test setups give a QueuePool a creator that returns one shared connection: the
    # pool cannot know, but the driver says a transaction is open on what it handed out.
    shared = make_engine(database.url, poolclass=NullPool).raw_connection()
    engine = make_engine(database.url, creator=lambda: shared.dbapi_connection)
    inject("pool handing out a connection inside a transaction")
    name = unique_name()
    try:
        with engine.connect() as connection:
            write(connection, notes_table, "before the locks")
            with advisory_lock(engine, name):
                assert busy_elsewhere(rival, name)
            with Session(engine) as session, advisory_lock(session, name):
                assert busy_elsewhere(rival, name)
            assert read(connection, notes_table) == ["before the locks"]
            connection.rollback()
            assert read(connection, notes_table) == []
        assert not busy_elsewhere(rival, name)
    finally:
        shared.close()


def driver_mode(connection: Any) -> object:
    """What the application configured: SQLite's isolation_level, else autocommit."""
    if type(connection).__module__ in ("sqlite3", "_sqlite3"):
        return connection.isolation_level
    return driver_autocommit(connection)


@pytest.mark.parametrize("kind", ["engine", "session"])
def test_configured_connection_mode_is_left_as_configured(
    kind: str, single: Callable[..., Engine], database: FaultDatabase, notes_table: str
) -> None:
    options: dict[str, Any] = {}
    if database.name == "sqlite":
        options["connect_args"] = {"isolation_level": "IMMEDIATE"}
    engine = single(**options)
    with engine.connect() as connection:
        dbapi = connection.connection.dbapi_connection
        configured = driver_mode(dbapi)
        write(connection, notes_table, "open")  # the locks below run inside this transaction
        with Session(engine) as session:
            bind: Engine | Session = engine if kind == "engine" else session
            with advisory_lock(bind, unique_name()), advisory_lock(bind, unique_name()):
                assert driver_mode(dbapi) == configured
        connection.rollback()
        with Session(engine) as session:  # and with no transaction open
            bind = engine if kind == "engine" else session
            with advisory_lock(bind, unique_name()):
                assert driver_mode(dbapi) == configured
        assert driver_mode(dbapi) == configured
    if database.name == "sqlite":
        assert configured == "IMMEDIATE"


def test_autocommit_mode_stays_autocommit(
    single: Callable[..., Engine], database: FaultDatabase, rival: Engine
) -> None:
    if database.name == "sqlite":
        engine = single(connect_args={"isolation_level": None})
    else:
        engine = single(isolation_level="AUTOCOMMIT")
    name = unique_name()
    with Session(engine) as session:
        session.execute(text("SELECT 1"))
        with advisory_lock(session, name):
            assert busy_elsewhere(rival, name)
            session.execute(text("SELECT 1"))
            dbapi = session.connection().connection.dbapi_connection
            assert driver_autocommit(dbapi)
    assert not busy_elsewhere(rival, name)
