"""Lease locks on blocking raw driver binds: psycopg's ConnectionPool and Connection and a
psycopg2 connection on PostgreSQL, a PyMySQL connection on MariaDB, a ``sqlite3``
connection on SQLite.

The same lease as through SQLAlchemy (one implementation): exclusion across processes
and bindings, a token that only grows, a frozen holder that learns of its loss within one
renewal period and whose fenced write is refused. A pool lends each statement a
connection; a single connection needs ``connect=`` and is never used by the lease.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import socket
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import ConnectionPool
from sqlalchemy.engine import make_url

from advisory_locks import (
    LeaseTableMissing,
    LockConnectionLost,
    LockLost,
    UnsupportedFeature,
    lease_lock,
)
from tests.helpers import EventRecorder
from tests.lease.conftest import SESSION_ID_SQL, LeaseDatabase, fenced_write
from tests.lease.raw_binds import PAIRS, RawBind
from tests.lease.test_lease_locks import (
    drop_missing_table_database,
    missing_table_url,
    unique,
    url_text,
)
from tests.lease.workers import raw_hold, raw_hold_until_resumed

SPAWN = multiprocessing.get_context("spawn")
START_SECONDS = 60.0

pytestmark = pytest.mark.parametrize(("lease_db", "kind"), PAIRS, indirect=["lease_db"])


@pytest.fixture
def raw(lease_db: LeaseDatabase, kind: str) -> Iterator[RawBind]:
    bind = RawBind(kind, lease_db.url).open()
    yield bind
    bind.close()


def test_a_lease_held_in_another_process_excludes_this_one_and_the_token_grows(
    raw: RawBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    report = SPAWN.Queue()
    release = SPAWN.Event()
    child = SPAWN.Process(
        target=raw_hold, args=(raw.kind, url_text(lease_db), name, report, release)
    )
    child.start()
    try:
        kind, held_token = report.get(timeout=START_SECONDS)
        assert kind == "acquired"
        assert not raw.lease(name, timeout=0).acquire()
        # A SQLAlchemy holder on the same database is the same lease.
        assert not lease_lock(lease_db.engine, name, timeout=0).acquire()
        release.set()
        assert report.get(timeout=START_SECONDS) == ("released", None)
        tokens = [held_token]
        for _ in range(3):
            with raw.lease(name, timeout=10) as lease:
                assert lease.held
                tokens.append(lease.token)
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == 4
    finally:
        release.set()
        child.join(30)
    assert child.exitcode == 0


def test_a_frozen_holder_learns_it_was_stolen_and_its_fenced_write_is_refused(
    raw: RawBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    ttl, period = 1.5, 0.4
    report = SPAWN.Queue()
    resumed = SPAWN.Event()
    child = SPAWN.Process(
        target=raw_hold_until_resumed,
        args=(raw.kind, url_text(lease_db), name, ttl, period, report, resumed),
    )
    child.start()
    try:
        kind, stale_token = report.get(timeout=START_SECONDS)
        assert kind == "acquired"
        os.kill(child.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        with raw.lease(name, ttl=30, timeout=10) as thief:
            assert thief.token == stale_token + 1
            raw.fenced_write(thief, "thief")
            os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
            resumed.set()
            kind, outcome = report.get(timeout=START_SECONDS)
        child.join(30)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
            child.kill()
    assert kind == "done"
    assert outcome["lost_after"] is not None
    assert outcome["lost_after"] <= period
    assert outcome == {
        "lost_after": outcome["lost_after"],
        "held": False,
        "ensure_held": "LockStolen",
        "fence": "LockStolen",
        "exit": "LockStolen",
    }
    prefix = os.environ.get("ADVISORY_LOCKS_PREFIX", "")
    assert lease_db.writes(prefix + name) == [(stale_token + 1, "thief", 0)]


def test_raw_and_sqlalchemy_holders_of_one_name_count_one_token(
    raw: RawBind, lease_db: LeaseDatabase
) -> None:
    name = unique()
    with raw.lease(name, timeout=0) as lease:
        raw.fenced_write(lease, "raw-holder")
    with lease_lock(lease_db.engine, name, timeout=0) as other:
        fenced_write(other, lease_db.engine, "sqlalchemy-holder")
    prefix = os.environ.get("ADVISORY_LOCKS_PREFIX", "")
    assert [token for token, _writer, _value in lease_db.writes(prefix + name)] == [
        lease.token,
        other.token,
    ]


def test_holding_a_lease_pins_no_connection_of_the_pool(raw: RawBind) -> None:
    if raw.kind != "psycopg-pool":
        # A single connection's leases run on connections from connect=, never on it.
        connection_in_use = raw.bind
        with raw.lease(unique(), ttl=3) as lease:
            cursor = connection_in_use.cursor()
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
            assert lease.held
        return
    with raw.lease(unique(), ttl=3) as lease:
        raw.use_a_pooled_connection()  # the pool has one connection, and it is free
        assert lease.held


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"ttl": 0}, ValueError),
        ({"ttl": math.nan}, ValueError),
        ({"ttl": 30, "renew_every": 30}, ValueError),
        ({"timeout": -1}, ValueError),
        ({"connect": "dsn"}, TypeError),
        ({"cancel_on_loss": True}, UnsupportedFeature),
    ],
)
def test_bad_options_are_refused_before_any_sql(
    raw: RawBind, lease_db: LeaseDatabase, options: dict[str, Any], error: type
) -> None:
    name = unique()
    with pytest.raises(error):
        raw.lease(name, **options)
    assert lease_db.row(name) is None


def test_a_single_connection_without_connect_is_refused_before_any_sql(raw: RawBind) -> None:
    connection = raw.connect()
    try:
        with pytest.raises(UnsupportedFeature, match="connect="):
            lease_lock(connection, unique())
    finally:
        connection.close()


def test_a_missing_table_is_an_error_that_says_how_to_create_it(
    raw: RawBind, lease_db: LeaseDatabase, tmp_path: Any
) -> None:
    url = missing_table_url(lease_db, tmp_path)
    if lease_db.kind == "sqlite":
        sqlite3.connect(make_url(url).database).close()  # an empty database file
    empty = RawBind(raw.kind, make_url(url)).open()
    try:
        with pytest.raises(LeaseTableMissing) as raised:
            empty.lease(unique(), timeout=0).acquire()
        assert "advisory_locks_lease" in str(raised.value)
        assert "create_lease_table(engine)" in str(raised.value)
        assert "migrate" in str(raised.value)
    finally:
        empty.close()
        drop_missing_table_database(lease_db, make_url(url))


def test_a_raw_lease_reports_its_grant_refusal_and_release_with_its_token(
    raw: RawBind, lease_db: LeaseDatabase, lock_events: EventRecorder
) -> None:
    name = unique()
    with raw.lease(name, ttl=10) as lease:
        assert not raw.lease(name, timeout=0).acquire()
    acquired, refused, released = lock_events.about(name)
    assert (acquired.kind, refused.kind, released.kind) == ("acquired", "not_acquired", "released")
    for event in (acquired, released):
        assert (event.scope, event.token, event.system) == ("lease", lease.token, lease_db.kind)
        assert event.binding == raw.kind.partition("-")[0]
    assert refused.reason == "busy"


def test_a_lease_on_a_connection_the_server_ended_is_a_typed_error_and_released_on_a_fresh_one(
    raw: RawBind, lease_db: LeaseDatabase
) -> None:
    """A pool's idle connection, or the one ``connect=`` hands over, ended by the server
    (sqlite3: closed) before a lease statement runs on it."""
    ending = [True]

    def end(connection: Any) -> None:
        if raw.kind.startswith("sqlite3"):
            connection.close()
            return
        cursor = connection.cursor()
        cursor.execute(SESSION_ID_SQL[lease_db.kind])
        (session_id,) = cursor.fetchone()
        cursor.close()
        connection.rollback()  # idle, as a pool keeps it and a new connection is
        lease_db.end_session(session_id)

    test_thread = threading.current_thread()

    def connect() -> Any:
        connection = raw.connect()
        # Not the renewer's: it connects in a thread of its own.
        if ending[0] and threading.current_thread() is test_thread:
            ending[0] = False
            end(connection)
        return connection

    def end_the_next_connection() -> None:
        if raw.kind == "psycopg-pool":
            with raw.bind.connection(timeout=10) as pooled:  # the pool's only connection
                end(pooled)
        else:
            ending[0] = True

    name = unique()
    # timeout=0: no listener, whose connection would be the first connect() returns.
    options: dict[str, Any] = {"ttl": 30, "timeout": 0}
    if raw.kind != "psycopg-pool":
        options["connect"] = connect
    lease = lease_lock(raw.bind, name, **options)
    end_the_next_connection()
    with pytest.raises(LockConnectionLost) as raised:
        lease.acquire()
    assert raised.value.name == name
    assert raised.value.__cause__ is not None
    assert not lease.held
    assert lease.acquire()  # on a fresh connection
    end_the_next_connection()
    lease.release()  # the release is sent again, on a fresh connection
    row = lease_db.row(lease.lease_name)
    assert row is not None
    assert row.holder is None
    assert not lease.lost.is_set()


def test_a_lease_released_while_no_connection_can_be_opened_is_lock_lost(
    raw: RawBind, lease_db: LeaseDatabase
) -> None:
    """A restart in progress: the connection the release meets is dead, or cannot be
    opened, and no new one can be opened either. Not the driver's error: LockLost, and
    the row stays ours until it expires."""
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        down_url = raw.url.set(host="127.0.0.1", port=closed.getsockname()[1])
    if raw.kind.startswith("sqlite3"):
        down_url = raw.url.set(database=str(Path(str(raw.url.database)).parent / "no" / "x.db"))
    down = [False]
    test_thread = threading.current_thread()

    def url() -> Any:
        # The renewer, in a thread of its own, is left alone.
        return down_url if down[0] and threading.current_thread() is test_thread else raw.url

    def connect() -> Any:
        return RawBind(raw.kind, url()).connect()

    name = unique()
    options: dict[str, Any] = {"ttl": 30, "timeout": 0}
    bind = raw.bind
    if raw.kind == "psycopg-pool":
        # What the pool opens is what conninfo says at that moment (psycopg_pool 3.3).
        bind = ConnectionPool(
            lambda: url().set(drivername="postgresql").render_as_string(hide_password=False),
            min_size=1,
            max_size=1,
            timeout=10,
            open=True,
        )
    else:
        options["connect"] = connect
    try:
        lease = lease_lock(bind, name, **options)
        assert lease.acquire()
        if raw.kind == "psycopg-pool":
            with bind.connection() as pooled:  # the pool's one connection: ended
                session_id = pooled.info.backend_pid
            lease_db.end_session(session_id)
        down[0] = True
        with pytest.raises(LockLost) as raised:
            lease.release()
        assert type(raised.value) is LockLost
        assert raised.value.name == name
        assert raised.value.__cause__ is not None
        assert lease.lost.is_set()
        row = lease_db.row(lease.lease_name)
        assert row is not None
        assert row.holder is not None
    finally:
        if bind is not raw.bind:
            bind.close()


def test_a_release_that_meets_a_fenced_transaction_past_its_lock_wait_is_lock_lost(
    raw: RawBind, lease_db: LeaseDatabase
) -> None:
    """Another connection's transaction, fenced in another thread, keeps the row locked
    (MariaDB) or the database's write lock (SQLite) for longer than the release's lock
    wait: not the driver's lock-wait error, LockLost, and the row ours until it expires."""
    if raw.kind.startswith("psycopg"):
        pytest.skip("on PostgreSQL a fence's KEY SHARE lets the release through at once")

    def connect() -> Any:
        if raw.kind.startswith("sqlite3"):
            return sqlite3.connect(str(raw.url.database), timeout=0.3)
        connection = raw.connect()
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        return connection

    lease = lease_lock(raw.bind, unique(), ttl=30, timeout=0, connect=connect)
    fenced, finish = threading.Event(), threading.Event()

    def fence() -> None:
        connection = raw.connect()
        try:
            lease.fence(connection)
            fenced.set()
            assert finish.wait(30)
        finally:
            connection.rollback()
            connection.close()

    fencer = threading.Thread(target=fence)
    try:
        assert lease.acquire()
        fencer.start()
        assert fenced.wait(30)
        with pytest.raises(LockLost) as raised:
            lease.release()
    finally:
        finish.set()
        if fencer.ident is not None:
            fencer.join(30)
    assert type(raised.value) is LockLost
    assert raised.value.name == lease.name
    assert raised.value.__cause__ is not None
    assert lease.lost.is_set()
    assert not lease.held
    row = lease_db.row(lease.lease_name)
    assert row is not None
    assert row.holder is not None
    assert row.expires_in > 20
