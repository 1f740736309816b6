"""Fixtures that hand tests a real database server; see tests/databases.py for how one is found."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL

from tests.databases import (
    MYSQL,
    POSTGRESQL,
    Discovery,
    PostgresDriver,
    ServerKind,
    discover,
    postgres_url_with_driver,
    psycopg_connect,
)

# A test that uses one of these fixtures, directly or through another fixture, gets the
# marker, so `-m "not postgresql"` runs everything that needs no server.
MARKER_FOR_FIXTURE = {"postgres_url": POSTGRESQL.name, "mysql_url": MYSQL.name}
KIND_FOR_MARKER = {POSTGRESQL.name: POSTGRESQL, MYSQL.name: MYSQL}

# One discovery per kind of server for the whole run, and the containers it started.
_DISCOVERIES = pytest.StashKey[dict[str, Discovery]]()
_CONTAINERS = pytest.StashKey[contextlib.ExitStack]()


def discovered(config: pytest.Config, kind: ServerKind) -> Discovery:
    """The run's server of this kind, looked for once (containers stop at the end)."""
    found = config.stash.setdefault(_DISCOVERIES, {})
    if kind.name not in found:
        if _CONTAINERS not in config.stash:
            containers = contextlib.ExitStack()
            config.stash[_CONTAINERS] = containers
            config.add_cleanup(containers.close)
        found[kind.name] = discover(kind, os.environ, config.stash[_CONTAINERS])
    return found[kind.name]


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook applies `-m` to the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in MARKER_FOR_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: look only for servers in use
def pytest_collection_finish(session: pytest.Session) -> None:
    """Skip the tests of a missing, unrequired server by marker, with one short reason.

    A skip marker (unlike a skip raised by a fixture) lets pytest fold a file's skips into
    one summary line; the long story (what was tried, how to start the server) is told
    once, in the 'database servers' section at the end of the run.
    """
    for name, kind in KIND_FOR_MARKER.items():
        needing = [item for item in session.items if item.get_closest_marker(name)]
        if not needing:
            continue
        discovery = discovered(session.config, kind)
        if discovery.url is None and discovery.required_by is None:
            for item in needing:
                item.add_marker(pytest.mark.skip(reason=discovery.skip_reason))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    missing = [d for d in config.stash.get(_DISCOVERIES, {}).values() if d.url is None]
    if not missing:
        return
    terminalreporter.section("database servers", yellow=True)
    for discovery in missing:
        terminalreporter.write_line(discovery.notice)


@pytest.fixture(scope="session")
def postgres_url(request: pytest.FixtureRequest) -> URL:
    """The PostgreSQL server under test, as a SQLAlchemy URL for psycopg 3."""
    return discovered(request.config, POSTGRESQL).require()


@pytest.fixture(scope="session")
def mysql_url(request: pytest.FixtureRequest) -> URL:
    """The MySQL or MariaDB server under test, as a SQLAlchemy URL for PyMySQL."""
    return discovered(request.config, MYSQL).require()


@pytest.fixture(scope="session")
def postgres_url_for(postgres_url: URL) -> Callable[[PostgresDriver], URL]:
    """The same server for another driver: psycopg, psycopg2, asyncpg or psycopg_async."""
    return lambda driver: postgres_url_with_driver(postgres_url, driver)


@pytest.fixture
def pg_engine(postgres_url: URL) -> Iterator[Engine]:
    engine = create_engine(postgres_url)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_admin(postgres_url: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    """A separate autocommit connection for looking at pg_locks from outside."""
    with psycopg_connect(postgres_url, autocommit=True) as admin:
        yield admin


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    django_db_modify_db_settings_parallel_suffix: None, postgres_url: URL
) -> None:
    """Point tests/django_settings.py at the discovered server before pytest-django creates
    the test databases, so a missing server skips or fails like any other test."""
    from django.conf import settings

    for database in settings.DATABASES.values():
        if database["ENGINE"] != "django.db.backends.postgresql":
            continue  # the MySQL and SQLite aliases are aimed by the tests that use them
        if database["NAME"] == database.get("TEST", {}).get("NAME"):
            # The test database exists already: renaming it back would make
            # pytest-django's teardown drop the server's own database instead.
            continue
        database.update(
            HOST=postgres_url.host or "",
            PORT=postgres_url.port or "",
            USER=postgres_url.username or "",
            PASSWORD=postgres_url.password or "",
            NAME=postgres_url.database or "postgres",
        )
