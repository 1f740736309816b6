"""What a lease dialect does: the SQL of one database family for lease rows.

A lease is a row of the table ``advisory_locks_lease``, keyed by the lease name. Every
method that talks to the database is a generator of ``Statement`` requests (see
``advisory_locks._core.steps``), so blocking and asyncio drivers run the same SQL. Each
statement reads time from the DATABASE's clock only; the client sends durations (the ttl
in seconds), never instants.

Rows are never deleted: the ``token`` column counts acquisitions of its name for ever, and
is the fencing token. Releasing or pruning only clears ``holder``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeAlias, TypeVar

from advisory_locks._core.contract import Timeout
from advisory_locks._core.steps import Statement

__all__ = [
    "LEASE_TABLE",
    "MAX_HOLDER_CHARS",
    "MAX_LEASE_NAME_CHARS",
    "Attempt",
    "LeaseBackend",
    "LeaseRow",
    "StatementSteps",
]

T = TypeVar("T")
StatementSteps: TypeAlias = Generator[Statement, Any, T]

LEASE_TABLE: Final = "advisory_locks_lease"
# VARCHAR(255): a primary key MySQL indexes in utf8mb4 on every supported version.
MAX_LEASE_NAME_CHARS: Final = 255
MAX_HOLDER_CHARS: Final = 255


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one acquire attempt learnt."""

    # The fencing token of the new holding; None when the lease stayed with someone else.
    token: int | None
    # Seconds until the current holder's lease expires by the database's clock (<= 0:
    # expired), when the attempt failed and the database said; None otherwise (the row
    # was locked by a fenced transaction, so it could not be read without waiting).
    expires_in: float | None = None


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """One row of the lease table, with its times as the database's clock sees them."""

    name: str
    holder: str | None
    token: int
    # Seconds since the current (or last) holder acquired it; None if never acquired.
    held_for: float | None
    # Seconds until it expires (negative: expired that long ago); None for a free row.
    expires_in: float | None

    @property
    def held(self) -> bool:
        """Whether someone holds the lease now (a holder whose lease has not expired)."""
        return self.holder is not None and self.expires_in is not None and self.expires_in > 0


class LeaseBackend(Protocol):
    """The lease SQL of one database family."""

    dialect_name: str
    # The most leases one renewal statement carries.
    renew_batch_size: int
    # The statement that subscribes a connection to release notifications (the release
    # statement sends them), or None where the database has none.
    listen_sql: str | None

    def create_table(self) -> list[str]:
        """DDL that creates the lease table if it is missing (idempotent)."""

    def system_name(self, state: dict[str, Any]) -> str:
        """The database as events name it (``"mariadb"`` for a MariaDB server), from
        what the connection's ``state`` learnt."""

    def check_database(self, state: dict[str, Any]) -> StatementSteps[None]:
        """Refuse, before the first lease, a database that cannot hold leases for other
        connections (SQLite in memory). ``state`` lives as long as the connection."""

    def renewer_setup(self, renew_every: float) -> list[str]:
        """Statements that prepare the renewer's own connection."""

    def acquire(
        self, state: dict[str, Any], name: str, holder: str, ttl: float, *, lock_wait: Timeout
    ) -> StatementSteps[Attempt]:
        """Take ``name`` for ``holder`` for ``ttl`` seconds if it is free or expired.

        One conditional statement (where the database allows) that never resets the
        token. ``lock_wait`` bounds how long it may wait for a row that a fenced
        transaction keeps locked: 0 does not wait, None waits until that transaction ends.
        """

    def renew(self, leases: Sequence[tuple[str, str, int]], ttl: float) -> StatementSteps[set[str]]:
        """Extend every unexpired ``(name, holder, token)`` holding by ``ttl`` seconds;
        return the names renewed. Rows locked by another transaction are skipped, never
        waited for (a renewal must not stall the rest of its batch)."""

    def release(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        """Free ``name`` if ``holder`` still holds it with ``token``; False otherwise."""

    def fence(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        """Inside the caller's transaction: whether the holding is still ours and
        unexpired, keeping a takeover out until that transaction ends."""

    def rows(self, names: Sequence[str]) -> StatementSteps[list[LeaseRow]]:
        """The rows of ``names`` (who holds each), without waiting for row locks."""

    def list_leases(self) -> StatementSteps[list[LeaseRow]]:
        """Every row of the lease table, by name."""

    def prune(self, expired_for: float) -> StatementSteps[int]:
        """Clear the holder of leases expired for more than ``expired_for`` seconds;
        return how many. Never deletes a row, never touches a token."""

    def is_missing_table(self, error: BaseException) -> bool:
        """Whether ``error`` says the lease table does not exist."""

    def is_connection_failure(self, error: BaseException) -> bool:
        """Whether ``error`` means the connection is gone."""

    def is_busy(self, error: BaseException) -> bool:
        """Whether ``error`` means a statement gave up waiting for a lock that another
        transaction holds (the statement did nothing; the connection is fine)."""
