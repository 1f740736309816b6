"""The advisory locks of a Django database, as the management command and the admin page
show them: the backend's ``list_locks`` on the alias's connection, the names this process
can tell for the keys listed, and the held leases of the database's lease table."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import connections, transaction

from advisory_locks._core.steps import on, run_steps
from advisory_locks._dialects.base import LockedRow
from advisory_locks._dialects.lease import LeaseRow, lease_backend_for_dialect
from advisory_locks._monitoring import KnownNames
from advisory_locks.keys import LockName
from advisory_locks_django._binding import DjangoExecutor, backend_for_alias, held_keys
from advisory_locks_django.conf import lock_settings

__all__ = ["DatabaseLocks", "database_locks", "known_names", "list_leases", "list_locks"]


def list_locks(alias: str) -> list[LockedRow]:
    """Every advisory lock held or awaited on ``alias``'s database (connecting if needed).

    Raises ``UnsupportedFeature`` where the database cannot list them (SQLite, MySQL or
    MariaDB without a lock table) and the driver's error where it cannot be reached.
    """
    backend = backend_for_alias(alias)
    wrapper = connections[alias]
    wrapper.ensure_connection()
    # Listing holds nothing client-side, so a throwaway state dict is enough.
    executor = DjangoExecutor(wrapper, wrapper.connection, {})
    return run_steps(on(executor, backend.list_locks(executor.state)))


def list_leases(alias: str) -> list[LeaseRow] | None:
    """Every row of the lease table of ``alias``'s database (free ones too); None where
    the database has no lease table."""
    backend = lease_backend_for_dialect(connections[alias].vendor)
    wrapper = connections[alias]
    wrapper.ensure_connection()
    executor = DjangoExecutor(wrapper, wrapper.connection, {})
    try:
        # Its own transaction: a failure (a missing table) must not leave the connection
        # in an aborted one.
        with transaction.atomic(using=alias):
            rows: list[LeaseRow] = run_steps(on(executor, backend.list_leases()))
    except Exception as error:
        # Django wraps the driver's error; either may say the table is missing.
        if backend.is_missing_table(error) or backend.is_missing_table(error.__cause__ or error):
            return None
        raise
    return rows


def known_names(alias: str, given: Iterable[LockName] = ()) -> KnownNames:
    """What each listed key stands for, where this process can tell: the locks any thread
    of this process holds on ``alias`` (their keys are the very ones it sent), and the
    ``given`` names, hashed with the project's key prefix and every key scheme."""
    configured = lock_settings()
    known = KnownNames(backend_for_alias(alias).dialect_name)
    known.add_held(held_keys(alias), source="held here")
    for name in given:
        known.add(name, prefix=configured.key_prefix, source="given")
    return known


@dataclass
class DatabaseLocks:
    """One database's listing, or why there is none."""

    alias: str
    vendor: str
    database_name: str
    rows: list[LockedRow] = field(default_factory=list)
    known: KnownNames | None = None
    problem: str | None = None
    # None: the database has no lease table (or it could not be read: lease_problem).
    leases: list[LeaseRow] | None = None
    lease_problem: str | None = None


def database_locks(alias: str) -> DatabaseLocks:
    """The listing of ``alias``; a problem (unsupported, unreachable) becomes ``problem``."""
    wrapper = connections[alias]
    listing = DatabaseLocks(alias, wrapper.vendor, str(wrapper.settings_dict.get("NAME", "")))
    try:
        # In a savepoint when the request runs in a transaction (ATOMIC_REQUESTS): a
        # listing that fails must not break it.
        with transaction.atomic(using=alias):
            listing.rows = list_locks(alias)
        listing.known = known_names(alias)
    except Exception as error:
        # Shown to the operator in place of the table: SQLite's file locks, a MariaDB
        # without performance_schema, a server that is down.
        listing.problem = _one_line(error)
    try:
        leases = list_leases(alias)
        # Held leases, and expired ones nobody took since; free rows are history.
        listing.leases = None if leases is None else [r for r in leases if r.holder is not None]
    except Exception as error:
        listing.lease_problem = _one_line(error)
    return listing


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
