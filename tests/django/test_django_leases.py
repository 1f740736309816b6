"""``advisory_locks_django.lease_lock``: lease locks on Django's databases.

The table is made by the app's migration (pytest-django migrates the PostgreSQL test
database); a SQLAlchemy worker in another process, on the same database, excludes a
Django worker by name and the other way round. MariaDB and SQLite aliases get the table
from the migration's own function.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import RequestFactory, override_settings
from sqlalchemy.engine import URL

from advisory_locks import LockConnectionLost, LockLost
from advisory_locks_django import (
    LockNotAcquired,
    LockStolen,
    UnsupportedFeature,
    lease_lock,
)
from advisory_locks_django.checks import check_settings
from advisory_locks_django.models import Lease
from tests.django.support import end_the_lease_listener, run_in_thread
from tests.django_aliases import aim_django_alias
from tests.helpers import backend_alive, unique_name, wait_for

PROCESS_SECONDS = 60.0


def _url_of_default(postgres_url: URL) -> URL:
    return postgres_url.set(database=connections["default"].settings_dict["NAME"])


def _sqlalchemy_worker(url: URL, name: str, script: str) -> subprocess.Popen[str]:
    """A process that uses SQLAlchemy only, on ``url``, with ``lease`` and ``engine``."""
    code = textwrap.dedent(
        f"""
        import sys
        from sqlalchemy import create_engine
        from advisory_locks import lease_lock, LockNotAcquired
        engine = create_engine({url.render_as_string(hide_password=False)!r})
        name = {name!r}
        """
    ) + textwrap.dedent(script)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "ADVISORY_LOCKS_PREFIX": ""},
    )


def _create_table(alias: str) -> None:
    from advisory_locks._dialects.lease import lease_backend_for_dialect

    wrapper = connections[alias]
    with wrapper.cursor() as cursor:
        for sql in lease_backend_for_dialect(wrapper.vendor).create_table():
            cursor.execute(sql)


# -- PostgreSQL: the migrated test database -------------------------------------------------


@pytest.mark.postgresql
@pytest.mark.django_db(transaction=True)
class TestOnPostgreSQL:
    @pytest.fixture(autouse=True)
    def _no_listener_left(self, admin: Any) -> Iterator[None]:
        # A waiting acquire opens the LISTEN connection, which idles on for 10 s and
        # would keep pytest-django from dropping the test database after a short run.
        yield
        end_the_lease_listener(admin)

    def test_with_block_holds_a_row_of_the_lease_model_with_its_token(self) -> None:
        name = unique_name("lease")
        with lease_lock(name, ttl=10, key_prefix="") as lease:
            row = Lease.objects.get(name=name)
            assert (row.token, lease.token) == (1, 1)
            assert row.holder is not None
            assert lease.held
            assert not lease.lost.is_set()
            lease.ensure_held()
            # Another holder (another object, same thread) is refused.
            assert not lease_lock(name, timeout=0, key_prefix="").acquire()
        assert Lease.objects.get(name=name).holder is None
        with lease_lock(name, key_prefix="") as again:
            assert again.token == 2

    def test_fence_runs_inside_atomic_and_refuses_outside(self) -> None:
        name = unique_name("lease")
        with lease_lock(name, key_prefix="") as lease:
            with pytest.raises(UnsupportedFeature, match="atomic"):
                lease.fence()
            with transaction.atomic():
                lease.fence()
                # Acquire/release inside atomic() commit on their own connection.
                other = lease_lock(unique_name("lease"), key_prefix="")
                assert other.acquire()
                other.release()
            assert Lease.objects.get(name=name).holder is not None

    def test_a_stolen_lease_is_refused_by_fence_and_reported_at_exit(self) -> None:
        name = unique_name("lease")
        lease = lease_lock(name, ttl=30, key_prefix="")

        def stolen_inside() -> None:
            with lease:
                with connections["default"].cursor() as cursor:
                    cursor.execute(
                        "UPDATE advisory_locks_lease SET holder = 'thief', token = token + 1 "
                        "WHERE name = %s",
                        [name],
                    )
                with pytest.raises(LockStolen), transaction.atomic():
                    lease.fence()
                assert lease.lost.is_set()

        # The block itself did not raise: its exit reports the loss.
        with pytest.raises(LockStolen, match="thief"):
            stolen_inside()

    def test_manual_transaction_mode_leaves_the_lease_out_of_the_apps_transaction(
        self, admin: Any
    ) -> None:
        # With autocommit off and no atomic(), the thread's connection is in a transaction
        # the application ends when it likes: a lease written there would be undone by its
        # rollback (and invisible to other holders until its commit).
        name = unique_name("lease")

        def holder() -> Any:
            row = admin.execute(
                "SELECT holder FROM advisory_locks_lease WHERE name = %s", [name]
            ).fetchone()
            return None if row is None else row[0]

        transaction.set_autocommit(False)
        try:
            lease = lease_lock(name, ttl=30, key_prefix="")
            assert lease.acquire()
            assert holder() is not None  # committed: other connections see it held
            transaction.rollback()
            assert holder() is not None
            lease.ensure_held()
            lease.release()
            assert holder() is None
            transaction.rollback()
        finally:
            transaction.set_autocommit(True)

    def test_lease_signals_report_grant_refusal_loss_and_release(self) -> None:
        from advisory_locks_django import (
            DjangoLeaseLock,
            lease_acquired,
            lease_failed,
            lease_lost,
            lease_released,
            lock_acquired,
        )

        name = unique_name("lease")
        sent: list[tuple[str, dict[str, Any]]] = []

        def receiver(signal_name: str) -> Any:
            def receive(sender: Any, **kwargs: Any) -> None:
                assert sender is DjangoLeaseLock
                if kwargs["name"] == name:
                    sent.append((signal_name, kwargs))

            return receive

        receivers = {
            signal: receiver(label)
            for signal, label in (
                (lease_acquired, "acquired"),
                (lease_failed, "failed"),
                (lease_lost, "lost"),
                (lease_released, "released"),
                (lock_acquired, "lock_acquired"),
            )
        }
        for signal, receive in receivers.items():
            signal.connect(receive)
        lease = lease_lock(name, ttl=30, key_prefix="")

        def stolen_inside() -> None:
            with lease:
                assert not lease_lock(name, timeout=0, key_prefix="").acquire()
                with connections["default"].cursor() as cursor:
                    cursor.execute(
                        "UPDATE advisory_locks_lease SET holder = 'thief', token = token + 1 "
                        "WHERE name = %s",
                        [name],
                    )
                lease.ensure_held()

        try:
            with pytest.raises(LockStolen):
                stolen_inside()
        finally:
            for signal, receive in receivers.items():
                signal.disconnect(receive)
        assert [label for label, _ in sent] == ["acquired", "failed", "released", "lost"]
        acquired, failed, released, lost = (kwargs for _, kwargs in sent)
        assert (acquired["using"], acquired["token"]) == ("default", lease.token)
        assert acquired["waited"] >= 0
        assert (failed["reason"], failed["token"]) == ("busy", None)
        assert released["reason"] == "stolen"
        assert (lost["reason"], type(lost["error"])) == ("stolen", LockStolen)

    async def test_async_code_is_told_what_to_use_instead(self) -> None:
        with pytest.raises(UnsupportedFeature, match="sync_to_async"):
            async with lease_lock(unique_name("lease"), key_prefix=""):
                pass
        with pytest.raises(UnsupportedFeature, match="async bind"):

            @lease_lock("job", key_prefix="")
            async def job() -> None:
                pass

    def test_decorator_formats_the_name_and_skips_when_held(self) -> None:
        calls: list[int] = []

        @lease_lock("lease-job-{account}", key_prefix=unique_name("prefix"), timeout=0)
        def sync(account: int) -> str:
            calls.append(account)
            return "ran"

        @lease_lock("{account}", key_prefix="", timeout=0, skip_if_locked=True)
        def skipped(account: str) -> str:
            return "ran"

        assert sync(7) == "ran"
        assert calls == [7]
        name = unique_name("lease")
        with lease_lock(name, key_prefix=""):
            assert skipped(name) is None
        assert skipped(name) == "ran"

    def test_the_renewer_keeps_the_lease_without_the_threads_connection(self) -> None:
        name = unique_name("lease")
        with lease_lock(name, ttl=1.5, key_prefix="") as lease:
            connections["default"].close()  # the renewer has its own
            first = Lease.objects.get(name=name).renewed_at
            wait_for(
                lambda: Lease.objects.get(name=name).renewed_at > first,
                "a renewal of the lease",
            )
            time.sleep(1.6)  # past the ttl: only renewals keep it
            lease.ensure_held()
            assert Lease.objects.get(name=name).token == lease.token

    def test_notify_wakes_a_blocked_waiter_promptly(self, admin: Any) -> None:
        name = unique_name("lease")
        holder = lease_lock(name, ttl=30, key_prefix="")
        assert holder.acquire()
        pids: list[int] = []
        acquired_at: list[float] = []

        def wait() -> None:
            connections["default"].ensure_connection()
            pids.append(connections["default"].connection.info.backend_pid)
            with lease_lock(name, timeout=20, key_prefix=""):
                acquired_at.append(time.monotonic())

        waiter = run_in_thread(wait)

        def failed_first_attempt() -> bool:
            # After a refused upsert the waiter reads the row's expiry, then sleeps.
            row = admin.execute(
                "SELECT state, query FROM pg_stat_activity WHERE pid = %s",
                [pids[0] if pids else 0],
            ).fetchone()
            return row is not None and row[0] == "idle" and "acquired_at" in row[1]

        try:
            wait_for(failed_first_attempt, "the waiter failed its first attempt")
            released_at = time.monotonic()
            holder.release()
            waiter.get()
        finally:
            end_the_lease_listener(admin)
        # Without NOTIFY the waiter would sleep until the expiry it read (capped at 2 s).
        assert acquired_at[0] - released_at < 1.0

    def test_a_lease_on_a_connection_the_server_ended_is_a_typed_error_then_released_anew(
        self, admin: Any
    ) -> None:
        def end_the_threads_connection() -> None:
            connections["default"].ensure_connection()
            pid = connections["default"].connection.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
            wait_for(lambda: not backend_alive(admin, pid), "the backend has exited")

        name = unique_name("lease")
        lease = lease_lock(name, ttl=30, timeout=0, key_prefix="")
        end_the_threads_connection()
        with pytest.raises(LockConnectionLost) as raised:
            lease.acquire()
        assert raised.value.name == name
        assert not lease.held
        assert lease.acquire()  # Django opened a new connection
        end_the_threads_connection()
        lease.release()  # sent again, on a new connection
        assert Lease.objects.get(name=name).holder is None
        assert not lease.lost.is_set()

    def test_lease_ttl_setting_is_the_default_and_checked(self) -> None:
        with override_settings(ADVISORY_LOCKS={"LEASE_TTL": 12}):
            assert lease_lock(unique_name("lease")).ttl == 12.0
        for bad in (0, -1, float("nan"), "30", True, 1e20):
            with override_settings(ADVISORY_LOCKS={"LEASE_TTL": bad}):
                assert [error.id for error in check_settings()] == ["advisory_locks.E009"]
        with pytest.raises(ValueError, match="renew_every"):
            lease_lock(unique_name("lease"), ttl=3, renew_every=3)

    def test_admin_lists_holder_token_and_expires_in_read_only(self) -> None:
        from django.contrib import admin

        from advisory_locks_django.admin import LeaseAdmin

        name = unique_name("lease")
        request = RequestFactory().get("/")
        model_admin = LeaseAdmin(Lease, admin.AdminSite())
        with lease_lock(name, ttl=30, key_prefix="") as lease:
            row = model_admin.get_queryset(request).get(name=name)
            shown = model_admin.expires_in(row)
            assert 25.0 < float(shown.rstrip("s")) <= 30.0
            assert (row.holder, row.token) == (Lease.objects.get(name=name).holder, lease.token)
        row = model_admin.get_queryset(request).get(name=name)
        assert model_admin.expires_in(row) == "free"
        assert not model_admin.has_add_permission(request)
        assert not model_admin.has_change_permission(request, row)
        assert not model_admin.has_delete_permission(request, row)
        assert {"holder", "token", "expires_in"} <= set(model_admin.list_display)

    def test_a_django_and_a_sqlalchemy_worker_exclude_each_other(self, postgres_url: URL) -> None:
        name = unique_name("lease")
        url = _url_of_default(postgres_url)
        # SQLAlchemy holds it: Django is refused until the SQLAlchemy process releases.
        worker = _sqlalchemy_worker(
            url,
            name,
            """
            with lease_lock(engine, name, ttl=30, key_prefix="") as lease:
                print("held", lease.token, flush=True)
                sys.stdin.readline()
            print("released", flush=True)
            """,
        )
        try:
            assert worker.stdout is not None
            assert worker.stdin is not None
            assert worker.stdout.readline().split() == ["held", "1"]
            assert not lease_lock(name, timeout=0, key_prefix="").acquire()
            worker.stdin.write("\n")
            worker.stdin.flush()
            assert worker.stdout.readline().strip() == "released"
            assert worker.wait(PROCESS_SECONDS) == 0
        finally:
            worker.kill()
        # Django holds it: SQLAlchemy is refused, and takes it (token 3) once released.
        with lease_lock(name, key_prefix="") as lease:
            assert lease.token == 2
            refused = _sqlalchemy_worker(
                url,
                name,
                """
                print(lease_lock(engine, name, timeout=0, key_prefix="").acquire())
                """,
            )
            out, err = refused.communicate(timeout=PROCESS_SECONDS)
            assert (out.strip(), refused.returncode) == ("False", 0), err
        taker = _sqlalchemy_worker(
            url,
            name,
            """
            with lease_lock(engine, name, timeout=0, key_prefix="") as lease:
                print(lease.token)
            """,
        )
        out, err = taker.communicate(timeout=PROCESS_SECONDS)
        assert (out.strip(), taker.returncode) == ("3", 0), err


# -- MariaDB and SQLite ---------------------------------------------------------------------


@pytest.fixture(params=["mysql", "sqlite"])
def lease_alias(
    request: pytest.FixtureRequest, tmp_path: Path, django_db_blocker: Any
) -> Iterator[tuple[str, URL]]:
    alias: str = request.param
    if alias == "mysql":
        url: URL = request.getfixturevalue("mysql_url")
        # The alias keeps its test database if pytest-django made one (an earlier test
        # asked for it): the SQLAlchemy worker must use the database the alias uses.
        url = url.set(database=aim_django_alias("mysql", url)["NAME"])
    else:
        url = URL.create("sqlite", database=str(tmp_path / "leases.sqlite3"))
        aim_django_alias("sqlite", url, tmp_path / "leases.sqlite3")
    with django_db_blocker.unblock():
        _create_table(alias)
        yield alias, url
        connections[alias].close()


def test_leases_on_mariadb_and_sqlite_exclude_a_sqlalchemy_worker(
    lease_alias: tuple[str, URL],
) -> None:
    alias, url = lease_alias
    name = unique_name("lease")
    with lease_lock(name, using=alias, ttl=10, key_prefix="") as lease:
        first = lease.token
        assert first is not None
        refused = _sqlalchemy_worker(
            url, name, 'print(lease_lock(engine, name, timeout=0, key_prefix="").acquire())'
        )
        out, err = refused.communicate(timeout=PROCESS_SECONDS)
        assert (out.strip(), refused.returncode) == ("False", 0), err
        lease.ensure_held()
        with transaction.atomic(using=alias):
            lease.fence()

    def hold_in_thread() -> int | None:
        with lease_lock(name, using=alias, timeout=0, key_prefix="") as again:
            return again.token

    assert run_in_thread(hold_in_thread).get() == first + 1
    with lease_lock(name, using=alias, key_prefix="", timeout=0):
        second = lease_lock(name, using=alias, key_prefix="", timeout=0)
        with pytest.raises(LockNotAcquired):
            second.__enter__()


@pytest.fixture
def sqlite_lease_alias(tmp_path: Path, django_db_blocker: Any) -> Iterator[str]:
    aim_django_alias("sqlite", URL.create("sqlite"), tmp_path / "leases.sqlite3")
    with django_db_blocker.unblock():
        _create_table("sqlite")
        yield "sqlite"
        connections["sqlite"].close()


def _hold_the_sqlite_write_lock(alias: str, write: Any) -> tuple[threading.Event, Any]:
    """Run ``write()`` in another thread's ``atomic()``, which then keeps SQLite's write
    lock until the returned event is set; returns once the write is made."""
    written, finish = threading.Event(), threading.Event()

    def writer() -> None:
        with transaction.atomic(using=alias):
            write()
            written.set()
            assert finish.wait(30)

    result = run_in_thread(writer)
    assert written.wait(30)
    return finish, result


def test_a_sqlite_lease_fenced_by_another_transaction_is_busy_for_a_thief(
    sqlite_lease_alias: str,
) -> None:
    # Django raises SQLite's "database is locked" as its own OperationalError, which is
    # no sqlite3.OperationalError: the lease must still read it as "held", as it does
    # on PostgreSQL and MariaDB.
    alias = sqlite_lease_alias
    name = unique_name("lease")
    holder = lease_lock(name, using=alias, ttl=30)
    assert holder.acquire()
    try:
        finish, fenced = _hold_the_sqlite_write_lock(alias, holder.fence)
        try:
            started = time.monotonic()
            assert lease_lock(name, using=alias, timeout=0).acquire() is False
            assert lease_lock(name, using=alias, timeout=0.3).acquire() is False
            assert time.monotonic() - started < 5
        finally:
            finish.set()
            fenced.get()
        assert lease_lock(name, using=alias, timeout=0).acquire() is False
        holder.ensure_held()
    finally:
        holder.release()


def test_a_sqlite_lease_released_while_another_transaction_is_fenced_is_lock_lost(
    sqlite_lease_alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The write lock is kept past the lease connections' busy timeout: LockLost, not
    # Django's OperationalError, and the row stays ours until it expires.
    alias = sqlite_lease_alias
    monkeypatch.setitem(connections.settings[alias].setdefault("OPTIONS", {}), "timeout", 0.3)
    connections[alias].close()  # opened by the fixture, with the default 5 s
    name = unique_name("lease")
    holder = lease_lock(name, using=alias, ttl=30)
    assert holder.acquire()
    finish, fenced = _hold_the_sqlite_write_lock(alias, holder.fence)
    try:
        with pytest.raises(LockLost) as raised:
            holder.release()
    finally:
        finish.set()
        fenced.get()
    assert type(raised.value) is LockLost
    assert raised.value.__cause__ is not None
    assert holder.lost.is_set()
    assert not holder.held
    row = Lease.objects.using(alias).get(name=name)
    assert row.holder is not None
    assert lease_lock(name, using=alias, timeout=0).acquire() is False


def test_a_lease_name_must_be_text() -> None:
    with pytest.raises(TypeError, match="str"):
        lease_lock(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decorator"), lease_lock("job-{n}"):
        pass
    with pytest.raises(ValueError, match="alias"):
        lease_lock("x", using="nowhere").acquire()
