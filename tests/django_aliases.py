"""Aim the MySQL and SQLite aliases of tests/django_settings.py at the databases under test.

Tests that only take locks need no tables, so these aliases use the servers' own
databases (and for SQLite a file the test chooses) and no test database is made for them;
the tests that use them unblock pytest-django's database access themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL

__all__ = ["aim_django_alias"]

CONNECTION_SETTINGS = ("ENGINE", "NAME", "HOST", "PORT", "USER", "PASSWORD")


def aim_django_alias(alias: str, url: URL, sqlite_file: Path | None = None) -> dict[str, Any]:
    """Point ``alias`` at ``url`` (or ``sqlite_file``); return its connection settings.

    "default" keeps its NAME, which is the PostgreSQL test database once pytest-django has
    made it. Connections opened from now on, in any thread, use the new settings.
    """
    from django.db import connections

    database = connections.settings[alias]
    if database["ENGINE"].endswith("sqlite3"):
        if sqlite_file is not None:
            database["NAME"] = str(sqlite_file)
    else:
        database.update(
            HOST=url.host or "",
            PORT=url.port or "",
            USER=url.username or "",
            PASSWORD=url.password or "",
        )
        test_name = (database.get("TEST") or {}).get("NAME")
        if alias != "default" and not (test_name and database["NAME"] == test_name):
            # Not once pytest-django has made this alias's test database: its teardown
            # drops whatever NAME says then, which would be the server's own database.
            database["NAME"] = url.database
    return {setting: database[setting] for setting in CONNECTION_SETTINGS if setting in database}
