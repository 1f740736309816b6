"""What a dialect backend does, and the small driver interface it runs SQL through."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from advisory_locks.keys import LockKey

Timeout: TypeAlias = float | None


class Executor(Protocol):
    """Runs SQL on one DB-API connection; made by the ORM binding for its driver."""

    @property
    def state(self) -> dict[str, Any]:
        """Scratch space that lives exactly as long as the DB-API connection.

        Backends that hold a lock client-side (SQLite's file locks) keep it here, so it
        is let go when the connection is closed or discarded.
        """

    def fetch_value(self, sql: str, params: Sequence[object]) -> object:
        """Run one statement with ``%s`` placeholders and return the first column."""

    def run_script(self, sql: str) -> None:
        """Run several ``;``-separated statements in one round trip (no parameters)."""

    def fetch_rows(self, sql: str) -> list[tuple[object, ...]]:
        """Run one statement without parameters and return all rows."""


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

    def check_options(self, *, shared: bool, transaction: bool, timeout: Timeout) -> None:
        """Raise before any SQL when this database cannot honour the options."""

    def acquire(
        self,
        executor: Executor,
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> bool:
        """Take the lock; False when it stayed busy for ``timeout``.

        ``in_transaction`` tells whether the connection is inside a transaction the
        caller owns: then a failed wait must leave that transaction usable.
        """

    def lock_identity(self, key: LockKey) -> Hashable:
        """What the server locks on for ``key``: equal identities are one lock."""

    def release(self, executor: Executor, key: LockKey, *, shared: bool) -> bool:
        """Give back a session lock; False when the server says it did not hold it."""

    def is_held(self, executor: Executor, key: LockKey, *, shared: bool) -> bool:
        """Whether the server holds ``key`` in this mode for the executor's session.

        One round trip; a session or transaction lock of that mode both count.
        """

    def inspect_server(self, executor: Executor) -> int:
        """Check, once per physical connection, that the server really has these locks.

        Raise ``UnsupportedDatabase`` for servers that only imitate them; warn where
        they cannot coordinate with other servers. Return the server's id for this
        session (PostgreSQL: ``pg_backend_pid()``), which a binding compares with the id
        the driver was told at connect to notice a pooler or proxy in between.
        """

    def list_locks(self, executor: Executor) -> list[LockedRow]:
        """Every advisory lock held or awaited in the connection's database."""

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


def validate_flags(*, shared: object, transaction: object) -> None:
    """``shared`` and ``transaction`` must be real bools: ``"no"`` is truthy."""
    for option, value in (("shared", shared), ("transaction", transaction)):
        if not isinstance(value, bool):
            raise TypeError(f"{option} must be True or False, not {type(value).__name__}")


def validate_timeout(timeout: object) -> Timeout:
    """None, or finite seconds >= 0; raise TypeError/ValueError otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout must be None or a number of seconds, not {type(timeout).__name__}"
        )
    seconds = float(timeout)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise ValueError(
            f"timeout must be None (wait forever), 0 (do not wait) or finite seconds > 0, "
            f"not {timeout!r}"
        )
    return seconds
