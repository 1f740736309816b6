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
    raise UnsupportedDatabase(
        f"advisory-locks has no backend for the {dialect_name!r} database yet; "
        "PostgreSQL is supported"
    )
