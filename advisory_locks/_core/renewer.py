"""The renewer: daemon threads that keep every held lease of the process alive.

Leases are grouped by site (one per database) and renewed in batches: one statement
extends every due lease of a site with the same ttl, on that site's renewer connection
(never a caller's Session, which is not thread-safe, and never a pooled connection the
application might be waiting for). Leases due soon are renewed with those due now, so a
site's leases fall into step and a period costs a handful of statements whatever their
number. Each site has a thread of its own, so that a database that stops answering
holds up the renewals of no other.

A renewal that finds a row taken marks that lease lost at once (asking who holds it:
``LockStolen`` or ``LockLost``). A renewal that fails (the database unreachable, a
restart) is logged and retried; the renewer never dies of it. Independently of any
answer, a lease whose last successful renewal was sent ``ttl - margin`` ago is declared
lost: the database may have let it expire by now. Where the site's thread cannot do it,
blocked in a statement that is neither answered nor refused (a partition, a hung
server), a watchdog thread that sends no statement does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Awaitable, Callable, Generator, Iterable
from typing import Any, Final, TypeVar

from advisory_locks._core.lease import LeaseHolding, loss_error, safety_margin, still_ours
from advisory_locks._core.steps import SCRIPT, Statement, Steps, on, run_steps

__all__ = ["AsyncRenewer", "Renewer", "async_renewer", "renewer"]

logger = logging.getLogger("advisory_locks")

T = TypeVar("T")

# After a failed renewal, try again after this part of the period (at most RETRY_MAX s).
RETRY_FRACTION: Final = 0.25
RETRY_MAX: Final = 1.0
# A due lease takes along the leases of its site due within this part of their period.
ALIGN_FRACTION: Final = 0.5
IDLE_WAIT: Final = 3600.0
# A holding whose site's thread has not declared it by its deadline plus this part of
# its safety margin is declared lost by the watchdog.
STALL_GRACE_FRACTION: Final = 0.5
# ...or, when that thread began its statement after the deadline, these seconds after.
LATE_ANSWER_WAIT: Final = 1.0
# How often the watchdog looks while a site's thread has an overdue holding to declare.
WATCH_POLL: Final = 0.1
# How long an abandoned async renewer connection may take to close.
ABANDONED_CLOSE_WAIT: Final = 10.0


class _Site:
    """The renewer's view of one lease site: its holdings, its own connection, and the
    thread that renews them on it."""

    __slots__ = ("busy_since", "connection", "fresh", "holdings", "retired", "site", "wake_at")

    def __init__(self, site: Any) -> None:
        self.site = site
        self.holdings: set[LeaseHolding] = set()
        self.connection: Any = None
        # Not yet connected to ahead of its first renewal.
        self.fresh = True
        # Set once nothing is held here any more, or once its thread stalled and a new
        # site took its holdings: its thread closes the connection and ends.
        self.retired = False
        # When its thread began the statements it is waiting on (None: not waiting).
        self.busy_since: float | None = None
        # When its waiting thread wakes up by itself (-inf: it is awake). A new holding
        # due no earlier needs no notify: waking the thread for each of 10,000 acquires
        # made each one cost a pass over every held lease.
        self.wake_at = -math.inf

    def executor(self, renew_every: float) -> Any:
        if self.connection is None:
            connection = self.site.renewal_connection()
            try:
                for sql in self.site.backend.renewer_setup(renew_every):
                    connection.executor.execute(Statement(SCRIPT, sql))
            except BaseException:
                connection.close()
                raise
            self.connection = connection
        return self.connection.executor

    def drop_connection(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            try:
                connection.close()
            except Exception:
                logger.debug("closing the renewer's connection failed", exc_info=True)


class Renewer:
    """Renews the leases this process holds; started on the first lease.

    Each site (database) is renewed by a thread of its own, so that a database that
    stops answering (a partition, a hung server: the socket neither answers nor fails)
    holds up only its own renewals. A watchdog thread, which sends no statement, declares
    a holding lost when its site's thread is blocked in a statement past the holding's
    deadline (``stall_due``), before the database may let the lease expire. That site's
    stalled thread is then given up on: a new thread, on a new connection, renews what is
    still held there, and the old one closes its connection and ends whenever its
    statement returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sites: dict[int, _Site] = {}
        # One condition per site thread (by id of its _Site), and the watchdog's; all on
        # self._lock.
        self._site_wakes: dict[int, threading.Condition] = {}
        self._watch = threading.Condition(self._lock)
        self._watch_at = -math.inf
        self._watchdog: threading.Thread | None = None

    def hold(self, holding: LeaseHolding) -> None:
        with self._lock:
            site = self._sites.get(id(holding.site))
            if site is None or site.site is not holding.site:
                site = self._sites[id(holding.site)] = _Site(holding.site)
            site.holdings.add(holding)
            wake = self._site_wakes.get(id(site))
            if wake is None:
                self._start_site(site)
            elif site.fresh or min(holding.next_due, holding.deadline) < site.wake_at:
                wake.notify()
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(
                    target=self._run_watchdog, name="advisory-locks-lease-deadlines", daemon=True
                )
                self._watchdog.start()
            elif holding.deadline + stall_grace(holding) < self._watch_at:
                self._watch.notify()

    def forget(self, holding: LeaseHolding) -> None:
        with self._lock:
            site = self._sites.get(id(holding.site))
            if site is not None:
                site.holdings.discard(holding)
                if not site.holdings:
                    # Its thread may be using the connection right now: it closes it.
                    del self._sites[id(holding.site)]
                    self._retire(site)

    def holdings(self) -> list[LeaseHolding]:
        with self._lock:
            return [holding for site in self._sites.values() for holding in site.holdings]

    def _start_site(self, site: _Site) -> None:
        # Called with self._lock held.
        self._site_wakes[id(site)] = threading.Condition(self._lock)
        threading.Thread(
            target=self._run_site, args=(site,), name="advisory-locks-renewer", daemon=True
        ).start()

    def _retire(self, site: _Site) -> None:
        # Called with self._lock held.
        site.retired = True
        wake = self._site_wakes.get(id(site))
        if wake is not None:
            wake.notify()

    # -- a site's thread ------------------------------------------------------------------

    def _run_site(self, site: _Site) -> None:
        try:
            while True:
                try:
                    if not self._wait_until_due(site):
                        return
                    if site.fresh:
                        self._connect(site)
                    now = time.monotonic()
                    self._renew_site(site, now)
                    self._declare_overdue(site)
                except Exception:
                    # Whatever went wrong, the leases still need renewing.
                    logger.exception("lease renewer: unexpected error; carrying on")
                    time.sleep(RETRY_MAX)
        finally:
            site.drop_connection()
            with self._lock:
                self._site_wakes.pop(id(site), None)

    def _wait_until_due(self, site: _Site) -> bool:
        """Wait until the site has work; False once it is retired."""
        with self._lock:
            wake = self._site_wakes[id(site)]
            site.busy_since = None
            while True:
                if site.retired:
                    return False
                if site.fresh and site.holdings:
                    break
                wake_at = next_wake([site])
                if wake_at is not None:
                    delay = wake_at - time.monotonic()
                    if delay <= 0:
                        break
                else:
                    wake_at, delay = math.inf, IDLE_WAIT
                site.wake_at = wake_at
                wake.wait(delay)
            site.wake_at = -math.inf
            site.busy_since = time.monotonic()
            return True

    def _connect(self, site: _Site) -> None:
        # At once, not at the first renewal: a process frozen before then would otherwise
        # connect after it resumes, and learn of a takeover that much later.
        with self._lock:
            site.fresh = False
            holdings = list(site.holdings)
        if holdings and site.connection is None:
            try:
                site.executor(min(h.renew_every for h in holdings))
            except Exception:
                logger.debug("the renewer could not connect yet", exc_info=True)
                site.drop_connection()

    def _renew_site(self, site: _Site, now: float) -> None:
        with self._lock:
            holdings = [h for h in site.holdings if h.loss is None and not h.inherited]
        for ttl, batch in due_batches(site, holdings, now):
            self._renew_batch(site, ttl, batch)

    def _renew_batch(self, site: _Site, ttl: float, batch: list[LeaseHolding]) -> None:
        period = min(h.renew_every for h in batch)
        sent = time.monotonic()
        try:
            executor = site.executor(period)
            sent = time.monotonic()
            answer = run_steps(renewal_steps(executor, site.site.backend, batch, ttl))
        except Exception as error:
            site.drop_connection()
            renewal_failed(batch, error, period)
            return
        renewal_answered(answer, sent, period, self._registered)

    def _declare_overdue(self, site: _Site) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = overdue_by_site([site], now)
        for found, holdings in overdue:
            declare_overdue(holdings, _ask(found, holdings), now, self._registered)

    def _registered(self, holding: LeaseHolding) -> bool:
        with self._lock:
            site = self._sites.get(id(holding.site))
            return site is not None and holding in site.holdings

    # -- the watchdog ---------------------------------------------------------------------

    def _run_watchdog(self) -> None:
        while True:
            try:
                stalled = self._wait_for_a_stall()
                if stalled is None:
                    return
                now = time.monotonic()
                for holding in stalled:
                    reason = (
                        f"no renewal succeeded for {now - holding.last_sent:.3g} s "
                        f"(ttl {holding.ttl:g} s), and the database has not answered the "
                        "renewer since"
                    )
                    if self._registered(holding):
                        _lost(holding, loss_error(holding, None, reason))
            except Exception:
                logger.exception("lease renewer watchdog: unexpected error; carrying on")
                time.sleep(RETRY_MAX)

    def _wait_for_a_stall(self) -> list[LeaseHolding] | None:
        """The holdings whose site's thread is blocked in a statement past their
        ``stall_due``, once there are any (each such site's thread replaced); None once
        nothing is held."""
        late: dict[LeaseHolding, float] = {}
        with self._lock:
            while True:
                now = time.monotonic()
                stalled: list[LeaseHolding] = []
                wake_at = math.inf
                for site in self._sites.values():
                    for holding in site.holdings:
                        if holding.loss is not None or holding.inherited:
                            continue
                        due = stall_due(holding, site.busy_since)
                        if due is None:
                            # Its site's thread is not in a statement: it declares the
                            # holding lost itself at its deadline. Look again soon.
                            first = holding.deadline + stall_grace(holding)
                            due = first if first > now else now + WATCH_POLL
                        elif due <= now and now >= holding.last_sent + holding.ttl:
                            # Seen only after the database may have let it expire: this
                            # thread was held up too (a frozen process). Its site's
                            # thread, resumed with it, may yet answer who holds it now.
                            due = late.setdefault(holding, now) + LATE_ANSWER_WAIT
                        if due <= now:
                            stalled.append(holding)
                        wake_at = min(wake_at, due)
                if stalled:
                    break
                if wake_at == math.inf:
                    self._watchdog = None
                    return None
                self._watch_at = wake_at
                self._watch.wait(wake_at - now)
            self._watch_at = -math.inf
            for key, site in list(self._sites.items()):
                if site.busy_since is not None and any(h in site.holdings for h in stalled):
                    # Its thread is blocked in a statement: the holdings still in time
                    # go on with a new thread and connection.
                    fresh = self._sites[key] = _Site(site.site)
                    fresh.holdings, site.holdings = site.holdings, set()
                    self._retire(site)
                    self._start_site(fresh)
            return stalled

    def after_fork_in_child(self) -> None:
        # The parent's threads do not exist here, and the parent's leases are not ours:
        # a child neither renews nor releases them.
        # No lock is taken: the parent's renewer may have held one at the fork.
        for site in list(self._sites.values()):
            for holding in list(site.holdings):
                holding.inherited = True
        self._lock = threading.Lock()
        self._sites = {}
        self._site_wakes = {}
        self._watch = threading.Condition(self._lock)
        self._watch_at = -math.inf
        self._watchdog = None


def stall_grace(holding: LeaseHolding) -> float:
    """How long past its local deadline a holding waits for its site's thread to declare
    it (with the database's word on who holds it) before the watchdog does."""
    return safety_margin(holding.ttl) * STALL_GRACE_FRACTION


def stall_due(holding: LeaseHolding, busy_since: float | None) -> float | None:
    """When the watchdog declares ``holding`` lost, its site's thread having been in a
    statement since ``busy_since`` (None: it is not, and declares it itself).

    A thread blocked since before the deadline gets the grace: the database may let the
    lease expire at the end of the margin. One that began after it (a process resumed
    from a freeze asks who holds the lease now) gets ``LATE_ANSWER_WAIT``: the lease is
    due to be declared lost anyway, and its answer tells ``LockStolen`` from
    ``LockLost``."""
    if busy_since is None:
        return None
    if busy_since < holding.deadline:
        return holding.deadline + stall_grace(holding)
    return busy_since + LATE_ANSWER_WAIT


def due_batches(
    site: Any, holdings: list[LeaseHolding], now: float
) -> list[tuple[float, list[LeaseHolding]]]:
    """The batches (one ttl each, at most the backend's batch size) to renew now: none
    unless one lease is due; then every lease due within ALIGN_FRACTION of its period."""
    if not any(h.next_due <= now for h in holdings):
        return []
    due = [h for h in holdings if h.next_due <= now + h.renew_every * ALIGN_FRACTION]
    by_ttl: dict[float, list[LeaseHolding]] = defaultdict(list)
    for holding in due:
        by_ttl[holding.ttl].append(holding)
    size = site.site.backend.renew_batch_size
    return [
        (ttl, group[start : start + size])
        for ttl, group in by_ttl.items()
        for start in range(0, len(group), size)
    ]


Answer = tuple[list[LeaseHolding], set[str], list[LeaseHolding], list[Any]]


def renewal_steps(
    executor: Any, backend: Any, batch: list[LeaseHolding], ttl: float
) -> Steps[Answer]:
    """Renew ``batch`` on the renewer's connection; read the rows of those not renewed."""
    renewed: set[str] = yield from on(
        executor, backend.renew([(h.lease_name, h.holder, h.token) for h in batch], ttl)
    )
    missing = [h for h in batch if h.lease_name not in renewed]
    rows: list[Any] = (
        (yield from on(executor, backend.rows([h.lease_name for h in missing]))) if missing else []
    )
    return batch, renewed, missing, rows


def renewal_failed(batch: list[LeaseHolding], error: Exception, period: float) -> None:
    """Log a failed renewal and try again soon: the renewer never dies of it."""
    retry = min(RETRY_MAX, period * RETRY_FRACTION)
    logger.warning(
        "lease renewer: renewing %d lease(s) failed, retrying in %.2f s: %s",
        len(batch),
        retry,
        error,
        exc_info=logger.isEnabledFor(logging.DEBUG),
    )
    for holding in batch:
        holding.next_due = time.monotonic() + retry
        holding.report("renewal_failed", reason="error", error=error)


def renewal_answered(
    answer: Answer, sent: float, period: float, registered: Callable[[LeaseHolding], bool]
) -> None:
    batch, renewed, missing, rows = answer
    for holding in batch:
        if holding.lease_name in renewed:
            holding.renewed(sent)
    by_name = {row.name: row for row in rows}
    for holding in missing:
        row = by_name.get(holding.lease_name)
        if still_ours(holding, row):
            # Locked by another transaction (a fence on MySQL/SQLite, a takeover
            # attempt in flight): still ours, renew it at the next chance.
            holding.next_due = time.monotonic() + min(RETRY_MAX, period * RETRY_FRACTION)
        elif registered(holding):  # not released meanwhile
            _lost(holding, loss_error(holding, row, "a renewal found it no longer ours"))


def overdue_by_site(sites: Iterable[Any], now: float) -> list[tuple[Any, list[LeaseHolding]]]:
    """The holdings past their local deadline, by renewer site."""
    found = []
    for site in sites:
        holdings = [
            h for h in site.holdings if h.loss is None and not h.inherited and h.overdue(now)
        ]
        if holdings:
            found.append((site, holdings))
    return found


def declare_overdue(
    holdings: list[LeaseHolding],
    rows: dict[str, Any],
    now: float,
    registered: Callable[[LeaseHolding], bool],
) -> None:
    for holding in holdings:
        row = rows.get(holding.lease_name)
        reason = f"no renewal succeeded for {now - holding.last_sent:.3g} s (ttl {holding.ttl:g} s)"
        if registered(holding):
            _lost(holding, loss_error(holding, row, reason))


def next_wake(sites: Iterable[Any]) -> float | None:
    """When a renewer must act next (a renewal due or a deadline); None: nothing held."""
    holdings = [h for site in sites for h in site.holdings if h.loss is None and not h.inherited]
    if not holdings:
        return None
    return float(min(min(h.next_due, h.deadline) for h in holdings))


def _ask(site: _Site, holdings: Iterable[LeaseHolding]) -> dict[str, Any]:
    names = [h.lease_name for h in holdings]
    try:
        executor = site.executor(min(h.renew_every for h in holdings))
        rows = run_steps(on(executor, site.site.backend.rows(names)))
    except Exception:
        site.drop_connection()
        return {}
    return {row.name: row for row in rows}


def _lost(holding: LeaseHolding, loss: Any) -> None:
    if holding.mark_lost(loss):
        logger.warning("%s", loss)


def _forget_abandoned(
    abandoned: set[asyncio.Future[Any]],
) -> Callable[[asyncio.Future[Any]], None]:
    def forget(task: asyncio.Future[Any]) -> None:
        abandoned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("an abandoned renewer statement failed", exc_info=task.exception())

    return forget


async def _close_quietly(connection: Any) -> None:
    try:
        await asyncio.wait_for(connection.aclose(), ABANDONED_CLOSE_WAIT)
    except Exception:
        logger.debug("closing an abandoned renewer connection failed", exc_info=True)


def _script(sql: str) -> Generator[Statement, Any, None]:
    yield Statement(SCRIPT, sql)


class _AsyncSite:
    """The async renewer's view of one lease site: its holdings, its own connection, and
    the task that renews them on it."""

    __slots__ = ("connection", "fresh", "holdings", "retired", "site", "task", "wake")

    def __init__(self, site: Any) -> None:
        self.site = site
        self.holdings: set[LeaseHolding] = set()
        self.connection: Any = None
        # Not yet connected to ahead of its first renewal.
        self.fresh = True
        # Set once nothing is held here any more: its task ends.
        self.retired = False
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()

    async def executor(self, renew_every: float) -> Any:
        if self.connection is None:
            connection = await self.site.renewal_connection()
            try:
                for sql in self.site.backend.renewer_setup(renew_every):
                    await self.site.run(on(connection.executor, _script(sql)))
            except BaseException:
                await connection.aclose()
                raise
            self.connection = connection
        return self.connection.executor

    async def drop_connection(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            try:
                await connection.aclose()
            except Exception:
                logger.debug("closing the renewer's connection failed", exc_info=True)


class AsyncRenewer:
    """Renews the leases held through async binds on one event loop, a task per site.

    The same rules as the threads (``due_batches``, ``renewal_steps``, the deadlines),
    run by awaiting: an asyncio driver's connection belongs to its loop, and a lease held
    by a coroutine is renewed while that coroutine awaits. Each site (database) has a
    task of its own, so that a database that stops answering holds up no other's
    renewals; a statement there is given up on at its leases' deadline (``_bounded``).
    A site's task ends when nothing is held there and starts again with the next lease.
    A loop that stays blocked (CPU-bound code in a coroutine) stops its renewals like a
    SIGSTOP would: once it runs again, the local deadline or the next renewal tells its
    leases they were lost.
    """

    def __init__(self) -> None:
        self._sites: dict[int, _AsyncSite] = {}
        # Abandoned statements and connections being closed (kept referenced until
        # they are done).
        self._closing: set[asyncio.Future[Any]] = set()

    def hold(self, holding: LeaseHolding) -> None:
        site = self._sites.get(id(holding.site))
        if site is None or site.site is not holding.site:
            site = self._sites[id(holding.site)] = _AsyncSite(holding.site)
        site.holdings.add(holding)
        if site.task is None or site.task.done():
            site.task = asyncio.get_running_loop().create_task(
                self._run(site), name="advisory-locks-renewer"
            )
        site.wake.set()

    def forget(self, holding: LeaseHolding) -> None:
        site = self._sites.get(id(holding.site))
        if site is not None:
            site.holdings.discard(holding)
            if not site.holdings:
                # The task may be using the connection right now: it closes it itself.
                del self._sites[id(holding.site)]
                site.retired = True
                site.wake.set()

    def holdings(self) -> list[LeaseHolding]:
        return [holding for site in self._sites.values() for holding in site.holdings]

    def _registered(self, holding: LeaseHolding) -> bool:
        site = self._sites.get(id(holding.site))
        return site is not None and holding in site.holdings

    def _close_later(self, connection: Any) -> None:
        if connection is not None:
            self._keep_until_done(
                asyncio.get_running_loop().create_task(_close_quietly(connection))
            )

    def _keep_until_done(self, task: asyncio.Future[Any]) -> None:
        self._closing.add(task)
        task.add_done_callback(_forget_abandoned(self._closing))

    async def _bounded(self, site: _AsyncSite, work: Awaitable[T]) -> T:
        """``work`` on ``site``'s connection, given up on at the first ``stall_due`` of
        the site's holdings: a statement neither answered nor refused (a partition, a
        hung server) must not keep them from being declared lost before the database
        may let them expire. Those past their deadline then are, and the connection is
        abandoned (closed in the background)."""
        live = [h for h in site.holdings if h.loss is None and not h.inherited]
        if not live:
            return await work
        now = time.monotonic()
        limit = min(stall_due(h, now) or now for h in live) - now
        # Not wait_for(): a driver may not end a cancelled statement before the server
        # answers (psycopg waits for its cancel request), which a stall never does.
        running = asyncio.ensure_future(work)
        try:
            await asyncio.wait({running}, timeout=limit if limit > 0 else LATE_ANSWER_WAIT)
            if not running.done() and time.monotonic() >= min(h.last_sent + h.ttl for h in live):
                # Woken only after the database may have let a lease expire: the loop was
                # held up too (a frozen process), and the statement, resumed with it, may
                # yet answer who holds the lease now.
                await asyncio.wait({running}, timeout=LATE_ANSWER_WAIT)
        except BaseException:
            running.cancel()
            raise
        if running.done():
            return running.result()
        running.cancel()
        self._keep_until_done(running)
        connection, site.connection = site.connection, None
        self._close_later(connection)
        now = time.monotonic()
        stalled = [h for h in live if h.loss is None and h.overdue(now)]
        declare_overdue(stalled, {}, now, self._registered)
        raise TimeoutError(f"the database did not answer the renewer within {max(limit, 0):.3g} s")

    async def _run(self, site: _AsyncSite) -> None:
        while True:
            try:
                await self._connect(site)
                if not await self._wait_until_due(site):
                    # Retired, or nothing left to renew: decided with no await since, so
                    # a hold() after this starts a new task, and the connection is no
                    # longer the site's.
                    site.task = None
                    connection, site.connection = site.connection, None
                    site.fresh = True
                    self._close_later(connection)
                    return
                now = time.monotonic()
                await self._renew_site(site, now)
                await self._declare_overdue(site)
            except Exception:
                # Whatever went wrong, the leases still need renewing.
                logger.exception("lease renewer: unexpected error; carrying on")
                await asyncio.sleep(RETRY_MAX)

    async def _wait_until_due(self, site: _AsyncSite) -> bool:
        while True:
            site.wake.clear()
            if site.retired:
                return False
            if site.fresh and site.holdings:
                return True
            wake_at = next_wake([site])
            if wake_at is None:
                return False
            delay = wake_at - time.monotonic()
            if delay <= 0:
                return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(site.wake.wait(), delay)

    async def _connect(self, site: _AsyncSite) -> None:
        # At once, not at the first renewal (see Renewer._connect).
        holdings = list(site.holdings)
        if not (site.fresh and holdings):
            return
        site.fresh = False
        if site.connection is None:
            try:
                await self._bounded(site, site.executor(min(h.renew_every for h in holdings)))
            except Exception:
                logger.debug("the renewer could not connect yet", exc_info=True)
                await site.drop_connection()

    async def _renew_site(self, site: _AsyncSite, now: float) -> None:
        holdings = [h for h in site.holdings if h.loss is None and not h.inherited]
        for ttl, batch in due_batches(site, holdings, now):
            await self._renew_batch(site, ttl, batch)

    async def _renew_batch(self, site: _AsyncSite, ttl: float, batch: list[LeaseHolding]) -> None:
        period = min(h.renew_every for h in batch)
        sent = time.monotonic()
        try:
            executor = await self._bounded(site, site.executor(period))
            sent = time.monotonic()
            answer = await self._bounded(
                site, site.site.run(renewal_steps(executor, site.site.backend, batch, ttl))
            )
        except Exception as error:
            await site.drop_connection()
            renewal_failed(batch, error, period)
            return
        renewal_answered(answer, sent, period, self._registered)

    async def _declare_overdue(self, site: _AsyncSite) -> None:
        now = time.monotonic()
        for found, holdings in overdue_by_site([site], now):
            rows: dict[str, Any] = {}
            try:
                executor = await self._bounded(
                    found, found.executor(min(h.renew_every for h in holdings))
                )
                answered = await self._bounded(
                    found,
                    found.site.run(
                        on(executor, found.site.backend.rows([h.lease_name for h in holdings]))
                    ),
                )
                rows = {row.name: row for row in answered}
            except Exception:
                await found.drop_connection()
            declare_overdue(holdings, rows, now, self._registered)


_async_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncRenewer] = (
    weakref.WeakKeyDictionary()
)


def async_renewer() -> AsyncRenewer:
    """The running event loop's renewer."""
    loop = asyncio.get_running_loop()
    found = _async_renewers.get(loop)
    if found is None:
        found = _async_renewers[loop] = AsyncRenewer()
    return found


_renewer_lock = threading.Lock()
_renewer: Renewer | None = None


def renewer() -> Renewer:
    """The process's renewer (a forked child gets its own)."""
    global _renewer
    with _renewer_lock:
        if _renewer is None:
            _renewer = Renewer()
        return _renewer


def _after_fork_in_child() -> None:
    global _renewer_lock
    _renewer_lock = threading.Lock()
    if _renewer is not None:
        _renewer.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
