"""What one connection holds: re-entrancy counts and transaction-lock lifetimes.

Holdings are counted per connection (per SQLAlchemy Session for session locks taken
through a Session), never per thread or per lock object: two threads or tasks sharing one
connection would otherwise both believe they own the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from advisory_locks.keys import LockKey, LockName

if TYPE_CHECKING:
    from advisory_locks.backends.base import Backend

__all__ = ["ConnectionLocks", "Holding"]

HoldingKey = tuple[Hashable, bool, bool]


@dataclass(eq=False, slots=True)
class Holding:
    """One lock the server holds for a connection, however many times it was taken."""

    key: LockKey
    shared: bool
    transaction: bool
    count: int = 0
    # Savepoint depth at which a transaction lock was taken: rolling back a savepoint
    # at or above it makes PostgreSQL release the lock.
    depth: int = 0
    active: bool = True


@dataclass(eq=False)
class ConnectionLocks:
    """Locks taken through this library on one connection."""

    holdings: dict[HoldingKey, Holding] = field(default_factory=dict)
    savepoints: list[str] = field(default_factory=list)
    # Session locks whose unlock could not run because the caller's transaction had
    # failed; they are released as soon as that transaction ends.
    pending_release: list[Holding] = field(default_factory=list)
    mutex: threading.RLock = field(default_factory=threading.RLock)
    # The backend that took them, so a pool guard can give them back.
    backend: Backend | None = None

    def find(self, key: LockKey, *, shared: bool, transaction: bool) -> Holding | None:
        holding = self.holdings.get(self._entry(key, shared, transaction))
        return holding if holding is not None and holding.active else None

    def add(self, key: LockKey, *, shared: bool, transaction: bool) -> Holding:
        with self.mutex:
            holding = Holding(key, shared, transaction, depth=len(self.savepoints))
            self.holdings[self._entry(key, shared, transaction)] = holding
            return holding

    def forget(self, holding: Holding) -> None:
        with self.mutex:
            holding.active = False
            entry_key = self._entry(holding.key, holding.shared, holding.transaction)
            if self.holdings.get(entry_key) is holding:
                del self.holdings[entry_key]

    def _entry(self, key: LockKey, shared: bool, transaction: bool) -> HoldingKey:
        # What the server locks on decides which holdings are one lock: the integer key
        # on PostgreSQL, the GET_LOCK name on MySQL (two names whose keys collide are two
        # locks there).
        identity = key.ints if self.backend is None else self.backend.lock_identity(key)
        return identity, shared, transaction

    def session_holdings(self) -> list[Holding]:
        return [h for h in self.holdings.values() if not h.transaction] + self.pending_release

    def names(self) -> list[LockName]:
        return [h.key.name for h in self.holdings.values() if h.active]

    def transaction_ended(self) -> None:
        """The server released every transaction lock; forget them."""
        with self.mutex:
            self.savepoints.clear()
            for holding in [h for h in self.holdings.values() if h.transaction]:
                self.forget(holding)

    def savepoint_started(self, name: str) -> None:
        with self.mutex:
            self.savepoints.append(name)

    def savepoint_rolled_back(self, name: str) -> None:
        with self.mutex:
            depth = self._truncate_savepoints(name)
            if depth is None:
                return
            for holding in [h for h in self.holdings.values() if h.transaction]:
                if holding.depth > depth:
                    self.forget(holding)

    def savepoint_released(self, name: str) -> None:
        with self.mutex:
            depth = self._truncate_savepoints(name)
            if depth is None:
                return
            # Locks taken inside a released savepoint now belong to its parent.
            for holding in self.holdings.values():
                if holding.transaction and holding.depth > depth:
                    holding.depth = depth

    def _truncate_savepoints(self, name: str) -> int | None:
        for depth in range(len(self.savepoints) - 1, -1, -1):
            if self.savepoints[depth] == name:
                del self.savepoints[depth:]
                return depth
        return None
