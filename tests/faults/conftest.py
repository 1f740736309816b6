"""Fixtures of the fault-injection suite: engines it configures, and a count of faults.

Every fault a test injects (a killed process, a terminated backend, a disposed pool, a
forced deadlock, ...) goes through :func:`inject`, so a run reports how many it caused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL

from tests.faults.pgbouncer import PgBouncer, running_pgbouncer

FAULTS_INJECTED: dict[str, int] = {}
REPORT_LINES: list[str] = []


def inject(kind: str) -> None:
    """Record one injected fault of ``kind``."""
    FAULTS_INJECTED[kind] = FAULTS_INJECTED.get(kind, 0) + 1


def report(line: str) -> None:
    """A line for the end-of-run summary (soak counts and the like)."""
    REPORT_LINES.append(line)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in REPORT_LINES:
        terminalreporter.write_line(line)
    if FAULTS_INJECTED:
        details = ", ".join(f"{kind}: {n}" for kind, n in sorted(FAULTS_INJECTED.items()))
        terminalreporter.write_line(f"faults injected: {sum(FAULTS_INJECTED.values())} ({details})")


@pytest.fixture
def make_engine(postgres_url: URL) -> Iterator[Callable[..., Engine]]:
    """Engines a test configures itself (pool size, application_name); disposed after."""
    engines: list[Engine] = []

    def make(url: URL | None = None, **options: Any) -> Engine:
        engine = create_engine(url or postgres_url, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture(scope="session")
def pgbouncer(postgres_url: URL) -> Iterator[PgBouncer]:
    """A PgBouncer in front of the test server, in session and transaction pooling."""
    with running_pgbouncer(postgres_url) as bouncer:
        yield bouncer
