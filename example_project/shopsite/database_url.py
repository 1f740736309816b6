"""``DATABASE_URL`` -> Django's ``DATABASES`` entry, and the same URL for SQLAlchemy.

Parsed with SQLAlchemy's ``make_url`` rather than dj-database-url: the shop's SQLAlchemy
service (``sqlalchemy_service.py``) reads the same variable, so one URL must suit both,
and only SQLAlchemy's parser takes driver-qualified URLs (``postgresql+psycopg://``,
``mysql+pymysql://``) as well as plain ones. SQLAlchemy is installed for that service
anyway, so this costs no dependency.

A plain ``mysql://`` URL works with whichever MySQL driver is installed: Django's MySQL
backend gets PyMySQL from the advisory_locks_django app where mysqlclient is missing,
and ``sqlalchemy_url()`` names the installed driver for SQLAlchemy.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import django
from django.core.exceptions import ImproperlyConfigured
from sqlalchemy.engine import URL, make_url

__all__ = ["database_from_url", "sqlalchemy_url"]

ENGINES = {
    "postgresql": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",
    "mariadb": "django.db.backends.mysql",
    "sqlite": "django.db.backends.sqlite3",
}

# Seconds a SQLite writer waits for another writer's transaction before "database is
# locked". The checkout race runs many writers at once; they must queue, not fail.
SQLITE_BUSY_TIMEOUT = 30


def database_from_url(url: str) -> dict[str, Any]:
    if url.startswith("postgres://"):  # Heroku's spelling; SQLAlchemy 2 dropped it
        url = "postgresql://" + url.removeprefix("postgres://")
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend not in ENGINES:
        raise ImproperlyConfigured(
            f"DATABASE_URL {parsed.render_as_string()!r}: the example runs on "
            "postgresql://, mysql:// / mariadb:// or sqlite:///<file>"
        )
    if backend == "sqlite":
        return sqlite_database(parsed.database)
    return {
        "ENGINE": ENGINES[backend],
        "NAME": parsed.database or "",
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
        "OPTIONS": {key: value for key, value in parsed.query.items() if isinstance(value, str)},
    }


def sqlite_database(path: str | None) -> dict[str, Any]:
    if not path or path == ":memory:":
        # Locks on SQLite are OS file locks next to the database file.
        raise ImproperlyConfigured("the example needs a SQLite database file: sqlite:///shop.db")
    options: dict[str, Any] = {"timeout": SQLITE_BUSY_TIMEOUT}
    if django.VERSION >= (5, 1):
        # BEGIN IMMEDIATE: a transaction takes SQLite's write lock when it starts, so it
        # waits (busy timeout) for other writers instead of failing with "database is
        # locked" when it reads first and another writer commits before its own write.
        options["transaction_mode"] = "IMMEDIATE"
    return {
        "ENGINE": ENGINES["sqlite"],
        "NAME": path,
        "OPTIONS": options,
        # `manage.py test` would make the test database in memory, where locks are
        # refused (system check advisory_locks.W005): a file next to the database.
        "TEST": {"NAME": f"{path}.test"},
    }


def sqlalchemy_url(url: str) -> URL:
    """``url`` for SQLAlchemy, naming a driver that is installed where it names none.

    To SQLAlchemy a plain ``mysql://`` means mysqlclient and ``postgresql://`` psycopg2,
    installed or not; the shop's extras install PyMySQL and psycopg 3.
    """
    if url.startswith("postgres://"):
        url = "postgresql://" + url.removeprefix("postgres://")
    parsed = make_url(url)
    backend, _, driver = parsed.drivername.partition("+")
    if driver:
        return parsed
    if backend in {"mysql", "mariadb"} and not _mysqlclient_installed():
        return parsed.set(drivername=f"{backend}+pymysql")
    if backend == "postgresql" and _installed("psycopg"):
        return parsed.set(drivername="postgresql+psycopg")
    return parsed


def _mysqlclient_installed() -> bool:
    loaded = sys.modules.get("MySQLdb")
    if loaded is not None:  # PyMySQL registered under mysqlclient's name is not it
        return loaded.__name__ == "MySQLdb"
    return _installed("MySQLdb")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: imports of it are blocked
        return False
