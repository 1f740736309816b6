"""What a dialect backend does.

A backend holds one database family's SQL and error codes, and nothing else: its methods
that talk to the server are generators of ``Statement`` requests (see
``advisory_locks._core.steps``), so the same backend serves blocking and asyncio drivers.
``state`` is the dict that lives exactly as long as the driver connection (the per-connection
cache a backend may keep: SQLite's open lock files, whether a MySQL server is MariaDB).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeAlias, TypeVar, runtime_checkable

from advisory_locks._core.contract import Timeout
from advisory_locks._core.steps import Statement
from advisory_locks.keys import LockKey

T = TypeVar("T")

# Key in a connection's state: the server version string, where the driver learned it at
# connect (no round trip needed to tell MariaDB from MySQL).
SERVER_VERSION_STATE: Final = "server_version"
# Key in a connection's state: the server's id of the session its statements run in
# (pg_backend_pid(), CONNECTION_ID()), learned by the server check. Read by cancel_wait
# from another thread, where some drivers refuse to be asked anything mid-statement.
SERVER_SESSION_STATE: Final = "server_session_id"
# Key in a connection's state: a threading.Event that a binding able to abandon waits puts
# there for the length of one acquire (see ``AbandonableWait``). ``cancel_wait`` sets it;
# a backend whose wait runs in this process (SQLite's file lock) polls it.
WAIT_CANCELLED_STATE: Final = "wait_cancelled"
StatementSteps: TypeAlias = Generator[Statement, Any, T]


@dataclass(frozen=True, slots=True)
class LockedRow:
    """One held or awaited advisory lock as a monitoring query reports it."""

    pid: int
    # The integer key(s) on PostgreSQL; the lock's name as the server has it on MySQL.
    key: int | tuple[int, int] | str
    mode: str
    granted: bool
    waiting_seconds: float | None
    held_at_most_seconds: float | None
    application_name: str
    client_addr: str | None
    state: str | None
    query: str


class Backend(Protocol):
    """The SQL of one database family for taking and giving back named locks."""

    dialect_name: str
    # False where the locks are held by this process (SQLite's file locks): then taking
    # one sends no statement that could disturb the caller's transaction.
    locks_on_server: bool
    # True where ``lock_identity(key)`` is ``key.ints``, which a lock's bookkeeping then
    # reads without the call.
    locks_by_ints: bool

    def check_options(self, *, shared: bool, transaction: bool, timeout: Timeout) -> None:
        """Raise before any SQL when this database cannot honour the options."""

    def system_name(self, state: dict[str, Any]) -> str:
        """The server as OpenTelemetry's ``db.system.name`` calls it, as far as known
        without a round trip (lock events carry it)."""

    def acquire(
        self,
        state: dict[str, Any],
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> StatementSteps[bool]:
        """Take the lock; False when it stayed busy for ``timeout``.

        ``in_transaction`` tells whether the connection is inside a transaction the
        caller owns: then a failed wait must leave that transaction usable.
        """

    def lock_statement(
        self,
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> Statement | None:
        """The one statement ``acquire`` would send, where it sends only that: with
        ``timeout=0`` its value says whether the lock was granted, with any other timeout
        its success is the grant. None where ``acquire`` may need more. A lock runs
        this statement directly (no steps to drive); if it raises, the lock throws the
        error into ``acquire``, whose first statement it must be.
        """

    def lock_statements(
        self,
        key: LockKey,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> tuple[Statement | None, Statement | None]:
        """``lock_statement`` and, for a session lock, ``unlock_statement`` (None for a
        transaction lock), in one call: what a lock asks before it sends anything."""

    def lock_identity(self, key: LockKey) -> Hashable:
        """What the server locks on for ``key``: equal identities are one lock."""

    def release(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        """Give back a session lock; False when the server says it did not hold it."""

    def unlock_statement(self, key: LockKey, *, shared: bool) -> Statement | None:
        """The one statement ``release`` sends, where it sends only that, its value says
        whether the server held the lock, and ``release`` leaves its errors alone; None
        where ``release`` does more. A lock runs this statement directly.
        """

    def is_held(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        """Whether the server holds ``key`` in this mode for the executor's session.

        One round trip; a session or transaction lock of that mode both count.
        """

    def inspect_server(self, state: dict[str, Any]) -> StatementSteps[int]:
        """Check, once per physical connection, that the server really has these locks.

        Raise ``UnsupportedDatabase`` for servers that only imitate them; warn where
        they cannot coordinate with other servers. Return the server's id for this
        session (PostgreSQL: ``pg_backend_pid()``), which a binding compares with the id
        the driver was told at connect to notice a pooler or proxy in between.
        """

    def list_locks(self, state: dict[str, Any]) -> StatementSteps[list[LockedRow]]:
        """Every advisory lock held or awaited in the connection's database."""

    def cancel_wait(self, state: dict[str, Any], driver_connection: Any) -> StatementSteps[None]:
        """Interrupt, from another thread, the lock wait ``driver_connection`` is in.

        The interrupted ``acquire`` raises ``LockTimeout`` (or returns False), and gives
        back a grant the server made in the same instant. Where the driver can interrupt
        the statement itself (PostgreSQL's cancel request) or the wait runs in this process
        (SQLite), nothing is yielded; otherwise the statements yielded are for ANOTHER
        connection to the same server, the waiting one being busy (MySQL's KILL QUERY).
        """

    def is_connection_failure(self, error: BaseException) -> bool:
        """Whether ``error`` means the connection (and so any lock on it) is gone."""

    def is_failed_transaction(self, error: BaseException) -> bool:
        """Whether ``error`` means the caller's transaction failed and awaits rollback."""


@runtime_checkable
class HoldsLocksClientSide(Protocol):
    """A backend whose locks are held by this process rather than by a server (SQLite)."""

    def connection_closed(self, state: dict[str, Any]) -> None:
        """The DB-API connection whose executor ``state`` this is has closed: let go of
        every lock held for it, as a server lets go of a closed session's locks."""
