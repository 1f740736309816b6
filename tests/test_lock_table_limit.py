"""A full lock table (SQLSTATE 53200) is a clear error that leaves every other lock intact.

PostgreSQL keeps advisory locks in its shared lock table, sized by
``max_locks_per_transaction`` x connections. Filling the shared test server's table would
make every other client of it fail, so these specs start a private cluster with a tiny
table (tests/private_postgres.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL

from advisory_locks import AdvisoryLock, AdvisoryLockError, advisory_lock
from tests.databases import POSTGRESQL, required_by
from tests.private_postgres import PrivateServerUnavailable, private_postgres

pytestmark = pytest.mark.slow

# About 10 x (20 + background workers) lock slots: full after a few hundred locks.
TINY_LOCK_TABLE = {"max_locks_per_transaction": 10, "max_connections": 20}
# Far more than TINY_LOCK_TABLE can hold, so the loop below must hit the limit.
MORE_THAN_FITS = 20_000


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[URL]:
    try:
        with private_postgres(TINY_LOCK_TABLE) as url:
            yield url
    except PrivateServerUnavailable as error:
        reason = required_by(POSTGRESQL, os.environ)
        if reason is not None:
            pytest.fail(f"{error} (PostgreSQL is required: {reason})")
        pytest.skip(str(error))


@pytest.fixture
def engine(tiny_server: URL) -> Iterator[Engine]:
    engine = create_engine(tiny_server)
    yield engine
    engine.dispose()


def _fill(engine: Engine) -> tuple[list[AdvisoryLock], AdvisoryLockError]:
    """Take locks on one connection until the server refuses one."""
    held: list[AdvisoryLock] = []
    with engine.connect() as connection:
        for number in range(MORE_THAN_FITS):
            lock = advisory_lock(connection, f"limit:{number}", timeout=5)
            try:
                lock.acquire()
            except AdvisoryLockError as error:
                for taken in reversed(held):
                    taken.release()
                return held, error
            held.append(lock)
    raise AssertionError(f"{MORE_THAN_FITS} locks fitted in a table sized for far fewer")


@pytest.fixture
def admin(tiny_server: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    # Opened before the table fills: a full lock table refuses new connections too.
    url = tiny_server
    with psycopg.connect(
        host=url.host, port=url.port, user=url.username, dbname=url.database, autocommit=True
    ) as connection:
        yield connection


def _held_on_server(admin: psycopg.Connection[TupleRow]) -> int:
    row = admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_full_lock_table_raises_an_error_naming_max_locks_per_transaction(
    engine: Engine,
) -> None:
    held, error = _fill(engine)

    assert held, "not even one lock fitted"
    assert "max_locks_per_transaction" in str(error)
    assert error.__cause__ is not None
    assert getattr(error.__cause__, "sqlstate", None) == "53200"


def test_locks_taken_before_the_table_filled_stay_held_and_release_cleanly(
    engine: Engine, admin: psycopg.Connection[TupleRow]
) -> None:
    with engine.connect() as connection:
        held = []
        for number in range(MORE_THAN_FITS):
            lock = advisory_lock(connection, f"intact:{number}", timeout=5)
            try:
                lock.acquire()
            except AdvisoryLockError:
                break
            held.append(lock)
        on_server_when_full = _held_on_server(admin)
        still_held = all(lock.held for lock in held)
        for lock in reversed(held):
            lock.release()  # LockLost here would mean the server dropped one of them

    assert on_server_when_full == len(held)
    assert still_held
    assert _held_on_server(admin) == 0


def test_the_connection_takes_locks_again_once_the_table_has_room(engine: Engine) -> None:
    _fill(engine)

    with engine.connect() as connection, advisory_lock(connection, "after-full", timeout=5) as lock:
        assert lock.held
