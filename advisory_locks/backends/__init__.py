"""Dialect backends: the only modules that contain database-specific SQL."""

from __future__ import annotations

from functools import cache

from advisory_locks.backends.base import Backend, LockedRow, Timeout
from advisory_locks.errors import UnsupportedDatabase

__all__ = ["Backend", "LockedRow", "Timeout", "backend_for_dialect"]


@cache
def backend_for_dialect(dialect_name: str) -> Backend:
    """Return the backend for a SQLAlchemy/Django dialect name such as ``postgresql``."""
    if dialect_name in ("postgresql", "postgres", "postgis"):
        from advisory_locks.backends.postgresql import PostgresBackend

        return PostgresBackend()
    if dialect_name in ("mysql", "mariadb"):
        from advisory_locks.backends.mysql import MySQLBackend

        return MySQLBackend()
    if dialect_name == "sqlite":
        try:
            from advisory_locks.backends.sqlite import SQLiteBackend
        except ModuleNotFoundError as error:
            raise UnsupportedDatabase(
                f"SQLite locks need {error.name}: pip install 'advisory-locks[sqlite]'"
            ) from None
        return SQLiteBackend()
    raise UnsupportedDatabase(
        f"advisory-locks has no backend for the {dialect_name!r} database; "
        "PostgreSQL, MySQL, MariaDB and SQLite are supported"
    )
