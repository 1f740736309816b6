"""The lock object: context manager, decorator-free acquire/release pair, async twin.

The lock logic is written once, synchronously, against a *site* supplied by an ORM
binding. A site knows which connection a lock must run on and what that connection
already holds. The async lock runs the same logic inside SQLAlchemy's greenlet bridge,
so sync and async locks cannot drift apart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Protocol, TypeVar

from advisory_locks.backends.base import (
    Backend,
    Executor,
    Timeout,
    validate_flags,
    validate_timeout,
)
from advisory_locks.errors import AdvisoryLockError, LockLost, LockNotAcquired, LockTimeout
from advisory_locks.keys import LockKey, LockName
from advisory_locks.registry import ConnectionLocks, Holding

__all__ = [
    "AdvisoryLock",
    "AdvisoryLockSet",
    "AsyncAdvisoryLock",
    "AsyncAdvisoryLockSet",
    "Lease",
    "LockSite",
]

logger = logging.getLogger("advisory_locks")

T = TypeVar("T")


class Lease(Protocol):
    """A connection lent to one lock for as long as the lock is held."""

    executor: Executor
    locks: ConnectionLocks
    in_transaction: bool

    def done(self) -> None:
        """The lock no longer needs the connection."""

    def broken(self, error: BaseException) -> None:
        """The connection failed; it must never go back to a pool as if healthy."""


class LockSite(Protocol):
    """Where locks for one bind live (made by an ORM binding)."""

    backend: Backend

    def lease(self, *, transaction: bool) -> Lease:
        """The connection a lock of this scope must use, ready for the backend's SQL."""

    def held_names(self) -> list[LockName]:
        """Names this library holds through this bind."""


class AdvisoryLock:
    """A named database lock, made by [`advisory_lock`][advisory_locks.advisory_lock].

    A context manager (``with`` acquires, raising ``LockNotAcquired`` / ``LockTimeout``
    when busy, and releases at the end, also on an exception) and an explicit
    ``acquire()`` / ``release()`` pair. Do not construct it directly.
    """

    __slots__ = (
        "_count",
        "_holding",
        "_lease",
        "_owner",
        "_site",
        "key_info",
        "shared",
        "timeout",
        "transaction",
    )

    def __init__(
        self,
        site: LockSite,
        key: LockKey,
        *,
        timeout: Timeout = None,
        shared: bool = False,
        transaction: bool = False,
    ) -> None:
        validate_flags(shared=shared, transaction=transaction)
        self.timeout = validate_timeout(timeout)
        site.backend.check_options(shared=shared, transaction=transaction, timeout=self.timeout)
        self._site = site
        self.key_info = key
        self.shared = shared
        self.transaction = transaction
        self._count = 0
        self._owner: tuple[int, int] | None = None
        self._lease: Lease | None = None
        self._holding: Holding | None = None

    @property
    def name(self) -> LockName:
        """The name this lock was made with."""
        return self.key_info.name

    @property
    def key(self) -> int | tuple[int, int]:
        """The key(s) sent to the server."""
        return self.key_info.value

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (a transaction lock until its transaction ends)."""
        return self._count > 0 and self._holding is not None and self._holding.active

    def acquire(self) -> bool:
        """Take the lock; False when it stayed busy for the whole timeout."""
        self._claim()
        if self._count and self._holding is not None and self._holding.active:
            self._count += 1
            self._holding.count += 1
            return True
        self._count = 0
        try:
            return self._acquire_once()
        finally:
            if not self._count:
                self._owner = None

    def _claim(self) -> None:
        # A lock object's own count stands for one holder. Shared by two threads (a
        # module-level lock used like threading.Lock) or two asyncio tasks, the second
        # would count itself in without any lock on its own connection: refuse instead.
        owner = _current_owner()
        with _CLAIMS:
            if self._owner is not None and self._owner != owner:
                raise AdvisoryLockError(
                    f"advisory lock object {self.name!r} is in use by another thread or "
                    "task; make one lock object per use (call advisory_lock(...) where "
                    "the lock is needed)"
                )
            self._owner = owner

    def _acquire_once(self) -> bool:
        lease = self._site.lease(transaction=self.transaction)
        options = {"shared": self.shared, "transaction": self.transaction}
        holding = lease.locks.find(self.key_info, **options)
        if holding is None:
            try:
                granted = self._site.backend.acquire(
                    lease.executor,
                    self.key_info,
                    timeout=self.timeout,
                    in_transaction=lease.in_transaction,
                    **options,
                )
            except BaseException as error:
                self._give_back(lease, error)
                raise
            if not granted:
                lease.done()
                return False
            holding = lease.locks.add(self.key_info, **options)
        holding.count += 1
        self._count = 1
        self._lease = lease
        self._holding = holding
        return True

    def release(self) -> None:
        """Give the lock back (a transaction lock stays with its transaction)."""
        holding, lease = self._holding, self._lease
        if not self._count or holding is None or lease is None:
            raise AdvisoryLockError(f"advisory lock {self.name!r} is not held by this object")
        self._count -= 1
        holding.count -= 1
        if self._count:
            return
        self._holding = self._lease = None
        self._owner = None
        if holding.count > 0:
            lease.done()
            return
        if holding.transaction:
            # The server frees it when the transaction ends; until then taking it again
            # on this connection is free, so the holding stays registered.
            lease.done()
            return
        if not holding.active:
            lease.done()
            raise LockLost(
                f"advisory lock {self.name!r} was released before its block ended "
                "(its connection was returned to the pool or closed)",
                name=self.name,
            )
        self._unlock(holding, lease)

    def ensure_held(self) -> None:
        """Ask the server whether it still holds this lock; raise LockLost if not.

        One round trip on the lock's own connection, so call it at safe points of the
        block (before an irreversible step), never from another thread.
        """
        holding, lease = self._holding, self._lease
        if not self._count or holding is None or lease is None:
            raise AdvisoryLockError(f"advisory lock {self.name!r} is not held by this object")
        if not holding.active:
            reason = (
                "its transaction ended"
                if holding.transaction
                else "its connection was returned to the pool or closed"
            )
            raise LockLost(
                f"advisory lock {self.name!r} is no longer held: {reason}", name=self.name
            )
        backend = self._site.backend
        try:
            held = backend.is_held(lease.executor, self.key_info, shared=self.shared)
        except Exception as error:
            if not backend.is_connection_failure(error):
                raise
            lease.locks.forget(holding)
            lease.broken(error)
            raise LockLost(
                f"advisory lock {self.name!r} was lost: its connection failed ({error})",
                name=self.name,
            ) from error
        if not held:
            # Someone unlocked it on our connection (pg_advisory_unlock_all(), DISCARD ALL):
            # the block must not go on believing it is protected.
            lease.locks.forget(holding)
            raise LockLost(
                f"the server no longer holds advisory lock {self.name!r}", name=self.name
            )

    def _unlock(self, holding: Holding, lease: Lease) -> None:
        backend = self._site.backend
        try:
            released = backend.release(lease.executor, self.key_info, shared=self.shared)
        except Exception as error:
            if backend.is_failed_transaction(error):
                # The caller's transaction failed inside the block; the server rejects
                # every statement until it ends, and session locks survive its rollback.
                lease.locks.forget(holding)
                lease.locks.pending_release.append(holding)
                lease.done()
                logger.debug("release of %r deferred to the end of the transaction", self.name)
                return
            lease.locks.forget(holding)
            if backend.is_connection_failure(error):
                lease.broken(error)
                raise LockLost(
                    f"advisory lock {self.name!r} was lost: its connection failed ({error})",
                    name=self.name,
                ) from error
            lease.done()
            raise
        lease.locks.forget(holding)
        lease.done()
        if not released:
            raise LockLost(
                f"the server did not hold advisory lock {self.name!r} at release",
                name=self.name,
            )

    def _give_back(self, lease: Lease, error: BaseException) -> None:
        # An interrupted wait (task cancelled, KeyboardInterrupt) leaves the server's
        # answer unknown: asyncpg, for one, stops listening while the server may still
        # grant the lock. Only discarding the connection ensures no one inherits it.
        if not isinstance(error, Exception) or self._site.backend.is_connection_failure(error):
            lease.broken(error)
        else:
            lease.done()

    def __enter__(self) -> AdvisoryLock:
        if not self.acquire():
            raise _not_acquired(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockLost:
            if not _reported_inside(exc, self):
                raise

    def __repr__(self) -> str:
        state = "held" if self.held else "not held"
        return f"<AdvisoryLock {self.name!r} key={self.key!r} {state}>"


class AsyncAdvisoryLock:
    """The awaitable twin of [`AdvisoryLock`][advisory_locks.AdvisoryLock], for
    SQLAlchemy's asyncio binds: ``async with``, ``await acquire()``, ``await release()``."""

    __slots__ = ("_lock", "_run")

    def __init__(self, lock: AdvisoryLock, run: Callable[..., Awaitable[Any]]) -> None:
        self._lock = lock
        self._run = run

    @property
    def name(self) -> LockName:
        return self._lock.name

    @property
    def key(self) -> int | tuple[int, int]:
        return self._lock.key

    @property
    def held(self) -> bool:
        return self._lock.held

    async def acquire(self) -> bool:
        """Take the lock; False when it stayed busy for the whole timeout."""
        granted: bool = await self._run(self._lock.acquire)
        return granted

    async def release(self) -> None:
        """Give the lock back (a transaction lock stays with its transaction)."""
        await self._run(self._lock.release)

    async def ensure_held(self) -> None:
        """Ask the server whether it still holds this lock; raise LockLost if not."""
        await self._run(self._lock.ensure_held)

    async def __aenter__(self) -> AsyncAdvisoryLock:
        if not await self.acquire():
            raise _not_acquired(self._lock)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except LockLost:
            if not _reported_inside(exc, self._lock):
                raise

    def __repr__(self) -> str:
        return "<Async" + repr(self._lock)[1:]


class AdvisoryLockSet:
    """Several locks taken in one canonical order (by key) and given back together.

    Two holders that take overlapping sets through this class queue behind each other
    instead of deadlocking, whatever order their names were listed in: both ask for the
    lowest key first. A ``timeout`` bounds the whole acquisition, not each lock.
    """

    __slots__ = ("_refused", "_taken", "locks", "timeout")

    def __init__(self, locks: Iterable[AdvisoryLock], *, timeout: Timeout = None) -> None:
        self.timeout = validate_timeout(timeout)
        unique: dict[tuple[int, tuple[int, ...]], AdvisoryLock] = {}
        for lock in locks:
            ints = lock.key_info.ints
            unique.setdefault((len(ints), ints), lock)
        self.locks: tuple[AdvisoryLock, ...] = tuple(unique[order] for order in sorted(unique))
        self._taken: list[AdvisoryLock] = []
        self._refused: AdvisoryLock | None = None

    @property
    def names(self) -> list[LockName]:
        """The names in the order they are taken."""
        return [lock.name for lock in self.locks]

    @property
    def held(self) -> bool:
        return bool(self._taken) and all(lock.held for lock in self._taken)

    def acquire(self) -> bool:
        """Take every lock in key order; False (holding none) when one stayed busy."""
        if self._taken:
            raise AdvisoryLockError("this lock set is already held; release it first")
        deadline = None if not self.timeout else time.monotonic() + self.timeout
        taken: list[AdvisoryLock] = []
        try:
            for lock in self.locks:
                if deadline is not None:
                    # Zero left means "try once", which is still an answer, not a hang.
                    lock.timeout = max(0.0, deadline - time.monotonic())
                if not lock.acquire():
                    self._refused = lock
                    _release_all(taken)
                    return False
                taken.append(lock)
        except BaseException:
            _release_all(taken, quietly=True)
            raise
        self._taken = taken
        self._refused = None
        return bool(taken) or not self.locks

    def release(self) -> None:
        """Give every lock back, newest first; the first failure is raised after all ran."""
        if not self._taken and self.locks:
            raise AdvisoryLockError("this lock set is not held")
        taken, self._taken = self._taken, []
        _release_all(taken)

    def ensure_held(self) -> None:
        """[AdvisoryLock.ensure_held][advisory_locks.AdvisoryLock.ensure_held] for every lock of
        the set."""
        for lock in self._taken:
            lock.ensure_held()

    def __enter__(self) -> AdvisoryLockSet:
        if not self.acquire():
            assert self._refused is not None
            raise _not_acquired(self._refused, self.timeout)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockLost:
            if not isinstance(exc, LockLost):
                raise

    def __repr__(self) -> str:
        state = "held" if self.held else "not held"
        return f"<AdvisoryLockSet {self.names!r} {state}>"


class AsyncAdvisoryLockSet:
    """The awaitable twin of [AdvisoryLockSet][advisory_locks.AdvisoryLockSet]."""

    __slots__ = ("_run", "_set")

    def __init__(self, lock_set: AdvisoryLockSet, run: Callable[..., Awaitable[Any]]) -> None:
        self._set = lock_set
        self._run = run

    @property
    def names(self) -> list[LockName]:
        return self._set.names

    @property
    def held(self) -> bool:
        return self._set.held

    async def acquire(self) -> bool:
        granted: bool = await self._run(self._set.acquire)
        return granted

    async def release(self) -> None:
        await self._run(self._set.release)

    async def ensure_held(self) -> None:
        await self._run(self._set.ensure_held)

    async def __aenter__(self) -> AsyncAdvisoryLockSet:
        if not await self.acquire():
            assert self._set._refused is not None
            raise _not_acquired(self._set._refused, self._set.timeout)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except LockLost:
            if not isinstance(exc, LockLost):
                raise

    def __repr__(self) -> str:
        return "<Async" + repr(self._set)[1:]


def _release_all(locks: list[AdvisoryLock], *, quietly: bool = False) -> None:
    first_error: BaseException | None = None
    for lock in reversed(locks):
        try:
            lock.release()
        except Exception as error:
            logger.debug("releasing %r from a lock set failed: %s", lock.name, error)
            first_error = first_error or error
    if first_error is not None and not quietly:
        raise first_error


def _reported_inside(exc: BaseException | None, lock: AdvisoryLock) -> bool:
    # ensure_held() inside the block already raised this loss; a second LockLost from
    # the release would only bury the first one under "during handling ...".
    return isinstance(exc, LockLost) and exc.name == lock.name


def _not_acquired(lock: AdvisoryLock, timeout: Timeout = None) -> LockNotAcquired:
    return not_acquired_error(lock.name, lock.timeout if timeout is None else timeout)


def not_acquired_error(name: LockName, timeout: Timeout) -> LockNotAcquired:
    """The error for a lock that stayed busy: LockTimeout whenever a wait ran out.

    With ``timeout=None`` the library sets no limit, so a refusal means the connection's
    own ``lock_timeout`` ended the wait: a timeout all the same.
    """
    if timeout == 0:
        return LockNotAcquired(f"advisory lock {name!r} is held elsewhere", name=name)
    if timeout is None:
        return LockTimeout(
            f"advisory lock {name!r} was not granted before the connection's own "
            "lock_timeout ran out",
            name=name,
        )
    return LockTimeout(f"advisory lock {name!r} was not granted within {timeout} s", name=name)


_CLAIMS = threading.Lock()


def _current_owner() -> tuple[int, int]:
    """The thread, and the asyncio task within it (0 outside one), asking for a lock."""
    loop = asyncio._get_running_loop()
    task = None if loop is None else asyncio.current_task(loop)
    return threading.get_ident(), 0 if task is None else id(task)
