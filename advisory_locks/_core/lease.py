"""The lease lock: the lock contract implemented on a row of ``advisory_locks_lease``.

A lease is held until it expires unless renewed, so it outlives any one connection:
every statement borrows a pooled connection from the binding's *lease site* and gives it
back, and the process's one renewer (``advisory_locks._core.renewer``) keeps held leases
alive. The rules are written here once, as steps, like the advisory lock's.

Time: the database's clock decides expiry (the client sends durations only). The client
keeps one local deadline per holding, measured with ``time.monotonic()`` from the moment
the last successful acquire or renewal statement was SENT: the database computed its
expiry later than that, so once ``ttl - margin`` has passed locally the lease may be gone
and is declared lost, even if the database cannot be reached to say so.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from advisory_locks._core import events
from advisory_locks._core.contract import LockContract, Timeout, validate_timeout
from advisory_locks._core.steps import Borrow, Settle, Steps, on, run_steps
from advisory_locks.errors import (
    LeaseTableMissing,
    LockLost,
    LockNotAcquired,
    LockStolen,
    LockTimeout,
    LockUsageError,
)
from advisory_locks.keys import PREFIX_ENV

if TYPE_CHECKING:
    from advisory_locks._dialects.lease import Attempt, LeaseBackend, LeaseRow

__all__ = [
    "DEFAULT_TTL",
    "LeaseHolding",
    "LeaseLock",
    "LeaseOptions",
    "LeaseSite",
    "lease_name",
    "new_holder",
    "safety_margin",
]

logger = logging.getLogger("advisory_locks")

DEFAULT_TTL: Final = 30.0
# The part of the ttl kept in reserve: a lease is declared lost locally once
# ttl - margin has passed since its last renewal was sent.
SAFETY_MARGIN_FRACTION: Final = 0.1
RENEWALS_PER_TTL: Final = 3
# A waiter sleeps until the expiry it read, but at most this long: a holder that releases
# early (on databases without NOTIFY) is noticed within it.
MAX_WAIT_PAUSE: Final = 2.0
# Waiters that read the same expiry spread out by up to this much.
WAIT_JITTER: Final = 0.05
MAX_NAME_CHARS: Final = 255


def safety_margin(ttl: float) -> float:
    """Seconds before the database's expiry at which a holding is declared lost locally."""
    return ttl * SAFETY_MARGIN_FRACTION


def _seconds(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{option} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds <= 0:
        raise ValueError(f"{option} must be finite seconds > 0, not {value!r}")
    return seconds


@dataclass(frozen=True, slots=True)
class LeaseOptions:
    """How a lease is held, validated on construction (before any SQL)."""

    ttl: float = DEFAULT_TTL
    renew_every: float | None = None
    timeout: Timeout = None

    def __post_init__(self) -> None:
        ttl = _seconds("ttl", self.ttl)
        object.__setattr__(self, "ttl", ttl)
        object.__setattr__(self, "timeout", validate_timeout(self.timeout))
        if self.renew_every is None:
            object.__setattr__(self, "renew_every", ttl / RENEWALS_PER_TTL)
            return
        renew_every = _seconds("renew_every", self.renew_every)
        limit = ttl - safety_margin(ttl)
        if renew_every >= limit:
            raise ValueError(
                f"renew_every ({renew_every} s) must be below ttl minus its safety margin "
                f"({limit:g} s for ttl={ttl:g}): a renewal must arrive before the lease is "
                "declared lost"
            )
        object.__setattr__(self, "renew_every", renew_every)

    @property
    def period(self) -> float:
        """Seconds between renewals."""
        assert self.renew_every is not None
        return self.renew_every


def lease_name(name: object, key_prefix: object) -> str:
    """The text a lease is stored under: ``key_prefix`` (default ``$ADVISORY_LOCKS_PREFIX``)
    followed by ``name``; TypeError/ValueError before any SQL."""
    if not isinstance(name, str):
        raise TypeError(f"lease name must be str, not {type(name).__name__}")
    if not name:
        raise ValueError("lease name must not be empty")
    prefix = os.environ.get(PREFIX_ENV, "") if key_prefix is None else key_prefix
    if isinstance(prefix, bool) or not isinstance(prefix, (str, int)):
        raise TypeError(f"key prefix must be str or int, not {type(prefix).__name__}")
    full = f"{prefix}{name}"
    if len(full) > MAX_NAME_CHARS:
        raise ValueError(
            f"lease name (with its prefix) must be at most {MAX_NAME_CHARS} characters, "
            f"not {len(full)}"
        )
    if "\x00" in full:
        raise ValueError("lease name must not contain NUL characters")
    return full


_holder_lock = threading.Lock()
_holder: tuple[int, str] = (0, "")


_attempts = itertools.count(1)


def new_holder() -> str:
    """A holder string unique to one acquire attempt: ``host:pid:random#n``. The
    random part tells a forked child (same pid reused later) from its parent; the
    counter tells two lock objects of one process apart (MySQL learns whether an attempt
    won by reading the holder back)."""
    global _holder
    pid = os.getpid()
    with _holder_lock:
        if _holder[0] != pid:
            host = socket.gethostname()[:200]
            _holder = (pid, f"{host}:{pid}:{secrets.token_hex(4)}")
        return f"{_holder[1]}#{next(_attempts)}"


class LeaseSite(Protocol):
    """Where the leases of one bind live (made by a binding, one per database).

    ``borrow()`` lends a pooled connection in autocommit mode for one statement or two
    (the Borrowed protocol of the advisory lock, with ``executor.state`` as the
    connection's scratch space); ``renewal_connection()`` opens the renewer's own.
    """

    backend: LeaseBackend
    # How to create the table, for the LeaseTableMissing message.
    create_hint: str

    def borrow(self, *, transaction: bool) -> Any: ...

    def renewal_connection(self) -> RenewalConnection: ...

    def release_listener(self) -> Any:
        """A ``ReleaseListener`` waking this site's waiters, or None (waiters poll)."""

    def fence_executor(self, bind: object) -> Any:
        """An executor on ``bind``'s connection, inside the caller's transaction."""


class RenewalConnection(Protocol):
    executor: Any

    def close(self) -> None: ...


@dataclass(eq=False)
class LeaseHolding:
    """One held lease, shared by its lock object and the renewer."""

    site: Any
    lease_name: str
    name: str
    holder: str
    token: int
    ttl: float
    renew_every: float
    # time.monotonic() when the last successful acquire/renewal statement was sent.
    last_sent: float
    lost: threading.Event
    next_due: float = 0.0
    loss: LockLost | None = None
    # A forked child's copy of its parent's holding: never renewed or released here.
    inherited: bool = False
    mutex: threading.Lock = field(default_factory=threading.Lock)
    # Set when the grant was reported to event listeners: only then is the rest reported.
    granted_at: float | None = None
    source: events.EventSource | None = None

    def __post_init__(self) -> None:
        self.next_due = self.last_sent + self.renew_every

    @property
    def deadline(self) -> float:
        return self.last_sent + self.ttl - safety_margin(self.ttl)

    def renewed(self, sent: float) -> None:
        with self.mutex:
            if self.loss is None:
                self.last_sent = max(self.last_sent, sent)
                self.next_due = sent + self.renew_every

    def overdue(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline

    def mark_lost(self, loss: LockLost) -> bool:
        """Record the loss once; True the first time (the caller logs it)."""
        with self.mutex:
            if self.loss is not None:
                return False
            self.loss = loss
        self.lost.set()
        if isinstance(loss, LockStolen):
            self.report("released", reason="stolen")
            self.report("stolen", error=loss)
        else:
            reason = "expired" if self.overdue() else "not_held"
            self.report("released", reason="lost")
            self.report("lost", reason=reason, error=loss)
        return True

    def report(
        self,
        kind: events.EventKind,
        *,
        waited: float | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Tell the event listeners about this holding, if they were told of its grant."""
        source = self.source
        if source is None or not events.listeners or self.inherited:
            return
        granted_at = self.granted_at
        held = None if granted_at is None or kind == "acquired" else time.monotonic() - granted_at
        events.emit(
            events.LockEvent(
                kind,
                self.name,
                None,
                source.system,
                "exclusive",
                "lease",
                source.binding,
                source.database,
                waited=waited,
                held=held,
                reason=reason,
                error=error,
                granted_at=granted_at,
                token=self.token,
            )
        )


def loss_error(holding: LeaseHolding, row: LeaseRow | None, reason: str) -> LockLost:
    """LockStolen when another holder has the lease now, LockLost otherwise."""
    if row is not None and row.held and (row.holder, row.token) != (holding.holder, holding.token):
        return LockStolen(
            f"lease {holding.name!r} (token {holding.token}) was taken over by {row.holder} "
            f"(token {row.token}); {reason}",
            name=holding.name,
            holder=row.holder,
            token=row.token,
        )
    return LockLost(
        f"lease {holding.name!r} (token {holding.token}) was lost; {reason}", name=holding.name
    )


def still_ours(holding: LeaseHolding, row: LeaseRow | None) -> bool:
    return (
        row is not None and row.held and (row.holder, row.token) == (holding.holder, holding.token)
    )


def wait_pause(expires_in: float | None, left: float | None) -> float:
    """How long a waiter sleeps before its next attempt: until the expiry it read (the
    holder cannot lose the lease earlier, short of releasing it), capped, with jitter so
    that waiters reading one expiry do not all arrive in the same millisecond."""
    # expires_in None: the row was locked (fenced), its expiry could not be read.
    base = MAX_WAIT_PAUSE / 4 if expires_in is None else min(max(expires_in, 0.0), MAX_WAIT_PAUSE)
    pause = base + random.uniform(0.0, WAIT_JITTER)
    return pause if left is None else max(0.0, min(pause, left))


class LeaseLock(LockContract):
    """A lease lock, made by [`lease_lock`][advisory_locks.lease_lock]: a row held until
    it expires unless renewed, with a fencing token.

    A context manager (``with`` acquires, raising ``LockNotAcquired`` / ``LockTimeout``
    when busy, releases at the end, and raises ``LockStolen`` / ``LockLost`` there if the
    lease was lost inside the block) and an explicit ``acquire()`` / ``release()`` pair.
    One object is one holder: it is not re-entrant, and two objects for one name exclude
    each other, also in one thread. Do not construct it directly.

    ``lost`` is a ``threading.Event`` set as soon as this process learns that the lease
    it holds was lost (a renewal found it taken, or its renewals stopped for too long);
    it is cleared by the next successful ``acquire()``.
    """

    __slots__ = ("_holding", "_last_token", "_site", "lease_name", "lost", "options", "user_name")

    def __init__(self, site: Any, name: str, stored_name: str, options: LeaseOptions) -> None:
        self._site = site
        self.user_name = name
        self.lease_name = stored_name
        self.options = options
        self.lost = threading.Event()
        self._holding: LeaseHolding | None = None
        self._last_token: int | None = None

    # -- the contract ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The name this lease was made with (without its prefix)."""
        return self.user_name

    @property
    def ttl(self) -> float:
        return self.options.ttl

    @property
    def token(self) -> int | None:
        """The fencing token of the current (or last) holding: it strictly increases each
        time anyone acquires this name. None before the first acquire."""
        return self._last_token

    @property
    def held(self) -> bool:
        """Whether this object holds the lease now, as far as this process knows (no SQL)."""
        holding = self._holding
        return (
            holding is not None
            and holding.loss is None
            and not holding.inherited
            and not holding.overdue()
        )

    def acquire(self) -> bool:
        """Take the lease; False when it stayed held by someone else for the whole timeout.

        ``timeout=None`` waits as long as it takes, ``0`` tries once, ``t`` waits at most
        ``t`` seconds. A waiter sleeps until the expiry it read (at most 2 s at a time); on
        PostgreSQL a release wakes it at once (LISTEN/NOTIFY), unless the Engine is
        declared behind a transaction pooler.
        """
        self._claim()
        # No clock is read for events unless someone listens.
        started = time.monotonic() if events.listeners else None
        try:
            granted = self._acquire(started)
        except BaseException as error:
            self._report_refusal(started, error)
            raise
        if not granted:
            self._report_refusal(started, None)
        return granted

    def _acquire(self, started: float | None) -> bool:
        timeout = self.options.timeout
        if timeout == 0:
            return self._try(0.0, started) is None
        deadline = None if timeout is None else time.monotonic() + timeout
        # Subscribed before the first attempt, so a release right after it still wakes us.
        listener = self._site.release_listener()
        released = None if listener is None else listener.subscribe(self.lease_name)
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if released is not None:
                    released.clear()
                attempt = self._try(left, started)
                if attempt is None:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                pause = wait_pause(attempt.expires_in, left)
                if released is None:
                    time.sleep(pause)
                else:
                    released.wait(pause)
        finally:
            if released is not None:
                assert listener is not None
                listener.unsubscribe(self.lease_name, released)

    def _try(self, lock_wait: Timeout, started: float | None) -> Attempt | None:
        """One attempt: None when it took the lease, else what it learnt."""
        attempt, holder, sent = run_steps(self._attempt_steps(lock_wait), self._site)
        if attempt.token is None:
            return attempt
        self._hold(holder, attempt.token, sent, started)
        return None

    def _report_refusal(self, started: float | None, error: BaseException | None) -> None:
        if started is None or not events.listeners:
            return
        if error is None:
            reason = "busy" if self.options.timeout == 0 else "timeout"
        else:
            reason = "timeout" if isinstance(error, LockTimeout) else "error"
        source = _source(self._site)
        events.emit(
            events.LockEvent(
                "not_acquired",
                self.name,
                None,
                source.system,
                "exclusive",
                "lease",
                source.binding,
                source.database,
                waited=time.monotonic() - started,
                reason=reason,
                error=error,
            )
        )

    def release(self) -> None:
        """Give the lease back; ``LockStolen`` / ``LockLost`` if it was lost meanwhile."""
        holding = self._take_holding()
        if holding.inherited:
            return  # a forked child never releases its parent's lease
        if holding.loss is None and not holding.overdue():
            released = run_steps(self._release_steps(holding), self._site)
            if released:
                holding.report("released", reason="unlock")
                return
            raise self._learn_loss(holding, "it was no longer held at release")
        row = self._row_or_none(holding)
        if still_ours(holding, row):
            # Declared lost locally (paused past its deadline) but nobody took it: free
            # it now rather than make the next holder wait for the expiry.
            run_steps(self._release_steps(holding), self._site)
        raise self._learn_loss(
            holding, "its renewals stopped for longer than its ttl", row=row, asked=True
        )

    def ensure_held(self) -> None:
        """Raise ``LockStolen`` / ``LockLost`` unless the lease is still ours.

        One round trip: reads the lease row (never waits for a fenced row). If the
        database cannot be reached, the local deadline decides: the database cannot
        expire the lease before it (its expiry is counted from a later instant).
        """
        holding = self._current_holding()
        backend = self._site.backend
        for attempt in range(2):
            try:
                rows = run_steps(self._rows_steps(holding), self._site)
            except Exception as error:
                if not backend.is_connection_failure(error):
                    raise
                # The first try may meet a pooled connection that died meanwhile.
                logger.debug("ensure_held() could not read lease %r", self.name, exc_info=True)
                if attempt:
                    self._current_holding()  # the local deadline, again
                    return
                continue
            row = rows[0] if rows else None
            if not still_ours(holding, row):
                raise self._learn_loss(holding, "ensure_held() found it gone", row=row, asked=True)
            return

    def fence(self, bind: object) -> None:
        """Inside ``bind``'s current transaction, prove the lease is still ours and keep any
        other holder from taking it over until that transaction ends.

        Call it before the writes the lease protects, in the same transaction: a write
        made after ``fence()`` commits only if this holder still held the lease. Raises
        ``LockStolen`` / ``LockLost`` (and the transaction should be rolled back) if not.

        Args:
            bind: a SQLAlchemy ``Session`` or ``Connection`` on the lease's database; a
                transaction is begun on it if none is open (as any statement would).
        """
        holding = self._current_holding()
        executor = self._site.fence_executor(bind)
        backend = self._site.backend
        try:
            proven = run_steps(
                on(executor, backend.fence(holding.lease_name, holding.holder, holding.token))
            )
        except Exception as error:
            if backend.is_missing_table(error):
                raise LeaseTableMissing(self._site.create_hint) from error
            raise
        if not proven:
            raise self._learn_loss(holding, "fence() refused it")

    def _not_acquired(self) -> LockNotAcquired:
        timeout = self.options.timeout
        if timeout == 0:
            return LockNotAcquired(f"lease {self.name!r} is held elsewhere", name=self.name)
        return LockTimeout(
            f"lease {self.name!r} was not granted within {timeout} s", name=self.name
        )

    # -- the rules ------------------------------------------------------------------------

    def _claim(self) -> None:
        holding = self._holding
        if holding is not None and holding.loss is None and not holding.inherited:
            raise LockUsageError(
                f"lease {self.name!r} is already held by this object; a lease lock is not "
                "re-entrant: make one lease_lock(...) per holder"
            )
        if holding is not None:
            self._forget(holding)

    def _attempt_steps(self, lock_wait: Timeout) -> Steps[tuple[Attempt, str, float]]:
        site = self._site
        backend = site.backend
        borrowed = yield Borrow(False)
        executor = borrowed.executor
        try:
            yield from on(executor, backend.check_database(executor.state))
            holder = new_holder()
            sent = time.monotonic()
            attempt = yield from on(
                executor,
                backend.acquire(
                    executor.state, self.lease_name, holder, self.options.ttl, lock_wait=lock_wait
                ),
            )
        except BaseException as error:
            if not isinstance(error, Exception) or backend.is_connection_failure(error):
                borrowed.broken(error)
            else:
                borrowed.done()
            yield Settle(borrowed)
            if isinstance(error, Exception) and backend.is_missing_table(error):
                raise LeaseTableMissing(site.create_hint) from error
            raise
        borrowed.done()
        yield Settle(borrowed)
        return attempt, holder, sent

    def _release_steps(self, holding: LeaseHolding) -> Steps[bool]:
        released: bool = yield from self._borrowed_steps(
            lambda backend: backend.release(holding.lease_name, holding.holder, holding.token)
        )
        return released

    def _rows_steps(self, holding: LeaseHolding) -> Steps[list[LeaseRow]]:
        rows: list[LeaseRow] = yield from self._borrowed_steps(
            lambda backend: backend.rows([holding.lease_name])
        )
        return rows

    def _borrowed_steps(self, statements: Any) -> Steps[Any]:
        backend = self._site.backend
        borrowed = yield Borrow(False)
        try:
            result = yield from on(borrowed.executor, statements(backend))
        except BaseException as error:
            if not isinstance(error, Exception) or backend.is_connection_failure(error):
                borrowed.broken(error)
            else:
                borrowed.done()
            yield Settle(borrowed)
            if isinstance(error, Exception) and backend.is_missing_table(error):
                raise LeaseTableMissing(self._site.create_hint) from error
            raise
        borrowed.done()
        yield Settle(borrowed)
        return result

    def _hold(self, holder: str, token: int, sent: float, started: float | None) -> None:
        from advisory_locks._core.renewer import renewer

        options = self.options
        self.lost.clear()
        holding = LeaseHolding(
            site=self._site,
            lease_name=self.lease_name,
            name=self.name,
            holder=holder,
            token=token,
            ttl=options.ttl,
            renew_every=options.period,
            last_sent=sent,
            lost=self.lost,
        )
        self._holding = holding
        self._last_token = token
        if started is not None and events.listeners:
            holding.granted_at = time.monotonic()
            holding.source = _source(self._site)
            holding.report("acquired", waited=holding.granted_at - started)
        renewer().hold(holding)

    def _current_holding(self) -> LeaseHolding:
        holding = self._holding
        if holding is None or holding.inherited:
            raise LockUsageError(f"lease {self.name!r} is not held by this object")
        if holding.loss is not None:
            raise holding.loss
        if holding.overdue():
            raise self._learn_loss(holding, "its renewals stopped for longer than its ttl")
        return holding

    def _take_holding(self) -> LeaseHolding:
        holding = self._holding
        if holding is None:
            raise LockUsageError(f"lease {self.name!r} is not held by this object")
        self._forget(holding)
        return holding

    def _forget(self, holding: LeaseHolding) -> None:
        from advisory_locks._core.renewer import renewer

        self._holding = None
        renewer().forget(holding)

    def _row_or_none(self, holding: LeaseHolding) -> LeaseRow | None:
        try:
            rows = run_steps(self._rows_steps(holding), self._site)
        except Exception:
            logger.debug("could not ask who holds lease %r", holding.name, exc_info=True)
            return None
        return rows[0] if rows else None

    def _learn_loss(
        self,
        holding: LeaseHolding,
        reason: str,
        *,
        row: LeaseRow | None = None,
        asked: bool = False,
    ) -> LockLost:
        """Mark the holding lost, asking the database who holds it (once) to tell
        LockStolen from LockLost; return the error to raise."""
        if holding.loss is not None:
            return holding.loss
        if not asked:
            row = self._row_or_none(holding)
        loss = loss_error(holding, row, reason)
        if holding.mark_lost(loss):
            logger.warning("%s", loss)
        return holding.loss or loss


def _source(site: Any) -> events.EventSource:
    """Where a lease site's leases live, as their events say it."""
    return events.EventSource(site.backend.dialect_name, getattr(site, "binding", "unknown"), None)
