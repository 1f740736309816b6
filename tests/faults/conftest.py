"""Fixtures of the fault-injection suite: engines it configures, and a count of faults.

Every fault a test injects (a killed process, a terminated backend, a disposed pool, a
forced deadlock, ...) goes through :func:`inject`, so a run reports how many it caused.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

# The contract suite's database x binding targets (a holder process, a waiter observed
# on the server, SQLAlchemy and Django clients), reused for the faults that every
# database and binding must survive.
from tests.contract.conftest import DJANGO_ALIASES, target  # noqa: F401
from tests.databases import pymysql_connect
from tests.django_aliases import aim_django_alias
from tests.faults.pgbouncer import PgBouncer, running_pgbouncer
from tests.faults.servers import (
    FaultDatabase,
    mysql_holder,
    mysql_kill,
    postgres_holder,
    postgres_kill,
    sqlite_holder,
    sqlite_kill,
)

FAULTS_INJECTED: dict[str, int] = {}
REPORT_LINES: list[str] = []
# Soak totals over every database: operations, locks leaked, lost updates.
SOAKED: dict[str, int] = {"operations": 0, "leaked": 0, "lost": 0}


def inject(kind: str) -> None:
    """Record one injected fault of ``kind``."""
    FAULTS_INJECTED[kind] = FAULTS_INJECTED.get(kind, 0) + 1


def report(line: str) -> None:
    """A line for the end-of-run summary (soak counts and the like)."""
    REPORT_LINES.append(line)


def soaked(operations: int, leaked: int, lost_updates: int) -> None:
    """Add one soak run to the totals the end-of-run summary gives."""
    SOAKED["operations"] += operations
    SOAKED["leaked"] += leaked
    SOAKED["lost"] += lost_updates


def finish_soak(
    title: str,
    outcomes: Mapping[str, int],
    *,
    planned: int,
    leaked: list[object],
    lost_updates: int,
    waits: int = 0,
) -> None:
    """Report one soak run, add it to the totals, and assert what every soak must show.

    ``waits`` counts contention the outcomes do not name (waits for the counter's lock).
    """
    operations = sum(outcomes.values())
    soaked(operations, len(leaked), lost_updates)
    report(
        f"{title}: {operations} operations, locks leaked: {len(leaked)}, "
        f"lost updates: {lost_updates}"
    )
    for outcome, count in sorted(outcomes.items()):
        report(f"  {count:6d}  {outcome}")
    assert operations == planned
    assert leaked == []
    assert lost_updates == 0
    busy = waits + sum(count for outcome, count in outcomes.items() if "busy" in outcome)
    assert busy > 0, "the soak never contended"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in REPORT_LINES:
        terminalreporter.write_line(line)
    if SOAKED["operations"]:
        terminalreporter.write_line(
            f"operations soaked: {SOAKED['operations']}, locks leaked: {SOAKED['leaked']}, "
            f"lost updates: {SOAKED['lost']}"
        )
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


@pytest.fixture
def my_admin(mysql_url: URL) -> Iterator[Any]:
    """A separate autocommit MySQL/MariaDB connection for looking at the server's locks."""
    admin = pymysql_connect(mysql_url)
    admin.autocommit(True)
    yield admin
    admin.close()


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FaultDatabase]:
    """One database of each kind, with a way to see from outside who holds a name."""
    if request.param == "postgresql":
        admin: psycopg.Connection[TupleRow] = request.getfixturevalue("pg_admin")
        url: URL = request.getfixturevalue("postgres_url")
        yield FaultDatabase(
            "postgresql", url, postgres_holder(admin), frozenset(), postgres_kill(admin)
        )
    elif request.param == "mariadb":
        url = request.getfixturevalue("mysql_url")
        my_admin = request.getfixturevalue("my_admin")
        yield FaultDatabase(
            "mariadb",
            url,
            mysql_holder(my_admin),
            frozenset({"shared", "transaction"}),
            mysql_kill(my_admin),
        )
    else:
        file = tmp_path / "faults.sqlite"
        url = make_url(f"sqlite:///{file}")
        yield FaultDatabase(
            "sqlite", url, sqlite_holder(file), frozenset({"transaction"}), sqlite_kill
        )


@pytest.fixture
def django_alias(database: FaultDatabase, django_db_blocker: Any) -> Iterator[str]:
    """The Django alias of ``database`` (tests/django_settings.py), aimed at it."""
    from django.db import connections

    alias = DJANGO_ALIASES[database.name]
    sqlite_file = Path(database.url.database or "") if database.name == "sqlite" else None
    aim_django_alias(alias, database.url, sqlite_file)
    with django_db_blocker.unblock():
        yield alias
        connections[alias].close()


@pytest.fixture
def notes_table(database: FaultDatabase, make_engine: Callable[..., Engine]) -> Iterator[str]:
    """A real (transactional) table on ``database`` for the application's writes."""
    table = f"al_notes_{uuid.uuid4().hex[:12]}"
    admin = make_engine(database.url, poolclass=NullPool)
    with admin.begin() as connection:
        connection.execute(text(f"CREATE TABLE {table} (note VARCHAR(40) NOT NULL)"))
    yield table
    with admin.begin() as connection:
        connection.execute(text(f"DROP TABLE {table}"))
