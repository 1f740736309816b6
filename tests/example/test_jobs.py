"""The cron command skips while another run holds its lock; one booting pod backfills."""

from __future__ import annotations

import io
import threading

import pytest
from django.core.management import call_command

from advisory_locks_django import advisory_lock
from tests.django.support import run_in_thread
from tests.example.conftest import django_db

pytestmark = django_db


def run_command(name: str) -> str:
    out = io.StringIO()
    call_command(name, stdout=out)
    return out.getvalue()


def test_sales_report_runs_when_no_other_run_holds_the_lock(shop_db: str) -> None:
    from shop.models import SalesReport

    assert run_command("sales_report").startswith("sales report ")
    assert SalesReport.objects.count() == 1


def test_sales_report_skips_and_says_so_while_another_run_holds_the_lock(shop_db: str) -> None:
    from shop.models import SalesReport

    held, done = threading.Event(), threading.Event()

    def other_run() -> None:  # another pod: its own thread, its own connection
        with advisory_lock("cron-sales-report", using=shop_db):
            held.set()
            done.wait(30)

    holder = run_in_thread(other_run)
    assert held.wait(30)
    try:
        output = run_command("sales_report")
    finally:
        done.set()
        holder.get()
    assert output == "skipped: another run holds the lock 'cron-sales-report'\n"
    assert SalesReport.objects.count() == 0


def test_of_pods_booting_together_exactly_one_runs_the_backfill(
    shop_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shop.boot
    from shop.models import BackfillRun, Order, Product

    mug = Product.objects.create(sku="mug", name="Mug", price_cents=1000, stock=1)
    Order.objects.create(
        product=mug, customer="a@example.com", quantity=3, total_cents=1, payment_id="p"
    )
    runs: list[str] = []
    backfill = shop.boot.backfill_units_sold

    def counted(using: str) -> None:
        runs.append(using)
        backfill(using)

    monkeypatch.setattr(shop.boot, "backfill_units_sold", counted)
    pods = 4
    start = threading.Barrier(pods)

    def boot() -> str:
        start.wait()
        return run_command("boot_backfill")

    outputs = [result.get(timeout=60) for result in [run_in_thread(boot) for _ in range(pods)]]
    assert runs == [shop_db]
    assert sorted(output.split(":")[0] for output in outputs) == ["follower"] * 3 + ["leader"]
    assert BackfillRun.objects.count() == 1
    mug.refresh_from_db()
    assert mug.units_sold == 3


def test_a_pod_booting_after_the_backfill_does_nothing(shop_db: str) -> None:
    from shop.models import BackfillRun

    assert run_command("boot_backfill").startswith("leader: ")
    assert run_command("boot_backfill").startswith("follower: ")
    assert BackfillRun.objects.count() == 1
