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
from advisory_locks_django.conf import SESSION_UNSAFE_POOLERS, SETTING, lock_settings, problems

__all__ = ["check_databases", "check_settings"]

DOCS = "See docs/django.md#system-checks."


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
    for alias, vendor in vendors.items():
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


def _vendor(database: Any) -> str:
    # The wrapper class says its vendor without connecting or touching `connections`.
    try:
        vendor: str = load_backend(database.get("ENGINE", "")).DatabaseWrapper.vendor
    except Exception:  # Django's own checks report an engine that does not load
        return "unknown"
    return vendor
