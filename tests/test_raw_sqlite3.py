"""``sqlite3.Connection`` as a bind: file locks, with the standard library's driver alone.

What every database promises runs in tests/contract (leg ``sqlite-sqlite3``); here is
what is particular to a raw sqlite3 connection: its transaction, ``isolation_level`` and
``autocommit`` are left alone, a closed or dropped connection frees its lock files at
once, in-memory databases are refused, and the application's row and text factories do
not matter. A second connection to the same file is the witness of what is held.
"""

from __future__ import annotations

import gc
import os
import signal
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from advisory_locks import (
    AdvisoryLock,
    LockConnectionLost,
    LockLost,
    UnsupportedFeature,
    advisory_lock,
    advisory_lock_set,
    current_advisory_locks,
)
from advisory_locks._dialects.sqlite import lock_file_path
from advisory_locks.keys import LockName, derive_key
from tests.helpers import unique_name

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def database(tmp_path: Path) -> Path:
    path = tmp_path / "app.sqlite3"
    setup = sqlite3.connect(path)
    setup.execute("CREATE TABLE items (n INTEGER)")
    setup.execute("INSERT INTO items VALUES (1)")
    setup.commit()
    setup.close()
    return path


@pytest.fixture
def connect(database: Path) -> Iterator[Any]:
    """Opens connections to ``database`` (closed at the end of the test)."""
    opened: list[sqlite3.Connection] = []

    def connect(**options: Any) -> sqlite3.Connection:
        connection = sqlite3.connect(database, **options)
        opened.append(connection)
        return connection

    yield connect
    for connection in opened:
        connection.close()


def is_free(database: Path, name: LockName, *, shared: bool = False) -> bool:
    """Whether another connection can take ``name`` at once (it gives it back)."""
    other = sqlite3.connect(database)
    try:
        lock = advisory_lock(other, name, timeout=0, shared=shared)
        if not lock.acquire():
            return False
        lock.release()
        return True
    finally:
        other.close()


def held(lock: Any) -> bool:
    return bool(lock.held)


def count(connection: sqlite3.Connection) -> int:
    return int(connection.execute("SELECT COUNT(*) FROM items").fetchone()[0])


# -- a session lock ----------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_a_lock_is_a_file_lock_held_until_the_block_ends(
    connect: Any, database: Path, shared: bool
) -> None:
    name = unique_name("raw-sqlite")
    connection = connect()
    with advisory_lock(connection, name, shared=shared, timeout=1) as lock:
        assert isinstance(lock, AdvisoryLock)
        assert lock.held
        assert lock_file_path(database, derive_key(name)).exists()
        assert not is_free(database, name)  # an exclusive lock never fits beside it
        assert is_free(database, name, shared=True) is shared
        assert current_advisory_locks(connection) == [name]
        with advisory_lock(connection, name, shared=shared, timeout=0):  # counted
            pass
        assert not is_free(database, name)
    assert not held(lock)
    assert is_free(database, name)
    assert current_advisory_locks(connection) == []


def test_a_lock_set_and_a_refused_mode(connect: Any, database: Path) -> None:
    names = [unique_name("raw-sqlite-b"), unique_name("raw-sqlite-a")]
    connection = connect()
    with advisory_lock_set(connection, names, timeout=1):
        assert not any(is_free(database, name) for name in names)
    assert all(is_free(database, name) for name in names)
    with pytest.raises(UnsupportedFeature, match="session lock"):
        advisory_lock(connection, names[0], transaction=True)


@pytest.mark.parametrize("path", [":memory:", ""], ids=["memory", "temporary"])
def test_a_database_without_a_file_is_refused_clearly(path: str) -> None:
    connection = sqlite3.connect(path)
    try:
        with pytest.raises(UnsupportedFeature, match="in-memory or temporary database"):
            advisory_lock(connection, unique_name("raw-sqlite-memory")).acquire()
        assert current_advisory_locks(connection) == []
    finally:
        connection.close()


# -- the caller's transaction ------------------------------------------------------------------

# sqlite3's transaction modes: legacy isolation levels ("" = DEFERRED, every Python's
# default; None = autocommit), and Python 3.12's PEP 249 autocommit attribute.
MODES: list[Any] = [
    pytest.param({}, id="default"),
    pytest.param({"isolation_level": "IMMEDIATE"}, id="immediate"),
    pytest.param({"isolation_level": None}, id="autocommit"),
]
if sys.version_info >= (3, 12):
    MODES.append(pytest.param({"autocommit": False}, id="pep249"))


@pytest.mark.parametrize("mode", MODES)
def test_a_lock_taken_and_released_inside_a_transaction_commits_nothing(
    connect: Any, database: Path, mode: dict[str, Any]
) -> None:
    connection = connect(**mode)
    if mode.get("isolation_level", "") is None:
        connection.execute("BEGIN")
    connection.execute("INSERT INTO items VALUES (2)")
    assert connection.in_transaction
    settings = (connection.isolation_level, getattr(connection, "autocommit", None))
    with advisory_lock(connection, unique_name("raw-sqlite-inside"), timeout=1):
        assert connection.in_transaction
    assert connection.in_transaction
    assert (connection.isolation_level, getattr(connection, "autocommit", None)) == settings
    connection.rollback()
    assert count(connect()) == 1  # the insert was never committed


@pytest.mark.parametrize("mode", MODES)
def test_a_lock_on_an_idle_connection_begins_no_transaction(
    connect: Any, mode: dict[str, Any]
) -> None:
    connection = connect(**mode)
    idle = connection.in_transaction  # PEP 249 mode keeps a transaction open throughout
    settings = (connection.isolation_level, getattr(connection, "autocommit", None))
    lock = advisory_lock(connection, unique_name("raw-sqlite-idle"), timeout=1)
    assert lock.acquire()
    assert connection.in_transaction is idle
    lock.release()
    assert connection.in_transaction is idle
    assert (connection.isolation_level, getattr(connection, "autocommit", None)) == settings


def test_a_writer_in_another_connection_is_not_blocked_by_the_lock(
    connect: Any, database: Path
) -> None:
    # The lock holds no SQLite lock on the database: only its own file.
    connection, writer = connect(), connect()
    with advisory_lock(connection, unique_name("raw-sqlite-writer"), timeout=1):
        writer.execute("INSERT INTO items VALUES (2)")
        writer.commit()
        assert count(connection) == 2


# -- closed, dropped and interrupted -----------------------------------------------------------


def test_closing_the_connection_frees_its_lock_files_at_once(connect: Any, database: Path) -> None:
    name = unique_name("raw-sqlite-closed")
    connection = connect()
    lock = advisory_lock(connection, name, timeout=0)
    assert lock.acquire()
    connection.close()
    # Nothing touched the lock object: the close itself let go of the file.
    assert is_free(database, name)
    assert not lock.held
    with pytest.raises(LockLost):
        lock.release()
    with pytest.raises(LockConnectionLost, match="closed"):
        advisory_lock(connection, unique_name("raw-sqlite-after-close")).acquire()
    assert current_advisory_locks(connection) == []


def test_a_lock_lives_with_its_connection_not_with_its_lock_object(
    connect: Any, database: Path
) -> None:
    # As on a server: a lock object dropped while held leaves the lock with the
    # connection, until the connection closes.
    name = unique_name("raw-sqlite-object-dropped")
    connection = connect()
    assert advisory_lock(connection, name, timeout=0).acquire()
    gc.collect()
    assert not is_free(database, name)
    assert current_advisory_locks(connection) == [name]
    connection.close()
    assert is_free(database, name)


def test_ensure_held_on_a_closed_connection_is_lock_lost(connect: Any) -> None:
    connection = connect()
    lock = advisory_lock(connection, unique_name("raw-sqlite-ensure"), timeout=0)
    assert lock.acquire()
    lock.ensure_held()
    connection.close()
    with pytest.raises(LockLost):
        lock.ensure_held()


def open_descriptors(path: Path) -> int:
    """How many of this process's file descriptors are open on ``path`` (Linux)."""
    count = 0
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:
            continue
        count += target == str(path)
    return count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_a_dropped_connection_is_collected_with_its_lock_files(database: Path) -> None:
    # Nothing of the library keeps a connection alive: dropped without close() along
    # with the lock object still holding, both go, and so does the file lock.
    name = unique_name("raw-sqlite-dropped")
    connection = sqlite3.connect(database)
    lock = advisory_lock(connection, name, timeout=0)
    assert lock.acquire()
    assert open_descriptors(database) == 1
    del connection, lock
    gc.collect()
    assert open_descriptors(database) == 0
    assert is_free(database, name)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_a_connection_that_held_locks_is_collected_after_their_release(database: Path) -> None:
    connection = sqlite3.connect(database)
    with advisory_lock(connection, unique_name("raw-sqlite-released"), timeout=0):
        pass
    del connection
    gc.collect()
    assert open_descriptors(database) == 0


def test_an_interrupted_wait_keeps_the_connection_and_its_other_locks(
    connect: Any, database: Path
) -> None:
    # A file lock never granted leaves nothing behind (unlike a server's abandoned wait):
    # the connection stays open and keeps what it holds.
    class Interrupted(BaseException):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    busy, kept = unique_name("raw-sqlite-busy"), unique_name("raw-sqlite-kept")
    holder, connection = connect(), connect()
    assert advisory_lock(holder, busy).acquire()  # held until its connection closes
    kept_lock = advisory_lock(connection, kept, timeout=0)
    assert kept_lock.acquire()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            advisory_lock(connection, busy, timeout=None).acquire()  # blocks in flock
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert kept_lock.held
    assert not is_free(database, kept)
    assert count(connection) == 1  # the connection is open
    holder.close()
    assert is_free(database, busy)
    kept_lock.release()


# -- how the application made its connection -------------------------------------------------


def dict_rows(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
    return {column[0]: value for column, value in zip(cursor.description, row, strict=True)}


@pytest.mark.parametrize(
    "factories",
    [
        pytest.param({"row_factory": dict_rows}, id="dict-rows"),
        pytest.param({"row_factory": sqlite3.Row}, id="sqlite3.Row"),
        pytest.param({"text_factory": bytes}, id="bytes-text"),
    ],
)
def test_row_and_text_factories_do_not_matter(
    connect: Any, database: Path, factories: dict[str, Any]
) -> None:
    name = unique_name("raw-sqlite-factories")
    connection = connect()
    for attribute, factory in factories.items():
        setattr(connection, attribute, factory)
    with advisory_lock(connection, name, timeout=1):
        assert not is_free(database, name)
        assert lock_file_path(database, derive_key(name)).exists()
    assert is_free(database, name)


def test_a_connection_made_with_a_factory_class_is_a_bind(database: Path) -> None:
    class AppConnection(sqlite3.Connection):
        pass

    name = unique_name("raw-sqlite-factory-class")
    connection = sqlite3.connect(database, factory=AppConnection)
    try:
        with advisory_lock(connection, name, timeout=1):
            assert not is_free(database, name)
    finally:
        connection.close()


def test_the_lifetime_function_is_the_only_trace_on_the_connection(connect: Any) -> None:
    connection = connect()
    with advisory_lock(connection, unique_name("raw-sqlite-trace"), timeout=1):
        pass
    assert connection.execute("SELECT advisory_locks_lifetime()").fetchone() == (None,)
    assert connection.row_factory is None
    assert connection.total_changes == 0
