"""Fixtures for the Django app's tests: the test databases, and admin connections to them."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from django.db import connections
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL

from tests.databases import psycopg_connect


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
