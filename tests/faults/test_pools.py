"""The pool disposed or recycled while a lock is held, on PostgreSQL, MariaDB and SQLite.

What holds: a connection that holds a lock stays checked out, so neither
``engine.dispose()`` nor ``pool_recycle`` can close it or hand it to someone else. The
lock stays held until its block ends; the connection is closed (not pooled) when it comes
back to a disposed pool, and no lock outlives the block on any connection. On SQLite the
"connection" is the SQLite connection whose pool entry keeps the lock files open.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from advisory_locks import advisory_lock
from tests.faults.conftest import inject
from tests.faults.servers import FaultDatabase, opened_connections
from tests.helpers import open_bind, unique_name, wait_for

pytestmark = pytest.mark.faults

BINDS = ["engine", "connection", "session"]


@pytest.mark.parametrize("kind", BINDS)
def test_lock_stays_held_by_the_same_session_through_engine_dispose(
    kind: str, make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    engine = make_engine(database.url)
    name = unique_name()
    with open_bind(kind, engine) as bind, advisory_lock(bind, name) as lock:
        holder = database.holder(name)
        assert holder is not None
        engine.dispose()
        inject("pool disposed")
        assert database.holder(name) == holder
        lock.ensure_held()
    assert database.holder(name) is None


@pytest.mark.parametrize("kind", BINDS)
def test_connection_that_held_a_lock_is_not_handed_out_again_after_dispose(
    kind: str, make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    engine = make_engine(database.url)
    opened = opened_connections(engine)
    name = unique_name()
    with open_bind(kind, engine) as bind, advisory_lock(bind, name):
        holders: list[Any] = list(opened)  # kept referenced: no new object takes their id
        engine.dispose()
        inject("pool disposed")
    # It went back to the old pool, which closes it when collected; it holds nothing.
    assert database.holder(name) is None
    with engine.connect() as connection:
        assert all(connection.connection.dbapi_connection is not old for old in holders)


def test_engine_takes_the_lock_again_on_a_new_connection_after_dispose(
    make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    engine = make_engine(database.url)
    opened = opened_connections(engine)
    name = unique_name()
    with engine.connect() as connection, advisory_lock(connection, name):
        old = connection.connection.dbapi_connection
    engine.dispose()
    inject("pool disposed")
    with engine.connect() as connection, advisory_lock(connection, name, timeout=0):
        assert connection.connection.dbapi_connection is not old
        assert database.holder(name) is not None
    assert len(opened) == 2


def test_pool_recycle_never_replaces_the_connection_holding_a_session_lock(
    make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    # pool_recycle=0: every checkout replaces the connection it would have handed out.
    engine = make_engine(database.url, pool_recycle=0)
    name = unique_name()
    with Session(engine) as session:
        with advisory_lock(session, name) as lock:
            holder = database.holder(name)
            for _ in range(3):
                session.execute(text("SELECT 1"))
                session.commit()  # gives the Session's connection back; the next is new
                inject("pool recycled")
            assert database.holder(name) == holder
            lock.ensure_held()
        assert database.holder(name) is None


def test_abandoned_lock_on_a_disposed_pool_is_freed_with_its_connection(
    make_engine: Callable[..., Engine], database: FaultDatabase
) -> None:
    engine = make_engine(database.url)
    name = unique_name()
    connection = engine.connect()
    advisory_lock(connection, name).acquire()
    engine.dispose()
    inject("pool disposed")
    # Closed without releasing: the pool guard unlocks it, or closing the connection
    # ends the server session; either way nothing is left held.
    connection.close()
    wait_for(lambda: database.holder(name) is None, "the abandoned lock is freed")
