"""Lock events, on every database through every binding: what a listener hears.

One spec, run on each target of tests/contract/conftest.py (PostgreSQL, MariaDB and
SQLite, each through SQLAlchemy and Django).
"""

from __future__ import annotations

import threading
import time

import pytest

from advisory_locks import lock_key
from tests.contract.conftest import Target
from tests.helpers import EventRecorder, unique_name, wait_for

pytestmark = pytest.mark.timeout(60)

JOIN_SECONDS = 30.0
# How long the holder keeps the lock once the waiter is seen waiting.
HOLD_SECONDS = 0.3


def test_a_grant_and_its_release_are_reported(target: Target, lock_events: EventRecorder) -> None:
    name = unique_name("events")
    with target.client() as client, client.lock(name):
        pass
    acquired, released = lock_events.about(name)
    assert (acquired.kind, released.kind) == ("acquired", "released")
    for event in (acquired, released):
        assert event.system == target.database
        assert event.binding == target.binding
        assert event.database == target.django_alias
        assert (event.mode, event.scope) == ("exclusive", "session")
        assert event.key == lock_key(name)
        assert event.granted_at == acquired.granted_at is not None
    assert acquired.waited is not None
    assert acquired.waited >= 0
    assert acquired.held is None
    assert released.reason == "unlock"
    assert released.held is not None
    assert released.held >= 0


def test_the_time_waited_runs_from_acquire_to_the_grant(
    target: Target, lock_events: EventRecorder
) -> None:
    name = unique_name("events-wait")
    with target.client() as holder, target.client() as waiter:
        holding = holder.lock(name)
        holding.acquire()
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                with waiter.lock(name, timeout=None):
                    pass
            except BaseException as error:  # reported below
                errors.append(error)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        wait_for(lambda: target.waiting(name), "the waiter is queued on the lock")
        seen_waiting = time.monotonic()
        time.sleep(HOLD_SECONDS)  # the wait the event must account for
        holding.release()
        released_at = time.monotonic()
        thread.join(JOIN_SECONDS)
        assert not thread.is_alive()
        assert errors == []
    grants = [event for event in lock_events.about(name) if event.kind == "acquired"]
    assert len(grants) == 2
    # The waiter asked before it was seen waiting and was granted after the release.
    assert grants[1].waited is not None
    assert grants[1].waited >= released_at - seen_waiting >= HOLD_SECONDS


def test_a_busy_lock_is_reported_not_acquired(target: Target, lock_events: EventRecorder) -> None:
    name = unique_name("events-busy")
    with target.client() as holder, holder.lock(name), target.client() as other:
        assert other.lock(name, timeout=0).acquire() is False
    refused = lock_events.one(name, "not_acquired")
    assert refused.reason == "busy"
    assert refused.error is None
    assert refused.waited is not None
    assert refused.waited >= 0
    assert refused.system == target.database
    assert refused.binding == target.binding


def test_a_wait_that_timed_out_is_reported_with_its_length(
    target: Target, lock_events: EventRecorder
) -> None:
    name = unique_name("events-timeout")
    with target.client() as holder, holder.lock(name), target.client() as other:
        assert other.lock(name, timeout=0.3).acquire() is False
    refused = lock_events.one(name, "not_acquired")
    assert refused.reason == "timeout"
    assert refused.waited is not None
    assert refused.waited >= 0.25


def test_a_reentrant_acquire_reports_nothing(target: Target, lock_events: EventRecorder) -> None:
    name = unique_name("events-reentrant")
    with target.client() as client, client.lock(name):
        with client.lock(name):
            pass
        assert lock_events.kinds(name) == ["acquired"]
    assert lock_events.kinds(name) == ["acquired", "released"]
