"""Fixtures for the Django app's tests: the test databases, and admin connections to them."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from django.db import connections
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL

from tests.databases import psycopg_connect


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
            # The test database exists already (a second conftest re-uses this fixture,
            # so it can run after setup): renaming it back would make pytest-django's
            # teardown drop the server's own database instead.
            continue
        database.update(
            HOST=postgres_url.host or "",
            PORT=postgres_url.port or "",
            USER=postgres_url.username or "",
            PASSWORD=postgres_url.password or "",
            NAME=postgres_url.database or "postgres",
        )


def admin_for(postgres_url: URL, using: str = "default") -> Iterator[psycopg.Connection[TupleRow]]:
    """An autocommit connection to the test database behind ``using``."""
    name = connections[using].settings_dict["NAME"]
    with psycopg_connect(postgres_url.set(database=name), autocommit=True) as admin:
        yield admin


@pytest.fixture
def admin(django_db_setup: None, postgres_url: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    yield from admin_for(postgres_url)


@pytest.fixture
def other_admin(django_db_setup: None, postgres_url: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    yield from admin_for(postgres_url, "other")
