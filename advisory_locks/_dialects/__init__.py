"""Dialect backends: the only modules that contain database-specific SQL."""

from __future__ import annotations

import threading

from advisory_locks._core.contract import Timeout
from advisory_locks._dialects.base import Backend, LockedRow
from advisory_locks.errors import UnsupportedDatabase

__all__ = ["Backend", "LockedRow", "Timeout", "backend_for_dialect", "loaded_backends"]

# Each dialect name's backend once loaded (read directly where a call costs too much).
loaded_backends: dict[str, Backend] = {}
# First use may come from many threads at once (a web server's first requests). Python
# hands a module that is still being imported to other importing threads, and a failed
# import leaves them "cannot import name" instead of the real reason, so the first
# lookup of each dialect runs alone.
_first_use = threading.Lock()


def backend_for_dialect(dialect_name: str) -> Backend:
    """Return the backend for a SQLAlchemy/Django dialect name such as ``postgresql``."""
    backend = loaded_backends.get(dialect_name)
    if backend is None:
        with _first_use:
            backend = loaded_backends.get(dialect_name)
            if backend is None:
                backend = loaded_backends[dialect_name] = _load(dialect_name)
    return backend


def _load(dialect_name: str) -> Backend:
    if dialect_name in ("postgresql", "postgres", "postgis"):
        from advisory_locks._dialects.postgresql import PostgresBackend

        return PostgresBackend()
    if dialect_name in ("mysql", "mariadb"):
        from advisory_locks._dialects.mysql import MySQLBackend

        return MySQLBackend()
    if dialect_name == "sqlite":
        try:
            from advisory_locks._dialects.sqlite import SQLiteBackend
        except ImportError as error:
            missing = getattr(error, "name", None) or "portalocker"
            raise UnsupportedDatabase(
                f"SQLite locks need {missing}: pip install 'advisory-locks[sqlite]'"
            ) from None
        return SQLiteBackend()
    raise UnsupportedDatabase(
        f"advisory-locks has no backend for the {dialect_name!r} database; "
        "PostgreSQL, MySQL, MariaDB and SQLite are supported"
    )
