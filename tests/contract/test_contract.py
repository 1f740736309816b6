"""What every database promises, through every binding: one spec, run on each target.

PostgreSQL-only behaviours (transaction locks, savepoints, pg_locks) live in the other
spec files; MySQL- and SQLite-only ones in test_mysql.py and test_sqlite.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from advisory_locks import LockNotAcquired, LockTimeout, UnsupportedFeature
from tests.contract.conftest import Target
from tests.helpers import unique_name, wait_for

pytestmark = pytest.mark.timeout(60)


def test_a_held_lock_excludes_another_connection(target: Target) -> None:
    name = unique_name("exclusion")
    with target.client() as holder, holder.lock(name):
        assert not target.is_free(name)
    assert target.is_free(name)


def test_a_held_lock_excludes_another_process(target: Target) -> None:
    name = unique_name("process")
    with target.hold_in_process(name), target.client() as client:
        assert client.lock(name, timeout=0).acquire() is False


def test_a_killed_holder_process_frees_the_lock_for_a_waiter(target: Target) -> None:
    name = unique_name("killed")
    with target.hold_in_process(name) as holder, target.client() as client:
        lock = client.lock(name, timeout=30)
        holder.kill()
        assert lock.acquire() is True
        lock.release()


def test_timeout_zero_returns_false_when_busy(target: Target) -> None:
    name = unique_name("try")
    with target.client() as holder, holder.lock(name), target.client() as other:
        assert other.lock(name, timeout=0).acquire() is False


def test_timeout_zero_in_a_with_block_raises_lock_not_acquired(target: Target) -> None:
    name = unique_name("try-with")
    with target.client() as holder, holder.lock(name), target.client() as other:
        lock = other.lock(name, timeout=0)
        with pytest.raises(LockNotAcquired), lock:
            pytest.fail("the block must not run")


def test_timeout_t_gives_up_after_about_t(target: Target) -> None:
    name = unique_name("timeout")
    with target.client() as holder, holder.lock(name), target.client() as other:
        started = time.monotonic()
        with pytest.raises(LockTimeout), other.lock(name, timeout=0.5):
            pytest.fail("the block must not run")
        waited = time.monotonic() - started
    # MySQL (not MariaDB) rounds a timeout up to whole seconds; never down.
    assert 0.45 <= waited < 10


def test_a_waiter_wakes_when_the_holder_releases(target: Target) -> None:
    name = unique_name("wake")
    granted = threading.Event()
    with target.client() as holder, target.client() as waiter:
        lock = holder.lock(name)
        lock.acquire()

        def wait() -> None:
            with waiter.lock(name, timeout=None):
                granted.set()

        thread = threading.Thread(target=wait)
        thread.start()
        wait_for(lambda: target.waiting(name), "the waiter is queued for the lock")
        assert not granted.is_set()
        lock.release()
        assert granted.wait(10)
        thread.join(10)


def test_reacquiring_on_one_connection_is_counted(target: Target) -> None:
    name = unique_name("reentrant")
    with target.client() as client:
        with client.lock(name):
            with client.lock(name, timeout=0):
                pass
            assert not target.is_free(name)
        assert target.is_free(name)


def test_an_exception_in_the_block_releases_the_lock(target: Target) -> None:
    name = unique_name("exception")

    class Boom(Exception):
        pass

    with target.client() as client:
        with pytest.raises(Boom), client.lock(name):
            raise Boom
        assert target.is_free(name)


def test_commit_and_rollback_inside_a_session_lock_keep_it(target: Target) -> None:
    name = unique_name("commit")
    with target.client() as client:
        with client.lock(name):
            client.commit()
            assert not target.is_free(name)
            client.rollback()
            assert not target.is_free(name)
        assert target.is_free(name)


def test_names_differing_only_in_case_are_different_locks(target: Target) -> None:
    # MySQL compares GET_LOCK names case-insensitively; the library's name mapping
    # must keep "Job" and "job" apart there as on every other database.
    name = unique_name("Case")
    with target.client() as holder, holder.lock(name):
        assert target.is_free(name.lower())
        assert target.is_free(name.upper())


def test_names_longer_than_64_characters_lock_too(target: Target) -> None:
    name = unique_name("long-" + "x" * 100)
    with target.client() as holder, holder.lock(name):
        assert not target.is_free(name)
        assert target.is_free(name[:-1])


def test_integer_and_pair_names_lock(target: Target) -> None:
    with target.client() as holder, holder.lock(918_273_645), holder.lock((91827, 3645)):
        assert not target.is_free(918_273_645)  # type: ignore[arg-type]
        assert not target.is_free((91827, 3645))  # type: ignore[arg-type]


def test_the_first_lock_is_what_connects(target: Target) -> None:
    # The "before connecting" specs below rely on the target seeing every connect.
    with target.client() as client:
        assert target.statements == []
        with client.lock(unique_name("connects")):
            assert target.statements == ["<connect>"]


@pytest.mark.parametrize(
    ("name", "error"),
    [("", ValueError), (b"bytes", TypeError), (2**63, ValueError), ((1,), TypeError)],
)
def test_bad_names_fail_before_connecting(target: Target, name: object, error: type) -> None:
    with target.client() as client:
        with pytest.raises(error):
            client.lock(name)
        assert target.statements == []


@pytest.mark.parametrize("timeout", [-1, float("nan"), "1"])
def test_bad_timeouts_fail_before_connecting(target: Target, timeout: object) -> None:
    with target.client() as client:
        with pytest.raises((TypeError, ValueError)):
            client.lock(unique_name("bad-timeout"), timeout=timeout)
        assert target.statements == []


@pytest.mark.parametrize("mode", ["shared", "transaction"])
def test_each_mode_is_honoured_or_refused_before_connecting(target: Target, mode: str) -> None:
    name = unique_name(mode)
    with target.client() as client:
        if mode in target.refuses:
            with (
                pytest.raises(UnsupportedFeature, match="instead"),
                client.lock(name, **{mode: True}),
            ):
                pytest.fail("the block must not run")
            assert target.statements == []
        else:
            with client.lock(name, **{mode: True}):
                assert not target.is_free(name)


def test_shared_locks_admit_each_other_but_not_an_exclusive_one(target: Target) -> None:
    name = unique_name("shared")
    with target.client() as first, target.client() as second, target.client() as writer:
        if "shared" in target.refuses:
            with pytest.raises(UnsupportedFeature):
                first.lock(name, shared=True)
            return
        with first.lock(name, shared=True), second.lock(name, shared=True, timeout=0):
            assert writer.lock(name, timeout=0).acquire() is False
        assert target.is_free(name)
