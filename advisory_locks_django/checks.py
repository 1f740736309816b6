"""System checks for the ``ADVISORY_LOCKS`` setting and the databases locks run on.

Ids are stable; docs/django.md#system-checks explains each one.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.db.utils import load_backend

from advisory_locks._dialects import backend_for_dialect
from advisory_locks.errors import UnsupportedDatabase
from advisory_locks_django._mysql_driver import mysql_aliases, mysql_driver
from advisory_locks_django.conf import SESSION_UNSAFE_POOLERS, SETTING, lock_settings, problems

__all__ = ["check_databases", "check_mysql_driver", "check_settings", "check_sqlite_files"]

DOCS = "See docs/django.md#system-checks."
SQLITE_DOCS = "See docs/django.md#sqlite-databases-and-tests."
MYSQL_DOCS = "See docs/django.md#mysql-and-mariadb-drivers."


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001-E007: the ``ADVISORY_LOCKS`` dict itself."""
    raw = getattr(settings, SETTING, {})
    return [
        Error(problem.message, hint=problem.hint or DOCS, id=problem.id)
        for problem in problems(raw)
    ]


def check_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W001-W003: databases that cannot hold locks, or hold session locks unsafely."""
    messages: list[CheckMessage] = []
    vendors = {alias: _vendor(database) for alias, database in settings.DATABASES.items()}
    # A MySQL engine that does not load lacks its driver: E008 says so, not W001.
    unloadable_mysql = {a for a in mysql_aliases(settings.DATABASES) if vendors[a] == "unknown"}
    for alias, vendor in vendors.items():
        if alias in unloadable_mysql:
            continue
        try:
            backend_for_dialect(vendor)
        except UnsupportedDatabase as error:
            messages.append(
                Warning(
                    f"Database {alias!r} cannot hold advisory locks: {error}.",
                    hint="Locks on this alias raise UnsupportedDatabase; silence this "
                    "check if the alias is never locked. " + DOCS,
                    obj=alias,
                    id="advisory_locks.W001",
                )
            )
    if problems(getattr(settings, SETTING, {})):
        return messages  # check_settings reports those
    configured = lock_settings()
    for alias, vendor in vendors.items():
        pooler = configured.poolers.get(alias)
        if pooler in SESSION_UNSAFE_POOLERS and not configured.transaction:
            messages.append(
                Warning(
                    f"Database {alias!r} is behind a {pooler} pooler, but locks default to "
                    "session locks, which such a pooler cannot keep on one server "
                    "connection; they are refused there.",
                    hint=f"Set {SETTING}['TRANSACTION'] = True, or pass transaction=True "
                    "to each lock on this database. " + DOCS,
                    obj=alias,
                    id="advisory_locks.W002",
                )
            )
        database = settings.DATABASES[alias]
        if (
            pooler is None
            and database.get("DISABLE_SERVER_SIDE_CURSORS")
            and vendor == "postgresql"
        ):
            messages.append(
                Warning(
                    f"Database {alias!r} sets DISABLE_SERVER_SIDE_CURSORS, which usually "
                    "means PgBouncer in transaction pooling mode, where session locks are "
                    "not safe.",
                    hint=f"Declare the pooler in {SETTING}['POOLERS'] (e.g. "
                    f"{{{alias!r}: 'pgbouncer-transaction'}}) and use transaction=True, or "
                    "'pgbouncer-session' if it pools sessions. " + DOCS,
                    obj=alias,
                    id="advisory_locks.W003",
                )
            )
    return messages


def check_mysql_driver(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E008: a MySQL/MariaDB database, but neither mysqlclient nor PyMySQL to reach it."""
    aliases = mysql_aliases(settings.DATABASES)
    if not aliases or mysql_driver() is not None:
        return []
    return [
        Error(
            f"Database {alias!r} uses MySQL/MariaDB, but neither mysqlclient nor PyMySQL "
            "is installed.",
            hint="pip install 'advisory-locks[mysql]' (PyMySQL: pure Python; this app "
            "registers it for Django's MySQL backend) or 'advisory-locks[mysqlclient]'. "
            + MYSQL_DOCS,
            obj=alias,
            id="advisory_locks.E008",
        )
        for alias in aliases
    ]


def check_sqlite_files(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W004-W005: SQLite databases in memory, where locks (file locks) are refused."""
    messages: list[CheckMessage] = []
    for alias, database in settings.DATABASES.items():
        if _vendor(database) != "sqlite":
            continue
        test_name = (database.get("TEST") or {}).get("NAME")
        if _in_memory(database.get("NAME")):
            # Also what `manage.py test` shows: its checks run after the test databases
            # were created, with NAME set to the test database's.
            messages.append(
                Warning(
                    f"Database {alias!r} is an in-memory SQLite database: locks on SQLite "
                    "are file locks next to the database file, so every lock on it raises "
                    "UnsupportedFeature.",
                    hint=f'Give it a file: DATABASES["{alias}"]["NAME"], and for tests '
                    f'DATABASES["{alias}"]["TEST"]["NAME"] (e.g. BASE_DIR / '
                    f'"test_{alias}.sqlite3"). ' + SQLITE_DOCS,
                    obj=alias,
                    id="advisory_locks.W004",
                )
            )
        elif _in_memory(test_name):
            messages.append(
                Warning(
                    f"Database {alias!r} gets an in-memory SQLite test database (Django's "
                    "default when TEST NAME is not set), where every lock raises "
                    "UnsupportedFeature: locks on SQLite are file locks next to the "
                    "database file.",
                    hint=f'Set DATABASES["{alias}"]["TEST"]["NAME"] to a file, e.g. '
                    f'BASE_DIR / "test_{alias}.sqlite3". ' + SQLITE_DOCS,
                    obj=alias,
                    id="advisory_locks.W005",
                )
            )
    return messages


def _in_memory(name: object) -> bool:
    # Django's test runner uses an in-memory database for a missing or ":memory:" name, and
    # names it "file:memorydb_<alias>?mode=memory&cache=shared".
    if name is None or name == "":
        return True
    return isinstance(name, str) and (name == ":memory:" or "mode=memory" in name)


def _vendor(database: Any) -> str:
    # The wrapper class says its vendor without connecting or touching `connections`.
    try:
        vendor: str = load_backend(database.get("ENGINE", "")).DatabaseWrapper.vendor
    except Exception:  # Django's own checks report an engine that does not load
        return "unknown"
    return vendor
