"""Raw blocking PostgreSQL drivers as binds: psycopg 3, psycopg_pool and psycopg2.

No SQLAlchemy in the path: ``advisory_lock(conn, ...)`` on the driver's own connection
(or pool). pg_locks, read over a separate admin connection, is the witness of what the
server holds; the driver's own transaction status is the witness of what the lock did to
the caller's transaction.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg2
import psycopg2.extensions
import pytest
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolClosed
from sqlalchemy import Engine
from sqlalchemy.engine import URL

from advisory_locks import (
    AdvisoryLock,
    AdvisoryLockError,
    LockLost,
    LockNotAcquired,
    LockTimeout,
    LockUsageError,
    UnsupportedDatabase,
    UnsupportedFeature,
    advisory_lock,
    advisory_lock_set,
    current_advisory_locks,
    declare_pooler,
    lease_lock,
)
from advisory_locks._core.executors import DBAPIExecutor
from advisory_locks._core.steps import VALUE, Statement
from advisory_locks.keys import LockName
from advisory_locks.psycopg_pool import LockConnectionTimeout, LockPoolClosed
from advisory_locks.sqlalchemy import create_lease_table
from tests.helpers import (
    EventRecorder,
    assert_refused_by_an_exhausted_pool,
    backend_alive,
    holder_pids,
    lock_rows,
    needs_raw_cursors,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)

Admin = psycopg.Connection[TupleRow]
# psycopg2's transaction status numbers are libpq's, like psycopg 3's.
IDLE = int(TransactionStatus.IDLE)
INTRANS = int(TransactionStatus.INTRANS)


def libpq_url(url: URL) -> str:
    """The test server as a libpq connection string (what raw drivers take)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class RawTarget:
    """One kind of raw bind: makes connections (or the pool) and says how they behave."""

    def __init__(self, kind: str, dsn: str) -> None:
        self.kind = kind
        self.dsn = dsn
        self._closers: list[Callable[[], None]] = []
        self.pool: ConnectionPool[Any] | None = None

    @property
    def autocommit(self) -> bool:
        return self.kind.endswith("autocommit") or self.kind == "psycopg_pool"

    def connect(self, **options: Any) -> Any:
        if self.kind.startswith("psycopg2"):
            connection: Any = psycopg2.connect(self.dsn)
            connection.autocommit = self.autocommit
        else:
            options.setdefault("autocommit", self.autocommit)
            connection = psycopg.connect(self.dsn, **options)
        self._closers.append(connection.close)
        return connection

    def bind(self) -> Any:
        """What the tests lock on: a fresh connection, or the pool."""
        if self.kind != "psycopg_pool":
            return self.connect()
        if self.pool is None:
            self.pool = ConnectionPool(self.dsn, min_size=1, max_size=4, open=True)
            self._closers.append(self.pool.close)
        return self.pool

    def status(self, connection: Any) -> int:
        if isinstance(connection, psycopg2.extensions.connection):
            return int(connection.get_transaction_status())
        return int(connection.pgconn.transaction_status)

    def close(self) -> None:
        for close in reversed(self._closers):
            close()


RAW_KINDS = ["psycopg", "psycopg.autocommit", "psycopg2", "psycopg2.autocommit", "psycopg_pool"]
CONNECTION_KINDS = [kind for kind in RAW_KINDS if kind != "psycopg_pool"]


@pytest.fixture(params=RAW_KINDS)
def target(request: pytest.FixtureRequest, postgres_url: URL) -> Iterator[RawTarget]:
    target = RawTarget(request.param, libpq_url(postgres_url))
    yield target
    target.close()


@pytest.fixture(params=CONNECTION_KINDS)
def connection_target(request: pytest.FixtureRequest, postgres_url: URL) -> Iterator[RawTarget]:
    target = RawTarget(request.param, libpq_url(postgres_url))
    yield target
    target.close()


@pytest.fixture
def dsn(postgres_url: URL) -> str:
    return libpq_url(postgres_url)


def is_free(dsn: str, name: LockName) -> bool:
    """Whether another connection can take ``name`` at once (it gives it back)."""
    with psycopg.connect(dsn, autocommit=True) as other:
        lock = advisory_lock(other, name, timeout=0)
        if not lock.acquire():
            return False
        lock.release()
        return True


def held(lock: Any) -> bool:
    """``lock.held`` read anew (mypy keeps a property narrowed by an earlier assert)."""
    return bool(lock.held)


def open_transaction(target: RawTarget, connection: Any) -> Any:
    """A context in which ``connection`` is inside a transaction the caller owns."""
    if isinstance(connection, psycopg2.extensions.connection):
        # psycopg2: `with conn:` commits at the end; the first statement begins it.
        connection.autocommit = False
        return connection
    return connection.transaction()


# -- every bind, every mode ------------------------------------------------------------------

MODES = [
    pytest.param({"timeout": None}, id="wait"),
    pytest.param({"timeout": 0}, id="try"),
    pytest.param({"timeout": 2.5}, id="timeout"),
    pytest.param({"shared": True}, id="shared"),
    pytest.param({"shared": True, "timeout": 0}, id="shared-try"),
    pytest.param({"shared": True, "timeout": 2.5}, id="shared-timeout"),
]


@pytest.mark.parametrize("options", MODES)
def test_a_session_lock_is_held_by_the_server_in_its_block_and_released_after(
    target: RawTarget, pg_admin: Admin, options: dict[str, Any]
) -> None:
    name = unique_name("raw-session")
    bind = target.bind()
    with advisory_lock(bind, name, **options) as lock:
        assert isinstance(lock, AdvisoryLock)
        assert lock.held
        rows = [row for row in lock_rows(pg_admin, name) if row.granted]
        assert len(rows) == 1
        assert rows[0].mode == ("ShareLock" if options.get("shared") else "ExclusiveLock")
        assert current_advisory_locks(bind) == [name]
    assert not held(lock)
    assert holder_pids(pg_admin, name) == []
    assert current_advisory_locks(bind) == []


@pytest.mark.parametrize("options", MODES)
def test_a_transaction_lock_lives_in_the_drivers_transaction(
    connection_target: RawTarget, pg_admin: Admin, options: dict[str, Any]
) -> None:
    name = unique_name("raw-xact")
    connection = connection_target.connect()
    with open_transaction(connection_target, connection):
        with advisory_lock(connection, name, transaction=True, **options) as lock:
            assert lock.held
            assert len(holder_pids(pg_admin, name)) == 1
        # Leaving the block does not release a transaction lock: its transaction does.
        assert len(holder_pids(pg_admin, name)) == 1
        assert current_advisory_locks(connection) == [name]
    assert connection_target.status(connection) == IDLE
    assert holder_pids(pg_admin, name) == []
    assert current_advisory_locks(connection) == []


def test_a_transaction_lock_on_a_pool_is_refused_before_checking_out(dsn: str) -> None:
    with ConnectionPool(dsn, min_size=0, max_size=1, open=True) as pool:
        with pytest.raises(UnsupportedFeature, match="a pool has none"):
            advisory_lock(pool, unique_name(), transaction=True)
        assert pool.get_stats().get("connections_num", 0) == 0


@pytest.mark.parametrize("kind", ["psycopg.autocommit", "psycopg2.autocommit"])
def test_a_transaction_lock_outside_a_transaction_in_autocommit_is_refused(
    dsn: str, pg_admin: Admin, kind: str
) -> None:
    target = RawTarget(kind, dsn)
    try:
        connection = target.connect()
        name = unique_name("raw-xact-refused")
        with (
            pytest.raises(UnsupportedFeature, match="needs a transaction"),
            advisory_lock(connection, name, transaction=True),
        ):
            pytest.fail("the block must not run")
        assert holder_pids(pg_admin, name) == []
    finally:
        target.close()


# -- exclusion, timeouts, waiting -------------------------------------------------------------


def test_a_held_lock_excludes_another_connection(target: RawTarget, dsn: str) -> None:
    name = unique_name("raw-exclusion")
    with advisory_lock(target.bind(), name):
        assert not is_free(dsn, name)
        other = RawTarget(target.kind, dsn)
        try:
            assert advisory_lock(other.bind(), name, timeout=0).acquire() is False
        finally:
            other.close()
    assert is_free(dsn, name)


def test_timeout_t_gives_up_after_about_t_with_lock_timeout(target: RawTarget, dsn: str) -> None:
    name = unique_name("raw-timeout")
    with psycopg.connect(dsn, autocommit=True) as holder, advisory_lock(holder, name):
        bind = target.bind()
        started = time.monotonic()
        with pytest.raises(LockTimeout), advisory_lock(bind, name, timeout=0.4):
            pytest.fail("the block must not run")
        assert 0.35 <= time.monotonic() - started < 5
        with pytest.raises(LockNotAcquired), advisory_lock(bind, name, timeout=0):
            pytest.fail("the block must not run")


def test_a_blocked_waiter_wakes_when_the_holder_releases(target: RawTarget, dsn: str) -> None:
    name = unique_name("raw-wake")
    granted = threading.Event()
    errors: list[BaseException] = []
    bind = target.bind()

    def wait() -> None:
        try:
            with advisory_lock(bind, name, timeout=None):
                granted.set()
        except BaseException as error:  # reported below
            errors.append(error)

    with psycopg.connect(dsn, autocommit=True) as holder:
        lock = advisory_lock(holder, name)
        lock.acquire()
        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        with psycopg.connect(dsn, autocommit=True) as admin:
            wait_for(lambda: any(not r.granted for r in lock_rows(admin, name)), "queued")
        assert not granted.is_set()
        lock.release()
        assert granted.wait(10)
        thread.join(10)
    assert errors == []


# -- re-entrancy and the caller's transaction ------------------------------------------------


def test_retaking_a_name_on_one_connection_is_counted_without_sql(
    connection_target: RawTarget, pg_admin: Admin, dsn: str
) -> None:
    name = unique_name("raw-reentrant")
    connection = connection_target.connect()
    with advisory_lock(connection, name):
        with advisory_lock(connection, name, timeout=0) as inner:
            assert inner.held
        assert not is_free(dsn, name)
    assert is_free(dsn, name)
    # pg_locks would show two session holds stacked as one row; the count proves one take.
    assert holder_pids(pg_admin, name) == []


def test_a_session_lock_on_an_idle_connection_leaves_no_transaction_open(
    connection_target: RawTarget, dsn: str
) -> None:
    name = unique_name("raw-idle")
    connection = connection_target.connect()
    lock = advisory_lock(connection, name, timeout=1)
    assert lock.acquire()
    assert connection_target.status(connection) == IDLE
    assert not is_free(dsn, name)
    lock.release()
    assert connection_target.status(connection) == IDLE
    assert connection.autocommit is connection_target.autocommit
    assert is_free(dsn, name)


def test_a_session_lock_in_the_callers_transaction_survives_its_rollback(
    connection_target: RawTarget, dsn: str
) -> None:
    name = unique_name("raw-survives")
    connection = connection_target.connect()
    connection.autocommit = False
    cursor = connection.cursor()
    cursor.execute("SELECT 1")
    with advisory_lock(connection, name, timeout=2):
        assert connection_target.status(connection) == INTRANS
        connection.rollback()
        assert not is_free(dsn, name)
        cursor.execute("SELECT 1")
        connection.commit()
        assert not is_free(dsn, name)
    assert connection_target.status(connection) == IDLE
    assert is_free(dsn, name)


def test_a_timed_out_wait_inside_a_transaction_leaves_it_usable(
    connection_target: RawTarget, dsn: str
) -> None:
    name = unique_name("raw-timeout-in-transaction")
    connection = connection_target.connect()
    connection.autocommit = False
    cursor = connection.cursor()
    with psycopg.connect(dsn, autocommit=True) as holder, advisory_lock(holder, name):
        cursor.execute("SET LOCAL lock_timeout = '7s'")
        for transaction in (False, True):
            assert not advisory_lock(
                connection, name, timeout=0.2, transaction=transaction
            ).acquire()
            cursor.execute("SELECT current_setting('lock_timeout')")
            assert cursor.fetchone()[0] == "7s"
    connection.commit()


def test_a_transaction_lock_is_taken_again_in_the_next_transaction(
    connection_target: RawTarget, dsn: str
) -> None:
    # The driver cannot tell one transaction from the next: a lock recorded for the first
    # must not stand for the second (which would then run unprotected).
    name = unique_name("raw-next-transaction")
    connection = connection_target.connect()
    connection.autocommit = False
    cursor = connection.cursor()
    kept = advisory_lock(connection, name, transaction=True)
    assert kept.acquire()  # still counted by this object when the transaction ends
    for _ in range(2):
        with advisory_lock(connection, name, transaction=True, timeout=0):
            assert not is_free(dsn, name)
        connection.commit()
        assert is_free(dsn, name)
        cursor.execute("SELECT 1")  # the next transaction is open before the lock is asked
    assert not kept.held
    connection.rollback()


def test_a_transaction_lock_is_free_for_another_connection_once_committed(
    connection_target: RawTarget, dsn: str
) -> None:
    name = unique_name("raw-implicit")
    connection = connection_target.connect()
    connection.autocommit = False
    lock = advisory_lock(connection, name, transaction=True, timeout=1)
    assert lock.acquire()
    assert connection_target.status(connection) == INTRANS  # the lock began it, as DB-API does
    lock.release()
    assert not is_free(dsn, name)
    connection.commit()
    assert not lock.held
    assert is_free(dsn, name)


class RolledBack(Exception):
    """Raised to roll a savepoint back."""


def rolled_back_savepoint(target: RawTarget, connection: Any, body: Callable[[], None]) -> None:
    """Run ``body`` inside a savepoint of the open transaction, then roll the savepoint back."""
    if isinstance(connection, psycopg2.extensions.connection):
        cursor = connection.cursor()
        cursor.execute("SAVEPOINT inner_work")
        body()
        cursor.execute("ROLLBACK TO SAVEPOINT inner_work")
        return
    with contextlib.suppress(RolledBack), connection.transaction():
        body()
        raise RolledBack


def transaction_lock_events(
    recorder: EventRecorder, name: LockName
) -> list[tuple[str, str | None]]:
    """(kind, reason) of the transaction lock's events (``is_free`` reports session ones)."""
    return [
        (event.kind, event.reason) for event in recorder.about(name) if event.scope == "transaction"
    ]


def test_one_lock_object_taken_again_in_a_later_transaction_excludes_others(
    connection_target: RawTarget, dsn: str
) -> None:
    # The commit and the next transaction's first statement happen between two calls of
    # the library, which never sees the connection idle: the object's holding of the
    # first transaction must not stand for the next one.
    name = unique_name("raw-later-transaction")
    connection = connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    for _ in range(3):
        with open_transaction(connection_target, connection):
            connection.cursor().execute("SELECT 1")
            assert lock.acquire()
            assert held(lock)
            assert not is_free(dsn, name)
        assert is_free(dsn, name)


def test_one_lock_object_taken_again_after_its_savepoint_rolled_back_excludes_others(
    connection_target: RawTarget, dsn: str
) -> None:
    name = unique_name("raw-savepoint-again")
    connection = connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    with open_transaction(connection_target, connection):
        connection.cursor().execute("SELECT 1")
        rolled_back_savepoint(connection_target, connection, lambda: lock.acquire() or None)
        assert is_free(dsn, name)  # the rollback to the savepoint released it
        assert lock.acquire()
        assert held(lock)
        assert not is_free(dsn, name)


def test_ensure_held_reports_a_transaction_lock_whose_transaction_ended_unseen(
    connection_target: RawTarget,
) -> None:
    # held cannot know, without asking the server, that the connection committed and
    # began the next transaction between two calls of the library; ensure_held() asks.
    name = unique_name("raw-ensure-later-transaction")
    connection = connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    with open_transaction(connection_target, connection):
        assert lock.acquire()
    with open_transaction(connection_target, connection):
        connection.cursor().execute("SELECT 1")
        with pytest.raises(LockLost, match="no longer holds"):
            lock.ensure_held()
        assert not held(lock)


def test_a_transaction_lock_taken_twice_in_one_transaction_is_one_holding_counted_twice(
    connection_target: RawTarget, dsn: str, lock_events: EventRecorder
) -> None:
    name = unique_name("raw-xact-twice")
    connection = connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    with open_transaction(connection_target, connection):
        connection.cursor().execute("SELECT 1")
        assert lock.acquire()
        assert lock.acquire()
        lock.release()
        assert held(lock)
        lock.release()
        assert not held(lock)
        assert not is_free(dsn, name)  # a transaction lock stays with its transaction
        assert current_advisory_locks(connection) == [name]
    assert is_free(dsn, name)
    assert current_advisory_locks(connection) == []
    assert transaction_lock_events(lock_events, name) == [
        ("acquired", None),
        ("released", "transaction_ended"),
    ]


def test_a_transaction_lock_of_an_ended_transaction_is_not_counted_into_the_next(
    connection_target: RawTarget, dsn: str, lock_events: EventRecorder
) -> None:
    # The first transaction's holding ended with it: one release in the next transaction
    # lets the object go, and listeners hear two grants and two ends.
    name = unique_name("raw-xact-not-counted-on")
    connection = connection_target.connect()
    lock = advisory_lock(connection, name, transaction=True, timeout=0)
    for _ in range(2):
        with open_transaction(connection_target, connection):
            connection.cursor().execute("SELECT 1")
            assert lock.acquire()
            assert current_advisory_locks(connection) == [name]
    with open_transaction(connection_target, connection):
        connection.cursor().execute("SELECT 1")
        assert lock.acquire()
        lock.release()
        assert not held(lock)
        assert not is_free(dsn, name)
    assert is_free(dsn, name)
    assert current_advisory_locks(connection) == []
    assert (
        transaction_lock_events(lock_events, name)
        == [
            ("acquired", None),
            ("released", "transaction_ended"),
        ]
        * 3
    )


# -- pools ------------------------------------------------------------------------------------


def test_a_pool_lends_each_lock_a_connection_and_takes_it_back_at_release(dsn: str) -> None:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        first, second = unique_name("pool-a"), unique_name("pool-b")
        with advisory_lock(pool, first), advisory_lock(pool, second):
            assert pool.get_stats()["pool_available"] == 0
            assert sorted(current_advisory_locks(pool)) == sorted([first, second])
        assert current_advisory_locks(pool) == []
        # Both came back idle and as the pool made them (not autocommit).
        with pool.connection() as connection:
            assert connection.autocommit is False
            assert connection.pgconn.transaction_status == TransactionStatus.IDLE
        assert is_free(dsn, first)
        assert is_free(dsn, second)


def test_each_pool_reports_its_own_locks_and_a_dropped_lock_leaves_no_trace(
    dsn: str, pg_admin: Admin
) -> None:
    # current_advisory_locks(pool) reads one registry of borrows kept for every pool: it
    # must name only the pool's own locks, and a lock dropped while held (never released)
    # must neither keep its connection alive nor stay in the registry, while the other
    # pool's lock, alive through the same collection, stays registered.
    from advisory_locks._bindings import _raw

    def registered(*pools: ConnectionPool) -> int:
        borrows = [ref() for ref in _raw._pool_borrows.copy().values()]
        return sum(1 for b in borrows if b is not None and b.site.pool in pools)

    mine, theirs, dropped = unique_name("pool-mine"), unique_name("pool-theirs"), unique_name()
    with (
        ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool,
        ConnectionPool(dsn, min_size=1, max_size=2, open=True) as other,
    ):
        with advisory_lock(pool, mine), advisory_lock(other, theirs):
            assert current_advisory_locks(pool) == [mine]
            assert current_advisory_locks(other) == [theirs]
            assert registered(pool) == registered(other) == 1
        assert registered(pool, other) == 0
        gc.collect()  # nothing an earlier test dropped is left to leave the count below
        entries = len(_raw._pool_borrows)

        with advisory_lock(other, theirs):
            lock = advisory_lock(pool, dropped)
            assert lock.acquire()
            assert current_advisory_locks(pool) == [dropped]
            assert len(_raw._pool_borrows) == entries + 2
            (pid,) = holder_pids(pg_admin, dropped)
            del lock
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)  # psycopg's "not closed"
                gc.collect()
            assert len(_raw._pool_borrows) == entries + 1
            assert current_advisory_locks(pool) == []
            assert current_advisory_locks(other) == [theirs]
        assert len(_raw._pool_borrows) == entries
        wait_for(lambda: not backend_alive(pg_admin, pid), "the dropped lock's session ends")
        assert is_free(dsn, dropped)


def test_a_lock_dropped_while_held_gives_its_pool_connection_back(dsn: str) -> None:
    # As an Engine's pool takes back a checkout whose lock object was collected: else a
    # pool of one would lend nothing again.
    name = unique_name("pool-dropped")
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        lock = advisory_lock(pool, name)
        assert lock.acquire()
        del lock
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        # Given back by the library's thread: the checkout waits for it.
        with pool.connection(timeout=5) as connection:
            assert connection.execute("SELECT 1").fetchone() == (1,)
        assert is_free(dsn, name)
        assert current_advisory_locks(pool) == []


def test_a_released_lock_seen_by_current_advisory_locks_gives_back_nothing_more(
    dsn: str,
) -> None:
    # current_advisory_locks(pool) holds the registry's references while it reads them:
    # a borrow released and collected meanwhile has its reference call back, and must not
    # close and return, a second time, a connection that is another caller's by then.
    from advisory_locks._bindings import _raw

    name = unique_name("pool-released-seen")
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        lock = advisory_lock(pool, name)
        assert lock.acquire()
        read_meanwhile = list(_raw._pool_borrows.values())
        lock.release()
        del lock
        with pool.connection(timeout=5) as connection:  # the next caller's, the same one
            del read_meanwhile
            gc.collect()
            given_back = threading.Event()
            _raw._abandoned.put(given_back.set)  # after whatever was queued before it
            assert given_back.wait(5)
            assert not connection.closed
            assert connection.execute("SELECT 1").fetchone() == (1,)
        assert pool.get_stats().get("returns_bad", 0) == 0
        assert is_free(dsn, name)


def test_a_lock_set_on_a_pool_uses_one_connection(dsn: str, pg_admin: Admin) -> None:
    names = [unique_name("set-a"), unique_name("set-b"), unique_name("set-c")]
    with ConnectionPool(dsn, min_size=1, max_size=3, open=True) as pool:
        with advisory_lock_set(pool, names, timeout=1):
            pids = {pid for name in names for pid in holder_pids(pg_admin, name)}
            assert len(pids) == 1
        assert all(is_free(dsn, name) for name in names)
        assert pool.get_stats()["pool_available"] >= 1


def test_a_lock_on_a_pool_connection_stays_with_that_connection(dsn: str) -> None:
    name = unique_name("pool-connection")
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        with pool.connection() as connection, advisory_lock(connection, name, timeout=1):
            assert current_advisory_locks(connection) == [name]
            assert not is_free(dsn, name)
        assert is_free(dsn, name)


@pytest.mark.parametrize("autocommit", [True, False])
@pytest.mark.parametrize("with_reset", [False, True])
def test_a_lock_left_on_a_connection_given_back_to_its_pool_is_released_and_lost(
    dsn: str, pg_admin: Admin, autocommit: bool, with_reset: bool, caplog: Any
) -> None:
    # psycopg_pool only rolls a returned connection back, which ends no session lock: the
    # next borrower of that connection would be granted the name as its own, a second
    # holder while the first holder's lock still says it is held.
    name = unique_name("pool-checkin")
    resets: list[object] = []
    reset = resets.append if with_reset else None
    kwargs: dict[str, Any] = {"autocommit": autocommit}
    with ConnectionPool(dsn, min_size=1, max_size=1, kwargs=kwargs, reset=reset) as pool:
        first_connection = pool.getconn()
        first = advisory_lock(first_connection, name, timeout=0)
        assert first.acquire()
        pid = holder_pids(pg_admin, name)
        assert len(pid) == 1
        pool.putconn(first_connection)
        if not with_reset:
            # A pool without a reset of its own returns connections in the caller's
            # thread, the guard included: unlocked before putconn() returned, not by the
            # pool's worker thread.
            assert [
                record.thread for record in caplog.records if repr(name) in record.getMessage()
            ] == [threading.get_ident()]
            assert holder_pids(pg_admin, name) == []
        with pool.connection(timeout=10) as second_connection:
            assert second_connection is first_connection  # a pool of one
            assert holder_pids(pg_admin, name) == []
            second = advisory_lock(second_connection, name, timeout=0)
            assert second.acquire()
            assert not held(first)
            with pytest.raises(LockLost):
                first.ensure_held()
            with pytest.raises(LockLost):
                first.release()
            assert second.held
            assert not is_free(dsn, name)
            second.release()
        if with_reset:
            # The pool runs reset callables in a worker, after putconn() returned.
            wait_for(lambda: len(resets) == 2, "the pool reset the connection twice")
        assert resets == ([first_connection, first_connection] if with_reset else [])
    assert is_free(dsn, name)
    assert any(
        record.levelname == "WARNING" and repr(name) in record.getMessage()
        for record in caplog.records
    )


@pytest.mark.parametrize("pool_class", ["SimpleConnectionPool", "ThreadedConnectionPool"])
@pytest.mark.parametrize("state", ["idle", "in_transaction", "failed_transaction"])
def test_a_lock_left_on_a_connection_given_back_to_a_psycopg2_pool_is_released(
    dsn: str, pg_admin: Admin, pool_class: str, state: str
) -> None:
    import psycopg2.pool

    name = unique_name("psycopg2-pool-checkin")
    pool = getattr(psycopg2.pool, pool_class)(1, 1, dsn)
    try:
        connection = pool.getconn()
        first = advisory_lock(connection, name, timeout=0)
        assert first.acquire()
        if state != "idle":
            cursor = connection.cursor()
            cursor.execute("SELECT 1")
            if state == "failed_transaction":
                with pytest.raises(psycopg2.Error):
                    cursor.execute("SELECT 1/0")
        pool.putconn(connection)
        if state == "failed_transaction":
            # The unlock failed, so the pool closed the connection: its server session
            # ends, and its locks with it, a moment later.
            wait_for(lambda: holder_pids(pg_admin, name) == [], "the closed session ended")
        assert holder_pids(pg_admin, name) == []
        with pytest.raises(LockLost):
            first.ensure_held()
        again = pool.getconn()
        # A failed transaction made the unlock fail: the pool closed that connection.
        assert (again is connection) == (state != "failed_transaction")
        second = advisory_lock(again, name, timeout=0)
        assert second.acquire()
        assert not is_free(dsn, name)
        second.release()
        pool.putconn(again)
    finally:
        pool.closeall()
    assert is_free(dsn, name)


def test_the_private_psycopg2_api_the_binding_patches_exists() -> None:
    import inspect

    import psycopg2.pool

    from advisory_locks._bindings import _psycopg2_compat

    version = ".".join(psycopg2.__version__.split(".")[:2])
    assert version in _psycopg2_compat.CHECKED_VERSIONS
    parameters = list(inspect.signature(psycopg2.pool.AbstractConnectionPool._putconn).parameters)
    assert parameters == ["self", "conn", "key", "close"]


def test_a_pool_connection_whose_unlock_fails_at_checkin_is_closed_not_reused(
    dsn: str, pg_admin: Admin
) -> None:
    name = unique_name("pool-checkin-dead")
    with ConnectionPool(dsn, min_size=1, max_size=1) as pool:
        connection = pool.getconn()
        lock = advisory_lock(connection, name, timeout=0)
        assert lock.acquire()
        backend_pid = connection.info.backend_pid
        terminate(pg_admin, backend_pid)
        pool.putconn(connection)
        with pool.connection(timeout=10) as replacement:
            assert replacement.info.backend_pid != backend_pid
            assert current_advisory_locks(replacement) == []
        with pytest.raises(LockLost):
            lock.release()
    assert is_free(dsn, name)


def test_a_lock_released_before_checkin_costs_the_pool_nothing(dsn: str, pg_admin: Admin) -> None:
    name = unique_name("pool-checkin-clean")
    with ConnectionPool(dsn, min_size=1, max_size=1) as pool:
        with pool.connection() as connection:
            backend_pid = connection.info.backend_pid
            with advisory_lock(connection, name, timeout=0):
                pass
        with pool.connection(timeout=10) as again:
            assert again.info.backend_pid == backend_pid


# -- a pool that lends no connection ---------------------------------------------------------

# How long the exhausted pools below wait for a connection before they give up.
POOL_TIMEOUT_SECONDS = 0.2


def test_an_exhausted_pool_refuses_a_lock_with_lock_connection_timeout(
    dsn: str,
) -> None:
    name = unique_name("pool-exhausted")
    with ConnectionPool(
        dsn, min_size=1, max_size=1, timeout=POOL_TIMEOUT_SECONDS, open=True
    ) as pool:
        pool.wait()
        lock = advisory_lock(pool, name)
        # Another checkout holds the pool's only connection.
        with pool.connection(), pytest.raises(LockConnectionTimeout) as raised:
            lock.acquire()
        assert_refused_by_an_exhausted_pool(raised.value, name, pool)
        assert not held(lock)
        assert current_advisory_locks(pool) == []
        # A pool with room lends the next lock a connection, the refused object included.
        with lock:
            assert not is_free(dsn, name)
        assert is_free(dsn, name)


def test_an_exhausted_pool_refusing_a_lock_set_names_every_lock_of_the_set(dsn: str) -> None:
    names = [unique_name("pool-exhausted-a"), unique_name("pool-exhausted-b")]
    with ConnectionPool(
        dsn, min_size=1, max_size=1, timeout=POOL_TIMEOUT_SECONDS, open=True
    ) as pool:
        with pool.connection(), pytest.raises(LockConnectionTimeout) as raised:
            advisory_lock_set(pool, names).acquire()
        assert raised.value.name is None
        assert f"advisory locks {names!r} needed a connection" in str(raised.value)
        with advisory_lock_set(pool, names, timeout=1):
            assert not any(is_free(dsn, name) for name in names)


def test_a_lock_refused_by_an_exhausted_pool_is_reported_not_acquired_for_an_error(
    dsn: str, lock_events: EventRecorder
) -> None:
    # Not "timeout": that reason says the lock was busy, and nobody held it.
    name = unique_name("pool-exhausted-event")
    with (
        ConnectionPool(
            dsn, min_size=1, max_size=1, timeout=POOL_TIMEOUT_SECONDS, open=True
        ) as pool,
        pool.connection(),
        pytest.raises(LockConnectionTimeout),
    ):
        advisory_lock(pool, name).acquire()
    refused = lock_events.one(name, "not_acquired")
    assert (refused.reason, refused.binding, refused.system) == ("error", "psycopg", "postgresql")
    assert isinstance(refused.error, LockConnectionTimeout)


def test_a_closed_pool_refuses_a_lock_with_lock_pool_closed(dsn: str) -> None:
    name = unique_name("pool-closed")
    pool = ConnectionPool(dsn, min_size=1, max_size=1, open=True)
    pool.close()
    lock = advisory_lock(pool, name)
    with pytest.raises(LockPoolClosed) as raised:
        lock.acquire()
    error = raised.value
    assert isinstance(error, PoolClosed)  # psycopg_pool's own class, too
    assert isinstance(error, LockUsageError)
    assert type(error.__cause__) is PoolClosed
    assert error.name == name
    assert f"advisory lock {name!r} needs a connection" in str(error)
    assert f"the pool {pool.name!r} is already closed" in str(error)
    assert "while it is open" in str(error)
    assert error.diag.sqlstate is None  # a psycopg error whose psycopg attributes work
    assert not held(lock)
    assert current_advisory_locks(pool) == []
    assert is_free(dsn, name)


# -- prepared statements -----------------------------------------------------------------------


@pytest.mark.parametrize("autocommit", [True, False])
@pytest.mark.parametrize(
    "options",
    [
        {"timeout": None},
        {"timeout": 0},
        {"timeout": 1.5},
        {"shared": True, "timeout": 1.5},
        {"transaction": True},
        {"transaction": True, "timeout": 1.5},
        {"transaction": True, "timeout": 0},
    ],
)
def test_every_mode_works_with_prepare_threshold_zero(
    dsn: str, autocommit: bool, options: dict[str, Any]
) -> None:
    # Everything is prepared then, except what must not be (scripts).
    name = unique_name("prepared")
    with psycopg.connect(dsn, autocommit=autocommit, prepare_threshold=0) as connection:
        for _ in range(3):
            if options.get("transaction") and autocommit:
                with connection.transaction(), advisory_lock(connection, name, **options):
                    assert not is_free(dsn, name)
            else:
                with advisory_lock(connection, name, **options):
                    assert not is_free(dsn, name)
                connection.commit()
            assert is_free(dsn, name)


# -- lost connections --------------------------------------------------------------------------


def terminate(admin: Admin, pid: int) -> None:
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    wait_for(lambda: not backend_alive(admin, pid), "the backend is gone")


def test_a_terminated_backend_makes_release_and_ensure_held_report_lock_lost(
    target: RawTarget, pg_admin: Admin
) -> None:
    name = unique_name("raw-terminated")
    bind = target.bind()
    for check in ("release", "ensure_held"):
        lock = advisory_lock(bind, name, timeout=1)
        assert lock.acquire()
        terminate(pg_admin, holder_pids(pg_admin, name)[0])
        with pytest.raises(LockLost):
            lock.release() if check == "release" else lock.ensure_held()
        assert not lock.held
        if target.kind != "psycopg_pool":
            bind = target.bind()
    if target.pool is not None:
        # The pool replaced the connection it lost and locks go on working.
        with advisory_lock(target.pool, name, timeout=1) as lock:
            assert lock.held


def test_acquire_on_a_dead_connection_raises_a_typed_error(
    connection_target: RawTarget, pg_admin: Admin
) -> None:
    connection = connection_target.connect()
    with advisory_lock(connection, unique_name("raw-pid"), timeout=0):
        pass  # connects the state and learns the pid
    pid = (
        connection.get_backend_pid()
        if isinstance(connection, psycopg2.extensions.connection)
        else connection.info.backend_pid
    )
    terminate(pg_admin, pid)
    with pytest.raises(AdvisoryLockError, match=r"gone|closed") as raised:
        advisory_lock(connection, unique_name("raw-dead"), timeout=1).acquire()
    assert isinstance(raised.value.__cause__, (psycopg.Error, psycopg2.Error)) or (
        "closed" in str(raised.value)
    )


def test_a_statement_on_a_closed_psycopg2_connection_fails_saying_the_connection_is_closed(
    dsn: str,
) -> None:
    # psycopg2 closes a connection's cursors with it; the executor's reused cursor would
    # then fail with "cursor already closed", which says nothing of the connection. The
    # executor asks a psycopg2 cursor whether it is closed and makes a new one, whose
    # error names the connection (the other drivers' cursors are never asked).
    connection = psycopg2.connect(dsn)
    executor = DBAPIExecutor(connection)
    assert executor.execute(Statement(VALUE, "SELECT 1")) == 1
    connection.close()
    with pytest.raises(psycopg2.InterfaceError, match="connection already closed"):
        executor.execute(Statement(VALUE, "SELECT 1"))


def test_a_closed_connection_reports_its_locks_lost(connection_target: RawTarget) -> None:
    connection = connection_target.connect()
    lock = advisory_lock(connection, unique_name("raw-closed"), timeout=0)
    assert lock.acquire()
    connection.close()
    assert not lock.held
    with pytest.raises(LockLost):
        lock.release()


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_dropped_connection_is_collected_and_its_session_ends(
    dsn: str, pg_admin: Admin, driver: str
) -> None:
    # The library keeps nothing that would keep a connection alive: dropped without
    # close() (with the lock object that still holds on it), the garbage collector
    # closes it, and the server ends the session and its locks, as without the library.
    # (psycopg 3 keeps the library's state on the connection; psycopg2's connections
    # have no attributes of their own, so it lives in a weak mapping there.)
    name = unique_name("raw-dropped")
    connection: Any = psycopg.connect(dsn) if driver == "psycopg" else psycopg2.connect(dsn)
    lock = advisory_lock(connection, name)
    assert lock.acquire()
    lock.ensure_held()
    pid = connection.info.backend_pid
    del connection, lock
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # psycopg's "not closed" warning
        gc.collect()
    wait_for(lambda: not backend_alive(pg_admin, pid), "the dropped connection's session ends")
    assert is_free(dsn, name)


# -- poolers ------------------------------------------------------------------------------------


def test_a_connection_declared_behind_a_transaction_pooler_refuses_session_locks(
    dsn: str,
) -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        declare_pooler(connection, "transaction")
        with pytest.raises(UnsupportedFeature, match="transaction pooler"):
            advisory_lock(connection, unique_name()).acquire()
        with (
            connection.transaction(),
            advisory_lock(connection, unique_name(), transaction=True) as lock,
        ):
            assert lock.held


def test_a_pool_declaration_covers_its_connections(dsn: str) -> None:
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        declare_pooler(pool, "transaction")
        with pytest.raises(UnsupportedFeature, match="transaction pooler"):
            advisory_lock(pool, unique_name()).acquire()
        with pool.connection() as connection, pytest.raises(UnsupportedFeature):
            advisory_lock(connection, unique_name()).acquire()


def test_declaring_an_unknown_pooler_mode_is_a_value_error(dsn: str) -> None:
    with psycopg.connect(dsn) as connection, pytest.raises(ValueError, match="pooler"):
        declare_pooler(connection, "pgbouncer")


def test_a_psycopg_connection_with_dict_rows_locks_like_any_other(
    dsn: str, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    # The application's default row type must not reach the library's own statements.
    from psycopg.rows import dict_row

    name = unique_name()
    with (
        psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn,
        advisory_lock(conn, name),
    ):
        assert holder_pids(pg_admin, name) == [conn.info.backend_pid]
    assert holder_pids(pg_admin, name) == []


def test_a_psycopg2_connection_with_real_dict_cursors_locks_like_any_other(
    dsn: str, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    import psycopg2.extras

    name = unique_name()
    conn = psycopg2.connect(dsn, cursor_factory=psycopg2.extras.RealDictCursor)
    conn.autocommit = True
    try:
        with advisory_lock(conn, name):
            assert holder_pids(pg_admin, name) == [conn.info.backend_pid]
        assert holder_pids(pg_admin, name) == []
    finally:
        conn.close()


def test_a_psycopg2_asynchronous_connection_is_refused_before_anything_is_sent(
    dsn: str, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    # Its execute() returns before the server answers: a lock would read no answer (it
    # failed with a bare IndexError before this refusal).
    import select

    import psycopg2.extensions

    def wait(connection: Any) -> None:
        while (state := connection.poll()) != psycopg2.extensions.POLL_OK:
            if state == psycopg2.extensions.POLL_WRITE:
                select.select([], [connection.fileno()], [], 10)
            else:
                select.select([connection.fileno()], [], [], 10)

    name = unique_name()
    # A lease's own connections (connect=) are refused the same way.
    with psycopg2.connect(dsn) as blocking:
        lease = lease_lock(blocking, name, connect=lambda: psycopg2.connect(dsn, async_=True))
        with pytest.raises(UnsupportedDatabase, match="asynchronous connections"):
            lease.acquire()
    conn = psycopg2.connect(dsn, async_=True)
    try:
        wait(conn)
        for timeout in (0, None, 5.0):
            with pytest.raises(UnsupportedDatabase, match="asynchronous connections"):
                advisory_lock(conn, name, timeout=timeout).acquire()
        with pytest.raises(UnsupportedDatabase, match="asynchronous connections"):
            lease_lock(conn, name, connect=lambda: psycopg2.connect(dsn))
        assert holder_pids(pg_admin, name) == []
        # Nothing was sent: the connection is ready for the application's next query.
        cursor = conn.cursor()
        cursor.execute("SELECT 42")
        wait(conn)
        assert cursor.fetchone() == (42,)
    finally:
        conn.close()


@needs_raw_cursors
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transactional"])
def test_a_psycopg_connection_with_raw_query_cursors_locks_like_any_other(
    dsn: str, pg_admin: psycopg.Connection[TupleRow], autocommit: bool
) -> None:
    # A RawCursor takes $1 placeholders: the library's %s statements failed on it with
    # the server's syntax error before its cursors stopped following cursor_factory.
    name = unique_name()
    with psycopg.connect(dsn, autocommit=autocommit, cursor_factory=psycopg.RawCursor) as conn:
        pid = conn.info.backend_pid
        for timeout in (0, None, 5.0):
            with advisory_lock(conn, name, timeout=timeout) as lock:
                lock.ensure_held()
                assert current_advisory_locks(conn) == [name]
                assert holder_pids(pg_admin, name) == [pid]
            assert holder_pids(pg_admin, name) == []
        if not autocommit:
            with conn.transaction():
                advisory_lock(conn, name, timeout=5.0, transaction=True).acquire()
                assert holder_pids(pg_admin, name) == [pid]
            assert holder_pids(pg_admin, name) == []
        # The application's own cursors are still raw-query ones.
        assert conn.execute("SELECT $1::int", [7]).fetchone() == (7,)


@needs_raw_cursors
def test_a_psycopg_pool_of_raw_query_cursor_connections_locks_like_any_other(
    dsn: str, pg_admin: psycopg.Connection[TupleRow], pg_engine: Engine
) -> None:
    create_lease_table(pg_engine)  # if it is not there yet
    name = unique_name()
    with ConnectionPool(
        dsn, min_size=1, max_size=1, kwargs={"cursor_factory": psycopg.RawCursor}, open=True
    ) as pool:
        for timeout in (0, None, 5.0):
            with advisory_lock(pool, name, timeout=timeout) as lock:
                lock.ensure_held()
                assert len(holder_pids(pg_admin, name)) == 1
            assert holder_pids(pg_admin, name) == []
        # A lease's statements run on the pool's connections too.
        with lease_lock(pool, name, ttl=30) as lease:
            lease.ensure_held()
            assert lease.token >= 1
