"""Managers and multiple databases, async code, system checks, the management command,
and the checkout race the library exists for."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from typing import Any

import psycopg
import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import close_old_connections, connection, connections
from django.test import override_settings
from psycopg.rows import TupleRow

from advisory_locks.keys import lock_key
from advisory_locks_django import (
    LockNotAcquired,
    UnsupportedFeature,
    advisory_lock,
    current_advisory_locks,
    lock_failed,
)
from advisory_locks_django.checks import check_databases, check_settings
from tests.django.support import holders, in_thread, run_in_thread, server_pid
from tests.django_app.models import Invoice, LedgerEntry, Order, Product
from tests.helpers import unique_name, wait_for, waiter_pids

pytestmark = [
    pytest.mark.postgresql,
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
]

Admin = psycopg.Connection[TupleRow]


# -- managers and databases -----------------------------------------------------------------


def test_with_advisory_lock_locks_on_the_default_database(admin: Admin) -> None:
    name = unique_name()
    with Product.objects.with_advisory_lock(name):
        assert holders(admin, name) == [server_pid("default")]


def test_using_locks_on_that_database(admin: Admin, other_admin: Admin) -> None:
    name = unique_name()
    with Product.objects.using("other").with_advisory_lock(name):
        assert holders(other_admin, name) == [server_pid("other")]
        assert holders(admin, name) == []


def test_db_manager_locks_on_that_database(other_admin: Admin) -> None:
    name = unique_name()
    with Product.objects.db_manager("other").with_advisory_lock(name):
        assert holders(other_admin, name) == [server_pid("other")]


def test_a_router_sends_the_lock_to_the_write_database(admin: Admin, other_admin: Admin) -> None:
    name = unique_name()
    with LedgerEntry.objects.with_advisory_lock(name):
        assert holders(other_admin, name) == [server_pid("other")]
        assert holders(admin, name) == []


def test_a_transaction_lock_joins_the_atomic_block_of_its_database(other_admin: Admin) -> None:
    name = unique_name()
    with LedgerEntry.objects.with_advisory_lock(name, transaction=True):
        assert connections["other"].in_atomic_block
        assert not connections["default"].in_atomic_block
        LedgerEntry.objects.create(amount=5)
    assert LedgerEntry.objects.using("other").count() == 1
    assert holders(other_admin, name) == []


def test_the_mixins_and_as_manager_give_with_advisory_lock(admin: Admin) -> None:
    for manager in (Invoice.objects, Invoice.as_queryset, Invoice.plain):
        name = unique_name()
        with manager.with_advisory_lock(name):
            assert holders(admin, name) == [server_pid()]


def test_with_advisory_lock_refuses_a_using_option() -> None:
    with pytest.raises(TypeError, match="using"):
        Product.objects.with_advisory_lock("x", using="other")


# -- async ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
async def _close_async_connections() -> Any:
    # Async tests reach the database from asgiref's thread for sync work; close its
    # connections so the test databases can be dropped.
    yield
    await sync_to_async(connections.close_all)()


async def test_async_with_holds_a_session_lock_across_awaits(admin: Admin) -> None:
    name = unique_name()
    async with advisory_lock(name):
        count = await Product.objects.acount()
        pid = await sync_to_async(server_pid)()
        assert await sync_to_async(holders)(admin, name) == [pid]
    assert count == 0
    assert await sync_to_async(holders)(admin, name) == []


async def test_a_decorated_coroutine_runs_under_the_lock(admin: Admin) -> None:
    name = unique_name()

    @advisory_lock(name, timeout=0)
    async def job() -> list[Any]:
        return await sync_to_async(current_advisory_locks)()

    assert await job() == [name]


async def test_async_code_cannot_hold_a_transaction_lock_across_awaits() -> None:
    with pytest.raises(UnsupportedFeature, match="sync_to_async"):
        async with advisory_lock(unique_name(), transaction=True):
            pass


async def test_a_transaction_lock_runs_in_sync_code_called_from_async(admin: Admin) -> None:
    name = unique_name()

    @sync_to_async
    @advisory_lock(name, transaction=True)
    def restock() -> bool:
        Product.objects.create(sku=name[-30:], stock=1)
        return connection.in_atomic_block

    assert await restock() is True
    assert await Product.objects.filter(sku=name[-30:]).aexists()


async def test_async_with_raises_when_busy() -> None:
    name = unique_name()
    with pytest.raises(LockNotAcquired):  # noqa: PT012 - the lock is taken in a thread
        holder = await sync_to_async(_hold_in_thread)(name)
        try:
            async with advisory_lock(name, timeout=0):
                pass
        finally:
            holder.set()


async def test_a_cancelled_wait_sends_lock_failed_with_reason_cancelled(admin: Admin) -> None:
    name = unique_name()
    reasons: list[str] = []

    def failed(sender: Any, **details: Any) -> None:
        if details["name"] == name:
            reasons.append(details["reason"])

    holder = await sync_to_async(_hold_in_thread)(name)
    lock_failed.connect(failed)
    try:
        waiting = asyncio.ensure_future(advisory_lock(name).aacquire())
        await sync_to_async(wait_for, thread_sensitive=False)(
            lambda: waiter_pids(admin, name) != [], "the server queued the waiter"
        )
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # The worker thread reports the wait once the server has ended it.
        await sync_to_async(wait_for, thread_sensitive=False)(
            lambda: reasons != [], "lock_failed was sent"
        )
    finally:
        lock_failed.disconnect(failed)
        holder.set()
    assert reasons == ["cancelled"]


def _hold_in_thread(name: str) -> threading.Event:
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with advisory_lock(name):
            taken.set()
            done.wait(30)

    run_in_thread(hold)
    assert taken.wait(30)
    return done


# -- system checks --------------------------------------------------------------------------


def _ids(messages: list[Any]) -> list[str]:
    return [message.id for message in messages]


def test_a_valid_setting_passes_the_checks() -> None:
    with override_settings(ADVISORY_LOCKS={"TIMEOUT": 5, "KEY_SCHEME": "rails", "KEY_PREFIX": 3}):
        assert check_settings() == []
        assert check_databases() == []


@pytest.mark.parametrize(
    ("value", "check_id"),
    [
        ([("TIMEOUT", 1)], "advisory_locks.E001"),
        ({"TIMEOUTS": 1}, "advisory_locks.E002"),
        ({"TIMEOUT": -1}, "advisory_locks.E003"),
        ({"TIMEOUT": "5"}, "advisory_locks.E003"),
        ({"KEY_SCHEME": "md5"}, "advisory_locks.E004"),
        ({"KEY_PREFIX": 1.5}, "advisory_locks.E005"),
        ({"KEY_SCHEME": "rails", "KEY_PREFIX": "shop"}, "advisory_locks.E005"),
        ({"SEND_SIGNALS": "yes"}, "advisory_locks.E006"),
        ({"POOLERS": {"nowhere": "pgbouncer-transaction"}}, "advisory_locks.E007"),
        ({"POOLERS": {"default": "odyssey"}}, "advisory_locks.E007"),
    ],
)
def test_a_bad_setting_is_reported_with_a_stable_id(value: object, check_id: str) -> None:
    with override_settings(ADVISORY_LOCKS=value):
        assert _ids(check_settings()) == [check_id]


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_an_engine_without_a_backend_gets_a_warning() -> None:
    databases = {**connections.settings, "legacy": {"ENGINE": "django.db.backends.dummy"}}
    with override_settings(DATABASES=databases):
        messages = check_databases()
    assert [(m.id, m.obj) for m in messages] == [("advisory_locks.W001", "legacy")]


def test_session_locks_by_default_behind_transaction_pooling_warn() -> None:
    with override_settings(ADVISORY_LOCKS={"POOLERS": {"default": "pgbouncer-transaction"}}):
        assert _ids(check_databases()) == ["advisory_locks.W002"]
    setting = {"TRANSACTION": True, "POOLERS": {"default": "pgbouncer-transaction"}}
    with override_settings(ADVISORY_LOCKS=setting):
        assert check_databases() == []


def test_disable_server_side_cursors_without_a_declared_pooler_warns() -> None:
    default = connections["default"].settings_dict
    default["DISABLE_SERVER_SIDE_CURSORS"] = True
    try:
        assert _ids(check_databases()) == ["advisory_locks.W003"]
        with override_settings(ADVISORY_LOCKS={"POOLERS": {"default": "pgbouncer-session"}}):
            assert check_databases() == []
    finally:
        default["DISABLE_SERVER_SIDE_CURSORS"] = False


# -- management command ---------------------------------------------------------------------


def _command(*arguments: str) -> str:
    out = io.StringIO()
    call_command("advisory_locks", *arguments, stdout=out)
    return out.getvalue()


def test_key_prints_the_key_the_server_sees() -> None:
    assert _command("key", "nightly-report").splitlines()[0] == str(lock_key("nightly-report"))


def test_key_uses_the_configured_scheme_and_prefix() -> None:
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": "rails", "KEY_PREFIX": 7}):
        first_line = _command("key", "test").splitlines()[0]
    assert first_line == "1484750348, 7"


def test_list_shows_a_lock_held_by_another_connection_with_its_name() -> None:
    name = unique_name()
    taken, done = threading.Event(), threading.Event()

    def hold() -> int:
        with advisory_lock(name):
            taken.set()
            done.wait(30)
        return server_pid()

    holder = run_in_thread(hold)
    assert taken.wait(30)
    try:
        rows = json.loads(_command("list", "--json"))
        text = _command("list")
    finally:
        done.set()
    pid = holder.get()
    mine = [row for row in rows if row["key"] == lock_key(name)]
    assert [(r["pid"], r["name"], r["mode"], r["granted"]) for r in mine] == [
        (pid, name, "exclusive", True)
    ]
    assert str(lock_key(name)) in text
    assert repr(name) in text


def test_list_names_keys_given_with_name() -> None:
    name = unique_name()
    with advisory_lock(name):
        # A lock of another process is not in this process's registries; --name tells.
        in_thread(lambda: None)
        rows = json.loads(_command("list", "--json", "--name", name, "--database", "default"))
    assert [row["name"] for row in rows if row["key"] == lock_key(name)] == [name]


def test_list_rejects_an_unknown_database() -> None:
    with pytest.raises(CommandError, match="nowhere"):
        _command("list", "--database", "nowhere")


# -- the checkout race ----------------------------------------------------------------------

BUYERS = 30
STOCK = 10


def _buy(sku: str, start: threading.Barrier) -> bool:
    start.wait()
    with Product.objects.with_advisory_lock(f"checkout-{sku}", transaction=True, timeout=30):
        product = Product.objects.get(sku=sku)
        if product.stock < 1:
            return False
        product.stock -= 1
        product.save(update_fields=["stock"])
        Order.objects.create(product=product)
        return True


@pytest.mark.slow
def test_thirty_concurrent_buyers_of_ten_items_make_exactly_ten_orders() -> None:
    sku = unique_name("sku")[-40:]
    product = Product.objects.create(sku=sku, stock=STOCK)
    start = threading.Barrier(BUYERS)
    buyers = [run_in_thread(lambda: _buy(sku, start)) for _ in range(BUYERS)]
    results = [buyer.get(60) for buyer in buyers]
    assert results.count(True) == STOCK
    assert Order.objects.filter(product=product).count() == STOCK
    product.refresh_from_db()
    assert product.stock == 0


def test_without_the_lock_the_same_buyers_oversell() -> None:
    # The control: proves the race above is real, so the locked test can fail.
    sku = unique_name("sku")[-40:]
    product = Product.objects.create(sku=sku, stock=1)
    read = threading.Barrier(2)

    def buy_unlocked() -> None:
        item = Product.objects.get(sku=sku)
        read.wait()  # both have seen stock == 1
        if item.stock >= 1:
            item.stock -= 1
            item.save(update_fields=["stock"])
            Order.objects.create(product=item)

    buyers = [run_in_thread(buy_unlocked) for _ in range(2)]
    for buyer in buyers:
        buyer.get()
    assert Order.objects.filter(product=product).count() == 2


def test_close_old_connections_between_requests_keeps_no_stale_record(admin: Admin) -> None:
    name = unique_name()
    lock = advisory_lock(name)
    lock.acquire()
    connection.close()
    close_old_connections()
    assert in_thread(lambda: advisory_lock(name, timeout=5).acquire()) is True
