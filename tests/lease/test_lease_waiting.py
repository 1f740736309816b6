"""Waiting for a lease: NOTIFY on PostgreSQL hands a released lease to a blocked waiter
within a round trip or two; elsewhere, and behind a declared transaction pooler, a
waiter sleeps until the expiry it read (at most 2 s at a time)."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL

from advisory_locks import lease_lock
from tests.helpers import wait_for
from tests.lease.conftest import LeaseDatabase
from tests.lease.workers import hold_until_resumed

SPAWN = multiprocessing.get_context("spawn")


def unique() -> str:
    return f"lease-test:{uuid.uuid4()}"


def handoff_seconds(engine: Engine, name: str) -> float:
    """Seconds from a holder's release to a blocked waiter holding the lease; the waiter
    has made (and failed) its first attempt before the release."""
    checkouts: list[str] = []
    event.listen(
        engine.pool, "checkout", lambda *args: checkouts.append(threading.current_thread().name)
    )
    holder = lease_lock(engine, name, ttl=30)
    assert holder.acquire()
    baseline = len(checkouts)
    acquired_at: list[float] = []

    def wait() -> None:
        with lease_lock(engine, name, timeout=20):
            acquired_at.append(time.monotonic())

    waiter = threading.Thread(target=wait, name=f"waiter-{name}")
    waiter.start()
    # A failed attempt borrows once, for the upsert and the read of the expiry.
    wait_for(
        lambda: waiter.name in checkouts[baseline:] and engine.pool.checkedout() == 0,  # type: ignore[attr-defined]
        "the waiter failed its first attempt",
    )
    released_at = time.monotonic()
    holder.release()
    waiter.join(30)
    assert acquired_at
    return acquired_at[0] - released_at


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
@pytest.mark.parametrize("lease_db", ["postgresql"], indirect=True)
def test_notify_wakes_a_blocked_waiter_promptly_on_postgresql(
    lease_db: LeaseDatabase, postgres_url_for: Any, driver: str
) -> None:
    engine = create_engine(postgres_url_for(driver))
    try:
        samples = sorted(handoff_seconds(engine, unique()) for _ in range(5))
    finally:
        engine.dispose()
    assert samples[2] < 0.25  # the median; without NOTIFY a waiter would sleep ~2 s


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb", "sqlite"], indirect=True)
def test_a_killed_holders_lease_is_taken_over_about_ttl_later_not_before(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    ttl, period = 2.0, 0.5
    report = SPAWN.Queue()
    never = SPAWN.Event()  # kept referenced until the child has started
    child = SPAWN.Process(
        target=hold_until_resumed,
        args=(
            lease_db.url.render_as_string(hide_password=False),
            name,
            ttl,
            period,
            report,
            never,
        ),
    )
    child.start()
    try:
        assert report.get(timeout=60)[0] == "acquired"
    finally:
        child.kill()  # SIGKILL: no release, no finally
        child.join(30)
    killed = time.monotonic()
    with lease_lock(lease_db.engine, name, timeout=10):
        waited = time.monotonic() - killed
    # Its last renewal was at most one period before the kill; the waiter sleeps until
    # the expiry it reads (plus up to 50 ms of jitter).
    assert ttl - period - 0.3 < waited < ttl + 0.6


@pytest.mark.parametrize("lease_db", ["postgresql"], indirect=True)
def test_a_declared_transaction_pooler_gets_no_listen_and_polls_until_the_expiry(
    lease_db: LeaseDatabase, pg_admin: object
) -> None:
    application = f"lease-pooler-{uuid.uuid4().hex[:8]}"
    url: URL = lease_db.url.update_query_dict({"application_name": application})
    engine = create_engine(url, execution_options={"advisory_locks_pooler": "transaction"})
    try:
        seconds = handoff_seconds(engine, unique())
        assert 1.0 < seconds < 4.0  # slept towards the 30 s expiry, capped at 2 s
        listening = pg_admin.execute(  # type: ignore[attr-defined]
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = %s AND query ILIKE 'LISTEN%%'",
            [application],
        ).fetchone()[0]
        assert listening == 0
    finally:
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["mariadb", "sqlite"], indirect=True)
def test_without_notify_a_waiter_gets_a_released_lease_within_the_pause_cap(
    lease_db: LeaseDatabase,
) -> None:
    assert handoff_seconds(lease_db.engine, unique()) < 2.0 + 0.5


@pytest.mark.parametrize("lease_db", ["postgresql"], indirect=True)
def test_a_waiter_wakes_for_its_own_name_only(lease_db: LeaseDatabase) -> None:
    # Another name's release wakes nobody waiting for this one into taking it early.
    name, other = unique(), unique()
    holder = lease_lock(lease_db.engine, name, ttl=30)
    assert holder.acquire()
    with lease_lock(lease_db.engine, other):
        pass
    assert not lease_lock(lease_db.engine, name, timeout=0.5).acquire()
    holder.release()
    with lease_db.admin.connect() as connection:
        assert (
            connection.execute(
                text("SELECT holder FROM advisory_locks_lease WHERE name = :n"), {"n": name}
            ).scalar()
            is None
        )
