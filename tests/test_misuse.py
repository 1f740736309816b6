"""Misusing a lock object raises LockUsageError with a message that says what to do."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import Engine

from advisory_locks import AdvisoryLockError, LockUsageError, advisory_lock
from tests.helpers import unique_name

pytestmark = pytest.mark.postgresql


def test_lock_usage_error_is_an_advisory_lock_error_and_a_runtime_error() -> None:
    assert issubclass(LockUsageError, AdvisoryLockError)
    assert issubclass(LockUsageError, RuntimeError)


def test_releasing_a_lock_never_acquired_says_to_acquire_it(pg_engine: Engine) -> None:
    with pytest.raises(LockUsageError, match="acquire"):
        advisory_lock(pg_engine, unique_name()).release()


def test_releasing_through_another_object_says_who_holds_it(pg_engine: Engine) -> None:
    # The Rails habit: release by name, with a fresh object.
    name = unique_name()
    with (
        advisory_lock(pg_engine, name),
        pytest.raises(LockUsageError, match="another lock object"),
    ):
        advisory_lock(pg_engine, name).release()


def test_taking_one_object_from_two_threads_is_refused(pg_engine: Engine) -> None:
    lock = advisory_lock(pg_engine, unique_name())
    errors: list[BaseException] = []
    with lock:
        thread = threading.Thread(target=lambda: _capture(lock.acquire, errors))
        thread.start()
        thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], LockUsageError)
    assert "another thread or task" in str(errors[0])


def test_ensure_held_on_a_lock_not_held_is_a_usage_error(pg_engine: Engine) -> None:
    with pytest.raises(LockUsageError):
        advisory_lock(pg_engine, unique_name()).ensure_held()


def _capture(function: object, errors: list[BaseException]) -> None:
    try:
        function()  # type: ignore[operator]
    except BaseException as error:
        errors.append(error)
