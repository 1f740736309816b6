"""Leader election at boot: of N pods starting together, one runs the backfill.

Every pod runs ``manage.py boot_backfill`` before it starts serving (for instance in its
container entrypoint: ``python manage.py boot_backfill && gunicorn shopsite.wsgi``). The
first pod to take the lock is the leader and runs the backfill; the others wait on the
server for the lock, then find the ``BackfillRun`` row and go on booting. Pods that boot
later find the row at once. A leader that crashes mid-way releases the lock with its
connection and leaves no row, so the next pod in line runs the backfill again (it only
fills in what is missing, so running it twice is correct, merely wasteful).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Sum

from advisory_locks_django import advisory_lock
from shop.locking import shop_database
from shop.models import BackfillRun, Product

__all__ = ["BACKFILL", "BOOT_LOCK_TIMEOUT", "backfill_units_sold", "run_boot_backfill"]

BACKFILL = "units-sold-v1"
# How long a pod waits for the leader's backfill before its boot fails loudly.
BOOT_LOCK_TIMEOUT = 600
BATCH_SIZE = 500


def run_boot_backfill() -> bool:
    """Run the backfill unless it has run; True if this process ran it."""
    using = shop_database()
    # A session lock: the backfill commits batch by batch, and the lock must outlive
    # those commits until the marker row is written.
    with advisory_lock(f"boot-{BACKFILL}", using=using, timeout=BOOT_LOCK_TIMEOUT):
        if BackfillRun.objects.filter(name=BACKFILL).exists():
            return False
        backfill_units_sold(using)
        BackfillRun.objects.create(name=BACKFILL)
        return True


def backfill_units_sold(using: str) -> None:
    """Fill ``Product.units_sold`` from the orders, in batches of one transaction each."""
    pending = Product.objects.filter(units_sold__isnull=True).order_by("pk")
    while batch := list(pending.values_list("pk", flat=True)[:BATCH_SIZE]):
        with transaction.atomic(using=using):
            for pk in batch:
                sold = Product.objects.get(pk=pk).orders.aggregate(units=Sum("quantity"))
                Product.objects.filter(pk=pk).update(units_sold=sold["units"] or 0)
