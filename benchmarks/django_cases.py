"""Uncontended cases through Django and through the peers (django-pglock, pals).

Django keeps one connection per thread and alias; every case here runs on the main
thread's ``default`` connection (in autocommit, Django's default). Two references run on
it: the raw floor's statements through Django's own cursor, and ``floor.django.timeout``
(benchmarks.floors), the least any library must do there for acquire(timeout) + release,
with ``floor.django.contract``, the least a lock keeping the contract does there.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from sqlalchemy.engine import URL

from benchmarks.clients import PALS_APP, setup_django
from benchmarks.floors import django_contract_floor, django_floor
from benchmarks.measure import Case, Stopwatch
from benchmarks.uncontended import RAW_KEY_BASE, TIMEOUT_SECONDS, TWIN

__all__ = ["django_cases", "pals_cases"]

DJANGO_KEY = RAW_KEY_BASE + 50


def _django_socket() -> list[int]:
    from django.db import connection

    raw = connection.connection
    return [] if raw is None else [raw.pgconn.socket]


def django_cases(url: URL, stack: ExitStack) -> list[Case]:
    setup_django(url)
    import pglock
    from django.db import connection, transaction

    from advisory_locks_django import advisory_lock

    connection.ensure_connection()
    cases = []

    def add(
        name: str,
        description: str,
        body: Any,
        twin: str | None,
        group: str,
        bind_floor: str | None = None,
    ) -> None:
        def operation(watch: Stopwatch) -> None:
            watch.start()
            body()
            watch.stop()

        cases.append(
            Case(
                name,
                group,
                description,
                operation,
                twin=twin,
                bind_floor=bind_floor,
                sockets=_django_socket,
            )
        )

    def raw_django() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", (DJANGO_KEY,))
            cursor.fetchone()
            cursor.execute("SELECT pg_advisory_unlock(%s)", (DJANGO_KEY,))
            cursor.fetchone()

    add(
        "raw.django.try_lock+unlock",
        "the floor's two statements through Django's connection.cursor()",
        raw_django,
        None,
        "reference",
    )

    def ours(timeout: float | None) -> Any:
        name = f"bench.django.{timeout}"

        def body() -> None:
            with advisory_lock(name, timeout=timeout):
                pass

        return body

    add("ours.django", "advisory_lock(name) (Django)", ours(None), "raw.lock+unlock", "django")
    floor = django_floor(_django_socket)
    cases.append(floor)
    cases.append(django_contract_floor(_django_socket))
    add(
        "ours.django.timeout",
        f"advisory_lock(name, timeout={TIMEOUT_SECONDS}) (Django)",
        ours(TIMEOUT_SECONDS),
        TWIN,
        "django",
        floor.name,
    )

    def xact_case(name: str, description: str, lock: Any) -> None:
        def operation(watch: Stopwatch) -> None:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")  # the caller's transaction is open
                watch.start()
                lock()
                watch.stop()

        cases.append(
            Case(
                name,
                "django",
                description,
                operation,
                twin="raw.xact_lock_in_transaction",
                sockets=_django_socket,
            )
        )

    def ours_xact() -> None:
        with advisory_lock("bench.django.xact", transaction=True, timeout=TIMEOUT_SECONDS):
            pass

    xact_case(
        "ours.django.xact.timeout",
        f"advisory_lock(name, transaction=True, timeout={TIMEOUT_SECONDS}) inside atomic()",
        ours_xact,
    )

    def pglock_body(timeout: float | None) -> Any:
        name = f"bench.pglock.{timeout}"

        def body() -> None:
            with pglock.advisory(name, timeout=timeout):
                pass

        return body

    add(
        "pglock",
        "django-pglock: pglock.advisory(name, timeout=None)",
        pglock_body(None),
        "raw.lock+unlock",
        "peers",
    )
    add(
        "pglock.timeout",
        f"django-pglock: pglock.advisory(name, timeout={TIMEOUT_SECONDS})",
        pglock_body(TIMEOUT_SECONDS),
        TWIN,
        "peers",
    )

    def pglock_xact() -> None:
        pglock.advisory("bench.pglock.xact", xact=True, timeout=TIMEOUT_SECONDS).acquire()

    xact_case(
        "pglock.xact.timeout",
        f"django-pglock: advisory(name, xact=True, timeout={TIMEOUT_SECONDS}).acquire() "
        "inside atomic()",
        pglock_xact,
    )
    return cases


def pals_cases(url: URL, stack: ExitStack) -> list[Case]:
    import pals  # type: ignore[import-untyped]

    from benchmarks.postgres import TrackedEngine

    tracked = TrackedEngine(url, stack)
    locker = pals.Locker(PALS_APP, create_engine_callable=lambda: tracked.engine)

    def operation(watch: Stopwatch) -> None:
        watch.start()
        with locker.lock("bench.pals", blocking=True, acquire_timeout=TIMEOUT_SECONDS * 1000):
            pass
        watch.stop()

    return [
        Case(
            "pals.timeout",
            "peers",
            f"pals: Locker.lock(name, acquire_timeout={TIMEOUT_SECONDS * 1000}) on an Engine",
            operation,
            twin=TWIN,
            sockets=tracked.sockets,
        )
    ]
