"""``DATABASE_URL`` -> Django's ``DATABASES`` entry.

Parsed with SQLAlchemy's ``make_url`` rather than dj-database-url: the shop's SQLAlchemy
service (``sqlalchemy_service.py``) reads the same variable, so one URL must suit both,
and only SQLAlchemy's parser takes driver-qualified URLs (``postgresql+psycopg://``,
``mysql+pymysql://``) as well as plain ones. SQLAlchemy is installed for that service
anyway, so this costs no dependency.
"""

from __future__ import annotations

from typing import Any

import django
from django.core.exceptions import ImproperlyConfigured
from sqlalchemy.engine import make_url

__all__ = ["database_from_url"]

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
    if backend in {"mysql", "mariadb"}:
        use_pymysql_if_needed()
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
    return {"ENGINE": ENGINES["sqlite"], "NAME": path, "OPTIONS": options}


def use_pymysql_if_needed() -> None:
    # Django's MySQL backend speaks mysqlclient's API; PyMySQL (the `mysql` extra, pure
    # Python) can stand in for it where mysqlclient is not installed.
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        try:
            import pymysql
        except ImportError:
            raise ImproperlyConfigured(
                "a MySQL/MariaDB URL needs a driver: pip install 'advisory-locks[mysql]'"
            ) from None
        pymysql.install_as_MySQLdb()
