"""``manage.py feed_checker``: a long job that several processes run, one at a time, under a
lease lock: the Ruby ``Locker`` gem's pattern, with fencing.

Run it on every worker host (``manage.py feed_checker --feed supplier-eu``, from cron or
a process manager). The first process to take the lease ``feed-checker:<feed>`` checks
the feed's items one by one; the others wait for the lease, and the one that gets it
next carries on where the holder stopped (a crash, a deploy, a frozen process).

A lease, not an advisory lock: the job runs for minutes, behind a transaction pooler as
happily as on a direct connection, and pins no connection between items. The danger of
every lease is a holder that freezes past its ttl (a GC pause, a throttled container,
SIGSTOP) and wakes up believing it still holds the lease while another worker has taken
over. Each item's result is therefore written in a transaction that starts with
``lease.fence()``: the write commits only if this worker still holds the lease, and a
stale holder gets ``LockStolen`` instead of checking an item a second time.

Each line printed says what the worker did (``manage.py lease_demo`` reads them):
``acquired token T``, ``checking item N``, ``checked item N``, ``done``, ``nothing to do``,
``stopped: LockStolen ...``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from advisory_locks_django import LockLost, LockNotAcquired, lease_lock
from shop.locking import shop_database
from shop.models import FeedCheck, FeedItem


def lease_name(feed: str) -> str:
    return f"feed-checker:{feed}"


class Command(BaseCommand):
    help = "Check a feed's items under a lease: one worker at a time, fenced writes."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--feed", required=True, help="the feed whose items to check")
        parser.add_argument(
            "--ttl", type=float, default=30.0, help="lease ttl in seconds (default: 30)"
        )
        parser.add_argument(
            "--wait",
            type=float,
            default=None,
            help="seconds to wait for the lease (default: as long as it takes)",
        )
        parser.add_argument(
            "--item-seconds",
            type=float,
            default=0.1,
            help="how long checking one item takes, simulated (default: 0.1)",
        )
        parser.add_argument(
            "--no-fence",
            action="store_true",
            help="write results without fence(), checking the lease only afterwards "
            "(ensure_held()): the mistake lease_demo shows",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        feed: str = options["feed"]
        worker = f"{socket.gethostname()}:{os.getpid()}"
        using = shop_database()
        lease = lease_lock(
            lease_name(feed), using=using, ttl=options["ttl"], timeout=options["wait"]
        )
        try:
            with lease:
                self._say(f"acquired token {lease.token}")
                checked = self._check_items(lease, feed, worker, options)
        except LockNotAcquired as error:
            raise CommandError(f"not acquired: {error}") from error
        except LockLost as error:
            # The lease was taken over while this worker was not looking (paused past
            # its ttl): stop; the new holder carries on. Exit status 3 tells a process
            # manager this was a loss, not a crash.
            self._say(f"stopped: {type(error).__name__}: {error}")
            sys.exit(3)
        self._say("done" if checked else "nothing to do")

    def _check_items(self, lease: Any, feed: str, worker: str, options: dict[str, Any]) -> int:
        checked = 0
        while True:
            item = FeedItem.objects.filter(feed=feed, checked=False).order_by("number").first()
            if item is None:
                return checked
            self._say(f"checking item {item.number}")
            time.sleep(options["item_seconds"])  # fetch and validate the item, say
            if options["no_fence"]:
                self._record(item, worker, lease.token)
                lease.ensure_held()  # too late: the write above is already committed
            else:
                with transaction.atomic(using=shop_database()):
                    lease.fence()  # still ours, and nobody can take it until this commits
                    self._record(item, worker, lease.token)
            self._say(f"checked item {item.number}")
            checked += 1

    @staticmethod
    def _record(item: FeedItem, worker: str, token: int) -> None:
        FeedCheck.objects.create(item=item, worker=worker, token=token)
        FeedItem.objects.filter(pk=item.pk).update(checked=True)

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()
