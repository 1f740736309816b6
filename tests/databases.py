"""Which database servers the tests run against, and whether each one is required.

For each kind of server the candidates are tried in order; the first that accepts a plain
driver connection within ``CONNECT_TIMEOUT_SECONDS`` is used:

1. the SQLAlchemy URL in the kind's environment variable. When it is set it is the only
   candidate, so a mistyped URL fails loudly rather than quietly testing another server;
2. the local default on 127.0.0.1 (development and CI machines run both servers there);
3. a throwaway container, when testcontainers is installed and a Docker engine answers.

A kind is required when ``ADVISORY_LOCKS_REQUIRE_DATABASES`` (a comma list) names it or,
with that variable unset, when ``CI`` is true and the kind is in ``REQUIRED_IN_CI``. A test
that needs a required server that was not found fails; otherwise it is skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL, make_url

CONNECT_TIMEOUT_SECONDS = 2
REQUIRE_VARIABLE = "ADVISORY_LOCKS_REQUIRE_DATABASES"
# What CI needs when ADVISORY_LOCKS_REQUIRE_DATABASES is unset. SQLite needs no server.
REQUIRED_IN_CI = frozenset({"postgresql", "mysql"})

PostgresDriver = Literal["psycopg", "psycopg2", "asyncpg", "psycopg_async"]


@dataclass(frozen=True)
class ServerKind:
    name: str  # SQLAlchemy's backend name; also the pytest marker for tests that need it
    driver_url_name: str  # the dialect+driver of the URLs handed to tests
    environment_variable: str
    local_default: str
    connect: Callable[[URL], Any]  # opens a plain DB-API connection, raising if it cannot
    new_container: Callable[[], Any]  # an unstarted testcontainers container
    start_command: str  # how to start the local default server on a development machine


@dataclass(frozen=True)
class Discovery:
    kind: ServerKind
    url: URL | None
    required_by: str | None  # the setting that makes this kind required, if any
    failures: tuple[str, ...]  # one line per candidate that did not answer

    @property
    def skip_reason(self) -> str:
        """The one-line reason each test that needs this missing server is skipped with.

        Short on purpose: it is printed once per skipped test (or file); what was tried
        and how to start the server is printed once per run (``notice``).
        """
        return f"no {self.kind.name} server answered (see 'database servers' in this run's summary)"

    @property
    def notice(self) -> str:
        """What was tried and the command that starts the local server, said once a run."""
        tried = "\n".join(f"  - {failure}" for failure in self.failures)
        return (
            f"no {self.kind.name} server answered:\n{tried}\n"
            f"  start the local one with: {self.kind.start_command}\n"
            f"  or point {self.kind.environment_variable} at one (a SQLAlchemy URL)"
        )

    def require(self) -> URL:
        """Return the server's URL, or fail (if required) or skip the calling test."""
        if self.url is not None:
            return self.url
        if self.required_by is not None:
            pytest.fail(
                f"{self.kind.name} is required ({self.required_by}) but {self.notice}",
                pytrace=False,
            )
        pytest.skip(self.skip_reason)


MYSQLCLIENT_REQUIRE_VARIABLE = "ADVISORY_LOCKS_REQUIRE_MYSQLCLIENT"


def import_mysqlclient(environ: Mapping[str, str]) -> Any:
    """The mysqlclient driver module (``MySQLdb``), or fail/skip the calling test.

    mysqlclient compiles against the MySQL/MariaDB client library, so it is optional
    locally (skip, saying how to install it). It is required, and its absence fails the
    test, when ``ADVISORY_LOCKS_REQUIRE_MYSQLCLIENT=1`` and MySQL is a required database,
    as .ci/run sets them. PyMySQL registered as ``MySQLdb`` (tests/django_mysql_driver.py)
    does not count.
    """
    try:
        import MySQLdb as driver
    except ImportError:
        driver = None
    if driver is not None and driver.__name__ == "MySQLdb":
        return driver
    requirement = required_by(MYSQL, environ)
    if environ.get(MYSQLCLIENT_REQUIRE_VARIABLE) == "1" and requirement is not None:
        pytest.fail(
            f"mysqlclient is required ({MYSQLCLIENT_REQUIRE_VARIABLE}=1, {requirement}) but "
            "not installed: install the client library (Debian: default-libmysqlclient-dev "
            "pkg-config), then pip install mysqlclient",
            pytrace=False,
        )
    pytest.skip(
        "mysqlclient is optional and not installed; it needs the MySQL/MariaDB client "
        "library to build (Debian: apt-get install default-libmysqlclient-dev pkg-config; "
        "then pip install mysqlclient)"
    )


def psycopg_connect(url: URL, *, autocommit: bool = False) -> psycopg.Connection[TupleRow]:
    arguments: dict[str, Any] = url.translate_connect_args(username="user", database="dbname")
    arguments.update((key, value) for key, value in url.query.items() if isinstance(value, str))
    return psycopg.connect(
        **arguments, connect_timeout=CONNECT_TIMEOUT_SECONDS, autocommit=autocommit
    )


def pymysql_connect(url: URL) -> Any:
    import pymysql  # only the MySQL extras install it

    arguments = url.translate_connect_args(username="user")
    return pymysql.connect(**arguments, connect_timeout=CONNECT_TIMEOUT_SECONDS)


def _postgres_container() -> Any:
    from testcontainers.postgres import PostgresContainer

    return PostgresContainer("postgres:16-alpine")


def _mysql_container() -> Any:
    from testcontainers.mysql import MySqlContainer

    return MySqlContainer("mariadb:11")


POSTGRESQL = ServerKind(
    name="postgresql",
    driver_url_name="postgresql+psycopg",
    environment_variable="ADVISORY_LOCKS_TEST_POSTGRES_URL",
    local_default="postgresql+psycopg://postgres@127.0.0.1:5432/test",
    connect=psycopg_connect,
    new_container=_postgres_container,
    start_command="pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
)
MYSQL = ServerKind(
    name="mysql",
    driver_url_name="mysql+pymysql",
    environment_variable="ADVISORY_LOCKS_TEST_MYSQL_URL",
    local_default="mysql+pymysql://root@127.0.0.1:3306/test",
    connect=pymysql_connect,
    new_container=_mysql_container,
    start_command="start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
)
KINDS = {kind.name: kind for kind in (POSTGRESQL, MYSQL)}


def required_by(kind: ServerKind, environ: Mapping[str, str]) -> str | None:
    """Say which setting requires this kind of server, or None if none does."""
    listed = environ.get(REQUIRE_VARIABLE)
    if listed is not None:
        names = {name.strip() for name in listed.split(",") if name.strip()}
        if unknown := names - KINDS.keys():
            raise ValueError(f"{REQUIRE_VARIABLE} names unknown databases {sorted(unknown)}")
        return f"{REQUIRE_VARIABLE}={listed}" if kind.name in names else None
    in_ci = environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}
    return "CI is set" if in_ci and kind.name in REQUIRED_IN_CI else None


def postgres_url_with_driver(url: URL, driver: PostgresDriver) -> URL:
    if driver not in get_args(PostgresDriver):
        raise ValueError(f"unknown PostgreSQL driver {driver!r}")
    return url.set(drivername=f"postgresql+{driver}")


def discover(
    kind: ServerKind, environ: Mapping[str, str], containers: contextlib.ExitStack
) -> Discovery:
    """Find a server of this kind; containers started for it are stopped with `containers`."""
    requirement = required_by(kind, environ)
    failures: list[str] = []
    for source, locate in _candidates(kind, environ, containers):
        url: URL | None = None
        try:
            url = locate()
            if url.get_backend_name() != kind.name:
                raise ValueError(f"not a {kind.name} URL")
            kind.connect(url).close()
        except Exception as error:  # any failure just means "try the next candidate"
            shown = f" {url.render_as_string(hide_password=True)}" if url is not None else ""
            reason = " ".join(str(error).split()) or type(error).__name__
            failures.append(f"{source}{shown}: {reason}")
        else:
            return Discovery(
                kind, url.set(drivername=kind.driver_url_name), requirement, tuple(failures)
            )
    return Discovery(kind, None, requirement, tuple(failures))


def _candidates(
    kind: ServerKind, environ: Mapping[str, str], containers: contextlib.ExitStack
) -> list[tuple[str, Callable[[], URL]]]:
    explicit = environ.get(kind.environment_variable)
    if explicit:
        return [(f"${kind.environment_variable}", lambda: make_url(explicit))]
    return [
        ("local default", lambda: make_url(kind.local_default)),
        ("testcontainers", lambda: _start_container(kind, containers)),
    ]


def _start_container(kind: ServerKind, containers: contextlib.ExitStack) -> URL:
    try:
        import docker
    except ImportError:
        raise RuntimeError("not installed (pip install -e '.[containers]')") from None
    # Ask the engine first: without one, testcontainers would retry for a long time.
    docker.from_env(timeout=CONNECT_TIMEOUT_SECONDS).ping()
    container = containers.enter_context(kind.new_container())
    return make_url(container.get_connection_url())


class AdvisoryLockRow(NamedTuple):
    pid: int
    classid: int  # high 32 bits of a bigint key, or the first int4 of a pair
    objid: int  # low 32 bits of a bigint key, or the second int4 of a pair
    objsubid: int  # 1 for a bigint key, 2 for an (int4, int4) pair
    mode: str  # "ExclusiveLock" or "ShareLock"
    granted: bool  # False while the backend is waiting for the lock


def advisory_locks_held(
    admin: psycopg.Connection[TupleRow], pid: int | None = None
) -> list[AdvisoryLockRow]:
    """Advisory locks in the admin connection's database, granted or awaited, as pg_locks has them.

    Pass ``pid`` to see only one backend's locks.
    """
    query = """
        SELECT pid, classid, objid, objsubid, mode, granted
        FROM pg_locks
        WHERE locktype = 'advisory'
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
    """
    parameters: list[int] = []
    if pid is not None:
        query += " AND pid = %s"
        parameters.append(pid)
    query += " ORDER BY pid, classid, objid, objsubid, granted DESC"
    return [AdvisoryLockRow(*row) for row in admin.execute(query, parameters).fetchall()]
