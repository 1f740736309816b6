"""The renewer: one daemon thread per process that keeps every held lease alive.

Leases are grouped by site (one per database) and renewed in batches: one statement
extends every due lease of a site with the same ttl, on the renewer's own connection
(never a caller's Session, which is not thread-safe, and never a pooled connection the
application might be waiting for). Leases due soon are renewed with those due now, so a
site's leases fall into step and a period costs a handful of statements whatever their
number.

A renewal that finds a row taken marks that lease lost at once (asking who holds it:
``LockStolen`` or ``LockLost``). A renewal that fails (the database unreachable, a
restart) is logged and retried; the renewer never dies of it. Independently of any
answer, a lease whose last successful renewal was sent ``ttl - margin`` ago is declared
lost: the database may have let it expire by now.
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
from collections.abc import Callable, Generator, Iterable
from typing import Any, Final

from advisory_locks._core.lease import LeaseHolding, loss_error, still_ours
from advisory_locks._core.steps import SCRIPT, Statement, Steps, on, run_steps

__all__ = ["AsyncRenewer", "Renewer", "async_renewer", "renewer"]

logger = logging.getLogger("advisory_locks")

# After a failed renewal, try again after this part of the period (at most RETRY_MAX s).
RETRY_FRACTION: Final = 0.25
RETRY_MAX: Final = 1.0
# A due lease takes along the leases of its site due within this part of their period.
ALIGN_FRACTION: Final = 0.5
IDLE_WAIT: Final = 3600.0


class _Site:
    """The renewer's view of one lease site: its holdings and its own connection."""

    __slots__ = ("connection", "fresh", "holdings", "site")

    def __init__(self, site: Any) -> None:
        self.site = site
        self.holdings: set[LeaseHolding] = set()
        self.connection: Any = None
        # Not yet connected to ahead of its first renewal.
        self.fresh = True

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
    """Renews the leases this process holds; started on the first lease."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._sites: dict[int, _Site] = {}
        self._retired: list[_Site] = []
        self._thread: threading.Thread | None = None
        # When the waiting thread will wake up by itself (-inf: it is awake and will look
        # at every holding before it waits again). A new holding due no earlier needs no
        # notify: waking the thread for each of 10,000 acquires made each one cost a
        # pass over every held lease.
        self._wake_at = -math.inf

    def hold(self, holding: LeaseHolding) -> None:
        with self._wake:
            site = self._sites.get(id(holding.site))
            if site is None or site.site is not holding.site:
                site = self._sites[id(holding.site)] = _Site(holding.site)
            site.holdings.add(holding)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="advisory-locks-renewer", daemon=True
                )
                self._thread.start()
            if site.fresh or min(holding.next_due, holding.deadline) < self._wake_at:
                self._wake.notify()

    def forget(self, holding: LeaseHolding) -> None:
        with self._wake:
            site = self._sites.get(id(holding.site))
            if site is not None:
                site.holdings.discard(holding)
                if not site.holdings:
                    del self._sites[id(holding.site)]
                    if site.connection is None and self._wake_at != -math.inf:
                        # No connection to close, and the thread is waiting, so it is
                        # not opening one either: nothing to wake it for.
                        return
                    # The renewer thread may be using the connection right now: it
                    # closes it itself.
                    self._retired.append(site)
                    self._wake.notify()

    def holdings(self) -> list[LeaseHolding]:
        with self._wake:
            return [holding for site in self._sites.values() for holding in site.holdings]

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._connect_new_sites()
                self._wait_until_due()
                self._close_retired()
                now = time.monotonic()
                for site in self._due_sites():
                    self._renew_site(site, now)
                self._declare_overdue()
            except Exception:
                # Whatever went wrong, the leases still need renewing.
                logger.exception("lease renewer: unexpected error; carrying on")
                time.sleep(RETRY_MAX)

    def _connect_new_sites(self) -> None:
        # At once, not at the first renewal: a process frozen before then would otherwise
        # connect after it resumes, and learn of a takeover that much later.
        with self._wake:
            new = [site for site in self._sites.values() if site.fresh and site.holdings]
        for site in new:
            site.fresh = False
            holdings = list(site.holdings)
            if holdings and site.connection is None:
                try:
                    site.executor(min(h.renew_every for h in holdings))
                except Exception:
                    logger.debug("the renewer could not connect yet", exc_info=True)
                    site.drop_connection()

    def _close_retired(self) -> None:
        with self._wake:
            retired, self._retired = self._retired, []
        for site in retired:
            site.drop_connection()

    def _registered(self, holding: LeaseHolding) -> bool:
        with self._wake:
            site = self._sites.get(id(holding.site))
            return site is not None and holding in site.holdings

    def _wait_until_due(self) -> None:
        with self._wake:
            while True:
                if self._retired or any(s.fresh and s.holdings for s in self._sites.values()):
                    break
                wake_at = next_wake(self._sites.values())
                if wake_at is not None:
                    delay = wake_at - time.monotonic()
                    if delay <= 0:
                        break
                else:
                    wake_at, delay = math.inf, IDLE_WAIT
                self._wake_at = wake_at
                self._wake.wait(delay)
            self._wake_at = -math.inf

    def _due_sites(self) -> list[_Site]:
        with self._wake:
            return list(self._sites.values())

    def _renew_site(self, site: _Site, now: float) -> None:
        with self._wake:
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

    def _declare_overdue(self) -> None:
        now = time.monotonic()
        with self._wake:
            overdue = overdue_by_site(self._sites.values(), now)
        for site, holdings in overdue:
            declare_overdue(holdings, _ask(site, holdings), now, self._registered)

    def after_fork_in_child(self) -> None:
        # The parent's thread does not exist here, and the parent's leases are not ours:
        # a child neither renews nor releases them.
        # No lock is taken: the parent's renewer may have held one at the fork.
        for site in list(self._sites.values()):
            for holding in list(site.holdings):
                holding.inherited = True
        self._wake = threading.Condition()
        self._sites = {}
        self._retired = []
        self._thread = None
        self._wake_at = -math.inf


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


def _script(sql: str) -> Generator[Statement, Any, None]:
    yield Statement(SCRIPT, sql)


class _AsyncSite:
    """The async renewer's view of one lease site: its holdings and its own connection."""

    __slots__ = ("connection", "fresh", "holdings", "site")

    def __init__(self, site: Any) -> None:
        self.site = site
        self.holdings: set[LeaseHolding] = set()
        self.connection: Any = None
        # Not yet connected to ahead of its first renewal.
        self.fresh = True

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
    """Renews the leases held through async binds on one event loop, from one task.

    The same rules as the thread (``due_batches``, ``renewal_steps``, the deadlines), run
    by awaiting: an asyncio driver's connection belongs to its loop, and a lease held by
    a coroutine is renewed while that coroutine awaits. The task ends when nothing is
    held and starts again with the next lease. A loop that stays blocked (CPU-bound code
    in a coroutine) stops its renewals like a SIGSTOP would: once it runs again, the
    local deadline or the next renewal tells its leases they were lost.
    """

    def __init__(self) -> None:
        self._sites: dict[int, _AsyncSite] = {}
        self._retired: list[_AsyncSite] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def hold(self, holding: LeaseHolding) -> None:
        site = self._sites.get(id(holding.site))
        if site is None or site.site is not holding.site:
            site = self._sites[id(holding.site)] = _AsyncSite(holding.site)
        site.holdings.add(holding)
        self._start()

    def forget(self, holding: LeaseHolding) -> None:
        site = self._sites.get(id(holding.site))
        if site is not None:
            site.holdings.discard(holding)
            if not site.holdings:
                # The task may be using the connection right now: it closes it itself.
                del self._sites[id(holding.site)]
                self._retired.append(site)
                self._start()

    def holdings(self) -> list[LeaseHolding]:
        return [holding for site in self._sites.values() for holding in site.holdings]

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="advisory-locks-renewer"
            )
        self._wake.set()

    def _registered(self, holding: LeaseHolding) -> bool:
        site = self._sites.get(id(holding.site))
        return site is not None and holding in site.holdings

    async def _run(self) -> None:
        while True:
            try:
                await self._connect_new_sites()
                if not await self._wait_until_due():
                    # Nothing held, nothing to close: decided with no await since, so a
                    # hold() after this starts a new task.
                    self._task = None
                    return
                await self._close_retired()
                now = time.monotonic()
                for site in list(self._sites.values()):
                    await self._renew_site(site, now)
                await self._declare_overdue()
            except Exception:
                # Whatever went wrong, the leases still need renewing.
                logger.exception("lease renewer: unexpected error; carrying on")
                await asyncio.sleep(RETRY_MAX)

    async def _wait_until_due(self) -> bool:
        while True:
            self._wake.clear()
            if self._retired or any(s.fresh and s.holdings for s in self._sites.values()):
                return True
            wake_at = next_wake(self._sites.values())
            if wake_at is None:
                return False
            delay = wake_at - time.monotonic()
            if delay <= 0:
                return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _connect_new_sites(self) -> None:
        # At once, not at the first renewal (see Renewer._connect_new_sites).
        for site in list(self._sites.values()):
            holdings = list(site.holdings)
            if not (site.fresh and holdings):
                continue
            site.fresh = False
            if site.connection is None:
                try:
                    await site.executor(min(h.renew_every for h in holdings))
                except Exception:
                    logger.debug("the renewer could not connect yet", exc_info=True)
                    await site.drop_connection()

    async def _close_retired(self) -> None:
        retired, self._retired = self._retired, []
        for site in retired:
            await site.drop_connection()

    async def _renew_site(self, site: _AsyncSite, now: float) -> None:
        holdings = [h for h in site.holdings if h.loss is None and not h.inherited]
        for ttl, batch in due_batches(site, holdings, now):
            await self._renew_batch(site, ttl, batch)

    async def _renew_batch(self, site: _AsyncSite, ttl: float, batch: list[LeaseHolding]) -> None:
        period = min(h.renew_every for h in batch)
        sent = time.monotonic()
        try:
            executor = await site.executor(period)
            sent = time.monotonic()
            answer = await site.site.run(renewal_steps(executor, site.site.backend, batch, ttl))
        except Exception as error:
            await site.drop_connection()
            renewal_failed(batch, error, period)
            return
        renewal_answered(answer, sent, period, self._registered)

    async def _declare_overdue(self) -> None:
        now = time.monotonic()
        for site, holdings in overdue_by_site(list(self._sites.values()), now):
            rows: dict[str, Any] = {}
            try:
                executor = await site.executor(min(h.renew_every for h in holdings))
                found = await site.site.run(
                    on(executor, site.site.backend.rows([h.lease_name for h in holdings]))
                )
                rows = {row.name: row for row in found}
            except Exception:
                await site.drop_connection()
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
