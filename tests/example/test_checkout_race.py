"""`manage.py checkout_race` end to end: a subprocess, a real server, a fresh database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg import sql
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import URL

from tests.databases import psycopg_connect, pymysql_connect

ROOT = Path(__file__).resolve().parents[2]
MANAGE = ROOT / "example_project" / "manage.py"

pytestmark = pytest.mark.slow


@pytest.fixture
def fresh_postgresql_database(postgres_url: URL) -> Iterator[str]:
    """A new, empty PostgreSQL database, dropped afterwards: the race migrates it first."""
    name = f"advisory_locks_race_{uuid.uuid4().hex[:12]}"
    with psycopg_connect(postgres_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield postgres_url.set(drivername="postgresql", database=name).render_as_string(
            hide_password=False
        )
    finally:
        with psycopg_connect(postgres_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def fresh_mariadb_database(mysql_url: URL) -> Iterator[str]:
    """A new, empty MySQL/MariaDB database, dropped afterwards."""
    name = f"advisory_locks_race_{uuid.uuid4().hex[:12]}"
    admin = pymysql_connect(mysql_url)
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}`")
        yield mysql_url.set(drivername="mysql", database=name).render_as_string(hide_password=False)
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


@pytest.fixture(
    params=[
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mariadb", marks=pytest.mark.mysql),
        "sqlite",
    ]
)
def race_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'race.sqlite3'}"
    url: str = request.getfixturevalue(f"fresh_{request.param}_database")
    return url


def checkout_race(*arguments: str) -> subprocess.CompletedProcess[str]:
    # Not this test process's settings (pytest-django exported them) nor its database.
    inherited = {"DATABASE_URL", "DJANGO_SETTINGS_MODULE"}
    environment = {key: value for key, value in os.environ.items() if key not in inherited}
    return subprocess.run(
        [sys.executable, str(MANAGE), "checkout_race", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
    )


def test_checkout_race_json_shows_the_lock_selling_exactly_the_stock(
    race_database_url: str,
) -> None:
    finished = checkout_race(
        "--json", "--buyers", "8", "--stock", "3", "--database-url", race_database_url
    )
    assert finished.returncode == 0, finished.stderr
    result = json.loads(finished.stdout)  # nothing but the JSON object on stdout
    assert set(result) == {"without_lock", "with_lock"}
    with_lock, without_lock = result["with_lock"], result["without_lock"]
    assert (with_lock["orders"], with_lock["oversold"], with_lock["stock_left"]) == (3, 0, 0)
    assert (with_lock["stock"], with_lock["buyers"], with_lock["errors"]) == (3, 8, 0)
    # Without the lock the race usually oversells; that it may not is why only the
    # shape is checked here.
    for key in ("orders", "stock", "oversold"):
        assert isinstance(without_lock[key], int)
    assert without_lock["oversold"] == max(0, without_lock["orders"] - 3)
    # The database is left as the run found it: empty.
    assert "Dropped the tables this run created" in finished.stderr
    assert tables_in(race_database_url) == []


def tables_in(url: str) -> list[str]:
    from shopsite.database_url import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(url))
    try:
        return sorted(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_checkout_race_keeps_the_tables_it_created_when_asked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    finished = checkout_race(
        "--json", "--buyers", "2", "--stock", "1", "--keep-tables", "--database-url", url
    )
    assert finished.returncode == 0, finished.stderr
    assert "Kept the tables this run created" in finished.stderr
    assert {"django_migrations", "shop_order", "shop_product"} <= set(tables_in(url))


def test_checkout_race_leaves_tables_that_were_there_before_without_its_rows(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    first = checkout_race(
        "--json", "--buyers", "2", "--stock", "1", "--keep-tables", "--database-url", url
    )
    assert first.returncode == 0, first.stderr
    again = checkout_race("--json", "--buyers", "2", "--stock", "1", "--database-url", url)
    assert again.returncode == 0, again.stderr
    assert "they were there before this run" in again.stderr
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            assert connection.scalar(text("SELECT count(*) FROM shop_product")) == 0
    finally:
        engine.dispose()


def test_checkout_race_prints_a_table_and_reports_progress_on_stderr(tmp_path: Path) -> None:
    finished = checkout_race(
        "--buyers", "4", "--stock", "2", "--database-url", f"sqlite:///{tmp_path / 'shop.db'}"
    )
    assert finished.returncode == 0, finished.stderr
    rows = {line.split("  ")[0]: line.split() for line in finished.stdout.splitlines()}
    header = ["run", "buyers", "stock", "orders", "oversold", "stock", "left", "errors", "time"]
    assert rows["run"] == header
    assert rows["with lock"][2:7] == ["4", "2", "2", "0", "0"]
    assert "Concurrency: Each buyer is a thread" in finished.stdout
    assert "with lock, round 1/1: 4/4 buyers answered" in finished.stderr


def test_checkout_race_refuses_a_nonpositive_buyer_count(tmp_path: Path) -> None:
    finished = checkout_race("--buyers", "0", "--database-url", f"sqlite:///{tmp_path / 'x.db'}")
    assert finished.returncode != 0
    assert "--buyers: must be at least 1" in finished.stderr
