"""The lease lock: the lock contract implemented on a row of ``advisory_locks_lease``.

A lease is held until it expires unless renewed, so it outlives any one connection:
every statement borrows a pooled connection from the binding's *lease site* and gives it
back, and the process's renewer (``advisory_locks._core.renewer``: a thread per
database) keeps held leases alive. The rules are written here once, as steps, like the
advisory lock's.

Time: the database's clock decides expiry (the client sends durations only). The client
keeps one local deadline per holding, measured with ``time.monotonic()`` from the moment
the last successful acquire or renewal statement was SENT: the database computed its
expiry later than that, so once ``ttl - margin`` has passed locally the lease may be gone
and is declared lost, even if the database cannot be reached to say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol

from advisory_locks._core import events
from advisory_locks._core.contract import (
    AsyncLockContract,
    LockContract,
    Timeout,
    number_text,
    seconds_of,
    validate_timeout,
)
from advisory_locks._core.prune import MAX_AGE_SECONDS
from advisory_locks._core.steps import Borrow, BorrowAnew, Settle, Steps, on, run_steps
from advisory_locks.errors import (
    AdvisoryLockError,
    LeaseTableMissing,
    LockConnectionLost,
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
    "AsyncLeaseLock",
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
# A ttl beyond a century is refused, by the bound prune puts on ages and for the same
# reason: the expiry's date arithmetic would leave some databases' ranges (SQLite's and
# MySQL's dates end in 9999).
MAX_TTL: Final = MAX_AGE_SECONDS


def safety_margin(ttl: float) -> float:
    """Seconds before the database's expiry at which a holding is declared lost locally."""
    return ttl * SAFETY_MARGIN_FRACTION


def _seconds(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{option} must be a number of seconds, not {type(value).__name__}")
    seconds = seconds_of(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds <= 0:
        raise ValueError(f"{option} must be finite seconds > 0, not {number_text(value)}")
    return seconds


@dataclass(frozen=True, slots=True)
class LeaseOptions:
    """How a lease is held, validated on construction (before any SQL)."""

    ttl: float = DEFAULT_TTL
    renew_every: float | None = None
    timeout: Timeout = None

    def __post_init__(self) -> None:
        ttl = _seconds("ttl", self.ttl)
        if ttl > MAX_TTL:
            raise ValueError(f"ttl must be at most 100 years ({MAX_TTL:.0f} s), not {self.ttl!r}")
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
    connection's scratch space), raising ``LockConnectionLost`` for one found dead while
    it is made ready; ``borrow_anew()`` (``aborrow_anew()`` on an asyncio site) lends
    one opened for the statements, or one the pool has opened since it learnt that its
    idle connections died; ``renewal_connection()`` opens the renewer's own.
    """

    backend: LeaseBackend
    # How to create the table, for the LeaseTableMissing message.
    create_hint: str

    def borrow(self, *, transaction: bool) -> Any: ...

    def borrow_anew(self) -> Any: ...

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
    # A threading.Event (sync locks) or an asyncio.Event (async locks, set on their loop).
    lost: Any
    next_due: float = 0.0
    loss: LockLost | None = None
    # A forked child's copy of its parent's holding: never renewed or released here.
    inherited: bool = False
    mutex: threading.Lock = field(default_factory=threading.Lock)
    # Set when the grant was reported to event listeners: only then is the rest reported.
    granted_at: float | None = None
    source: events.EventSource | None = None
    # Called once with the loss, after ``lost`` is set (cancel_on_loss of async locks).
    on_lost: Callable[[LockLost], None] | None = None
    # The renewer renewing it (an async lock's is its event loop's).
    renewer: Any = None

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
        # Reported first, so that whoever sees ``lost`` set finds the loss in every
        # listener's record too (metrics, signals) already.
        if isinstance(loss, LockStolen):
            self.report("released", reason="stolen")
            self.report("stolen", error=loss)
        else:
            reason = "expired" if self.overdue() else "not_held"
            self.report("released", reason="lost")
            self.report("lost", reason=reason, error=loss)
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(loss)
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


class _LeaseRules:
    """The rules of a lease lock, written once as steps: the blocking ``LeaseLock`` runs
    them with ``run_steps``, the asyncio ``AsyncLeaseLock`` awaits them through its site.
    Only the waiting between attempts and the renewer differ (a thread, an asyncio task)."""

    __slots__ = (
        "_holding",
        "_last_token",
        "_site",
        "_system",
        "lease_name",
        "lost",
        "options",
        "user_name",
    )

    _site: Any
    # The database as events name it, once a connection told (MariaDB is not "mysql").
    _system: str | None
    user_name: str
    lease_name: str
    options: LeaseOptions
    # A threading.Event (LeaseLock) or an asyncio.Event (AsyncLeaseLock).
    lost: Any
    _holding: LeaseHolding | None
    _last_token: int | None

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

    def _not_acquired(self) -> LockNotAcquired:
        timeout = self.options.timeout
        if timeout == 0:
            return LockNotAcquired(f"lease {self.name!r} is held elsewhere", name=self.name)
        return LockTimeout(
            f"lease {self.name!r} was not granted within {timeout} s", name=self.name
        )

    def _renewer(self) -> Any:
        """The renewer this lock's holdings go to."""
        raise NotImplementedError

    # -- waiting (the decisions; the sleeping is the lock's) -------------------------------

    def _deadline(self) -> float | None:
        timeout = self.options.timeout
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    @staticmethod
    def _pause(attempt: Attempt, deadline: float | None) -> float | None:
        """How long to sleep before the next attempt; None: the timeout ran out."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        return wait_pause(attempt.expires_in, left)

    def _report_refusal(self, started: float | None, error: BaseException | None) -> None:
        if started is None or not events.listeners:
            return
        if error is None:
            reason = "busy" if self.options.timeout == 0 else "timeout"
        else:
            reason = "timeout" if isinstance(error, LockTimeout) else "error"
        source = _source(self._site, self._system)
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

    # -- the rules, as steps --------------------------------------------------------------

    def _claim(self) -> None:
        holding = self._holding
        if holding is not None and holding.loss is None and not holding.inherited:
            raise LockUsageError(
                f"lease {self.name!r} is already held by this object; a lease lock is not "
                "re-entrant: make one lease_lock(...) per holder"
            )
        if holding is not None:
            self._forget(holding)

    def _try_steps(self, lock_wait: Timeout, started: float | None) -> Steps[Attempt | None]:
        """One attempt: None when it took the lease (now held), else what it learnt."""
        attempt, holder, sent = yield from self._attempt_steps(lock_wait)
        if attempt.token is None:
            return attempt
        self._hold(holder, attempt.token, sent, started)
        return None

    def _attempt_steps(self, lock_wait: Timeout) -> Steps[tuple[Attempt, str, float]]:
        site = self._site
        backend = site.backend
        borrowed = yield from self._borrow_steps()
        executor = borrowed.executor
        try:
            if self._system is None:
                self._system = backend.system_name(executor.state)
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
            gone = not isinstance(error, Exception) or backend.is_connection_failure(error)
            if gone:
                borrowed.broken(error)
            else:
                borrowed.done()
            yield Settle(borrowed)
            if not isinstance(error, Exception):
                raise
            if gone:
                # As an advisory lock's acquire on a dead connection: typed, and the
                # connection discarded by its pool, so trying again takes a fresh one.
                raise LockConnectionLost(
                    f"lease {self.name!r} was not taken: the connection to the database "
                    f"was lost ({error})",
                    name=self.name,
                ) from error
            if backend.is_missing_table(error):
                raise LeaseTableMissing(site.create_hint) from error
            raise
        borrowed.done()
        yield Settle(borrowed)
        return attempt, holder, sent

    def _release_steps(self) -> Steps[None]:
        holding = self._take_holding()
        if holding.inherited:
            return  # a forked child never releases its parent's lease
        if holding.loss is None and not holding.overdue():
            released = yield from self._unhold_steps(holding)
            if released:
                holding.report("released", reason="unlock")
                return
            raise (yield from self._learn_loss_steps(holding, "it was no longer held at release"))
        row = yield from self._row_or_none_steps(holding)
        if still_ours(holding, row):
            # Declared lost locally (paused past its deadline) but nobody took it: free
            # it now rather than make the next holder wait for the expiry.
            yield from self._unhold_steps(holding)
        raise (
            yield from self._learn_loss_steps(
                holding, "its renewals stopped for longer than its ttl", row=row, asked=True
            )
        )

    def _ensure_held_steps(self) -> Steps[None]:
        holding = yield from self._current_holding_steps()
        backend = self._site.backend
        for attempt in range(2):
            try:
                rows = yield from self._rows_steps(holding)
            except Exception as error:
                if not backend.is_connection_failure(error):
                    raise
                # The first try may meet a pooled connection that died meanwhile.
                logger.debug("ensure_held() could not read lease %r", self.name, exc_info=True)
                if attempt:
                    yield from self._current_holding_steps()  # the local deadline, again
                    return
                continue
            row = rows[0] if rows else None
            if not still_ours(holding, row):
                raise (
                    yield from self._learn_loss_steps(
                        holding, "ensure_held() found it gone", row=row, asked=True
                    )
                )
            return

    def _fence_steps(self, executor: Any) -> Steps[None]:
        holding = yield from self._current_holding_steps()
        backend = self._site.backend
        try:
            proven = yield from on(
                executor, backend.fence(holding.lease_name, holding.holder, holding.token)
            )
        except Exception as error:
            if backend.is_missing_table(error):
                raise LeaseTableMissing(self._site.create_hint) from error
            raise
        if not proven:
            raise (yield from self._learn_loss_steps(holding, "fence() refused it"))

    def _unhold_steps(self, holding: LeaseHolding) -> Steps[bool]:
        """Free the holding's row: whether it was still ours.

        A pooled connection that died while the lease was held (a server's idle-session
        timeout, a restart, a failover: the pool's other idle connections are then
        likely dead too), or one that could not be opened, has the release sent again on
        a connection opened anew. A release that cannot reach the database that way
        either is ``LockLost``: the row stays until it expires, ttl after its last
        renewal. A pool that refuses a connection (full, closed: the library's typed
        refusal) raises that, and the lease expires the same way.

        A release that gave up waiting for another transaction's lock (SQLite's write
        lock, a MySQL fence's row lock, kept past the connection's lock wait) is
        ``LockLost`` too, and the row expires the same way: the statement did nothing,
        and it is not sent again, since its connection works and a new one would wait
        for the same lock.
        """
        try:
            return (yield from self._unhold_or_resend_steps(holding))
        except Exception as error:
            if isinstance(error, AdvisoryLockError) or not self._site.backend.is_busy(error):
                raise
            busy = error
        reason = (
            f"it could not be released: another transaction kept it locked for longer "
            f"than the release waits ({busy}); the database frees it at its expiry"
        )
        raise (yield from self._learn_loss_steps(holding, reason)) from busy

    def _unhold_or_resend_steps(self, holding: LeaseHolding) -> Steps[bool]:
        released, failure, first_sent = yield from self._release_try_steps(holding)
        if failure is None:
            return bool(released)
        logger.debug("releasing lease %r on a new connection", self.name, exc_info=failure)
        released, failure, _ = yield from self._release_try_steps(holding, anew=True)
        if failure is None:
            if released or first_sent is None:
                return bool(released)
            return (yield from self._released_unanswered_steps(holding, first_sent))
        reason = f"it could not be released ({failure}); the database frees it at its expiry"
        raise (yield from self._learn_loss_steps(holding, reason, asked=True)) from failure

    def _release_try_steps(
        self, holding: LeaseHolding, *, anew: bool = False
    ) -> Steps[tuple[bool | None, Exception | None, float | None]]:
        """One try at freeing the holding's row, on a connection borrowed (``anew``: one
        opened for it): the release's answer, or None with the error that left it
        without a working connection (one lent dead or that died, or none opened); and
        when (monotonic) the release went out, None where it did not. Other errors (the
        pool's refusal, a forked child's connection, a usage error) are raised."""
        backend = self._site.backend
        try:
            borrowed = yield from self._borrow_steps(anew=anew)
        except Exception as error:
            if not _no_connection(backend, error):
                raise
            return None, error, None
        sent = time.monotonic()
        try:
            released: bool = yield from self._borrowed_steps(
                lambda backend: backend.release(holding.lease_name, holding.holder, holding.token),
                borrowed,
            )
        except Exception as error:
            if not backend.is_connection_failure(error):
                raise
            return None, error, sent
        return released, None, sent

    def _released_unanswered_steps(self, holding: LeaseHolding, first_sent: float) -> Steps[bool]:
        """After a release sent again found nothing to free: whether the first one, sent
        at ``first_sent`` (monotonic), had freed the row and lost only its answer (its
        connection died in between). The row then is free with our token still on it;
        or a waiter took it since: held at a higher token, by a holding that began after
        the first release went out (a duration on each side: the clocks need not agree)
        while ours had not expired by our own deadline."""
        try:
            rows = yield from self._rows_steps(holding)
        except Exception:
            logger.debug("could not ask who holds lease %r", self.name, exc_info=True)
            return False
        row = rows[0] if rows else None
        if row is None or (row.holder is None and row.token == holding.token):
            return True
        return (
            row.token > holding.token
            and row.held_for is not None
            and row.held_for <= time.monotonic() - first_sent
            and not holding.overdue()
        )

    def _rows_steps(self, holding: LeaseHolding) -> Steps[list[LeaseRow]]:
        rows: list[LeaseRow] = yield from self._borrowed_steps(
            lambda backend: backend.rows([holding.lease_name])
        )
        return rows

    def _borrow_steps(self, *, anew: bool = False) -> Steps[Any]:
        """A connection lent for one statement or two (``anew``: opened for them, not
        one a pool kept idle). A binding's typed refusal (its pool lent none in time)
        names this lease: the binding lends connections, not leases."""
        try:
            borrowed = yield (BorrowAnew() if anew else Borrow(False))
        except AdvisoryLockError as error:
            if getattr(error, "name", "") is None:
                error.name = self.name  # type: ignore[attr-defined]
            raise
        return borrowed

    def _borrowed_steps(self, statements: Any, borrowed: Any = None) -> Steps[Any]:
        """Run ``statements(backend)`` on a borrowed connection (``borrowed``, else one
        borrowed now)."""
        backend = self._site.backend
        if borrowed is None:
            borrowed = yield from self._borrow_steps()
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

    def _new_flag(self) -> None:
        """Clear ``lost`` for a new holding."""
        self.lost.clear()

    def _hold(self, holder: str, token: int, sent: float, started: float | None) -> None:
        options = self.options
        self._new_flag()
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
            holding.source = _source(self._site, self._system)
            holding.report("acquired", waited=holding.granted_at - started)
        self._held(holding)
        holding.renewer = self._renewer()
        holding.renewer.hold(holding)

    def _held(self, holding: LeaseHolding) -> None:
        """A new holding, before the renewer sees it (the async lock hooks its loss)."""

    def _current_holding_steps(self) -> Steps[LeaseHolding]:
        holding = self._holding
        if holding is None or holding.inherited:
            raise LockUsageError(f"lease {self.name!r} is not held by this object")
        if holding.loss is not None:
            raise holding.loss
        if holding.overdue():
            raise (
                yield from self._learn_loss_steps(
                    holding, "its renewals stopped for longer than its ttl"
                )
            )
        return holding

    def _take_holding(self) -> LeaseHolding:
        holding = self._holding
        if holding is None:
            raise LockUsageError(f"lease {self.name!r} is not held by this object")
        self._forget(holding)
        return holding

    def _forget(self, holding: LeaseHolding) -> None:
        self._holding = None
        (holding.renewer or self._renewer()).forget(holding)

    def _row_or_none_steps(self, holding: LeaseHolding) -> Steps[LeaseRow | None]:
        try:
            rows = yield from self._rows_steps(holding)
        except Exception:
            logger.debug("could not ask who holds lease %r", holding.name, exc_info=True)
            return None
        return rows[0] if rows else None

    def _learn_loss_steps(
        self,
        holding: LeaseHolding,
        reason: str,
        *,
        row: LeaseRow | None = None,
        asked: bool = False,
    ) -> Steps[LockLost]:
        """Mark the holding lost, asking the database who holds it (once) to tell
        LockStolen from LockLost; return the error to raise."""
        if holding.loss is not None:
            return holding.loss
        if not asked:
            row = yield from self._row_or_none_steps(holding)
        loss = loss_error(holding, row, reason)
        if holding.mark_lost(loss):
            logger.warning("%s", loss)
        return holding.loss or loss


def _no_connection(backend: LeaseBackend, error: Exception) -> bool:
    """Whether ``error``, raised by a borrow, means no working connection was had: one
    lent dead (``LockConnectionLost``), or opening one failed (the backend's connection
    failures, and DB-API's ``OperationalError``, the class drivers raise for a refused or
    unreachable server, also as Django and SQLAlchemy wrap it). Not the library's other
    refusals, nor usage errors."""
    if isinstance(error, LockConnectionLost):
        return True
    if isinstance(error, AdvisoryLockError):
        return False
    return backend.is_connection_failure(error) or any(
        cls.__name__ == "OperationalError" for cls in type(error).__mro__
    )


class LeaseLock(_LeaseRules, LockContract):
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

    __slots__ = ()

    lost: threading.Event

    def __init__(self, site: Any, name: str, stored_name: str, options: LeaseOptions) -> None:
        self._site = site
        self.user_name = name
        self.lease_name = stored_name
        self.options = options
        self.lost = threading.Event()
        self._system = None
        self._holding: LeaseHolding | None = None
        self._last_token: int | None = None

    def _renewer(self) -> Any:
        from advisory_locks._core.renewer import renewer

        return renewer()

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
        if self.options.timeout == 0:
            return run_steps(self._try_steps(0.0, started), self._site) is None
        deadline = self._deadline()
        # Subscribed before the first attempt, so a release right after it still wakes us.
        listener = self._site.release_listener()
        released = None if listener is None else listener.subscribe(self.lease_name)
        try:
            while True:
                if released is not None:
                    released.clear()
                attempt = run_steps(self._try_steps(self._left(deadline), started), self._site)
                if attempt is None:
                    return True
                pause = self._pause(attempt, deadline)
                if pause is None:
                    return False
                if released is None:
                    time.sleep(pause)
                else:
                    released.wait(pause)
        finally:
            if released is not None:
                assert listener is not None
                listener.unsubscribe(self.lease_name, released)

    def release(self) -> None:
        """Give the lease back; ``LockStolen`` / ``LockLost`` if it was lost meanwhile."""
        run_steps(self._release_steps(), self._site)

    def ensure_held(self) -> None:
        """Raise ``LockStolen`` / ``LockLost`` unless the lease is still ours.

        One round trip: reads the lease row (never waits for a fenced row). If the
        database cannot be reached, the local deadline decides: the database cannot
        expire the lease before it (its expiry is counted from a later instant).
        """
        run_steps(self._ensure_held_steps(), self._site)

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
        if self._holding is None:
            raise LockUsageError(f"lease {self.name!r} is not held by this object")
        run_steps(self._fence_steps(self._site.fence_executor(bind)), self._site)


class AsyncLeaseLock(_LeaseRules, AsyncLockContract):
    """The asyncio twin of [`LeaseLock`][advisory_locks.LeaseLock], made by
    [`lease_lock`][advisory_locks.lease_lock] for an async bind: ``async with``, and
    ``acquire()``, ``release()``, ``ensure_held()`` and ``fence()`` are coroutines.

    ``lost`` is an ``asyncio.Event``. The running event loop's renewer task keeps the
    lease alive while the holder awaits; a loop blocked past the lease's deadline loses
    it like a frozen process does. With ``cancel_on_loss=True`` the task that acquired
    the lease is cancelled as soon as the loss is known, and the ``async with`` block
    raises ``LockStolen`` / ``LockLost`` at its exit instead of ``CancelledError``.
    """

    __slots__ = ("_cancelling", "cancel_on_loss")

    lost: asyncio.Event
    cancel_on_loss: bool

    def __init__(
        self,
        site: Any,
        name: str,
        stored_name: str,
        options: LeaseOptions,
        *,
        cancel_on_loss: bool = False,
    ) -> None:
        self._site = site
        self.user_name = name
        self.lease_name = stored_name
        self.options = options
        self.cancel_on_loss = cancel_on_loss
        self.lost = asyncio.Event()
        self._system = None
        self._holding: LeaseHolding | None = None
        self._last_token: int | None = None
        # The task cancel_on_loss cancelled, until the block's exit turns that into the loss.
        self._cancelling: asyncio.Task[Any] | None = None

    def _renewer(self) -> Any:
        from advisory_locks._core.renewer import async_renewer

        return async_renewer()

    async def acquire(self) -> bool:
        """Take the lease; False when it stayed held by someone else for the whole timeout
        (waiting as ``LeaseLock.acquire()`` does, without blocking the event loop)."""
        self._claim()
        started = time.monotonic() if events.listeners else None
        try:
            granted = await self._acquire(started)
        except BaseException as error:
            self._report_refusal(started, error)
            raise
        if not granted:
            self._report_refusal(started, None)
        return granted

    async def _acquire(self, started: float | None) -> bool:
        run = self._site.run
        if self.options.timeout == 0:
            return await run(self._try_steps(0.0, started)) is None
        deadline = self._deadline()
        listener = self._site.release_listener()
        released = None if listener is None else await listener.subscribe(self.lease_name)
        try:
            while True:
                if released is not None:
                    released.clear()
                attempt = await run(self._try_steps(self._left(deadline), started))
                if attempt is None:
                    return True
                pause = self._pause(attempt, deadline)
                if pause is None:
                    return False
                if released is None:
                    await asyncio.sleep(pause)
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(released.wait(), pause)
        finally:
            if released is not None:
                assert listener is not None
                listener.unsubscribe(self.lease_name, released)

    async def release(self) -> None:
        """Give the lease back; ``LockStolen`` / ``LockLost`` if it was lost meanwhile."""
        await self._site.run(self._release_steps())

    async def ensure_held(self) -> None:
        """Raise ``LockStolen`` / ``LockLost`` unless the lease is still ours (one round
        trip; see ``LeaseLock.ensure_held()``)."""
        await self._site.run(self._ensure_held_steps())

    async def fence(self, bind: object) -> None:
        """``LeaseLock.fence()`` inside ``bind``'s current transaction.

        Args:
            bind: the connection that makes the protected writes, inside its transaction:
                a SQLAlchemy ``AsyncSession`` or ``AsyncConnection``, an asyncpg
                ``Connection`` inside ``conn.transaction()``, a psycopg
                ``AsyncConnection`` in a transaction.
        """
        if self._holding is None:
            raise LockUsageError(f"lease {self.name!r} is not held by this object")
        await self._site.fence(bind, self._fence_steps)

    def _new_flag(self) -> None:
        self.lost.clear()
        self._cancelling = None

    def _held(self, holding: LeaseHolding) -> None:
        if self.cancel_on_loss:
            task = asyncio.current_task()
            if task is not None:
                holding.on_lost = lambda _loss: self._cancel(task)

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        if not task.done() and task is not asyncio.current_task():
            self._cancelling = task
            task.cancel(f"lease {self.name!r} was lost")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task, self._cancelling = self._cancelling, None
        if task is None or not isinstance(exc, asyncio.CancelledError):
            await super().__aexit__(exc_type, exc, traceback)
            return
        # The block was cancelled because the lease was lost: that loss is what it
        # raises, unless someone else cancelled the task too (then it stays cancelled).
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+
        try:
            await self.release()
        except LockLost as loss:
            if uncancel is not None and uncancel() > 0:
                return  # cancelled from outside as well: the CancelledError goes on
            raise loss from None
        raise exc  # pragma: no cover - a lost lease always raises at release

    def __repr__(self) -> str:
        state = "held" if self.held else "not held"
        return f"<AsyncLeaseLock {self.name!r} token={self.token} {state}>"


def _source(site: Any, system: str | None) -> events.EventSource:
    """Where a lease site's leases live, as their events say it."""
    return events.EventSource(
        system or site.backend.dialect_name,
        getattr(site, "binding", "unknown"),
        getattr(site, "database", None),
    )
