"""Django as it is deployed, on PostgreSQL, MariaDB and SQLite: persistent connections
across requests, connections killed under a request, forked workers, and async views
that give up waiting.

Requests here are real: a WSGI server worker thread (tests/django/real_requests.py) or
WSGIHandler called in place, so request_started, request_finished and Django's own
close_old_connections() run as in production. Django 5.1+'s native pool is
tests/django/test_django_pool.py (PostgreSQL only).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from advisory_locks import LockConnectionLost, LockLost, UnsupportedFeature
from advisory_locks_django import advisory_lock, current_advisory_locks
from tests.databases import psycopg_connect
from tests.django.real_requests import asgi_request, handle_request, wsgi_worker
from tests.django.support import in_thread, run_in_thread
from tests.faults.conftest import inject
from tests.faults.pgbouncer import TRANSACTION_POOL, PgBouncer
from tests.faults.servers import FaultDatabase, postgres_holder
from tests.helpers import backend_alive, holder_pids, unique_name, wait_for

pytestmark = pytest.mark.faults


@pytest.fixture
def holder(database: FaultDatabase, django_alias: str) -> Iterator[Any]:
    """Who holds a name on the database behind ``django_alias``, seen from outside.

    On PostgreSQL that alias is the test database pytest-django made (when a test that
    needs tables ran first), which pg_locks tells apart from the server's own.
    """
    if database.name != "postgresql":
        yield database.holder
        return
    with psycopg_connect(
        database.url.set(database=connections.settings[django_alias]["NAME"]), autocommit=True
    ) as admin:
        yield postgres_holder(admin)


@pytest.fixture
def persistent_alias(django_alias: str) -> Iterator[str]:
    """``django_alias`` with persistent connections (``CONN_MAX_AGE``), as most sites run."""
    settings = connections.settings[django_alias]
    previous = settings.get("CONN_MAX_AGE", 0)
    settings["CONN_MAX_AGE"] = 600
    yield django_alias
    settings["CONN_MAX_AGE"] = previous


def _free(name: str, alias: str) -> bool:
    """Whether another connection can take ``name`` right now (and gives it back)."""

    def try_lock() -> bool:
        lock = advisory_lock(name, using=alias, timeout=0)
        if not lock.acquire():
            return False
        lock.release()
        return True

    return bool(in_thread(try_lock))


# -- persistent connections: what a request leaves held ends with the request -------------


def test_a_lock_a_request_left_held_is_released_when_the_request_ends(
    holder: Any, persistent_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique_name("django-request-leak")
    box: dict[str, Any] = {}

    def leak() -> bool:
        box["lock"] = lock = advisory_lock(name, using=persistent_alias)
        granted = lock.acquire()
        box["connection"] = connections[persistent_alias].connection
        return granted

    with caplog.at_level(logging.WARNING, logger="advisory_locks_django"), wsgi_worker() as worker:
        assert worker.request(leak).body == "True"
        inject("Django request ended holding a lock")
        assert holder(name) is None
        assert name in caplog.text
        # The next request runs on the same, still open, connection, which holds nothing.
        after = worker.request(
            lambda: (
                connections[persistent_alias].connection is box["connection"],
                current_advisory_locks(persistent_alias),
            )
        )
        assert after.body == "(True, [])"
        # The forgetful holder learns it wherever it looks next.
        lost = worker.request(lambda: box["lock"].ensure_held())
    assert isinstance(lost.error, LockLost)
    assert "the request it was taken in ended" in str(lost.error)


def test_a_lock_taken_outside_any_request_outlives_requests_in_its_thread(
    holder: Any, persistent_alias: str
) -> None:
    # A management command or a worker thread holding a lock while it also handles a
    # request (or a test that holds one around the test client) keeps it.
    name = unique_name("django-outside-request")
    with advisory_lock(name, using=persistent_alias) as lock:
        assert handle_request(lambda: current_advisory_locks(persistent_alias)).status == 200
        assert holder(name) is not None
        lock.ensure_held()
    assert holder(name) is None


# -- a killed connection: LockLost, a typed error, and the next request reconnects --------


def test_a_lock_whose_connection_is_killed_mid_request_is_lost_and_the_next_request_reconnects(
    database: FaultDatabase, persistent_alias: str
) -> None:
    name = unique_name("django-killed-in-request")
    holding, killed = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    def hold_through_the_kill() -> str:
        lock = advisory_lock(name, using=persistent_alias)
        lock.acquire()
        box["connection"] = connections[persistent_alias].connection
        holding.set()
        assert killed.wait(10)
        with pytest.raises(LockLost):
            lock.ensure_held()
        with pytest.raises(LockLost):
            lock.release()
        return "lost"

    with wsgi_worker() as worker:
        first = run_in_thread(lambda: worker.request(hold_through_the_kill))
        assert holding.wait(10)
        database.kill([box["connection"]])
        killed.set()
        response = first.get()
        assert response.error is None
        assert response.body == "'lost'"
        again = worker.request(
            lambda: (
                advisory_lock(name, using=persistent_alias, timeout=0).acquire(),
                connections[persistent_alias].connection is not box["connection"],
            )
        )
    assert again.body == "(True, True)"


def test_taking_a_lock_on_a_killed_connection_is_a_typed_error_and_the_next_request_works(
    database: FaultDatabase, holder: Any, persistent_alias: str
) -> None:
    name = unique_name("django-acquire-killed")
    box: dict[str, Any] = {}

    def connect() -> None:
        connections[persistent_alias].ensure_connection()
        box["connection"] = connections[persistent_alias].connection

    with wsgi_worker() as worker:
        assert worker.request(connect).status == 200
        database.kill([box["connection"]])
        failed = worker.request(lambda: advisory_lock(name, using=persistent_alias).acquire())
        assert isinstance(failed.error, LockConnectionLost), failed.error
        assert isinstance(failed.error, ConnectionError)
        assert failed.error.name == name
        assert "connection" in str(failed.error)
        again = worker.request(
            lambda: advisory_lock(name, using=persistent_alias, timeout=0).acquire()
        )
    assert again.body == "True"
    assert holder(name) is None


@pytest.mark.postgresql
def test_a_lock_whose_session_the_server_ended_for_idling_is_lost(
    pg_admin: Any, django_db_blocker: Any
) -> None:
    # idle_session_timeout (57P05) is no error code a driver names "connection gone";
    # Django's own health check tells, and Django reconnects for the next lock.
    name = unique_name("django-idle-session")
    with django_db_blocker.unblock():
        lock = advisory_lock(name)
        lock.acquire()
        connections["default"].cursor().execute("SET idle_session_timeout = 100")
        pid = connections["default"].connection.info.backend_pid
        wait_for(lambda: not backend_alive(pg_admin, pid), "the server ended the idle session")
        inject("idle session timeout")
        with pytest.raises(LockLost, match="connection"):
            lock.ensure_held()
        with pytest.raises(LockLost):
            lock.release()
        again = advisory_lock(name, timeout=0)
        assert again.acquire() is True
        again.release()
        connections["default"].close()


# -- fork: a child never releases its parent's lock -----------------------------------------


def _child_of_a_lock_holder(lock: Any, alias: str, name: str, report: Any) -> None:
    try:
        lock.__exit__(None, None, None)  # leaves the inherited `with` block
        del lock
        gc.collect()  # and drops its copy of the lock object
        # A pre-forked worker's first request: Django closes the inherited connection at
        # its start (CONN_MAX_AGE=0), and the view locks on a connection of its own.
        response = handle_request(lambda: advisory_lock(name, using=alias, timeout=0).acquire())
        assert response.error is None, response.error
        assert response.body == "False", "the child was granted its parent's lock"
        connections.close_all()
        report.send("ok")
    except BaseException:
        report.send(traceback.format_exc())


# Python 3.12+ warns about forking a process with threads (the test run has some);
# gunicorn forks from a master without any, which is the shape this stands for.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_never_releases_its_parents_lock(holder: Any, django_alias: str) -> None:
    name = unique_name("django-fork")
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    with advisory_lock(name, using=django_alias) as lock:
        child = context.Process(
            target=_child_of_a_lock_holder, args=(lock, django_alias, name, sending)
        )
        child.start()
        inject("forked child")
        child.join(60)
        assert receiving.poll(5)
        assert receiving.recv() == "ok"
        assert holder(name) is not None
        lock.ensure_held()
        assert not _free(name, django_alias)
    assert holder(name) is None


def _child_of_a_connection_that_locked(alias: str, name: str, report: Any) -> None:
    try:
        with advisory_lock(name, using=alias, timeout=0):
            report.send("held")
        connections.close_all()
    except BaseException:
        report.send(traceback.format_exc())


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_locks_on_a_connection_of_its_own_after_its_parent_locked(
    holder: Any, django_alias: str
) -> None:
    # The parent's connection has lent its borrow for session locks already; the child's
    # copy of it must not be lent again (it is the parent's session), but replaced.
    with advisory_lock(unique_name("django-fork-first"), using=django_alias):
        pass
    name = unique_name("django-fork-own")
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(
        target=_child_of_a_connection_that_locked, args=(django_alias, name, sending)
    )
    child.start()
    child.join(60)
    assert receiving.poll(5)
    assert receiving.recv() == "held"
    assert holder(name) is None
    with advisory_lock(name, using=django_alias, timeout=0):  # the parent's session is intact
        assert holder(name) is not None


def _child_of_a_connection_no_lock_used(
    alias: str, name: str, action: str, checked: Any, report: Any
) -> None:
    try:
        if action == "lock":
            lock = advisory_lock(name, using=alias, timeout=0)
            report.send("held" if lock.acquire() else "busy")
            assert checked.wait(60)
            lock.release()
        connections.close_all()  # Django's close of the inherited connection, or its own
        report.send("closed")
    except BaseException:
        report.send(traceback.format_exc())


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("action", ["lock", "close only"])
def test_a_forked_child_leaves_a_connection_its_parent_opened_and_never_locked_on_alone(
    action: str, holder: Any, django_alias: str
) -> None:
    # The library first meets this connection in the child. Its socket, open at the fork,
    # says it is the parent's: the child's lock goes on a connection of its own (else it
    # would be held by the parent's session, and the parent's own lock there counted as a
    # re-entry: two holders), and closing the child's copy leaves the parent's session up.
    wrapper = connections[django_alias]
    with wrapper.cursor() as cursor:  # opened and used by the parent, for no lock
        cursor.execute("SELECT 1")
    parents = wrapper.connection
    name = unique_name("django-fork-unseen")
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    checked = context.Event()
    child = context.Process(
        target=_child_of_a_connection_no_lock_used,
        args=(django_alias, name, action, checked, sending),
    )
    child.start()
    inject("forked child")
    try:
        if action == "lock":
            assert receiving.poll(30)
            assert receiving.recv() == "held"
            # The parent, on its own connection, is excluded by the child's lock.
            assert not advisory_lock(name, using=django_alias, timeout=0).acquire()
    finally:
        checked.set()
        child.join(60)
    assert receiving.poll(5)
    assert receiving.recv() == "closed"
    assert holder(name) is None
    assert wrapper.connection is parents
    with wrapper.cursor() as cursor:  # the parent's session outlived the child's close
        cursor.execute("SELECT 1")
    with advisory_lock(name, using=django_alias, timeout=0):
        assert holder(name) is not None


# -- poolers: a connection refused once is refused at every lock ------------------------------


def test_every_session_lock_through_an_undeclared_transaction_pooler_is_refused(
    pgbouncer: PgBouncer, pg_admin: Any, django_db_blocker: Any
) -> None:
    # The first lock asks the server and finds statements running in another session
    # than the driver connected to; the connection's borrow is made before that check,
    # and the next lock must not be lent it without asking (a session lock through
    # transaction pooling can end up held on another client's server connection).
    inject("PgBouncer transaction pooling (Django)")
    settings = connections.settings["default"]
    saved = {key: settings[key] for key in ("HOST", "PORT", "NAME")}
    url = pgbouncer.url(TRANSACTION_POOL)
    name = unique_name("django-pooler")
    connections["default"].close()
    settings.update(HOST=url.host, PORT=url.port, NAME=url.database)
    try:
        with django_db_blocker.unblock():
            for _ in range(2):
                with pytest.raises(UnsupportedFeature, match="pooler or proxy"):
                    advisory_lock(name).acquire()
            assert holder_pids(pg_admin, name) == []
    finally:
        connections["default"].close()
        settings.update(saved)


# -- cancellation: an abandoned wait is never granted ---------------------------------------


def _hold_until(
    name: str,
    alias: str,
    release: threading.Event,
    seconds: float,
    let_go: threading.Event | None = None,
) -> Any:
    """Hold ``name`` in a thread until ``release`` is set (``seconds`` at most); set
    ``let_go`` once the lock is released."""
    held = threading.Event()

    def hold() -> None:
        try:
            with advisory_lock(name, using=alias):
                held.set()
                release.wait(seconds)
        finally:
            if let_go is not None:
                let_go.set()

    holder = run_in_thread(hold)
    assert held.wait(10)
    return holder


async def test_an_abandoned_async_acquire_is_never_granted_afterwards(
    holder: Any, django_alias: str
) -> None:
    name = unique_name("django-cancel")
    release, let_go = threading.Event(), threading.Event()
    holding = await sync_to_async(_hold_until, thread_sensitive=False)(
        name, django_alias, release, 30, let_go
    )
    try:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(advisory_lock(name, using=django_alias).aacquire(), 0.2)
        inject("async acquire cancelled")
        # The cancellation ended the wait, not the holder letting go (it holds until told).
        assert not let_go.is_set()
    finally:
        release.set()
        await sync_to_async(holding.get, thread_sensitive=False)()
        # The thread that ran the abandoned wait goes on to other work; its connection
        # must hold nothing (on a server, the abandoned waiter was first in line).
        assert await sync_to_async(current_advisory_locks)(django_alias) == []
    assert await sync_to_async(_free, thread_sensitive=False)(name, django_alias)
    await sync_to_async(connections.close_all)()
    assert holder(name) is None


def _give_up_after_a_moment(name: str, alias: str) -> Any:
    async def give_up() -> str:
        try:
            await asyncio.wait_for(advisory_lock(name, using=alias).aacquire(), 0.2)
        except asyncio.TimeoutError:
            return "gave up"
        return "granted"

    return give_up


async def test_wait_for_in_an_async_view_under_asgi_answers_at_its_timeout(
    database: FaultDatabase, django_alias: str
) -> None:
    name = unique_name("django-asgi-view")
    release, let_go = threading.Event(), threading.Event()
    # The holder lets go only when told (30 s at the latest): without cancellation
    # reaching the wait, the view would answer only after that.
    holding = await sync_to_async(_hold_until, thread_sensitive=False)(
        name, django_alias, release, 30, let_go
    )
    try:
        response = await asgi_request(_give_up_after_a_moment(name, django_alias))
        inject("async acquire cancelled")
        answered_while_held = not let_go.is_set()
    finally:
        release.set()
        await sync_to_async(holding.get, thread_sensitive=False)()
    assert response.body == "'gave up'", response.error
    assert answered_while_held
    assert await sync_to_async(_free, thread_sensitive=False)(name, django_alias)


def test_wait_for_in_an_async_view_answers_at_its_timeout(
    database: FaultDatabase, django_alias: str
) -> None:
    name = unique_name("django-async-view")
    release, let_go = threading.Event(), threading.Event()

    # The holder lets go only when told (30 s at the latest): without cancellation
    # reaching the wait, the view would answer only after that.
    holder = _hold_until(name, django_alias, release, 30, let_go)
    with wsgi_worker() as worker:
        response = worker.async_request(_give_up_after_a_moment(name, django_alias))
        inject("async acquire cancelled")
        answered_while_held = not let_go.is_set()
        release.set()
        holder.get()
        wait_for(lambda: _free(name, django_alias), "the lock is free once its holder let go")
    assert response.body == "'gave up'", response.error
    assert answered_while_held
