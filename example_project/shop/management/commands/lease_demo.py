"""``manage.py lease_demo``: freeze the holder of a lease past its ttl, and watch fence()
keep the stale holder from checking an item twice.

Each run starts ``--workers`` processes of ``manage.py feed_checker`` on one feed of
``--items`` items. One of them takes the lease and checks items; the others wait. When
the holder is checking item ``--freeze-at``, this command freezes it (SIGSTOP): its
renewer stops with it, the lease expires ``--ttl`` seconds later, and a waiting worker
takes over (the next fencing token) and checks the items from that same one on. Once the
new holder has checked it, the frozen worker is resumed (SIGCONT) and finishes the check
it was in the middle of.

- Without fence (``feed_checker --no-fence``): it writes its result, then learns from
  ``ensure_held()`` that the lease was stolen. The item is checked twice.
- With fence: its write begins with ``lease.fence()``, which raises ``LockStolen``; the
  transaction rolls back and the worker stops. No item is checked twice.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from argparse import ArgumentParser
from collections import Counter
from pathlib import Path
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from shop.management.commands.checkout_race import clean_up, describe_database, positive
from shop.management.commands.feed_checker import lease_name
from shop.models import FeedCheck, FeedItem

MANAGE = Path(__file__).resolve().parents[3] / "manage.py"
RUNS = (("without_fence", True), ("with_fence", False))
# How long any one step may take before the demo gives up (worker start-up included).
STEP_SECONDS = 120.0


class Command(BaseCommand):
    help = (
        "Run feed_checker workers, freeze the lease holder past its ttl, resume it, and "
        "show the takeover and what fence() prevents (SIGSTOP/SIGCONT: POSIX only)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--workers", type=positive, default=3, help="default: 3")
        parser.add_argument("--items", type=positive, default=8, help="default: 8")
        parser.add_argument(
            "--freeze-at", type=positive, default=3, help="freeze while checking item N (3)"
        )
        parser.add_argument("--ttl", type=float, default=2.0, help="lease ttl (default: 2 s)")
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument(
            "--keep-tables",
            action="store_true",
            help="keep the tables this run created in a database given by URL",
        )
        parser.add_argument("--database-url", metavar="URL", help="as for checkout_race")

    def handle(self, *args: Any, **options: Any) -> None:
        if not hasattr(signal, "SIGSTOP"):
            raise CommandError("lease_demo freezes a process with SIGSTOP: POSIX only")
        if options["database_url"] is not None:
            raise CommandError("--database-url only works through example_project/manage.py")
        if options["freeze_at"] > options["items"]:
            raise CommandError("--freeze-at must be at most --items")
        tables_before = set(connection.introspection.table_names())
        call_command("migrate", verbosity=0, interactive=False)
        created = sorted(set(connection.introspection.table_names()) - tables_before)
        results: dict[str, dict[str, Any]] = {}
        try:
            sys.stderr.write(f"lease demo on {describe_database()}\n")
            for run, unfenced in RUNS:
                results[run] = self._run(run, unfenced, options)
        finally:
            FeedItem.objects.filter(feed__startswith="demo-").delete()
            sys.stderr.write(clean_up(created, keep=options["keep_tables"]) + "\n")
        if options["json"]:
            self.stdout.write(json.dumps(results))
            return
        for run, result in results.items():
            self.stdout.write(render(run, result))

    def _run(self, run: str, unfenced: bool, options: dict[str, Any]) -> dict[str, Any]:
        feed = f"demo-{run}-{uuid.uuid4().hex[:8]}"
        FeedItem.objects.bulk_create(
            FeedItem(feed=feed, number=number) for number in range(1, options["items"] + 1)
        )
        command = [
            sys.executable,
            str(MANAGE),
            "feed_checker",
            "--feed",
            feed,
            "--ttl",
            str(options["ttl"]),
            "--wait",
            str(STEP_SECONDS),
            *(["--no-fence"] if unfenced else []),
        ]
        watch = Watch(run)
        workers = [
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
            for _ in range(options["workers"])
        ]
        for number, worker in enumerate(workers, 1):
            threading.Thread(target=watch.read, args=(worker, number), daemon=True).start()
        frozen = 0
        try:
            freeze_line = f"checking item {options['freeze_at']}"
            while not frozen:
                number, line = watch.next_line(STEP_SECONDS)
                if line == freeze_line:
                    workers[number - 1].send_signal(signal.SIGSTOP)
                    frozen = number
                    watch.note(f"froze worker {number} (token {watch.tokens[number]}) past its ttl")
            stale_token = watch.tokens[frozen]
            deadline = time.monotonic() + STEP_SECONDS
            # Until another worker has checked the item the frozen one is in the middle of.
            while (
                not FeedCheck.objects.filter(item__feed=feed, item__number=options["freeze_at"])
                .exclude(token=stale_token)
                .exists()
            ):
                if time.monotonic() > deadline:
                    raise CommandError(f"{run}: nobody took over within {STEP_SECONDS:g} s")
                watch.next_line(0.05, required=False)
            workers[frozen - 1].send_signal(signal.SIGCONT)
            watch.note(f"resumed worker {frozen}")
            for worker in workers:
                worker.wait(STEP_SECONDS)
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.send_signal(signal.SIGCONT)
                    worker.kill()
                    worker.wait()
        while watch.next_line(0.2, required=False) is not None:
            pass
        checks = Counter(
            FeedCheck.objects.filter(item__feed=feed).values_list("item__number", flat=True)
        )
        return {
            "lease": lease_name(feed),
            "fenced": not unfenced,
            "workers": options["workers"],
            "items": options["items"],
            "items_checked": len(checks),
            "checked_twice": sorted(item for item, count in checks.items() if count > 1),
            "stale_token": stale_token,
            "takeover_tokens": sorted(t for n, t in watch.tokens.items() if n != frozen),
            "stale_holder_exit": workers[frozen - 1].returncode,
            "stale_holder_said": watch.last_said.get(frozen, ""),
            "exit_codes": [worker.returncode for worker in workers],
        }


class Watch:
    """The workers' output lines, as they come: logged to stderr, tokens noted."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.tokens: dict[int, int] = {}
        self.last_said: dict[int, str] = {}

    def read(self, worker: subprocess.Popen[str], number: int) -> None:
        assert worker.stdout is not None
        for line in worker.stdout:
            self.lines.put((number, line.rstrip("\n")))

    def next_line(self, timeout: float, *, required: bool = True) -> tuple[int, str] | Any:
        try:
            number, line = self.lines.get(timeout=timeout)
        except queue.Empty:
            if required:
                raise CommandError(
                    f"{self.run}: no worker said anything for {timeout:g} s"
                ) from None
            return None
        if line.startswith("acquired token "):
            self.tokens[number] = int(line.rpartition(" ")[2])
        self.last_said[number] = line
        self.note(f"worker {number}: {line}")
        return number, line

    def note(self, text: str) -> None:
        sys.stderr.write(f"  {self.run}: {text}\n")


def render(run: str, result: dict[str, Any]) -> str:
    title = (
        "WITH fence()" if result["fenced"] else "WITHOUT fence() (ensure_held() after the write)"
    )
    twice = result["checked_twice"]
    return "\n".join(
        [
            f"{title}:",
            f"  lease {result['lease']!r}: the holder (token {result['stale_token']}) "
            f"was frozen past its ttl; taken over by token(s) {result['takeover_tokens']}",
            f"  the stale holder, resumed: {result['stale_holder_said'] or '(said nothing)'}",
            f"  items checked: {result['items_checked']}/{result['items']}; "
            f"checked twice: {len(twice)}"
            + (f" (item {', '.join(map(str, twice))})" if twice else ""),
            "",
        ]
    )
