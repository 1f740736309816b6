"""advisory_locks_django.advisory_lock against a real PostgreSQL, through Django's connections."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable

import psycopg
import pytest
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connection, connections, transaction
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow

from advisory_locks import AdvisoryLock, LockUsageError
from advisory_locks._core.connection import Holding
from advisory_locks_django import (
    DjangoAdvisoryLock,
    LockLost,
    LockNotAcquired,
    LockTimeout,
    UnsupportedFeature,
    advisory_lock,
    current_advisory_locks,
)
from tests.django.support import holders, in_thread, run_in_thread, server_pid
from tests.helpers import lock_rows, refuse_lock_statements_on_cursors, unique_name, wait_for

pytestmark = [pytest.mark.postgresql, pytest.mark.django_db(transaction=True)]

Admin = psycopg.Connection[TupleRow]


def test_a_session_lock_excludes_other_connections_until_the_block_ends(admin: Admin) -> None:
    name = unique_name()
    with advisory_lock(name):
        assert holders(admin, name) == [server_pid()]
        assert in_thread(lambda: advisory_lock(name, timeout=0).acquire()) is False
    assert holders(admin, name) == []


def test_lock_statements_in_autocommit_skip_the_cursor(
    admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sent through psycopg's libpq wrapper (advisory_locks._core.libpq), unprepared as
    # Django's prepare_threshold=None asks.
    refuse_lock_statements_on_cursors(monkeypatch)
    name = unique_name()
    for _ in range(2):
        with advisory_lock(name, timeout=1):
            assert holders(admin, name) == [server_pid()]
        assert holders(admin, name) == []


def test_a_session_lock_in_autocommit_opens_no_transaction(admin: Admin) -> None:
    with advisory_lock(unique_name()):
        assert connection.connection.info.transaction_status == TransactionStatus.IDLE
        assert connection.get_autocommit()


def test_nested_locks_on_one_connection_are_counted_and_unlocked_once(admin: Admin) -> None:
    name = unique_name()
    with advisory_lock(name), advisory_lock(name):
        pass
    assert holders(admin, name) == []
    # One server-side hold, so one unlock emptied it: the lock is free for others.
    assert in_thread(lambda: advisory_lock(name, timeout=0).acquire()) is True


def test_an_exception_in_the_block_releases_the_lock(admin: Admin) -> None:
    name = unique_name()
    with pytest.raises(RuntimeError), advisory_lock(name):
        raise RuntimeError("boom")
    assert holders(admin, name) == []


def test_timeout_zero_raises_lock_not_acquired_when_busy(admin: Admin) -> None:
    name = unique_name()
    with advisory_lock(name), pytest.raises(LockNotAcquired):
        in_thread(lambda: advisory_lock(name, timeout=0).__enter__())


def test_a_waiter_gives_up_after_its_timeout(admin: Admin) -> None:
    name = unique_name()
    with advisory_lock(name), pytest.raises(LockTimeout):
        in_thread(lambda: advisory_lock(name, timeout=0.2).__enter__())


def test_a_waiter_is_granted_when_the_holder_releases(admin: Admin) -> None:
    name = unique_name()
    lock = advisory_lock(name)
    lock.acquire()
    waiter = run_in_thread(lambda: advisory_lock(name, timeout=30).acquire())
    wait_for(lambda: [r for r in lock_rows(admin, name) if not r.granted] != [], "waiter queued")
    lock.release()
    assert waiter.get() is True


def test_shared_locks_admit_each_other_but_not_an_exclusive_one(admin: Admin) -> None:
    name = unique_name()
    with advisory_lock(name, shared=True):
        assert in_thread(lambda: advisory_lock(name, shared=True, timeout=0).acquire()) is True
        assert in_thread(lambda: advisory_lock(name, timeout=0).acquire()) is False


def test_bad_names_and_options_fail_before_connecting() -> None:
    connection.close()
    with pytest.raises(TypeError):
        advisory_lock(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        advisory_lock("")
    with pytest.raises(ValueError, match="timeout"):
        advisory_lock("x", timeout=-1)
    with pytest.raises(TypeError, match="shared"):
        advisory_lock("x", shared="yes")  # type: ignore[arg-type]
    assert connection.connection is None


def test_options_valid_once_do_not_vouch_for_lookalikes_of_another_type() -> None:
    # 1 == True and 0 == False: options made (and validated) once are reused, but never
    # for a value that only compares equal to theirs.
    assert advisory_lock("x", timeout=1, shared=True).timeout == 1
    with pytest.raises(TypeError, match="timeout"):
        advisory_lock("x", timeout=True, shared=True)
    with pytest.raises(TypeError, match="shared"):
        advisory_lock("x", timeout=1, shared=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="transaction"):
        advisory_lock("x", transaction=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout"):
        advisory_lock("x", timeout=[1])  # type: ignore[arg-type]
    assert advisory_lock("x", skip_if_locked=False).skip_if_locked is False
    with pytest.raises(TypeError, match="skip_if_locked"):
        advisory_lock("x", skip_if_locked=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="alias"):
        advisory_lock("x", using=["default"])  # type: ignore[arg-type]


def test_the_class_made_directly_is_the_lock_advisory_lock_returns(admin: Admin) -> None:
    # advisory_lock() builds its object without calling the class; both ways must give
    # the same lock, and it is the core's AdvisoryLock.
    name = unique_name()
    direct = DjangoAdvisoryLock(name, timeout=0, key_prefix="app")
    made = advisory_lock(name, timeout=0, key_prefix="app")
    assert isinstance(made, DjangoAdvisoryLock)
    assert isinstance(direct, AdvisoryLock)
    assert (direct.name, direct.key, direct.timeout, direct.using) == (
        made.name,
        made.key,
        made.timeout,
        made.using,
    )
    with direct:
        assert direct.held
        assert holders(admin, name, prefix="app") == [server_pid()]
        assert in_thread(made.acquire) is False
    assert not direct.held
    with pytest.raises(ValueError, match="timeout"):
        DjangoAdvisoryLock("x", timeout=-1)
    with pytest.raises(TypeError, match="alias"):
        DjangoAdvisoryLock("x", using=1)  # type: ignore[arg-type]


def test_a_lock_named_by_a_function_only_decorates(admin: Admin) -> None:
    lock = DjangoAdvisoryLock(lambda account: f"account-{account}")
    assert "using='default'" in repr(lock)
    assert not lock.held
    for use in (lock.acquire, lock.release, lock.ensure_held, lambda: lock.name):
        with pytest.raises(TypeError, match="decorator"):
            use()
    with pytest.raises(TypeError, match="decorator"), lock:
        pass
    name = unique_name()

    @advisory_lock(lambda account: f"{name}-{account}")
    def job(account: int) -> list[int]:
        return holders(admin, f"{name}-{account}")

    assert job(7) == [server_pid()]


def test_current_advisory_locks_lists_the_names_this_connection_holds() -> None:
    name = unique_name()
    with advisory_lock(name):
        assert name in current_advisory_locks()
    assert name not in current_advisory_locks()


# -- transaction=True and atomic() ----------------------------------------------------------


def test_a_transaction_lock_opens_atomic_when_none_is_open(admin: Admin) -> None:
    name = unique_name()
    with advisory_lock(name, transaction=True):
        assert connection.in_atomic_block
        assert holders(admin, name) == [server_pid()]
    assert not connection.in_atomic_block
    assert holders(admin, name) == []


def test_a_transaction_lock_that_opened_atomic_is_released_only_in_its_thread(
    admin: Admin,
) -> None:
    # The atomic() block is the acquiring thread's: released from another thread, its
    # __exit__ would run on that thread's connection, and this one would stay in a
    # transaction that keeps the lock while the object said it had let go.
    name = unique_name()
    lock = advisory_lock(name, transaction=True)
    assert lock.acquire()
    try:
        with pytest.raises(LockUsageError, match="release it in that thread"):
            in_thread(lock.release)
        assert lock.held
        assert connection.in_atomic_block
        assert holders(admin, name) == [server_pid()]
    finally:
        lock.release()
    assert not connection.in_atomic_block
    assert holders(admin, name) == []


def test_a_reentered_transaction_lock_refuses_another_threads_release_of_an_inner_holder(
    admin: Admin,
) -> None:
    # The inner holder opened no block (it runs inside the outer's), but releasing it
    # from another thread would leave the owner's inner exit to close the outer's block.
    name = unique_name()
    lock = advisory_lock(name, transaction=True)
    with lock:
        with lock:
            with pytest.raises(LockUsageError, match="release it in that thread"):
                in_thread(lock.release)
            assert holders(admin, name) == [server_pid()]
        assert lock.held
        assert connection.in_atomic_block
        assert holders(admin, name) == [server_pid()]
    assert not connection.in_atomic_block
    assert holders(admin, name) == []


def test_a_refused_transaction_lock_leaves_no_block_for_another_threads_release(
    admin: Admin,
) -> None:
    # The block a refused acquire opened is closed at once: the object, used next by
    # another thread inside that thread's own atomic(), is released there as usual.
    name = unique_name()
    lock = advisory_lock(name, transaction=True, timeout=0)
    holder = advisory_lock(name)
    with holder:
        assert in_thread(lock.acquire) is False

    def take_and_release_inside_atomic() -> tuple[list[int], int]:
        with transaction.atomic():
            assert lock.acquire()
            pids = holders(admin, name)
            lock.release()  # a transaction lock: held until the atomic() block ends
        return pids, server_pid()

    pids, pid = in_thread(take_and_release_inside_atomic)
    assert pids == [pid]
    assert holders(admin, name) == []
    assert not connection.in_atomic_block


def test_a_transaction_lock_lives_until_the_outer_atomic_commits(admin: Admin) -> None:
    name = unique_name()
    with transaction.atomic():
        with transaction.atomic(), advisory_lock(name, transaction=True):
            pass
        # Out of the lock's block and its savepoint: the transaction still holds it.
        assert holders(admin, name) == [server_pid()]
        assert name in current_advisory_locks()
    assert holders(admin, name) == []
    assert name not in current_advisory_locks()


def test_a_transaction_lock_lives_until_the_outer_atomic_rolls_back(admin: Admin) -> None:
    name = unique_name()
    with transaction.atomic():
        with advisory_lock(name, transaction=True):
            pass
        assert holders(admin, name) == [server_pid()]
        transaction.set_rollback(True)
    assert holders(admin, name) == []


def test_a_transaction_lock_leaves_nothing_behind_once_its_transaction_ends() -> None:
    # Each transaction lock watches its transaction until it ends: kept any longer, a
    # connection's thousandth lock would carry the 999 before it, and look through them.
    name = unique_name()
    for rollback in (False, True, False, True):
        with transaction.atomic():
            with advisory_lock(name, transaction=True):
                pass
            transaction.set_rollback(rollback)
    gc.collect()
    left = [held for held in gc.get_objects() if isinstance(held, Holding)]
    assert [held for held in left if held.key.name == name] == []


def test_a_savepoint_rollback_releases_a_transaction_lock_taken_inside_it(admin: Admin) -> None:
    name = unique_name()
    with transaction.atomic():
        with transaction.atomic():
            with advisory_lock(name, transaction=True):
                pass
            transaction.set_rollback(True)  # rolls back to the savepoint
        assert holders(admin, name) == []
        assert name not in current_advisory_locks()
        # The registry knows it is gone, so taking it again really asks the server.
        with advisory_lock(name, transaction=True):
            assert holders(admin, name) == [server_pid()]


def test_a_savepoint_rollback_keeps_a_transaction_lock_taken_before_it(admin: Admin) -> None:
    name = unique_name()
    with transaction.atomic(), advisory_lock(name, transaction=True):
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            1 / 0  # noqa: B018
        assert holders(admin, name) == [server_pid()]
        assert name in current_advisory_locks()


def test_a_manual_savepoint_rollback_releases_a_transaction_lock_taken_after_it(
    admin: Admin,
) -> None:
    # transaction.savepoint() ids are not in Django's savepoint_ids, so its on_commit
    # bookkeeping keeps the lock's callback through savepoint_rollback(): the library
    # must learn of that rollback itself, or the next acquire is "re-entered" with no
    # SQL while another connection takes the lock.
    name = unique_name()
    with transaction.atomic():
        sid = transaction.savepoint()
        first = advisory_lock(name, transaction=True)
        assert first.acquire()
        transaction.savepoint_rollback(sid)
        assert holders(admin, name) == []
        assert name not in current_advisory_locks()
        again = advisory_lock(name, transaction=True, timeout=0)
        assert again.acquire()
        assert holders(admin, name) == [server_pid()]
        assert in_thread(lambda: advisory_lock(name, timeout=0).acquire()) is False
    assert holders(admin, name) == []


def test_a_manual_savepoint_rollback_reports_the_lock_taken_after_it_lost(admin: Admin) -> None:
    name = unique_name()
    with transaction.atomic():
        sid = transaction.savepoint()
        lock = advisory_lock(name, transaction=True)
        assert lock.acquire()
        transaction.savepoint_rollback(sid)
        assert not lock.held
        with pytest.raises(LockLost):
            lock.ensure_held()


def test_a_manual_savepoint_rollback_keeps_a_transaction_lock_taken_before_it(
    admin: Admin,
) -> None:
    name = unique_name()
    with transaction.atomic():
        lock = advisory_lock(name, transaction=True)
        assert lock.acquire()
        sid = transaction.savepoint()
        assert lock.acquire()  # re-entered inside the savepoint: no SQL, nothing to undo
        transaction.savepoint_rollback(sid)
        assert holders(admin, name) == [server_pid()]
        assert name in current_advisory_locks()
        assert lock.held
        lock.ensure_held()
    assert holders(admin, name) == []


def test_a_rollback_to_an_outer_savepoint_releases_a_lock_from_a_savepoint_released_in_it(
    admin: Admin,
) -> None:
    name = unique_name()
    with transaction.atomic():
        outer = transaction.savepoint()
        inner = transaction.savepoint()
        assert advisory_lock(name, transaction=True).acquire()
        transaction.savepoint_commit(inner)  # the lock now belongs to the outer savepoint
        assert holders(admin, name) == [server_pid()]
        transaction.savepoint_rollback(outer)
        assert holders(admin, name) == []
        assert name not in current_advisory_locks()
        assert advisory_lock(name, transaction=True, timeout=0).acquire()
        assert holders(admin, name) == [server_pid()]


def test_a_manual_savepoint_inside_a_nested_atomic_releases_a_lock_at_its_rollback(
    admin: Admin,
) -> None:
    name = unique_name()
    with transaction.atomic(), transaction.atomic():
        sid = transaction.savepoint()
        assert advisory_lock(name, transaction=True).acquire()
        transaction.savepoint_rollback(sid)
        assert holders(admin, name) == []
        assert advisory_lock(name, transaction=True, timeout=0).acquire()
        assert holders(admin, name) == [server_pid()]
        assert in_thread(lambda: advisory_lock(name, timeout=0).acquire()) is False


def test_a_failed_acquire_inside_atomic_leaves_the_transaction_usable(admin: Admin) -> None:
    from tests.django_app.models import Product

    name = unique_name()
    with advisory_lock(name):
        held_elsewhere = in_thread(
            lambda: _try_in_atomic(name, timeout=0.2)  # waits, times out, then writes
        )
    assert held_elsewhere == "timed out, then committed"
    assert Product.objects.filter(sku=name[-30:]).exists()


def _try_in_atomic(name: str, *, timeout: float) -> str:
    from tests.django_app.models import Product

    with transaction.atomic():
        try:
            with advisory_lock(name, timeout=timeout, transaction=True):
                pass
        except LockTimeout:
            Product.objects.create(sku=name[-30:], stock=1)
            return "timed out, then committed"
    return "acquired"


def test_a_session_lock_survives_an_inner_atomic_rollback(admin: Admin) -> None:
    name = unique_name()
    with transaction.atomic(), advisory_lock(name):
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            1 / 0  # noqa: B018
        assert holders(admin, name) == [server_pid()]
    assert holders(admin, name) == []


def test_a_session_lock_taken_in_atomic_outlives_its_rollback(admin: Admin) -> None:
    name = unique_name()
    lock = advisory_lock(name)
    with transaction.atomic():
        lock.acquire()
        transaction.set_rollback(True)
    assert holders(admin, name) == [server_pid()]
    lock.release()
    assert holders(admin, name) == []


def test_transaction_locks_refuse_manual_transaction_management() -> None:
    transaction.set_autocommit(False)
    try:
        with pytest.raises(UnsupportedFeature, match="atomic"):
            advisory_lock(unique_name(), transaction=True).acquire()
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)


# -- connections that Django closes or replaces ---------------------------------------------


def test_closing_the_connection_in_the_block_reports_the_lock_lost(admin: Admin) -> None:
    name = unique_name()
    with pytest.raises(LockLost), advisory_lock(name):
        connection.close()
    # The server ends the closed session's backend (and its locks) asynchronously.
    wait_for(lambda: holders(admin, name) == [], "the closed session's lock is gone")


def test_a_new_connection_starts_with_no_recorded_locks(admin: Admin) -> None:
    name = unique_name()
    lock = advisory_lock(name)
    lock.acquire()
    connection.close()
    connection.ensure_connection()
    assert current_advisory_locks() == []
    with advisory_lock(name):  # asks the server again rather than trusting a stale count
        assert holders(admin, name) == [server_pid()]
    with pytest.raises(LockLost):
        lock.release()


def test_each_thread_locks_on_its_own_connection(admin: Admin) -> None:
    name = unique_name()
    barrier = threading.Barrier(2)

    def hold_then_report() -> list[str]:
        with advisory_lock(name):
            barrier.wait()
            barrier.wait()
        return []

    holder = run_in_thread(hold_then_report)
    barrier.wait()
    try:
        assert name not in current_advisory_locks()
        assert advisory_lock(name, timeout=0).acquire() is False
    finally:
        barrier.wait()
    holder.get()


def test_releasing_another_threads_lock_by_name_says_it_is_held_elsewhere(admin: Admin) -> None:
    name = unique_name()
    with advisory_lock(name), pytest.raises(LockUsageError, match="another lock object"):
        in_thread(lambda: advisory_lock(name).release())


def test_a_session_lock_refuses_a_release_from_another_thread_before_any_sql(
    admin: Admin,
) -> None:
    # A Django connection belongs to its thread: released from another thread, the unlock
    # would be sent on the holder's connection, perhaps while the holder runs a query on it.
    name = unique_name()
    lock = advisory_lock(name)
    assert lock.acquire()
    try:
        with pytest.raises(LockUsageError, match="release it in that thread"):
            in_thread(lock.release)
        assert lock.held
        assert holders(admin, name) == [server_pid()]
    finally:
        lock.release()  # the holder still can
    assert holders(admin, name) == []


def test_a_transaction_lock_inside_atomic_refuses_a_release_from_another_thread(
    admin: Admin,
) -> None:
    # It opened no atomic() block of its own, so the block check does not apply: the
    # holder's count must stay whole all the same.
    name = unique_name()
    lock = advisory_lock(name, transaction=True)
    with transaction.atomic():
        assert lock.acquire()
        with pytest.raises(LockUsageError, match="release it in that thread"):
            in_thread(lock.release)
        assert lock.held
        lock.release()
        assert holders(admin, name) == [server_pid()]  # until the block commits
    assert holders(admin, name) == []


def _refused_in_async_code(monkeypatch: pytest.MonkeyPatch, prepare: Callable[[], None]) -> None:
    """In async code, run ``prepare`` while DJANGO_ALLOW_ASYNC_UNSAFE is set (it opens the
    async context's connection), then check that a sync acquire is refused like a query."""
    name = unique_name()

    async def take() -> None:
        wrapper = connections["default"]
        monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        prepare()
        monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE")
        try:
            with pytest.raises(SynchronousOnlyOperation):
                advisory_lock(name).acquire()
        finally:
            monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
            assert name not in current_advisory_locks()
            wrapper.close()
            monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE")

    asyncio.run(take())


def test_a_sync_acquire_from_async_code_is_refused_like_a_query(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Even where the async context has its connection open already (opened while
    # DJANGO_ALLOW_ASYNC_UNSAFE was set): blocking the event loop in a lock wait is what
    # Django's SynchronousOnlyOperation is there to stop.
    _refused_in_async_code(monkeypatch, lambda: connections["default"].ensure_connection())


def test_lock_statements_are_bound_on_the_server_and_not_prepared(admin: Admin) -> None:
    # Django's psycopg cursors render parameters into the text on the client; the lock's
    # statements send them apart (less client work), still unprepared as Django configures.
    name = unique_name()
    with advisory_lock(name, timeout=5):
        row = admin.execute(
            "SELECT query FROM pg_stat_activity WHERE pid = %s", (server_pid(),)
        ).fetchone()
        assert row is not None
        assert "pg_advisory_lock($1)" in row[0]
        prepared = connection.connection.execute("SELECT count(*) FROM pg_prepared_statements")
        assert prepared.fetchone() == (0,)


# A connection's later locks take a shorter path than its first (its borrow is kept);
# what the first lock's checks refuse, every later lock's checks refuse too.


def test_a_pooler_declared_after_a_connections_first_lock_is_refused_on_the_next() -> None:
    from django.test import override_settings

    with advisory_lock(unique_name()):
        pass
    with (
        override_settings(ADVISORY_LOCKS={"POOLERS": {"default": "pgbouncer-transaction"}}),
        pytest.raises(UnsupportedFeature, match="transaction=True"),
    ):
        advisory_lock(unique_name()).acquire()
    assert current_advisory_locks() == []


def test_a_sync_acquire_from_async_code_is_refused_after_the_connections_first_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def first_lock() -> None:
        with advisory_lock(unique_name()):  # allowed while the variable is set
            pass

    _refused_in_async_code(monkeypatch, first_lock)


def test_a_session_lock_inside_atomic_after_the_connections_first_lock_leaves_it_usable(
    admin: Admin,
) -> None:
    # Inside atomic() the lock's wait must not abort the caller's transaction, nor leave
    # its lock_timeout behind in it, although the connection's first lock (outside
    # atomic()) went the short way.
    name = unique_name()
    with advisory_lock(unique_name(), timeout=5):
        pass
    release, held = threading.Event(), threading.Event()

    def hold() -> None:
        with advisory_lock(name):
            held.set()
            release.wait(30)

    holder = run_in_thread(hold)
    assert held.wait(10)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SHOW lock_timeout")
            before = cursor.fetchone()
            assert advisory_lock(name, timeout=0.2).acquire() is False
            with advisory_lock(unique_name(), timeout=5):
                pass
            cursor.execute("SHOW lock_timeout")  # the transaction is usable, as it was
            assert cursor.fetchone() == before
    finally:
        release.set()
        holder.get()


def postpone_an_unlock(admin: Admin, name: str) -> None:
    """Take ``name`` and release it inside a transaction that failed, where no unlock can
    run: the unlock is postponed until the transaction has ended (rolled back here)."""
    from django.db import DatabaseError

    with advisory_lock(unique_name()):
        pass
    lock = advisory_lock(name)
    assert lock.acquire()
    with transaction.atomic():
        with pytest.raises(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")  # the transaction has failed: no unlock can run
        lock.release()
        assert holders(admin, name) == [server_pid()]
        transaction.set_rollback(True)


def test_an_unlock_a_failed_transaction_postponed_runs_at_the_next_lock(admin: Admin) -> None:
    name = unique_name()
    postpone_an_unlock(admin, name)
    with advisory_lock(unique_name()):  # the next lock finishes the postponed unlock
        pass
    assert holders(admin, name) == []


def test_lock_statements_in_a_psycopg_pipeline_are_refused_and_a_held_lock_stays(
    admin: Admin,
) -> None:
    # A new connection: its first lock would ask the server what it is, also refused.
    connection.close()
    connection.ensure_connection()
    driver = connection.connection
    assert isinstance(driver, psycopg.Connection)
    name = unique_name()
    with driver.pipeline(), pytest.raises(LockUsageError, match="pipeline mode"):
        advisory_lock(name, timeout=5.0).acquire()
    assert holders(admin, name) == []
    lock = advisory_lock(name)
    lock.acquire()
    with driver.pipeline():
        with pytest.raises(LockUsageError, match="pipeline mode"):
            lock.release()
        with pytest.raises(LockUsageError, match="pipeline mode"):
            advisory_lock(unique_name(), timeout=0).acquire()
    assert holders(admin, name) == [server_pid()]
    lock.release()
    assert holders(admin, name) == []


def test_an_unlock_postponed_by_a_failed_transaction_survives_a_refusal_in_a_pipeline(
    admin: Admin,
) -> None:
    name = unique_name()
    postpone_an_unlock(admin, name)
    driver = connection.connection
    assert isinstance(driver, psycopg.Connection)
    with driver.pipeline(), pytest.raises(LockUsageError, match="pipeline mode"):
        advisory_lock(unique_name()).acquire()
    assert holders(admin, name) == [server_pid()]
    with advisory_lock(unique_name()):  # outside the pipeline the unlock runs first
        assert holders(admin, name) == []
