"""Lease locks report to lock event listeners like advisory locks, plus what only a lease
can suffer: a renewal that failed, and a takeover (``stolen``). On PostgreSQL, MariaDB
and SQLite (the ``lease_db`` fixture)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from advisory_locks import LockLost, LockStolen, lease_lock
from tests.helpers import EventRecorder, wait_for
from tests.lease.conftest import LeaseDatabase
from tests.lease.test_lease_locks import expire_now, unique
from tests.otel_support import Telemetry

SYSTEMS = {"postgresql": "postgresql", "mariadb": "mariadb", "sqlite": "sqlite"}


def test_a_lease_grant_and_release_are_reported_with_its_token(
    lease_db: LeaseDatabase, lock_events: EventRecorder
) -> None:
    name = unique()
    with lease_lock(lease_db.engine, name, ttl=10) as lease:
        token = lease.token
    acquired, released = lock_events.about(name)
    assert (acquired.kind, released.kind, released.reason) == ("acquired", "released", "unlock")
    for event in (acquired, released):
        assert (event.scope, event.mode, event.key) == ("lease", "exclusive", None)
        assert event.token == token
        assert event.system == SYSTEMS[lease_db.kind]
        assert event.binding == "sqlalchemy"
    assert acquired.waited is not None
    assert released.held is not None
    assert released.held >= 0


def test_a_busy_lease_is_reported_not_acquired(
    lease_db: LeaseDatabase, lock_events: EventRecorder
) -> None:
    name = unique()
    with lease_lock(lease_db.engine, name, ttl=10):
        assert not lease_lock(lease_db.engine, name, timeout=0).acquire()
    refused = lock_events.one(name, "not_acquired")
    assert (refused.reason, refused.scope) == ("busy", "lease")


def test_a_taken_over_lease_is_reported_stolen_and_released(
    lease_db: LeaseDatabase, lock_events: EventRecorder
) -> None:
    name = unique()
    lease = lease_lock(lease_db.engine, name, ttl=3.0)
    assert lease.acquire()
    first_token = lease.token
    expire_now(lease_db, name)
    thief = lease_lock(lease_db.engine, name, ttl=30, timeout=0)
    assert thief.acquire()
    assert lease.lost.wait(lease.options.period + 0.5)  # a renewal finds it taken
    with pytest.raises(LockStolen):
        lease.release()
    thief.release()
    mine = [event for event in lock_events.about(name) if event.token == first_token]
    assert [event.kind for event in mine] == ["acquired", "released", "stolen"]
    assert mine[1].reason == "stolen"
    assert isinstance(mine[2].error, LockStolen)


def test_an_expired_lease_nobody_took_is_reported_lost(
    lease_db: LeaseDatabase, lock_events: EventRecorder
) -> None:
    name = unique()
    lease = lease_lock(lease_db.engine, name, ttl=3.0)
    assert lease.acquire()
    expire_now(lease_db, name)
    assert lease.lost.wait(lease.options.period + 0.5)
    with pytest.raises(LockLost):
        lease.release()
    assert lock_events.kinds(name) == ["acquired", "released", "lost"]
    assert lock_events.one(name, "lost").reason == "not_held"


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_failed_renewal_is_reported_and_the_lease_still_held(
    lease_db: LeaseDatabase, lock_events: EventRecorder
) -> None:
    from tests.lease.proxy import TcpProxy

    name = unique()
    with TcpProxy(lease_db.url.host or "127.0.0.1", lease_db.url.port or 0) as proxy:
        engine = create_engine(lease_db.url.set(host="127.0.0.1", port=proxy.port))
        lease = lease_lock(engine, name, ttl=4.0, renew_every=0.5)
        assert lease.acquire()
        try:
            proxy.cut()
            wait_for(lambda: "renewal_failed" in lock_events.kinds(name), "a renewal failed")
            assert lease.held
            failed = lock_events.one(name, "renewal_failed")
            assert failed.error is not None
            assert failed.token == lease.token
            proxy.restore()
            lease.ensure_held()  # retries past the pooled connection the cut killed
        finally:
            try:
                lease.release()
            finally:
                engine.dispose()


def test_opentelemetry_counts_a_stolen_lease_as_lost_and_no_longer_held(
    lease_db: LeaseDatabase, telemetry: Telemetry
) -> None:
    name = unique()
    lease = lease_lock(lease_db.engine, name, ttl=3.0)
    assert lease.acquire()
    (held,) = telemetry.points("advisory_lock.held", name)
    assert (held.value, held.attributes["advisory_lock.scope"]) == (1, "lease")
    expire_now(lease_db, name)
    thief = lease_lock(lease_db.engine, name, ttl=30, timeout=0)
    assert thief.acquire()
    assert lease.lost.wait(lease.options.period + 0.5)
    with pytest.raises(LockStolen):
        lease.release()
    (lost,) = telemetry.points("advisory_lock.lost", name)
    assert (lost.value, lost.attributes["advisory_lock.loss_reason"]) == (1, "stolen")
    (held,) = telemetry.points("advisory_lock.held", name)
    assert held.value == 1  # the thief's
    thief.release()
    (held,) = telemetry.points("advisory_lock.held", name)
    assert held.value == 0
    spans = telemetry.waits(name)
    assert {span.attributes["advisory_lock.lease.token"] for span in spans if span.attributes} == {
        lease.token,
        thief.token,
    }
