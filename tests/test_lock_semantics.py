"""What a lock means on the server, through each SQLAlchemy bind (sync, psycopg 3).

Every claim is checked against PostgreSQL's own view, ``pg_locks``, read from a separate
admin connection, and every competitor is a separate server connection.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from advisory_locks import (
    AdvisoryLockError,
    LockNotAcquired,
    LockTimeout,
    advisory_lock,
    current_advisory_locks,
    lock_key,
)
from advisory_locks.keys import LockName, derive_key
from advisory_locks.sqlalchemy import SyncBind
from tests.helpers import (
    BlockedWaiter,
    advisory_statements,
    holder_pids,
    lock_rows,
    open_bind,
    record_statements,
    unique_name,
    wait_for,
    waiter_pids,
)

JOIN_SECONDS = 15.0


@pytest.fixture(params=["engine", "connection", "session"])
def bind(request: pytest.FixtureRequest, pg_engine: Engine) -> Iterator[SyncBind]:
    with open_bind(request.param, pg_engine) as opened:
        yield opened


@pytest.fixture(params=["connection", "session"])
def reentrant_kind(request: pytest.FixtureRequest) -> str:
    """Binds that pin locks to one connection, where taking a held name again re-enters.

    (An Engine lends each lock its own connection, so a second lock of the same name on
    an Engine is a second, competing holder.)
    """
    return str(request.param)


@pytest.fixture
def rival(pg_engine: Engine) -> Iterator[Connection]:
    """Another server connection competing for the same names."""
    with pg_engine.connect() as connection:
        yield connection


@pytest.fixture
def waiter_engine(postgres_url: URL) -> Iterator[Engine]:
    engine = create_engine(postgres_url)
    yield engine
    engine.dispose()


# -- holding and giving back ---------------------------------------------------------------


def test_with_block_holds_the_lock_on_the_server_while_inside(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    with advisory_lock(bind, name):
        assert len(holder_pids(pg_admin, name)) == 1


def test_with_block_releases_the_lock_on_exit(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    with advisory_lock(bind, name):
        pass
    assert lock_rows(pg_admin, name) == []


def test_exception_in_the_block_releases_the_lock(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    with pytest.raises(KeyError), advisory_lock(bind, name):
        raise KeyError("application failure")
    assert lock_rows(pg_admin, name) == []


def test_acquire_and_release_pair_takes_and_gives_back_the_lock(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    lock = advisory_lock(bind, name)
    assert lock.acquire() is True
    assert len(holder_pids(pg_admin, name)) == 1
    lock.release()
    assert lock_rows(pg_admin, name) == []


def test_held_is_true_only_while_the_lock_is_held(bind: SyncBind) -> None:
    lock = advisory_lock(bind, unique_name())
    seen = [lock.held]
    with lock:
        seen.append(lock.held)
    seen.append(lock.held)
    assert seen == [False, True, False]


def test_lock_reports_its_name_and_the_key_sent_to_the_server(bind: SyncBind) -> None:
    name = unique_name()
    lock = advisory_lock(bind, name)
    assert lock.name == name
    assert lock.key == lock_key(name)


def test_releasing_a_lock_that_is_not_held_raises_advisory_lock_error(bind: SyncBind) -> None:
    lock = advisory_lock(bind, unique_name())
    with pytest.raises(AdvisoryLockError):
        lock.release()


def test_releasing_a_lock_twice_raises_advisory_lock_error(bind: SyncBind) -> None:
    lock = advisory_lock(bind, unique_name())
    lock.acquire()
    lock.release()
    with pytest.raises(AdvisoryLockError):
        lock.release()


def test_one_lock_object_held_in_one_thread_refuses_another_thread(
    pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    # A module-level lock used like threading.Lock: the second thread must not count
    # itself into the first thread's hold without a lock on its own connection.
    name = unique_name()
    lock = advisory_lock(pg_engine, name)
    outcome: list[BaseException | bool] = []

    def other_thread() -> None:
        try:
            outcome.append(lock.acquire())
        except AdvisoryLockError as error:
            outcome.append(error)

    with lock:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(JOIN_SECONDS)
        assert len(holder_pids(pg_admin, name)) == 1
    assert len(outcome) == 1
    assert isinstance(outcome[0], AdvisoryLockError)
    assert lock_rows(pg_admin, name) == []
    with lock:  # free again once its holder released it
        assert lock.held


def test_current_advisory_locks_lists_the_names_held_through_the_bind(bind: SyncBind) -> None:
    first, second = unique_name("first"), unique_name("second")
    with advisory_lock(bind, first), advisory_lock(bind, second):
        assert sorted(map(str, current_advisory_locks(bind))) == sorted([first, second])
    assert current_advisory_locks(bind) == []


# -- exclusion -----------------------------------------------------------------------------


def test_a_held_lock_is_not_granted_to_another_connection(
    bind: SyncBind, rival: Connection
) -> None:
    name = unique_name()
    with advisory_lock(bind, name):
        assert advisory_lock(rival, name, timeout=0).acquire() is False


def test_a_released_lock_is_granted_to_another_connection(
    bind: SyncBind, rival: Connection
) -> None:
    name = unique_name()
    with advisory_lock(bind, name):
        pass
    with advisory_lock(rival, name, timeout=0) as lock:
        assert lock.held


def test_with_block_raises_lock_not_acquired_when_busy_and_timeout_is_zero(
    bind: SyncBind, rival: Connection
) -> None:
    name = unique_name()
    with advisory_lock(rival, name):
        entered = False
        with pytest.raises(LockNotAcquired), advisory_lock(bind, name, timeout=0):
            entered = True
        assert not entered


def test_failed_try_leaves_the_lock_object_not_held(bind: SyncBind, rival: Connection) -> None:
    name = unique_name()
    with advisory_lock(rival, name):
        lock = advisory_lock(bind, name, timeout=0)
        lock.acquire()
        assert not lock.held
        assert current_advisory_locks(bind) == []


def test_shared_locks_admit_each_other(bind: SyncBind, rival: Connection) -> None:
    name = unique_name()
    with advisory_lock(bind, name, shared=True):
        other = advisory_lock(rival, name, shared=True, timeout=0)
        assert other.acquire() is True
        other.release()


def test_shared_lock_excludes_an_exclusive_one(bind: SyncBind, rival: Connection) -> None:
    name = unique_name()
    with advisory_lock(bind, name, shared=True):
        assert advisory_lock(rival, name, timeout=0).acquire() is False


def test_exclusive_lock_excludes_a_shared_one(bind: SyncBind, rival: Connection) -> None:
    name = unique_name()
    with advisory_lock(bind, name):
        assert advisory_lock(rival, name, shared=True, timeout=0).acquire() is False


def test_shared_lock_shows_as_share_lock_in_pg_locks(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    with advisory_lock(bind, name, shared=True):
        assert [row.mode for row in lock_rows(pg_admin, name)] == ["ShareLock"]


# -- timeouts and waiting ------------------------------------------------------------------


def test_timeout_gives_up_after_about_the_timeout(bind: SyncBind, rival: Connection) -> None:
    name, timeout = unique_name(), 0.5
    with advisory_lock(rival, name):
        started = time.monotonic()
        granted = advisory_lock(bind, name, timeout=timeout).acquire()
        elapsed = time.monotonic() - started
    assert granted is False
    assert 0.8 * timeout <= elapsed <= timeout + 2


def test_with_block_raises_lock_timeout_when_the_timeout_expires(
    bind: SyncBind, rival: Connection
) -> None:
    name = unique_name()
    with advisory_lock(rival, name), pytest.raises(LockTimeout):  # noqa: SIM117
        with advisory_lock(bind, name, timeout=0.2):
            pytest.fail("the block must not run without the lock")


def test_lock_timeout_is_a_lock_not_acquired_and_a_builtin_timeout_error() -> None:
    assert issubclass(LockTimeout, LockNotAcquired)
    assert issubclass(LockTimeout, TimeoutError)


def test_timeout_acquire_succeeds_at_once_when_the_lock_is_free(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    with advisory_lock(bind, name, timeout=5):
        assert len(holder_pids(pg_admin, name)) == 1


def test_blocked_waiter_gets_the_lock_when_the_holder_releases(
    bind: SyncBind, waiter_engine: Engine, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    waiter = BlockedWaiter(waiter_engine, name)
    holder = advisory_lock(bind, name)
    holder.acquire()
    try:
        waiter.start()
        assert waiter.waiting.wait(JOIN_SECONDS)
        wait_for(lambda: len(waiter_pids(pg_admin, name)) == 1, "the waiter queues on the server")
        assert not waiter.granted.is_set()
    finally:
        holder.release()
    waiter.finished(JOIN_SECONDS)
    assert waiter.granted.is_set()


# -- re-entrancy ---------------------------------------------------------------------------


def test_nested_block_with_the_same_name_sends_no_sql(
    reentrant_kind: str, postgres_url: URL
) -> None:
    engine = create_engine(postgres_url)
    statements = record_statements(engine)
    name = unique_name()
    try:
        with open_bind(reentrant_kind, engine) as opened, advisory_lock(opened, name):
            before = len(advisory_statements(statements))
            with advisory_lock(opened, name):
                during = len(advisory_statements(statements))
            after_inner = len(advisory_statements(statements))
        assert before >= 1, "the recorder saw the outer acquire"
        assert before == during == after_inner
    finally:
        engine.dispose()


def test_nested_lock_stays_held_until_the_outermost_block_exits(
    reentrant_kind: str, pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    with open_bind(reentrant_kind, pg_engine) as opened:
        with advisory_lock(opened, name):
            with advisory_lock(opened, name):
                assert len(lock_rows(pg_admin, name)) == 1
            assert len(holder_pids(pg_admin, name)) == 1
        assert lock_rows(pg_admin, name) == []


def test_same_name_on_two_connections_of_one_thread_is_not_reentrant(pg_engine: Engine) -> None:
    name = unique_name()
    with pg_engine.connect() as first, pg_engine.connect() as second, advisory_lock(first, name):
        assert advisory_lock(second, name, timeout=0).acquire() is False


def test_same_name_on_two_sessions_of_one_thread_is_not_reentrant(pg_engine: Engine) -> None:
    name = unique_name()
    with Session(pg_engine) as first, Session(pg_engine) as second, advisory_lock(first, name):
        assert advisory_lock(second, name, timeout=0).acquire() is False


def test_shared_and_exclusive_holds_of_one_name_are_counted_separately(
    reentrant_kind: str, pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name()
    with open_bind(reentrant_kind, pg_engine) as opened:
        with advisory_lock(opened, name, shared=True):
            with advisory_lock(opened, name):
                assert sorted(row.mode for row in lock_rows(pg_admin, name)) == [
                    "ExclusiveLock",
                    "ShareLock",
                ]
            assert [row.mode for row in lock_rows(pg_admin, name)] == ["ShareLock"]
        assert lock_rows(pg_admin, name) == []


# -- what the server sees for each kind of name --------------------------------------------


def _assert_pg_locks_row_matches(
    bind: SyncBind, name: LockName, admin: psycopg.Connection[TupleRow], objsubid: int
) -> None:
    classid, objid, expected_subid = derive_key(name).pg_locks_ids()
    assert expected_subid == objsubid
    # Fixed integer keys may be shared with other test runs on this server; never hang.
    with advisory_lock(bind, name, timeout=10):
        rows = [row for row in lock_rows(admin, name) if row.granted]
        assert [(row.classid, row.objid, row.objsubid) for row in rows] == [
            (classid, objid, objsubid)
        ]


@pytest.mark.parametrize("name", [0, -1, 2**63 - 1, -(2**63), random.randint(-(2**63), 2**63 - 1)])
def test_integer_name_is_one_bigint_key_with_objsubid_1(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow], name: int
) -> None:
    _assert_pg_locks_row_matches(bind, name, pg_admin, objsubid=1)


@pytest.mark.parametrize(
    "name", [(0, 0), (-1, -(2**31)), (2**31 - 1, 7), (random.randint(0, 2**31 - 1), -5)]
)
def test_pair_name_is_two_int4_keys_with_objsubid_2(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow], name: tuple[int, int]
) -> None:
    _assert_pg_locks_row_matches(bind, name, pg_admin, objsubid=2)


def test_string_name_is_hashed_to_one_bigint_key_with_objsubid_1(
    bind: SyncBind, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    _assert_pg_locks_row_matches(bind, unique_name(), pg_admin, objsubid=1)


def test_integer_name_and_the_same_pair_bits_are_different_locks(
    bind: SyncBind, rival: Connection
) -> None:
    pair = (random.randint(1, 2**31 - 1), random.randint(1, 2**31 - 1))
    same_bits = (pair[0] << 32) | pair[1]
    with advisory_lock(bind, pair, timeout=10):
        other = advisory_lock(rival, same_bits, timeout=0)
        assert other.acquire() is True
        other.release()
