"""The test-database discovery itself: found servers work, missing required ones fail."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from tests.databases import (
    MYSQLCLIENT_REQUIRE_VARIABLE,
    POSTGRESQL,
    REQUIRE_VARIABLE,
    AdvisoryLockRow,
    PostgresDriver,
    advisory_locks_held,
    discover,
    import_mysqlclient,
    required_by,
)

UNREACHABLE_POSTGRES = "postgresql://nobody@127.0.0.1:1/nothing"


def test_found_postgres_server_answers_select_1(pg_engine: Engine) -> None:
    with pg_engine.connect() as connection:
        assert connection.scalar(text("SELECT 1")) == 1


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_same_server_is_reachable_through_each_sync_driver(
    postgres_url_for: Callable[[PostgresDriver], URL], driver: PostgresDriver
) -> None:
    engine = create_engine(postgres_url_for(driver))
    with engine.connect() as connection:
        assert connection.scalar(text("SELECT 1")) == 1
    engine.dispose()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async"])
async def test_same_server_is_reachable_through_each_async_driver(
    postgres_url_for: Callable[[PostgresDriver], URL], driver: PostgresDriver
) -> None:
    engine = create_async_engine(postgres_url_for(driver))
    async with engine.connect() as connection:
        assert await connection.scalar(text("SELECT 1")) == 1
    await engine.dispose()


def test_admin_connection_sees_another_sessions_advisory_lock(
    pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    with pg_engine.connect() as connection:
        pid = connection.scalar(text("SELECT pg_backend_pid()"))
        connection.execute(text("SELECT pg_advisory_lock(42)"))

        held = advisory_locks_held(pg_admin, pid)

        connection.execute(text("SELECT pg_advisory_unlock(42)"))
    assert held == [AdvisoryLockRow(pid, 0, 42, 1, "ExclusiveLock", True)]


@pytest.mark.usefixtures("postgres_url")
def test_postgres_tests_get_the_postgresql_marker(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("postgresql") is not None


def test_unreachable_required_server_fails_the_test() -> None:
    environ = {
        POSTGRESQL.environment_variable: UNREACHABLE_POSTGRES,
        REQUIRE_VARIABLE: "postgresql",
    }

    discovery = discover(POSTGRESQL, environ, contextlib.ExitStack())

    with pytest.raises(pytest.fail.Exception, match="postgresql is required"):
        discovery.require()


def test_unreachable_unrequired_server_skips_the_test() -> None:
    environ = {POSTGRESQL.environment_variable: UNREACHABLE_POSTGRES}

    discovery = discover(POSTGRESQL, environ, contextlib.ExitStack())

    with pytest.raises(pytest.skip.Exception, match="no postgresql server answered"):
        discovery.require()


def test_explicit_url_is_the_only_candidate() -> None:
    environ = {POSTGRESQL.environment_variable: UNREACHABLE_POSTGRES}

    discovery = discover(POSTGRESQL, environ, contextlib.ExitStack())

    assert discovery.url is None
    assert len(discovery.failures) == 1


def test_url_of_the_wrong_database_kind_is_rejected() -> None:
    environ = {POSTGRESQL.environment_variable: "mysql+pymysql://root@127.0.0.1:3306/test"}

    discovery = discover(POSTGRESQL, environ, contextlib.ExitStack())

    assert discovery.url is None
    assert "not a postgresql URL" in discovery.failures[0]


def test_ci_requires_postgresql_by_default() -> None:
    assert required_by(POSTGRESQL, {"CI": "true"}) is not None
    assert required_by(POSTGRESQL, {"CI": "false"}) is None
    assert required_by(POSTGRESQL, {}) is None


def test_require_list_overrides_the_ci_default() -> None:
    assert required_by(POSTGRESQL, {"CI": "true", REQUIRE_VARIABLE: "mysql"}) is None
    assert required_by(POSTGRESQL, {REQUIRE_VARIABLE: "mysql, postgresql"}) is not None


def test_require_list_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="postgres"):
        required_by(POSTGRESQL, {REQUIRE_VARIABLE: "postgres"})


def test_a_missing_mysqlclient_fails_when_ci_requires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "MySQLdb", None)  # `import MySQLdb` raises ImportError
    environ = {MYSQLCLIENT_REQUIRE_VARIABLE: "1", REQUIRE_VARIABLE: "mysql"}
    with pytest.raises(pytest.fail.Exception, match="mysqlclient is required"):
        import_mysqlclient(environ)


def test_a_missing_mysqlclient_skips_with_install_hints_when_not_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    with pytest.raises(pytest.skip.Exception, match="default-libmysqlclient-dev"):
        import_mysqlclient({REQUIRE_VARIABLE: "mysql"})


def test_pymysql_standing_in_for_mysqlclient_does_not_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pymysql

    monkeypatch.setitem(sys.modules, "MySQLdb", pymysql)  # what install_as_MySQLdb() does
    environ = {MYSQLCLIENT_REQUIRE_VARIABLE: "1", REQUIRE_VARIABLE: "mysql"}
    with pytest.raises(pytest.fail.Exception, match="mysqlclient is required"):
        import_mysqlclient(environ)


def test_a_run_without_servers_explains_them_once_and_skips_with_a_short_reason() -> None:
    environ = {
        name: value
        for name, value in os.environ.items()
        if name not in (REQUIRE_VARIABLE, "CI", "PYTEST_ADDOPTS")
    }
    environ[POSTGRESQL.environment_variable] = UNREACHABLE_POSTGRES
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_found_postgres_server_answers_select_1",
            f"{__file__}::test_admin_connection_sees_another_sessions_advisory_lock",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
        cwd=Path(__file__).resolve().parent.parent,
    )
    output = completed.stdout
    assert completed.returncode == 0, output + completed.stderr
    assert output.count("Connection refused") == 1
    assert output.count(POSTGRESQL.start_command) == 1
    assert (
        "SKIPPED [2] tests/test_databases.py: no postgresql server answered (see 'database "
        "servers' in this run's summary)" in output
    )
