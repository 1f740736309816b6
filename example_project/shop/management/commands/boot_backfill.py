"""``manage.py boot_backfill``: run on every pod at boot; one of them does the work."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from shop.boot import BACKFILL, run_boot_backfill


class Command(BaseCommand):
    help = (
        "Run the boot-time backfill once however many pods boot at the same moment: the "
        "first takes an advisory lock and runs it, the others wait for it to finish."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        if run_boot_backfill():
            self.stdout.write(f"leader: ran backfill {BACKFILL}")
        else:
            self.stdout.write(f"follower: backfill {BACKFILL} already done, nothing to do")
