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


def test_prune_clears_an_abandoned_lease_keeps_a_live_one_and_counts_tokens_on(
    alias_and_url: tuple[str, URL],
) -> None:
    from advisory_locks._core.renewer import renewer
    from advisory_locks_django import prune_leases

    alias, url = alias_and_url
    abandoned_name, live_name = unique_name(), unique_name()
    engine = create_engine(url)
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        abandoned = lease_lock(engine, abandoned_name, ttl=30.0, timeout=0)
        assert abandoned.acquire()
        renewer().forget(abandoned._holding)  # type: ignore[arg-type] # as a crashed holder
        with admin.connect() as connection:  # expired just over an hour ago, by the server
            connection.execute(_expire_ago(alias), {"name": abandoned_name, "seconds": 3601})
        with lease_lock(engine, live_name, ttl=30.0, timeout=0) as live:
            prune_leases(older_than=7200, using=alias)
            assert _holder(alias, abandoned_name) is not None  # expired 1 h ago, not 2
            out = json.loads(_command("leases", "--prune", "1h", "--json", "--database", alias))
            assert out["pruned"] >= 1
            assert _command("leases", "--prune", "0", "--database", alias).startswith("Pruned ")
            live.ensure_held()
        listed = _listed(alias)
        assert listed[abandoned_name]["holder"] is None
        assert listed[abandoned_name]["token"] == abandoned.token
        with lease_lock(engine, abandoned_name, timeout=0) as again:
            assert again.token == abandoned.token + 1  # type: ignore[operator]
    finally:
        engine.dispose()
        admin.dispose()


def _listed(alias: str) -> dict[str, Any]:
    return {
        row["name"]: row for row in json.loads(_command("leases", "--json", "--database", alias))
    }


def _holder(alias: str, name: str) -> Any:
    return _listed(alias)[name]["holder"]


def _expire_ago(alias: str) -> Any:
    from sqlalchemy import text

    expired = {
        "default": "clock_timestamp() - :seconds * interval '1 second'",
        "mysql": "UTC_TIMESTAMP(6) - INTERVAL :seconds SECOND",
        "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || :seconds || ' seconds')",
    }[alias]
    return text(f"UPDATE advisory_locks_lease SET expires_at = {expired} WHERE name = :name")


@pytest.mark.parametrize("age", ["-1", "later", "1y"])
def test_prune_refuses_a_bad_age_before_any_sql(age: str) -> None:
    with pytest.raises(CommandError, match=r"not an age|between 0"):
        _command("leases", "--prune", age, "--database", "nowhere")


def test_prune_leases_refuses_a_bad_age_or_alias_before_any_sql() -> None:
    from advisory_locks_django import prune_leases

    with pytest.raises(ValueError, match="older_than"):
        prune_leases(older_than=-1, using="nowhere")
    with pytest.raises(TypeError, match="older_than"):
        prune_leases(older_than="1h", using="default")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown database alias"):
        prune_leases(older_than=0, using="nowhere")
