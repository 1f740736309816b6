"""Django 5.1+'s native connection pool: no connection goes back to it holding a lock.

The "pooled" alias (tests/django_settings.py) is the default database through a pool of
exactly one connection, so the connection one thread gives back is the one the next
borrower gets. The server counts session locks per connection: a connection given back
with a lock would make its next borrower a second holder, granted "re-entrantly".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import django
import psycopg
import pytest
from django.db import connections, transaction
from psycopg.rows import TupleRow

from advisory_locks_django import LockLost, advisory_lock, current_advisory_locks, lease_lock
from tests.django.real_requests import wsgi_worker
from tests.django.support import (
    end_the_lease_listener,
    holders,
    in_thread,
    run_in_thread,
    server_pid,
)
from tests.helpers import backend_alive, unique_name, wait_for

pytestmark = [
    # tox runs Django 4.2 too; CI runs 5.2, so this never skips there.
    pytest.mark.skipif(django.VERSION < (5, 1), reason="Django's native pool is 5.1+"),
    pytest.mark.postgresql,
    pytest.mark.django_db(transaction=True, databases=["default", "pooled"]),
]

Admin = psycopg.Connection[TupleRow]
POOLED = "pooled"


@pytest.fixture(autouse=True)
def _pool(admin: Admin) -> Iterator[None]:
    yield
    connections[POOLED].close()
    connections[POOLED].close_pool()
    # A blocking lease acquire leaves a LISTEN connection idling on for 10 s.
    end_the_lease_listener(admin)


def test_the_pool_lends_one_connection_to_one_borrower_at_a_time() -> None:
    # What the other specs rely on: the connection given back is the next one lent.
    first = in_thread(lambda: server_pid(POOLED))
    assert in_thread(lambda: server_pid(POOLED)) == first


def test_closing_while_holding_unlocks_before_the_pool_lends_the_connection(
    admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique_name("pool-close")
    closed = threading.Event()
    checked = threading.Event()

    def holder() -> None:
        lock = advisory_lock(name, using=POOLED)
        lock.acquire()
        connections[POOLED].close()  # back to the pool, still the holder's block
        closed.set()
        checked.wait(10)
        with pytest.raises(LockLost, match="gave it back to its pool"):
            lock.ensure_held()
        with pytest.raises(LockLost):
            lock.release()

    with caplog.at_level(logging.WARNING, logger="advisory_locks_django"):
        first = run_in_thread(holder)
        assert closed.wait(10)
        assert holders(admin, name) == []
        # The next borrower gets the same connection and a lock that is really free.
        assert in_thread(lambda: advisory_lock(name, using=POOLED, timeout=0).acquire())
        checked.set()
        first.get()
    assert name in caplog.text


def test_a_lock_a_request_left_held_is_not_lent_with_the_connection(admin: Admin) -> None:
    name = unique_name("pool-request")
    with wsgi_worker() as worker:
        first = worker.request(
            lambda: advisory_lock(name, using=POOLED).acquire() and server_pid(POOLED)
        )
        assert first.status == 200
        assert holders(admin, name) == []
        second = worker.request(lambda: (server_pid(POOLED), current_advisory_locks(POOLED)))
    assert second.body == repr((int(first.body), []))


def test_a_thread_of_another_request_cannot_take_what_a_request_holds(admin: Admin) -> None:
    # Exclusion still holds between two borrowers of the pool in turn: the second waits
    # for the pool, not past the lock.
    name = unique_name("pool-exclusion")
    held = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with advisory_lock(name, using=POOLED):
            held.set()
            done.wait(10)

    holder = run_in_thread(hold)
    assert held.wait(10)
    assert in_thread(lambda: advisory_lock(name, timeout=0).acquire()) is False
    done.set()
    holder.get()
    assert holders(admin, name) == []


def test_a_lease_statement_sent_anew_takes_no_connection_of_the_pool() -> None:
    """A lease's release that met a dead connection is sent again on one opened for it:
    after a restart every idle connection of the pool is dead, so not one of those."""
    from advisory_locks_django.leases import DjangoLeaseSite

    borrowed = DjangoLeaseSite(POOLED).borrow_anew()
    try:
        assert getattr(borrowed.driver, "_pool", None) is None
        # The pool's one connection is still there to lend, to another thread, at once.
        assert in_thread(lambda: server_pid(POOLED)) != borrowed.driver.info.backend_pid
    finally:
        borrowed.settle()


def test_a_lease_whose_pooled_connection_the_server_ended_is_released_at_once(
    admin: Admin,
) -> None:
    name = unique_name("pool-lease")

    def hold_then_release() -> bool:
        lease = lease_lock(name, using=POOLED, ttl=30, timeout=0, key_prefix="")
        assert lease.acquire()
        pid = server_pid(POOLED)
        connections[POOLED].close()  # back to the pool, idle
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(lambda: not backend_alive(admin, pid), "the backend has exited")
        lease.release()  # on the dead connection, then anew
        return lease.lost.is_set()

    assert in_thread(hold_then_release) is False
    holder = admin.execute(
        "SELECT holder FROM advisory_locks_lease WHERE name = %s", [name]
    ).fetchone()
    assert holder == (None,)


def test_a_lease_held_while_its_thread_keeps_the_pools_one_connection_is_renewed(
    admin: Admin,
) -> None:
    """The renewer's connection is its own, not one of the pool's: a request that holds
    a lease keeps its pooled connection for as long as it runs, so with a pool of one
    (or one request per pooled connection) a renewer waiting on the pool never renews."""
    name = unique_name("pool-renew")

    def hold_across_renewals() -> tuple[bool, float]:
        lease = lease_lock(name, using=POOLED, ttl=1.5, renew_every=0.3, timeout=0, key_prefix="")
        with lease:
            pid = server_pid(POOLED)  # this thread keeps the pool's one connection
            # Long enough for the lease to expire three times over, unless renewed.
            lease.lost.wait(4.5)
            assert server_pid(POOLED) == pid
            left = admin.execute(
                "SELECT extract(epoch FROM expires_at - now()) FROM advisory_locks_lease"
                " WHERE name = %s",
                [name],
            ).fetchone()
            assert left is not None
            return lease.lost.is_set(), float(left[0])

    lost, seconds_left = in_thread(hold_across_renewals)
    assert lost is False
    assert seconds_left > 0.5


def test_a_lease_waiters_listen_connection_is_none_of_the_pools(admin: Admin) -> None:
    """The waiters' LISTEN connection is its own too: the waiter's thread keeps the
    pool's one connection while it waits, and no connection that LISTENs goes back to
    the pool for a request to inherit."""
    name = unique_name("pool-listen")
    held = threading.Event()
    release = threading.Event()
    pooled_pid: list[int] = []

    def holder() -> None:
        # timeout=0: a blocking acquire would start a listener of its own.
        with lease_lock(name, using="default", ttl=30, timeout=0, key_prefix=""):
            held.set()
            release.wait(20)

    def wait_on_the_pool() -> list[str]:
        pooled_pid.append(server_pid(POOLED))  # this thread keeps the pool's connection
        lease = lease_lock(name, using=POOLED, ttl=30, timeout=15, key_prefix="")
        assert lease.acquire()
        lease.release()
        with connections[POOLED].cursor() as cursor:
            cursor.execute("SELECT pg_listening_channels()")
            return [row[0] for row in cursor.fetchall()]

    end_the_lease_listener(admin)  # one an earlier test left idling
    holding = run_in_thread(holder)
    assert held.wait(10)
    waiting = run_in_thread(wait_on_the_pool)
    # A listener that asked the pool for its connection would still be waiting for it.
    listening = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND query = 'LISTEN advisory_locks_lease'"
    )
    wait_for(lambda: admin.execute(listening).fetchall(), "a LISTEN connection")
    assert pooled_pid
    assert [pid for (pid,) in admin.execute(listening).fetchall()] != pooled_pid
    release.set()
    assert waiting.get() == []
    holding.get()
    # The pool's connection, given back by the waiter, is lent again at once, LISTENing
    # on nothing: the listener did not take it to keep while it idles.
    assert in_thread(lambda: server_pid(POOLED)) == pooled_pid[0]


def test_a_lease_taken_inside_atomic_on_a_pool_of_one_takes_no_second_pooled_connection(
    admin: Admin,
) -> None:
    """Inside atomic() a lease statement runs on a connection of its own. One asked of the
    pool would wait behind the thread's own (forever, with a pool of one; with a pool of
    n, as soon as n threads are inside atomic())."""
    name = unique_name("pool-atomic")

    def in_atomic() -> tuple[int, list[tuple[int | None]]]:
        with transaction.atomic(using=POOLED):
            pid = server_pid(POOLED)
            with lease_lock(name, using=POOLED, ttl=30, timeout=0, key_prefix="") as lease:
                lease.ensure_held()
                with transaction.atomic(using=POOLED):
                    lease.fence()
                token = lease.token
            assert server_pid(POOLED) == pid
        return token, admin.execute(
            "SELECT holder IS NULL FROM advisory_locks_lease WHERE name = %s", [name]
        ).fetchall()

    assert in_thread(in_atomic) == (1, [(True,)])
