"""``manage.py sales_report``: a cron job that every pod schedules and one pod runs.

Scheduled on each app server (``*/15 * * * * manage.py sales_report``), it would write
one report per pod; the lock with ``timeout=0`` lets the first run through and makes the
others skip at once, saying so (a skip is normal; one that always happens is a stuck
holder, see ``manage.py advisory_locks list``).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django.db.models import Count, Sum

from advisory_locks_django import advisory_lock
from shop.locking import shop_database
from shop.models import Order, SalesReport

LOCK_NAME = "cron-sales-report"


class Command(BaseCommand):
    help = "Write a sales report; skips when another run holds the cron lock."

    def handle(self, *args: Any, **options: Any) -> None:
        lock = advisory_lock(LOCK_NAME, using=shop_database(), timeout=0)
        if not lock.acquire():
            self.stdout.write(f"skipped: another run holds the lock {LOCK_NAME!r}")
            return
        try:
            totals = Order.objects.filter(status=Order.Status.PAID).aggregate(
                orders=Count("pk"), units=Sum("quantity"), revenue=Sum("total_cents")
            )
            report = SalesReport.objects.create(
                orders=totals["orders"],
                units=totals["units"] or 0,
                revenue_cents=totals["revenue"] or 0,
            )
        finally:
            lock.release()
        self.stdout.write(
            f"sales report {report.pk}: {report.orders} orders, {report.units} units, "
            f"{report.revenue_cents / 100:.2f} EUR"
        )
