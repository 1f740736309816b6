"""The decorator form, settings defaults and the lock signals."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import override_settings
from psycopg.rows import TupleRow
from sqlalchemy import Engine

from advisory_locks.keys import lock_key
from advisory_locks_django import (
    LockNotAcquired,
    advisory_lock,
    current_advisory_locks,
    lock_acquired,
    lock_failed,
    lock_released,
)
from tests.django.support import holders, in_thread, server_pid
from tests.helpers import unique_name

pytestmark = [pytest.mark.postgresql, pytest.mark.django_db(transaction=True)]

Admin = psycopg.Connection[TupleRow]


# -- decorator ------------------------------------------------------------------------------


def test_a_decorated_function_runs_under_the_lock(admin: Admin) -> None:
    name = unique_name()

    @advisory_lock(name)
    def job() -> list[int]:
        return holders(admin, name)

    assert job() == [server_pid()]
    assert holders(admin, name) == []


def test_skip_if_locked_returns_none_without_running_when_busy() -> None:
    name = unique_name()
    calls: list[int] = []

    @advisory_lock(name, timeout=0, skip_if_locked=True)
    def job() -> str:
        calls.append(1)
        return "ran"

    with advisory_lock(name):
        assert in_thread(job) is None
    assert calls == []
    assert job() == "ran"


def test_a_decorated_function_raises_when_busy_by_default() -> None:
    name = unique_name()

    @advisory_lock(name, timeout=0)
    def job() -> None:
        raise AssertionError("must not run")

    with advisory_lock(name), pytest.raises(LockNotAcquired):
        in_thread(job)


def test_a_name_template_is_formatted_from_the_call_arguments() -> None:
    prefix = unique_name()

    @advisory_lock(prefix + "-{account_id}")
    def sync_account(account_id: int, *, full: bool = False) -> list[Any]:
        return current_advisory_locks()

    assert sync_account(7) == [f"{prefix}-7"]
    assert sync_account(account_id=8, full=True) == [f"{prefix}-8"]


def test_calls_for_different_arguments_do_not_exclude_each_other() -> None:
    prefix = unique_name()

    @advisory_lock(prefix + "-{account_id}", timeout=0)
    def sync_account(account_id: int) -> str:
        return "ran"

    with advisory_lock(f"{prefix}-1"):
        assert in_thread(lambda: sync_account(2)) == "ran"
        with pytest.raises(LockNotAcquired):
            in_thread(lambda: sync_account(1))


def test_a_callable_name_gets_the_call_arguments() -> None:
    prefix = unique_name()

    @advisory_lock(lambda tenant, **_: f"{prefix}-{tenant}")
    def report(tenant: str, day: int) -> list[Any]:
        return current_advisory_locks()

    assert report("acme", day=3) == [f"{prefix}-acme"]


def test_a_template_naming_no_parameter_fails_at_decoration() -> None:
    with pytest.raises(TypeError, match="account"):

        @advisory_lock("sync-{account}")
        def job(account_id: int) -> None: ...


def test_doubled_braces_stay_literal_in_a_decorator_name() -> None:
    @advisory_lock("{{literal}}")
    def job() -> list[Any]:
        return current_advisory_locks()

    assert job() == ["{literal}"]


def test_a_transaction_decorator_commits_the_function_work_with_the_lock(admin: Admin) -> None:
    from tests.django_app.models import Product

    name = unique_name()

    @advisory_lock(name, transaction=True)
    def restock() -> bool:
        Product.objects.create(sku=name[-30:], stock=5)
        return connection.in_atomic_block

    assert restock() is True
    assert Product.objects.filter(sku=name[-30:]).exists()
    assert holders(admin, name) == []


def test_a_transaction_decorator_rolls_back_when_the_function_raises() -> None:
    from tests.django_app.models import Product

    name = unique_name()

    @advisory_lock(name, transaction=True)
    def restock() -> None:
        Product.objects.create(sku=name[-30:], stock=5)
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        restock()
    assert not Product.objects.filter(sku=name[-30:]).exists()


# -- settings -------------------------------------------------------------------------------


def test_key_scheme_and_prefix_come_from_settings() -> None:
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": "pglock", "KEY_PREFIX": "shop:"}):
        lock = advisory_lock("daily")
    assert lock.key == lock_key("daily", scheme="pglock", prefix="shop:")


def test_the_default_timeout_comes_from_settings() -> None:
    name = unique_name()
    with override_settings(ADVISORY_LOCKS={"TIMEOUT": 0}):
        lock = advisory_lock(name)
    assert lock.timeout == 0


def test_a_lock_made_as_one_before_follows_the_settings_of_the_moment() -> None:
    # A lock's arguments are looked at once per combination: a change of the setting
    # must still reach the next lock made with the same ones, and its end too.
    name = unique_name()
    assert advisory_lock(name).timeout is None
    with override_settings(ADVISORY_LOCKS={"TIMEOUT": 0, "TRANSACTION": True}):
        lock = advisory_lock(name)
        assert (lock.timeout, lock.transaction) == (0, True)
    lock = advisory_lock(name)
    assert (lock.timeout, lock.transaction) == (None, False)


def test_an_explicit_option_beats_the_setting() -> None:
    with override_settings(ADVISORY_LOCKS={"TIMEOUT": 0, "TRANSACTION": True}):
        lock = advisory_lock("x", timeout=None, transaction=False)
    assert (lock.timeout, lock.transaction) == (None, False)


def test_an_invalid_setting_raises_improperly_configured() -> None:
    with (
        override_settings(ADVISORY_LOCKS={"TIMEOUT": "soon"}),
        pytest.raises(ImproperlyConfigured, match="TIMEOUT"),
    ):
        advisory_lock("x")


def test_session_locks_are_refused_behind_a_declared_transaction_pooler() -> None:
    from advisory_locks_django import UnsupportedFeature

    with (
        override_settings(ADVISORY_LOCKS={"POOLERS": {"default": "pgbouncer-transaction"}}),
        pytest.raises(UnsupportedFeature, match="transaction=True"),
    ):
        advisory_lock(unique_name()).acquire()


# -- signals --------------------------------------------------------------------------------


@pytest.fixture
def events() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every lock signal sent in this thread, as (signal name, keyword arguments)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    me = threading.get_ident()
    receivers = {}
    for label, signal in (
        ("acquired", lock_acquired),
        ("released", lock_released),
        ("failed", lock_failed),
    ):

        def receiver(sender: Any, label: str = label, **kwargs: Any) -> None:
            if threading.get_ident() == me:
                kwargs.pop("signal")
                seen.append((label, kwargs))

        receivers[label] = receiver
        signal.connect(receiver)
    yield seen
    lock_acquired.disconnect(receivers["acquired"])
    lock_released.disconnect(receivers["released"])
    lock_failed.disconnect(receivers["failed"])


def test_acquiring_sends_lock_acquired_with_the_lock_details(events: list[Any]) -> None:
    name = unique_name()
    with advisory_lock(name, shared=True):
        pass
    label, details = events[0]
    assert label == "acquired"
    assert details["name"] == name
    assert details["key"] == lock_key(name)
    assert (details["using"], details["mode"], details["scope"]) == ("default", "shared", "session")
    assert details["waited"] >= 0


def test_releasing_a_session_lock_sends_lock_released_once(events: list[Any]) -> None:
    name = unique_name()
    with advisory_lock(name), advisory_lock(name):
        pass
    assert [label for label, _ in events] == ["acquired", "released"]
    assert events[1][1]["reason"] == "unlock"
    assert events[1][1]["held"] >= 0


def test_a_busy_lock_sends_lock_failed_with_the_reason() -> None:
    name = unique_name()
    with advisory_lock(name):
        assert in_thread(lambda: _failure_reason(name)) == ("busy", None)


def test_a_reentrant_acquire_sends_nothing(events: list[Any]) -> None:
    name = unique_name()
    with advisory_lock(name):
        events.clear()
        with advisory_lock(name):
            pass
        assert events == []


def test_signals_are_forwarded_from_the_first_receiver_on() -> None:
    # With no receiver the lock events are not even built; a lock granted then sends no
    # lock_released later, so a count of held locks kept from the signals stays right.
    assert not any(signal.receivers for signal in (lock_acquired, lock_released, lock_failed))
    seen: list[str] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs["reason"])

    name = unique_name()
    granted_unheard = advisory_lock(name)
    granted_unheard.acquire()
    lock_released.connect(receiver)
    try:
        granted_unheard.release()
        with advisory_lock(name):
            pass
    finally:
        lock_released.disconnect(receiver)
    with advisory_lock(name):
        pass
    assert seen == ["unlock"]


def _failure_reason(name: str) -> tuple[str, Any]:
    seen: list[tuple[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append((kwargs["reason"], kwargs["error"]))

    lock_failed.connect(receiver)
    try:
        advisory_lock(name, timeout=0).acquire()
    finally:
        lock_failed.disconnect(receiver)
    return seen[0]


def test_a_timed_out_wait_sends_lock_failed_with_reason_timeout() -> None:
    name = unique_name()
    with advisory_lock(name):
        assert in_thread(lambda: _timeout_reason(name)) == "timeout"


def _timeout_reason(name: str) -> str:
    seen: list[str] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs["reason"])

    lock_failed.connect(receiver)
    try:
        advisory_lock(name, timeout=0.1).acquire()
    finally:
        lock_failed.disconnect(receiver)
    return seen[0]


def test_a_transaction_lock_is_reported_released_at_the_outer_commit(
    events: list[Any], admin: Admin
) -> None:
    name = unique_name()
    with transaction.atomic():
        with advisory_lock(name, transaction=True):
            pass
        assert [label for label, _ in events] == ["acquired"]
    assert [label for label, _ in events] == ["acquired", "released"]
    assert events[1][1]["reason"] == "commit"
    assert events[1][1]["scope"] == "transaction"


def test_a_transaction_lock_is_reported_released_at_the_rollback(events: list[Any]) -> None:
    name = unique_name()
    with transaction.atomic():
        with advisory_lock(name, transaction=True):
            pass
        transaction.set_rollback(True)
    assert [(label, details.get("reason")) for label, details in events] == [
        ("acquired", None),
        ("released", "rollback"),
    ]


def test_a_savepoint_rollback_is_reported_when_it_happens(events: list[Any]) -> None:
    name = unique_name()
    with transaction.atomic():
        with transaction.atomic():
            with advisory_lock(name, transaction=True):
                pass
            transaction.set_rollback(True)
        # Reported before the outer transaction ends: that is when the server let go.
        assert [label for label, _ in events] == ["acquired", "released"]


def test_a_failing_receiver_neither_raises_nor_leaks_the_lock(admin: Admin) -> None:
    name = unique_name()

    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    lock_acquired.connect(broken)
    try:
        with advisory_lock(name):
            pass
    finally:
        lock_acquired.disconnect(broken)
    assert holders(admin, name) == []


def test_send_signals_false_sends_none(events: list[Any]) -> None:
    with override_settings(ADVISORY_LOCKS={"SEND_SIGNALS": False}), advisory_lock(unique_name()):
        pass
    assert events == []


def test_locks_taken_through_sqlalchemy_send_no_django_signal(
    events: list[Any], pg_engine: Engine
) -> None:
    from advisory_locks import advisory_lock as core_advisory_lock

    with core_advisory_lock(pg_engine, unique_name()):
        pass
    assert events == []
