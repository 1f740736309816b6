"""Lease locks on PostgreSQL, MariaDB and SQLite: exclusion, fencing tokens, renewal, loss.

Every spec runs on the three databases through SQLAlchemy. Processes are spawned and
frozen with SIGSTOP where a real pause is the point; waits are on events, queues or the
database's own state, never on a sleep that hopes something happened meanwhile.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy import exc as sqlalchemy_errors
from sqlalchemy.pool import NullPool, Pool, QueuePool

import advisory_locks
from advisory_locks import (
    LeaseTableMissing,
    LockConnectionLost,
    LockLost,
    LockNotAcquired,
    LockStolen,
    LockTimeout,
    LockUsageError,
    lease_lock,
)
from advisory_locks._core.lease import MAX_TTL, safety_margin
from advisory_locks._core.renewer import renewer
from advisory_locks.sqlalchemy import LockConnectionTimeout, create_lease_table
from tests.helpers import wait_for
from tests.lease.conftest import SESSION_ID_SQL, LeaseDatabase, fenced_write
from tests.lease.workers import hold_until_resumed, increment

SPAWN = multiprocessing.get_context("spawn")
START_SECONDS = 60.0


def unique() -> str:
    return f"lease-test:{uuid.uuid4()}"


def url_text(lease_db: LeaseDatabase) -> str:
    return lease_db.url.render_as_string(hide_password=False)


def expire_now(lease_db: LeaseDatabase, name: str) -> None:
    """Make the database see the lease as expired (as if its holder had stopped renewing)."""
    expired = {
        "postgresql": "clock_timestamp() - interval '1 second'",
        "mariadb": "UTC_TIMESTAMP(6) - INTERVAL 1 SECOND",
        "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 seconds')",
    }[lease_db.kind]
    with lease_db.admin.connect() as connection:
        connection.execute(
            text(f"UPDATE advisory_locks_lease SET expires_at = {expired} WHERE name = :name"),
            {"name": name},
        )


# -- exclusion and tokens ------------------------------------------------------------------


def test_token_strictly_increases_across_holders_and_survives_prune(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    tokens = []
    for _ in range(3):
        with lease_lock(lease_db.engine, name, timeout=0) as lease:
            tokens.append(lease.token)
    holder = lease_lock(lease_db.engine, name, ttl=5, timeout=0)
    assert holder.acquire()
    tokens.append(holder.token)
    renewer().forget(holder._holding)  # type: ignore[arg-type] # stop renewing: it expires
    expire_now(lease_db, name)
    pruned = run_prune(lease_db, expired_for=0.0)
    assert pruned >= 1
    row = lease_db.row(name)
    assert row is not None
    assert row.holder is None
    assert row.token == tokens[-1]
    with lease_lock(lease_db.engine, name, timeout=0) as lease:
        tokens.append(lease.token)
    assert tokens == list(range(tokens[0], tokens[0] + 5))
    assert tokens[0] == 1


def run_prune(lease_db: LeaseDatabase, expired_for: float) -> int:
    from advisory_locks._bindings.sqlalchemy_lease import lease_site
    from advisory_locks._core.steps import on, run_steps

    site = lease_site(lease_db.engine)
    borrowed = site.borrow(transaction=False)
    try:
        return int(run_steps(on(borrowed.executor, site.backend.prune(expired_for))))
    finally:
        borrowed.settle()


def test_prune_leaves_unexpired_and_recently_expired_leases_alone(lease_db: LeaseDatabase) -> None:
    held, recent = unique(), unique()
    with lease_lock(lease_db.engine, held, timeout=0):
        other = lease_lock(lease_db.engine, recent, ttl=5, timeout=0)
        assert other.acquire()
        renewer().forget(other._holding)  # type: ignore[arg-type]
        expire_now(lease_db, recent)
        run_prune(lease_db, expired_for=3600.0)
        assert lease_db.row(held).holder is not None  # type: ignore[union-attr]
        assert lease_db.row(recent).holder is not None  # type: ignore[union-attr]


def test_two_lock_objects_for_one_name_exclude_each_other_in_one_thread(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    first = lease_lock(lease_db.engine, name, timeout=0)
    second = lease_lock(lease_db.engine, name, timeout=0)
    assert first.acquire()
    assert not second.acquire()
    with pytest.raises(LockNotAcquired), second:
        pass
    first.release()
    assert second.acquire()
    assert second.token == first.token + 1  # type: ignore[operator]
    second.release()


def test_acquiring_a_held_lease_object_again_is_a_usage_error(lease_db: LeaseDatabase) -> None:
    lease = lease_lock(lease_db.engine, unique(), timeout=0)
    with lease, pytest.raises(LockUsageError):
        lease.acquire()
    with pytest.raises(LockUsageError):
        lease.release()


def test_token_is_available_inside_the_block_and_in_the_row(lease_db: LeaseDatabase) -> None:
    name = unique()
    with lease_lock(lease_db.engine, name) as lease:
        row = lease_db.row(name)
        assert row is not None
        assert row.token == lease.token
        assert lease.held
        assert 25 < row.expires_in <= 30.5
    assert not lease.held
    row = lease_db.row(name)
    assert row is not None
    assert row.holder is None


def test_holding_a_lease_pins_no_pooled_connection(lease_db: LeaseDatabase) -> None:
    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0, pool_timeout=5)
    try:
        with lease_lock(engine, unique(), ttl=3) as lease:
            assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
            with engine.connect() as connection:  # the pool's only connection is free
                connection.execute(text("SELECT 1"))
            assert lease.held
    finally:
        engine.dispose()


def test_a_session_bind_leases_through_its_engine_not_its_transaction(
    lease_db: LeaseDatabase,
) -> None:
    from sqlalchemy.orm import Session

    name = unique()
    with Session(lease_db.engine) as session:
        session.execute(text("SELECT 1"))  # the Session's transaction is open
        with lease_lock(session, name, timeout=0):
            session.rollback()  # does not undo the lease
            assert lease_db.row(name).holder is not None  # type: ignore[union-attr]
            assert not lease_lock(lease_db.engine, name, timeout=0).acquire()


def test_two_processes_incrementing_under_one_lease_lose_no_update(lease_db: LeaseDatabase) -> None:
    name = unique()
    start = SPAWN.Event()
    workers = [
        SPAWN.Process(target=increment, args=(url_text(lease_db), name, 5, 2.0, f"w{n}", start))
        for n in range(3)
    ]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    writes = lease_db.writes(f"{os.environ.get('ADVISORY_LOCKS_PREFIX', '')}{name}")
    assert [value for _token, _writer, value in writes] == list(range(1, 16))
    tokens = [token for token, _writer, _value in writes]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 15


# -- waiting -------------------------------------------------------------------------------


def test_timeout_zero_returns_at_once_and_timeout_t_waits_about_t(lease_db: LeaseDatabase) -> None:
    name = unique()
    with lease_lock(lease_db.engine, name):
        start = time.monotonic()
        assert not lease_lock(lease_db.engine, name, timeout=0).acquire()
        assert time.monotonic() - start < 1.0
        start = time.monotonic()
        with pytest.raises(LockTimeout), lease_lock(lease_db.engine, name, timeout=0.6):
            pass
        assert 0.6 <= time.monotonic() - start < 2.0


def test_a_waiter_without_timeout_gets_the_lease_when_the_holder_releases(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    holder = lease_lock(lease_db.engine, name, ttl=30)
    assert holder.acquire()
    got: list[int | None] = []
    waiting = threading.Event()

    def wait() -> None:
        waiting.set()
        with lease_lock(lease_db.engine, name, timeout=None) as lease:
            got.append(lease.token)

    thread = threading.Thread(target=wait)
    thread.start()
    waiting.wait(5)
    assert not got
    holder.release()
    thread.join(10)  # the waiter reads a 30 s expiry but wakes within the 2 s cap
    assert got == [holder.token + 1]  # type: ignore[operator]


def test_a_lease_whose_holder_stopped_renewing_is_taken_over_once_expired_not_before(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    stale = lease_lock(lease_db.engine, name, ttl=1.5, timeout=0)
    assert stale.acquire()
    renewer().forget(stale._holding)  # type: ignore[arg-type] # as if the process froze
    assert not lease_lock(lease_db.engine, name, timeout=0).acquire()
    start = time.monotonic()
    with lease_lock(lease_db.engine, name, timeout=10) as thief:
        waited = time.monotonic() - start
        assert thief.token == stale.token + 1  # type: ignore[operator]
    assert 0.5 < waited < 4.0


# -- renewal and loss ----------------------------------------------------------------------


def test_a_held_lease_is_renewed_past_its_ttl(lease_db: LeaseDatabase) -> None:
    name = unique()
    with lease_lock(lease_db.engine, name, ttl=1.0) as lease:
        deadline = time.monotonic() + 3.0  # three ttls
        while time.monotonic() < deadline:
            assert not lease_lock(lease_db.engine, name, timeout=0).acquire()
            time.sleep(0.2)
        lease.ensure_held()
        assert lease.held
        assert not lease.lost.is_set()


def test_one_renewer_renews_many_leases_in_one_statement_per_period(
    lease_db: LeaseDatabase,
) -> None:
    names = [unique() for _ in range(60)]
    leases = [lease_lock(lease_db.engine, name, ttl=3.0, timeout=0) for name in names]
    for lease in leases:
        assert lease.acquire()
    try:
        first = {name: lease_db.row(name).renewed_at for name in names}  # type: ignore[union-attr]
        wait_for(
            lambda: all(lease_db.row(n).renewed_at != first[n] for n in names),  # type: ignore[union-attr]
            "every lease was renewed",
        )
        wait_for(
            lambda: len({lease_db.row(n).renewed_at for n in names}) == 1,  # type: ignore[union-attr]
            "one renewal statement renewed them all at one instant",
        )
        assert sum(t.name == "advisory-locks-renewer" for t in threading.enumerate()) == 1
    finally:
        for lease in leases:
            lease.release()


def test_a_with_block_raises_lock_stolen_at_exit_when_taken_over_inside(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    thief = lease_lock(lease_db.engine, name, ttl=30, timeout=0)

    def block() -> None:
        with lease_lock(lease_db.engine, name, ttl=3.0) as lease:
            expire_now(lease_db, name)
            assert thief.acquire()
            assert lease.lost.wait(lease.options.period + 0.5)  # one renewal finds it taken
            assert not lease.held
            with pytest.raises(LockStolen):
                lease.ensure_held()

    with pytest.raises(LockStolen) as raised:
        block()
    assert raised.value.token == thief.token
    assert raised.value.holder is not None
    thief.release()


def test_an_expired_lease_nobody_took_is_lock_lost_not_stolen(lease_db: LeaseDatabase) -> None:
    name = unique()
    lease = lease_lock(lease_db.engine, name, ttl=3.0)
    assert lease.acquire()
    expire_now(lease_db, name)
    assert lease.lost.wait(lease.options.period + 0.5)
    with pytest.raises(LockLost) as raised:
        lease.release()
    assert type(raised.value) is LockLost


def test_a_frozen_holder_learns_it_was_stolen_and_its_fenced_write_is_refused(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    ttl, period = 1.5, 0.4
    report = SPAWN.Queue()
    resumed = SPAWN.Event()
    child = SPAWN.Process(
        target=hold_until_resumed, args=(url_text(lease_db), name, ttl, period, report, resumed)
    )
    child.start()
    try:
        kind, stale_token = report.get(timeout=START_SECONDS)
        assert kind == "acquired"
        os.kill(child.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        # Waits by the expiry it reads: about ttl after the child's last renewal.
        with lease_lock(lease_db.engine, name, ttl=30, timeout=10) as thief:
            assert thief.token == stale_token + 1
            fenced_write(thief, lease_db.engine, "thief")
            os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
            resumed.set()
            kind, outcome = report.get(timeout=START_SECONDS)
        child.join(30)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
            child.kill()
    assert kind == "done"
    assert outcome["lost_after"] is not None
    assert outcome["lost_after"] <= period
    assert outcome == {
        "lost_after": outcome["lost_after"],
        "held": False,
        "ensure_held": "LockStolen",
        "fence": "LockStolen",
        "exit": "LockStolen",
    }
    prefix = os.environ.get("ADVISORY_LOCKS_PREFIX", "")
    assert lease_db.writes(prefix + name) == [(stale_token + 1, "thief", 0)]


def test_a_fenced_transaction_keeps_a_takeover_out_until_it_ends(lease_db: LeaseDatabase) -> None:
    name = unique()
    lease = lease_lock(lease_db.engine, name, ttl=1.0)
    assert lease.acquire()
    thief = lease_lock(lease_db.engine, name, ttl=30, timeout=0)
    with lease_db.engine.connect() as connection, connection.begin():
        lease.fence(connection)
        renewer().forget(lease._holding)  # type: ignore[arg-type] # the holder stops renewing
        wait_for(
            lambda: lease_db.row(name).expires_in < 0,  # type: ignore[union-attr]
            "the lease expired by the database's clock",
        )
        assert not thief.acquire()  # expired, but fenced: held all the same
        start = time.monotonic()
        assert not lease_lock(lease_db.engine, name, ttl=30, timeout=0.5).acquire()
        assert time.monotonic() - start < 3.0
        # The fencing transaction committed: the takeover goes ahead.
    assert thief.acquire()
    thief.release()


@pytest.mark.parametrize("lease_db", ["postgresql"], indirect=True)
def test_a_fence_does_not_block_the_owners_own_renewals_on_postgresql(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    with lease_lock(lease_db.engine, name, ttl=1.0) as lease:
        with lease_db.engine.begin() as connection:
            lease.fence(connection)
            before = lease_db.row(name).renewed_at  # type: ignore[union-attr]
            wait_for(
                lambda: lease_db.row(name).renewed_at != before,  # type: ignore[union-attr]
                "the renewer renewed the fenced lease",
                timeout=2.0,
            )
            lease.fence(connection)  # still ours, in the same transaction
        lease.ensure_held()


def test_the_database_clock_decides_whatever_the_client_clock_says(
    lease_db: LeaseDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    name = unique()
    for hours in (+6, -6):
        monkeypatch.setattr(time, "time", lambda h=hours: real_time() + h * 3600)
        with lease_lock(lease_db.engine, name, ttl=5.0) as lease:
            row = lease_db.row(name)
            assert row is not None
            assert 4.0 < row.expires_in <= 5.5
            assert not lease_lock(lease_db.engine, name, timeout=0).acquire()
            lease.ensure_held()


# -- renewal failures ----------------------------------------------------------------------


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_renewal_errors_are_logged_and_retried_and_the_renewer_survives(
    lease_db: LeaseDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.lease.proxy import TcpProxy

    with TcpProxy(lease_db.url.host or "127.0.0.1", lease_db.url.port or 0) as proxy:
        engine = create_engine(lease_db.url.set(host="127.0.0.1", port=proxy.port))
        caplog.set_level(logging.WARNING, logger="advisory_locks")
        lease = lease_lock(engine, unique(), ttl=4.0, renew_every=0.5)
        assert lease.acquire()
        try:
            proxy.cut()  # every connection through it dies; new ones are refused
            wait_for(
                lambda: sum("renewing" in r.getMessage() for r in caplog.records) >= 2,
                "two failed renewals were logged",
            )
            assert lease.held  # within ttl - margin: not lost yet
            proxy.restore()
            renewed = lease_db.row(lease.lease_name).renewed_at  # type: ignore[union-attr]
            wait_for(
                lambda: lease_db.row(lease.lease_name).renewed_at != renewed,  # type: ignore[union-attr]
                "the renewer renewed again through the restored network",
            )
            assert not lease.lost.is_set()
            lease.ensure_held()
        finally:
            lease.release()
            engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_an_unreachable_database_loses_the_lease_locally_ttl_minus_margin_after_the_last_renewal(
    lease_db: LeaseDatabase,
) -> None:
    from tests.lease.proxy import TcpProxy

    with TcpProxy(lease_db.url.host or "127.0.0.1", lease_db.url.port or 0) as proxy:
        engine = create_engine(lease_db.url.set(host="127.0.0.1", port=proxy.port))
        ttl, period = 6.0, 1.0
        lease = lease_lock(engine, unique(), ttl=ttl, renew_every=period)
        assert lease.acquire()
        proxy.cut()
        cut = time.monotonic()
        assert lease.lost.wait(ttl + 2)
        lost_after = time.monotonic() - cut
        # Declared lost by its own deadline, ttl - margin after the last renewal SENT,
        # which was at most one period before the cut: not before that...
        assert lost_after >= ttl - safety_margin(ttl) - period
        # ...and before the database could have let the lease expire (its last renewal
        # reached it before the cut), with the margin as room for a loaded machine.
        assert lost_after <= ttl
        assert not lease.held
        with pytest.raises(LockLost) as raised:
            lease.ensure_held()
        assert type(raised.value) is LockLost  # nobody could be asked: not "stolen"
        with pytest.raises(LockLost):
            lease.release()
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_database_that_stops_answering_loses_its_leases_in_time_and_stalls_no_other(
    lease_db: LeaseDatabase,
) -> None:
    """A partition or a hung server: the renewer's statement is neither answered nor
    refused, so its thread blocks. The leases there are still declared lost before the
    database can let them expire; those on another database go on being renewed; and
    those there still in time are renewed on a new connection (after a failover, the
    new primary answers new connections while the old socket hangs)."""
    from tests.lease.proxy import TcpProxy

    with TcpProxy(lease_db.url.host or "127.0.0.1", lease_db.url.port or 0) as proxy:
        # NullPool: no statement of the test reuses a connection the stall froze.
        far = create_engine(lease_db.url.set(host="127.0.0.1", port=proxy.port), poolclass=NullPool)
        short_ttl, period = 5.0, 0.5
        # timeout=0: no LISTEN connection through the proxy for the stall to leave hanging.
        short = lease_lock(far, unique(), ttl=short_ttl, renew_every=period, timeout=0)
        long = lease_lock(far, unique(), ttl=8.0, renew_every=1.0, timeout=0)
        near = lease_lock(lease_db.engine, unique(), ttl=short_ttl, renew_every=period, timeout=0)
        assert short.acquire()
        assert long.acquire()
        assert near.acquire()
        try:
            acquired = lease_db.row(short.lease_name).renewed_at  # type: ignore[union-attr]
            wait_for(
                lambda: lease_db.row(short.lease_name).renewed_at != acquired,  # type: ignore[union-attr]
                "the far renewer renewed through its connection",
            )
            proxy.stall()
            stalled = time.monotonic()
            near_renewed = lease_db.row(near.lease_name).renewed_at  # type: ignore[union-attr]
            long_renewed = lease_db.row(long.lease_name).renewed_at  # type: ignore[union-attr]

            assert short.lost.wait(short_ttl + 2)
            # Before the database could have let it expire: its last renewal was sent
            # before the stall (and reached the database).
            assert time.monotonic() - stalled <= short_ttl
            with pytest.raises(LockLost) as raised:
                short.ensure_held()
            assert type(raised.value) is LockLost  # nobody could be asked

            # The other database's lease was renewed meanwhile, and is not lost.
            assert lease_db.row(near.lease_name).renewed_at != near_renewed  # type: ignore[union-attr]
            assert not near.lost.is_set()
            # The long lease is renewed through a new connection, past the time it would
            # have expired had its renewals stayed behind the hung one.
            wait_for(
                lambda: lease_db.row(long.lease_name).renewed_at != long_renewed,  # type: ignore[union-attr]
                "the far lease still in time was renewed on a new connection",
            )
            time.sleep(max(0.0, stalled + 8.5 - time.monotonic()))
            assert not long.lost.is_set()
            long.ensure_held()
            near.ensure_held()
        finally:
            long.release()
            near.release()
            with pytest.raises(LockLost):
                short.release()
            far.dispose()


# -- connections that die or do not come ---------------------------------------------------


def end_the_pooled_connection(lease_db: LeaseDatabase, engine: Engine) -> None:
    """End, from the server's side, the one connection idle in ``engine``'s pool of one
    (what an idle-session timeout, a restart or a failover does to a pool)."""
    with engine.connect() as connection:
        session_id = connection.exec_driver_sql(SESSION_ID_SQL[lease_db.kind]).scalar()
    lease_db.end_session(session_id)


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_lease_taken_on_a_pooled_connection_the_server_ended_is_a_typed_error_then_taken(
    lease_db: LeaseDatabase,
) -> None:
    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0)
    try:
        end_the_pooled_connection(lease_db, engine)
        lease = lease_lock(engine, unique(), ttl=30)
        with pytest.raises(LockConnectionLost) as raised:
            lease.acquire()
        assert raised.value.name == lease.name
        assert isinstance(raised.value, ConnectionError)
        assert raised.value.__cause__ is not None
        assert not lease.held
        row = lease_db.row(lease.lease_name)
        assert row is None or row.holder is None
        # The pool discarded the dead connection: the next try takes a fresh one.
        assert lease.acquire()
        lease.release()
    finally:
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_lease_whose_pooled_connection_the_server_ended_while_held_is_released_on_a_fresh_one(
    lease_db: LeaseDatabase,
) -> None:
    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0)
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        assert lease.acquire()
        end_the_pooled_connection(lease_db, engine)
        lease.release()  # no error: the release went out on a new connection
        row = lease_db.row(lease.lease_name)
        assert row is not None
        assert row.holder is None
        assert not lease.lost.is_set()
        other = lease_lock(engine, lease.name, ttl=30, timeout=0)
        assert other.acquire()  # at once, not at the expiry
        other.release()
    finally:
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
@pytest.mark.parametrize("poolclass", [QueuePool, NullPool])
def test_a_lease_released_while_the_database_cannot_be_reached_is_lock_lost(
    lease_db: LeaseDatabase, poolclass: type[Pool]
) -> None:
    # QueuePool: the release meets its pooled connection dead, then cannot open one.
    # NullPool: it cannot open one at all.
    from tests.lease.proxy import TcpProxy

    with TcpProxy(lease_db.url.host or "127.0.0.1", lease_db.url.port or 0) as proxy:
        engine = create_engine(
            lease_db.url.set(host="127.0.0.1", port=proxy.port), poolclass=poolclass
        )
        try:
            lease = lease_lock(engine, unique(), ttl=30)
            assert lease.acquire()
            proxy.cut()
            with pytest.raises(LockLost) as raised:
                lease.release()
            assert type(raised.value) is LockLost  # nobody could be asked: not "stolen"
            assert raised.value.name == lease.name
            assert raised.value.__cause__ is not None
            assert lease.lost.is_set()
            assert not lease.held
        finally:
            engine.dispose()
    # The row stays ours until its expiry: nobody else was let in early.
    row = lease_db.row(lease.lease_name)
    assert row is not None
    assert row.holder is not None
    assert row.expires_in > 20


# How long the lease's own connections wait for another transaction's lock: short, so
# that a release meeting one gives up within the test.
SHORT_LOCK_WAIT: dict[str, dict[str, Any]] = {
    "mariadb": {"init_command": "SET SESSION innodb_lock_wait_timeout = 1"},
    "sqlite": {"timeout": 0.3},
}


def assert_lost_and_kept_until_expiry(lease: Any, lease_db: LeaseDatabase, raised: Any) -> None:
    """A release that could not free the row: LockLost (nobody else holds it), reported,
    and the row still ours until its expiry."""
    assert type(raised.value) is LockLost
    assert raised.value.name == lease.name
    assert raised.value.__cause__ is not None
    assert lease.lost.is_set()
    assert not lease.held
    row = lease_db.row(lease.lease_name)
    assert row is not None
    assert row.holder is not None
    assert row.expires_in > 20


@pytest.mark.parametrize("lease_db", ["sqlite"], indirect=True)
def test_a_sqlite_lease_released_while_another_connection_writes_is_lock_lost(
    lease_db: LeaseDatabase,
) -> None:
    """Another connection keeps SQLite's write lock for longer than the release's busy
    timeout: not the driver's "database is locked", and not a lease that says it was
    freed while its row stays held."""
    engine = create_engine(lease_db.url, connect_args=SHORT_LOCK_WAIT["sqlite"])
    locked, finish = threading.Event(), threading.Event()

    def write() -> None:
        with lease_db.admin.connect() as connection:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
            locked.set()
            assert finish.wait(30)
            connection.exec_driver_sql("ROLLBACK")

    writer = threading.Thread(target=write)
    try:
        lease = lease_lock(engine, unique(), ttl=30, timeout=0)
        assert lease.acquire()
        writer.start()
        assert locked.wait(30)
        with pytest.raises(LockLost) as raised:
            lease.release()
        finish.set()
        writer.join(30)
        assert_lost_and_kept_until_expiry(lease, lease_db, raised)
    finally:
        finish.set()
        if writer.is_alive():
            writer.join(30)
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["mariadb", "sqlite"], indirect=True)
def test_a_release_that_meets_a_fenced_transaction_past_its_lock_wait_is_lock_lost(
    lease_db: LeaseDatabase,
) -> None:
    """A fence held open in another thread: MariaDB's shared row lock and SQLite's write
    lock make the release wait, for the connection's lock wait, then LockLost. (On
    PostgreSQL a fence's KEY SHARE lets the release through at once.)"""
    engine = create_engine(lease_db.url, connect_args=SHORT_LOCK_WAIT[lease_db.kind])
    fenced, finish = threading.Event(), threading.Event()
    lease = lease_lock(engine, unique(), ttl=30, timeout=0)

    def fence() -> None:
        with lease_db.engine.begin() as connection:
            lease.fence(connection)
            fenced.set()
            assert finish.wait(30)

    fencer = threading.Thread(target=fence)
    try:
        assert lease.acquire()
        fencer.start()
        assert fenced.wait(30)
        with pytest.raises(LockLost) as raised:
            lease.release()
        finish.set()
        fencer.join(30)
        assert_lost_and_kept_until_expiry(lease, lease_db, raised)
    finally:
        finish.set()
        if fencer.is_alive():
            fencer.join(30)
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_lease_that_gets_no_connection_raises_what_the_engine_raises(
    lease_db: LeaseDatabase,
) -> None:
    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        # The pool's only connection taken:
        with engine.connect(), pytest.raises(LockConnectionTimeout) as raised:
            lease.acquire()
        assert isinstance(raised.value, sqlalchemy_errors.TimeoutError)
        assert raised.value.name == lease.name
        assert "pool_size + max_overflow" in str(raised.value)
        assert lease.acquire()
        lease.release()
    finally:
        engine.dispose()
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    unreachable = create_engine(lease_db.url.set(host="127.0.0.1", port=port))
    try:
        with pytest.raises(sqlalchemy_errors.OperationalError) as connect_error:
            unreachable.connect()
        with pytest.raises(sqlalchemy_errors.OperationalError) as lease_error:
            lease_lock(unreachable, unique(), ttl=30).acquire()
        assert type(lease_error.value.orig) is type(connect_error.value.orig)
    finally:
        unreachable.dispose()


def end_every_pooled_connection(lease_db: LeaseDatabase, engine: Engine, size: int) -> None:
    """End every connection of ``engine``'s pool of ``size`` (all idle, all opened), as a
    server restart or a failover does."""
    checked_out = [engine.connect() for _ in range(size)]
    session_ids = [
        connection.exec_driver_sql(SESSION_ID_SQL[lease_db.kind]).scalar()
        for connection in checked_out
    ]
    for connection in checked_out:
        connection.close()
    for session_id in session_ids:
        lease_db.end_session(session_id)


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_lease_released_after_a_restart_ended_every_pooled_connection_is_released(
    lease_db: LeaseDatabase,
) -> None:
    engine = create_engine(lease_db.url, pool_size=3, max_overflow=0)
    handled: list[bool] = []
    event.listen(engine, "handle_error", lambda context: handled.append(context.is_disconnect))
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        assert lease.acquire()
        end_every_pooled_connection(lease_db, engine, 3)
        lease.release()  # not on another dead pooled connection: on a new one
        row = lease_db.row(lease.lease_name)
        assert row is not None
        assert row.holder is None
        assert not lease.lost.is_set()
        # The engine heard of the disconnect as it would without the library, and its
        # pool replaced the connections the server had ended: the next lease is taken
        # at once.
        assert True in handled
        assert lease.acquire()
        lease.release()
    finally:
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_lease_released_while_its_pool_lends_nothing_raises_the_pools_refusal_once(
    lease_db: LeaseDatabase,
) -> None:
    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        assert lease.acquire()
        with engine.connect():  # the pool's only connection
            started = time.monotonic()
            with pytest.raises(LockConnectionTimeout) as raised:
                lease.release()
            waited = time.monotonic() - started
        assert raised.value.name == lease.name
        assert waited < 0.2 * 2  # asked the pool once, not again as if a connection died
        assert not lease.lost.is_set()  # not lost: the row stays ours until it expires
    finally:
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["mariadb"], indirect=True)
def test_a_lease_whose_connection_dies_after_its_answer_keeps_the_answer(
    lease_db: LeaseDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection dies after a statement was answered, while the library puts the
    connection's mode back for its pool: the answer stands, and the pool gets no
    connection in the wrong mode. (On MariaDB, where PyMySQL sends the mode to the
    server; psycopg changes it without a round trip.)"""
    from advisory_locks._bindings import sqlalchemy_lease

    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0)
    restore = sqlalchemy_lease.restore_driver_autocommit
    ending: list[bool] = []

    def end_then_restore(dbapi: Any, previous: Any) -> None:
        if ending:
            ending.clear()
            cursor = dbapi.cursor()
            cursor.execute(SESSION_ID_SQL[lease_db.kind])
            (session_id,) = cursor.fetchone()
            cursor.close()
            lease_db.end_session(session_id)
        restore(dbapi, previous)

    monkeypatch.setattr(sqlalchemy_lease, "restore_driver_autocommit", end_then_restore)
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        ending.append(True)
        assert lease.acquire()
        row = lease_db.row(lease.lease_name)
        assert row is not None
        assert row.holder is not None
        assert lease.held
        ending.append(True)
        lease.release()
        row = lease_db.row(lease.lease_name)
        assert row is not None
        assert row.holder is None
        assert not lease.lost.is_set()
        with engine.connect() as connection:  # in the mode the application gave it
            assert connection.connection.dbapi_connection is not None
            assert connection.get_isolation_level() != "AUTOCOMMIT"
    finally:
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["mariadb"], indirect=True)
@pytest.mark.parametrize("taken_meanwhile", [False, True], ids=["free", "taken-meanwhile"])
def test_a_release_whose_answer_was_lost_after_it_freed_the_row_is_a_release(
    lease_db: LeaseDatabase, monkeypatch: pytest.MonkeyPatch, taken_meanwhile: bool
) -> None:
    """MySQL's release is two round trips (the UPDATE, then ROW_COUNT()): the connection
    dies between them, after the row was freed. Sent again on a new connection the
    release finds nothing to free; the row, free with our token still on it, or taken
    by a waiter at a higher token before our lease could have expired, says it was
    ours."""
    from advisory_locks._core.steps import ROWS, Statement
    from advisory_locks._dialects.lease.mysql import MySQLLeaseBackend

    original = MySQLLeaseBackend.release
    ending: list[bool] = []
    waiter: list[Any] = []
    user_names: list[str] = []

    def release_then_die(self: Any, name: str, holder: str, token: int) -> Any:
        session = yield Statement(ROWS, "SELECT CONNECTION_ID()")
        steps = original(self, name, holder, token)
        answer: Any = None
        sent = 0
        while True:
            try:
                statement = steps.send(answer)
            except StopIteration as stop:
                return stop.value
            if sent and ending:  # the UPDATE was answered (and committed): end it now
                ending.clear()
                lease_db.end_session(session[0][0])
                if taken_meanwhile:  # (by the name the user gave, as a waiter would)
                    taken = lease_lock(lease_db.engine, user_names[0], ttl=30, timeout=0)
                    assert taken.acquire()
                    waiter.append(taken)
            sent += 1
            answer = yield statement

    monkeypatch.setattr(MySQLLeaseBackend, "release", release_then_die)
    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0)
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        user_names.append(lease.name)
        assert lease.acquire()
        ending.append(True)
        lease.release()
        assert not ending  # the connection did die between the two statements
        row = lease_db.row(lease.lease_name)
        assert row is not None
        if taken_meanwhile:
            assert row.token == lease.token + 1  # type: ignore[operator]
            assert row.holder is not None
        else:
            assert row.holder is None
        assert not lease.lost.is_set()
    finally:
        monkeypatch.undo()
        for taken in waiter:
            taken.release()
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_lease_statement_interrupted_while_its_connection_is_put_back_leaks_no_connection(
    lease_db: LeaseDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interruption (Ctrl-C, a gevent timeout) while the library puts the connection's
    mode back: it goes on up, and the pool has its connection back all the same."""
    from advisory_locks._bindings import sqlalchemy_lease

    def interrupted(dbapi: Any, previous: Any) -> None:
        raise KeyboardInterrupt

    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0, pool_timeout=1)
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        monkeypatch.setattr(sqlalchemy_lease, "restore_driver_autocommit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            lease.acquire()
        monkeypatch.undo()
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        with engine.connect() as connection:  # the pool lends its connection again
            connection.execute(text("SELECT 1"))
    finally:
        engine.dispose()


@pytest.mark.parametrize("lease_db", ["postgresql", "mariadb"], indirect=True)
def test_a_lease_taken_over_before_a_release_that_met_a_dead_connection_is_stolen(
    lease_db: LeaseDatabase,
) -> None:
    """The lease expired on the server while this process could not tell (its clock
    stopped in a suspend, or a failover lost its last renewals) and another holder took
    it; the release then meets a dead connection. The row, taken before the release
    went out, is not read as one freed by it."""
    engine = create_engine(lease_db.url, pool_size=1, max_overflow=0)
    try:
        lease = lease_lock(engine, unique(), ttl=30)
        assert lease.acquire()
        expire_now(lease_db, lease.lease_name)
        thief = lease_lock(lease_db.engine, lease.name, ttl=30, timeout=0)
        assert thief.acquire()
        try:
            end_the_pooled_connection(lease_db, engine)
            time.sleep(0.2)  # the takeover well before the release goes out
            with pytest.raises(LockStolen):
                lease.release()
            assert lease.lost.is_set()
        finally:
            thief.release()
    finally:
        engine.dispose()


# -- bad input and a missing table ---------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"ttl": 0}, ValueError),
        ({"ttl": -1}, ValueError),
        ({"ttl": float("nan")}, ValueError),
        ({"ttl": float("inf")}, ValueError),
        ({"ttl": "30"}, TypeError),
        ({"ttl": True}, TypeError),
        ({"ttl": MAX_TTL + 1}, ValueError),
        ({"ttl": 1e20}, ValueError),  # the expiry would leave SQLite's and MySQL's dates
        ({"ttl": 1.8e305}, ValueError),
        ({"ttl": 10**400}, ValueError),  # an int too large for a float at all
        ({"ttl": 30, "renew_every": 27}, ValueError),
        ({"ttl": 30, "renew_every": 30}, ValueError),
        ({"ttl": 30, "renew_every": 0}, ValueError),
        ({"ttl": 30, "renew_every": float("nan")}, ValueError),
        ({"ttl": 30, "renew_every": 10**400}, ValueError),
        ({"timeout": -1}, ValueError),
        ({"timeout": float("nan")}, ValueError),
        ({"timeout": 10**400}, ValueError),
        ({"key_prefix": 1.5}, TypeError),
    ],
)
def test_bad_options_are_refused_before_any_connection(
    options: dict[str, Any], error: type
) -> None:
    engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    connects: list[object] = []
    event.listen(engine, "connect", lambda *args: connects.append(args))
    with pytest.raises(error):
        lease_lock(engine, "job", **options)
    assert connects == []


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("", ValueError),
        ("x" * 256, ValueError),
        ("a\x00b", ValueError),
        (42, TypeError),
        (("a", "b"), TypeError),
        (None, TypeError),
    ],
)
def test_bad_names_are_refused_before_any_connection(name: Any, error: type) -> None:
    engine = create_engine("sqlite:///:memory:")
    with pytest.raises(error):
        lease_lock(engine, name, key_prefix="")


def test_the_longest_ttl_and_an_enormous_timeout_hold_a_lease(lease_db: LeaseDatabase) -> None:
    # A century's expiry fits every database's dates, and a finite timeout whose
    # milliseconds overflow a float waits as long as the database allows, no error.
    name = unique()
    lease = lease_lock(lease_db.engine, name, ttl=MAX_TTL, timeout=1.8e305)
    assert lease.acquire()
    try:
        row = lease_db.row(name)
        assert row is not None
        assert row.expires_in > MAX_TTL - 3600
    finally:
        lease.release()
    with lease_lock(lease_db.engine, name, timeout=0) as again:  # released: free again
        assert again.token == 2


def test_renew_every_just_below_ttl_minus_margin_is_accepted() -> None:
    engine = create_engine("sqlite:///:memory:")
    assert lease_lock(engine, "job", ttl=30, renew_every=26.9).options.period == 26.9
    assert lease_lock(engine, "job", ttl=30).options.period == 10.0


def test_a_missing_table_is_an_error_that_says_how_to_create_it(
    lease_db: LeaseDatabase, tmp_path: Any
) -> None:
    url = missing_table_url(lease_db, tmp_path)
    engine = create_engine(url)
    try:
        with pytest.raises(LeaseTableMissing) as raised:
            lease_lock(engine, unique(), timeout=0).acquire()
        message = str(raised.value)
        assert "advisory_locks_lease" in message
        assert "create_lease_table(engine)" in message
        assert "lease_table(metadata)" in message
        assert "migrate" in message
        create_lease_table(engine)
        with lease_lock(engine, unique(), timeout=0) as lease:
            assert lease.token == 1
    finally:
        engine.dispose()
        drop_missing_table_database(lease_db, url)


def missing_table_url(lease_db: LeaseDatabase, tmp_path: Any) -> Any:
    if lease_db.kind == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.sqlite'}"
    scratch = f"lease_missing_{uuid.uuid4().hex[:12]}"
    with lease_db.admin.connect() as connection:
        if lease_db.kind == "postgresql":
            connection.exec_driver_sql(f"CREATE SCHEMA {scratch}")
            return lease_db.url.update_query_dict({"options": f"-csearch_path={scratch}"})
        connection.exec_driver_sql(f"CREATE DATABASE {scratch}")
        return lease_db.url.set(database=scratch)


def drop_missing_table_database(lease_db: LeaseDatabase, url: Any) -> None:
    if lease_db.kind == "postgresql":
        scratch = url.query["options"].split("=")[1]
        with lease_db.admin.connect() as connection:
            connection.exec_driver_sql(f"DROP SCHEMA {scratch} CASCADE")
    elif lease_db.kind == "mariadb":
        with lease_db.admin.connect() as connection:
            connection.exec_driver_sql(f"DROP DATABASE {url.database}")


def test_the_sqlalchemy_table_is_the_table_the_library_uses(
    lease_db: LeaseDatabase, tmp_path: Any
) -> None:
    from sqlalchemy import MetaData

    from advisory_locks.sqlalchemy import lease_table

    url = missing_table_url(lease_db, tmp_path)
    engine = create_engine(url)
    try:
        metadata = MetaData()
        table = lease_table(metadata)
        assert lease_table(metadata) is table
        metadata.create_all(engine)
        name = unique()
        with lease_lock(engine, name, ttl=1.0, timeout=0) as lease:
            wait_for(lambda: bool(renewer().holdings()), "the renewer holds it")
            assert not lease_lock(engine, name, timeout=0).acquire()
            with engine.begin() as connection:
                lease.fence(connection)
        with lease_lock(engine, name, timeout=0) as lease:
            assert lease.token == 2
    finally:
        engine.dispose()
        drop_missing_table_database(lease_db, url)


def test_sqlite_in_memory_cannot_hold_leases() -> None:
    engine = create_engine("sqlite:///:memory:")
    with pytest.raises(advisory_locks.UnsupportedFeature, match="in-memory"):
        lease_lock(engine, "job", timeout=0).acquire()
