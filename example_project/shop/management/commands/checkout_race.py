"""``manage.py checkout_race``: watch concurrent buyers oversell, then watch the lock stop it."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
import uuid
from argparse import ArgumentParser, ArgumentTypeError, RawDescriptionHelpFormatter
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder
from django.test.utils import override_settings

from shop.checkout import CHECKOUT_LOCK_TIMEOUT
from shop.locking import has_transaction_locks, shop_database
from shop.models import Order, Product

CONCURRENCY_MODEL = (
    "Each buyer is a thread that sends one real HTTP POST, all at the same moment, to the "
    "shop's checkout view on a Django threaded WSGI server this command starts on "
    "127.0.0.1 (one request thread and one database connection per buyer, as under "
    "runserver or gunicorn --threads). Between reading the stock and writing the order, "
    "the view queries the buyer's order history, prices the order and calls a simulated "
    "payment provider that answers after --payment-latency seconds."
)

WIDTH = 88

HELP = f"""Run concurrent buyers against one product, first WITHOUT the checkout lock,
then WITH it, and print what each run sold.

{textwrap.fill(CONCURRENCY_MODEL, 80)}

The database is DATABASE_URL / --database-url (PostgreSQL or MySQL/MariaDB), or
shop.sqlite3 next to manage.py; it is migrated first. In a database given by URL, the
tables the run had to create (shop_*, django_migrations) are dropped at the end unless
--keep-tables; tables that were there before are kept, without the race's rows.
Progress goes to stderr; --json prints one JSON object, {{"without_lock": ...,
"with_lock": ...}}, and nothing else, on stdout."""


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 60:
        raise ArgumentTypeError(f"must be between 0 and 60 seconds, not {value}")
    return value


@dataclass
class Round:
    orders: int  # units sold: every buyer asks for one
    oversold: int  # units sold beyond the initial stock
    stock_left: int  # what the product row says afterwards
    seconds: float
    out_of_stock: int  # buyers answered 409
    busy: int  # buyers answered 503 (lock timeout)
    errors: int  # any other answer: should never happen


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one access-log line per buyer would drown the table


class RaceServer(ThreadedWSGIServer):
    # All buyers connect at once; the default listen backlog of 10 would make the
    # kernel drop connections and the clients retry a second later.
    request_queue_size = 256


class Progress:
    """`without lock, round 1/1: 14/20 buyers answered`, on stderr, rewritten in place."""

    def __init__(self, stream: TextIO, label: str, total: int) -> None:
        self.stream, self.label, self.total = stream, label, total
        self.done = 0
        self.interactive = stream.isatty()
        self.guard = threading.Lock()
        self._show()

    def tick(self) -> None:
        with self.guard:
            self.done += 1
            if self.interactive or self.done == self.total:
                self._show()

    def _show(self) -> None:
        line = f"  {self.label}: {self.done}/{self.total} buyers answered"
        if self.interactive:
            end = "\n" if self.done == self.total else ""
            self.stream.write(f"\r{line}{end}")
        elif self.done in (0, self.total):
            self.stream.write(f"{line}\n")
        self.stream.flush()


class Command(BaseCommand):
    help = HELP

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> ArgumentParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.formatter_class = RawDescriptionHelpFormatter
        return parser

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--buyers", type=positive, default=20, help="default: 20")
        parser.add_argument(
            "--stock", type=positive, default=5, help="units in stock at the start; default: 5"
        )
        parser.add_argument(
            "--rounds", type=positive, default=1, help="races per run, summed; default: 1"
        )
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument(
            "--keep-tables",
            action="store_true",
            help="keep the tables this run created in a database given by URL",
        )
        parser.add_argument(
            "--payment-latency",
            type=seconds,
            default=None,
            help="seconds the simulated payment provider takes to answer "
            f"(default: {settings.SHOP_PAYMENT_LATENCY})",
        )
        # manage.py moves this option into DATABASE_URL before Django reads its settings;
        # it is declared here so that --help lists it.
        parser.add_argument(
            "--database-url",
            metavar="URL",
            help="postgresql://... or mysql://... (default: DATABASE_URL, else SQLite)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["database_url"] is not None:
            # manage.py takes the option out before Django starts; seeing it here means
            # the command was started some other way, too late to change the database.
            raise CommandError(
                "--database-url only works through example_project/manage.py; with "
                "django-admin, set DATABASE_URL instead"
            )
        buyers, stock, rounds = options["buyers"], options["stock"], options["rounds"]
        latency = options["payment_latency"]
        if latency is None:
            latency = settings.SHOP_PAYMENT_LATENCY
        progress_stream = sys.stderr
        tables_before = set(connection.introspection.table_names())
        call_command("migrate", verbosity=0, interactive=False)
        created = sorted(set(connection.introspection.table_names()) - tables_before)
        remove_earlier_races()
        runs: dict[str, list[Round]] = {"without_lock": [], "with_lock": []}
        try:
            self._race(runs, buyers, stock, rounds, latency, progress_stream)
        finally:
            progress_stream.write(clean_up(created, keep=options["keep_tables"]) + "\n")
        summary = {run: summarize(results, buyers, stock) for run, results in runs.items()}
        if options["json"]:
            self.stdout.write(json.dumps(summary))
        else:
            self.stdout.write(render(summary, runs))

    def _race(
        self,
        runs: dict[str, list[Round]],
        buyers: int,
        stock: int,
        rounds: int,
        latency: float,
        progress_stream: TextIO,
    ) -> None:
        with (
            override_settings(ROOT_URLCONF="shop.race_urls", SHOP_PAYMENT_LATENCY=latency),
            serving() as base_url,
        ):
            progress_stream.write(
                f"checkout race on {describe_database()}: {buyers} buyers, {stock} in "
                f"stock, {rounds} round(s) per run, buyers over HTTP at {base_url}\n"
            )
            for run, path in (
                ("without_lock", "race/checkout-without-lock"),
                ("with_lock", "checkout"),
            ):
                for number in range(1, rounds + 1):
                    label = f"{run.replace('_', ' ')}, round {number}/{rounds}"
                    progress = Progress(progress_stream, label, buyers)
                    runs[run].append(race(f"{base_url}/{path}", buyers, stock, progress))


def clean_up(created: list[str], *, keep: bool) -> str:
    """Leave the database as the run found it, as far as it can; say what it did."""
    where = describe_database()
    if not os.environ.get("DATABASE_URL"):
        return f"The shop stays in {where} for the next run."
    remove_earlier_races()
    if not created:
        return f"Left the shop's tables in {where}: they were there before this run."
    if keep:
        return f"Kept the tables this run created in {where}: {', '.join(created)}."
    # Unapplying the shop's migrations drops its tables in dependency order.
    call_command("migrate", "shop", "zero", verbosity=0, interactive=False)
    if "advisory_locks_lease" in created:  # the lease table came with this run's migrate
        call_command("migrate", "advisory_locks_django", "zero", verbosity=0, interactive=False)
    recorder = MigrationRecorder(connection)
    if recorder.Migration._meta.db_table in created and not recorder.migration_qs.exists():
        with connection.schema_editor() as editor:
            editor.delete_model(recorder.Migration)
    left = sorted(set(created) & set(connection.introspection.table_names()))
    note = f"; still there: {', '.join(left)}" if left else ""
    return f"Dropped the tables this run created in {where}{note} (--keep-tables keeps them)."


def remove_earlier_races() -> None:
    Order.objects.filter(product__sku__startswith="race-").delete()
    Product.objects.filter(sku__startswith="race-").delete()


def describe_database() -> str:
    if connection.vendor == "sqlite":
        return f"SQLite ({settings.DATABASES['default']['NAME']})"
    settings_dict = connection.settings_dict
    where = f"{settings_dict['HOST'] or 'localhost'}/{settings_dict['NAME']}"
    return f"{connection.display_name} ({where})"


def describe_lock() -> str:
    call = 'Product.objects.with_advisory_lock(f"checkout-{sku}", transaction=%s, timeout=%s)'
    if has_transaction_locks(shop_database()):
        return (
            call % (True, CHECKOUT_LOCK_TIMEOUT) + ": a PostgreSQL transaction lock, released "
            "by the commit of the order."
        )
    return (
        call % (False, CHECKOUT_LOCK_TIMEOUT) + f": {connection.display_name} has no "
        "transaction locks, so a session lock is held around the whole read-pay-write and "
        "released after the order's transaction commits (see shop/locking.py)."
    )


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """The shop on a threaded WSGI server at 127.0.0.1 on a free port, for the block."""
    server = RaceServer(("127.0.0.1", 0), QuietHandler, allow_reuse_address=False)
    server.set_app(WSGIHandler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def race(url: str, buyers: int, stock: int, progress: Progress) -> Round:
    product = Product.objects.create(
        sku=f"race-{uuid.uuid4().hex[:12]}", name="Race mug", price_cents=1200, stock=stock
    )
    start = threading.Barrier(buyers + 1)
    answers: Counter[int] = Counter()
    guard = threading.Lock()

    def buyer(number: int) -> None:
        body = json.dumps(
            {"quantity": 1, "customer": f"buyer{number}@example.com", "card": "tok_visa"}
        ).encode()
        request = urllib.request.Request(
            f"{url}/{product.sku}/",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        start.wait()
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
        except OSError:
            status = 0
        with guard:
            answers[status] += 1
        progress.tick()

    threads = [threading.Thread(target=buyer, args=(n,)) for n in range(buyers)]
    for thread in threads:
        thread.start()
    start.wait()  # every buyer is ready: go
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    sold = Order.objects.filter(product=product).count()
    product.refresh_from_db()
    return Round(
        orders=sold,
        oversold=max(0, sold - stock),
        stock_left=product.stock,
        seconds=round(elapsed, 3),
        out_of_stock=answers[409],
        busy=answers[503],
        errors=sum(n for status, n in answers.items() if status not in (201, 409, 503)),
    )


def summarize(results: list[Round], buyers: int, stock: int) -> dict[str, Any]:
    return {
        "buyers": buyers,
        "stock": stock,
        "rounds": len(results),
        "orders": sum(r.orders for r in results),
        "oversold": sum(r.oversold for r in results),
        "oversold_rounds": sum(1 for r in results if r.oversold),
        "stock_left": sum(r.stock_left for r in results),
        "seconds": round(sum(r.seconds for r in results), 3),
        "out_of_stock": sum(r.out_of_stock for r in results),
        "busy": sum(r.busy for r in results),
        "errors": sum(r.errors for r in results),
        "per_round": [asdict(r) for r in results],
    }


def render(summary: dict[str, dict[str, Any]], runs: dict[str, list[Round]]) -> str:
    lines = [
        "",
        *textwrap.wrap(f"Concurrency: {CONCURRENCY_MODEL}", WIDTH),
        "",
        *textwrap.wrap(f"Lock: {describe_lock()}", WIDTH),
        "",
        f"{'run':<16}{'buyers':>7}{'stock':>7}{'orders':>8}{'oversold':>10}"
        f"{'stock left':>12}{'errors':>8}{'time':>9}",
    ]
    for run, results in runs.items():
        first = summary[run]
        for number, result in enumerate(results, 1):
            label = run.replace("_", " ") + (f" #{number}" if len(results) > 1 else "")
            lines.append(
                f"{label:<16}{first['buyers']:>7}{first['stock']:>7}{result.orders:>8}"
                f"{result.oversold:>10}{result.stock_left:>12}{result.errors:>8}"
                f"{result.seconds:>8.2f}s"
            )
    without, with_lock = summary["without_lock"], summary["with_lock"]
    lines.append("")
    if without["oversold"]:
        lines += textwrap.wrap(
            f"Without the lock, {without['oversold']} unit(s) were sold that did not exist "
            f"({without['oversold_rounds']} of {without['rounds']} round(s)); the 'stock "
            "left' column shows what the database believes: the buyers' writes overwrote "
            "each other (lost updates).",
            WIDTH,
        )
    else:
        lines += textwrap.wrap(
            "Without the lock, this time no buyer slipped through the race window; run it "
            "again, or with more --buyers.",
            WIDTH,
        )
    lines += textwrap.wrap(
        f"With the lock, {with_lock['oversold']} oversold: each buyer read the stock only "
        "after the previous buyer's order was committed.",
        WIDTH,
    )
    failures = without["errors"] + with_lock["errors"]
    if failures:
        lines += textwrap.wrap(f"{failures} request(s) failed with an unexpected answer.", WIDTH)
    return "\n".join(lines) + "\n"
