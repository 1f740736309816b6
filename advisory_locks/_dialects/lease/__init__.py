"""Lease dialects: the SQL of lease rows, one module per database family."""

from __future__ import annotations

from advisory_locks._dialects.lease.base import (
    LEASE_TABLE,
    Attempt,
    LeaseBackend,
    LeaseRow,
)
from advisory_locks.errors import UnsupportedDatabase

__all__ = ["LEASE_TABLE", "Attempt", "LeaseBackend", "LeaseRow", "lease_backend_for_dialect"]


def lease_backend_for_dialect(dialect_name: str) -> LeaseBackend:
    """The lease SQL for a SQLAlchemy/Django dialect name such as ``postgresql``."""
    if dialect_name in ("postgresql", "postgres", "postgis", "cockroachdb"):
        from advisory_locks._dialects.lease.postgresql import PostgresLeaseBackend

        return PostgresLeaseBackend()
    if dialect_name in ("mysql", "mariadb"):
        from advisory_locks._dialects.lease.mysql import MySQLLeaseBackend

        return MySQLLeaseBackend()
    if dialect_name == "sqlite":
        from advisory_locks._dialects.lease.sqlite import SQLiteLeaseBackend

        return SQLiteLeaseBackend()
    raise UnsupportedDatabase(
        f"advisory-locks has no lease support for the {dialect_name!r} database; "
        "PostgreSQL, MySQL, MariaDB and SQLite are supported"
    )
