"""The pool disposed or recycled while a lock is held.

What holds: a connection that holds a lock stays checked out, so neither
``engine.dispose()`` nor ``pool_recycle`` can close it or hand it to someone else. The
lock stays held until its block ends; the connection is closed (not pooled) when it comes
back to a disposed pool, and no advisory lock outlives the block on any connection.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from advisory_locks import advisory_lock
from tests.faults.conftest import inject
from tests.helpers import (
    engine_backends_with_advisory_locks,
    holder_pids,
    open_bind,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.faults

Admin = psycopg.Connection[TupleRow]
BINDS = ["engine", "connection", "session"]


def named_engine(make_engine: Callable[..., Engine], **options: object) -> tuple[Engine, str]:
    application = f"advisory-locks-faults-{uuid.uuid4().hex[:12]}"
    engine = make_engine(connect_args={"application_name": application}, **options)
    return engine, application


@pytest.mark.parametrize("kind", BINDS)
def test_lock_stays_held_by_the_same_backend_through_engine_dispose(
    kind: str, make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine, _ = named_engine(make_engine)
    name = unique_name()
    with open_bind(kind, engine) as bind, advisory_lock(bind, name) as lock:
        (pid,) = holder_pids(pg_admin, name)
        engine.dispose()
        inject("pool disposed")
        assert holder_pids(pg_admin, name) == [pid]
        lock.ensure_held()
    assert holder_pids(pg_admin, name) == []


@pytest.mark.parametrize("kind", BINDS)
def test_connection_that_held_a_lock_is_not_handed_out_again_after_dispose(
    kind: str, make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine, application = named_engine(make_engine)
    name = unique_name()
    with open_bind(kind, engine) as bind, advisory_lock(bind, name):
        (pid,) = holder_pids(pg_admin, name)
        engine.dispose()
        inject("pool disposed")
    # It went back to the old pool, which closes it when collected; it holds nothing.
    assert engine_backends_with_advisory_locks(pg_admin, application) == []
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() != pid


def test_engine_takes_the_lock_again_on_a_new_connection_after_dispose(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine, _ = named_engine(make_engine)
    name = unique_name()
    with engine.connect() as connection, advisory_lock(connection, name):
        (old_pid,) = holder_pids(pg_admin, name)
    engine.dispose()
    inject("pool disposed")
    with engine.connect() as connection, advisory_lock(connection, name, timeout=0):
        assert holder_pids(pg_admin, name) not in ([], [old_pid])


def test_pool_recycle_never_replaces_the_connection_holding_a_session_lock(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    # pool_recycle=0: every checkout replaces the connection it would have handed out.
    engine, application = named_engine(make_engine, pool_recycle=0)
    name = unique_name()
    with Session(engine) as session:
        with advisory_lock(session, name) as lock:
            (pid,) = holder_pids(pg_admin, name)
            for _ in range(3):
                session.execute(text("SELECT 1"))
                session.commit()  # gives the Session's connection back; the next is new
                inject("pool recycled")
            assert holder_pids(pg_admin, name) == [pid]
            lock.ensure_held()
        assert engine_backends_with_advisory_locks(pg_admin, application) == []


def test_abandoned_lock_on_a_disposed_pool_is_freed_with_its_connection(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine, application = named_engine(make_engine)
    name = unique_name()
    connection = engine.connect()
    advisory_lock(connection, name).acquire()
    engine.dispose()
    inject("pool disposed")
    # Closed without releasing: the pool guard unlocks it, or closing the connection
    # ends the server session; either way nothing is left held.
    connection.close()
    wait_for(lambda: holder_pids(pg_admin, name) == [], "the abandoned lock is freed")
    assert engine_backends_with_advisory_locks(pg_admin, application) == []
