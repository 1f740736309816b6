"""``manage.py advisory_locks leases``: the lease table of a Django database, printed as the
``advisory-locks leases`` CLI prints it (one formatting, in advisory_locks._monitoring)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from sqlalchemy import create_engine
from sqlalchemy.engine import URL

from advisory_locks import lease_lock
from advisory_locks._dialects.lease import lease_backend_for_dialect
from tests.django_aliases import aim_django_alias
from tests.helpers import unique_name


def _command(*arguments: str) -> str:
    out = io.StringIO()
    call_command("advisory_locks", *arguments, stdout=out)
    return out.getvalue()


@pytest.fixture(params=["default", "mysql", "sqlite"])
def alias_and_url(
    request: pytest.FixtureRequest, tmp_path: Path, django_db_blocker: Any
) -> Iterator[tuple[str, URL]]:
    """A Django alias with the lease table, and a SQLAlchemy URL of the same database."""
    alias: str = request.param
    if alias == "default":
        request.getfixturevalue("django_db_setup")
        postgres_url: URL = request.getfixturevalue("postgres_url")
        url = postgres_url.set(database=connections["default"].settings_dict["NAME"])
    elif alias == "mysql":
        url = request.getfixturevalue("mysql_url")
        # The alias keeps its test database if pytest-django made one (an earlier test
        # asked for it): the SQLAlchemy worker must use the database the alias uses.
        url = url.set(database=aim_django_alias("mysql", url)["NAME"])
    else:
        url = URL.create("sqlite", database=str(tmp_path / "django.sqlite3"))
        aim_django_alias("sqlite", url, tmp_path / "django.sqlite3")
    with django_db_blocker.unblock():
        wrapper = connections[alias]
        with wrapper.cursor() as cursor:
            for sql in lease_backend_for_dialect(wrapper.vendor).create_table():
                cursor.execute(sql)
        yield alias, url
        wrapper.close()


def test_leases_lists_a_lease_held_by_a_sqlalchemy_worker(alias_and_url: tuple[str, URL]) -> None:
    alias, url = alias_and_url
    name = unique_name()
    engine = create_engine(url)
    try:
        with lease_lock(engine, name, ttl=30.0, timeout=0) as lease:  # no LISTEN connection left
            rows = {
                row["name"]: row
                for row in json.loads(_command("leases", "--json", "--database", alias))
            }
            held = rows[name]
            assert (held["held"], held["token"]) == (True, lease.token)
            assert held["holder"]
            assert 25.0 < held["expires_in_seconds"] <= 30.0
            table = _command("leases", "--database", alias)
            line = next(line for line in table.splitlines() if line.startswith(name))
            assert line.split()[1:4] == ["held", held["holder"], str(lease.token)]
            assert table.splitlines()[0].split()[:4] == ["NAME", "STATUS", "HOLDER", "TOKEN"]
    finally:
        engine.dispose()


def test_leases_refuses_an_unknown_alias() -> None:
    with pytest.raises(CommandError, match="unknown database alias 'nowhere'"):
        _command("leases", "--database", "nowhere")


def test_leases_without_the_table_is_a_command_error(
    tmp_path: Path, django_db_blocker: Any
) -> None:
    aim_django_alias("sqlite", URL.create("sqlite"), tmp_path / "empty.sqlite3")
    with django_db_blocker.unblock():
        try:
            with pytest.raises(CommandError, match="advisory_locks_lease does not exist"):
                _command("leases", "--database", "sqlite")
        finally:
            connections["sqlite"].close()
