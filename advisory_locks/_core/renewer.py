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

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Final

from advisory_locks._core.lease import LeaseHolding, loss_error, still_ours
from advisory_locks._core.steps import SCRIPT, Statement, on, run_steps

__all__ = ["Renewer", "renewer"]

logger = logging.getLogger("advisory_locks")

# After a failed renewal, try again after this part of the period (at most RETRY_MAX s).
RETRY_FRACTION: Final = 0.25
RETRY_MAX: Final = 1.0
# A due lease takes along the leases of its site due within this part of their period.
ALIGN_FRACTION: Final = 0.5
IDLE_WAIT: Final = 3600.0


class _Site:
    """The renewer's view of one lease site: its holdings and its own connection."""

    __slots__ = ("connection", "holdings", "site")

    def __init__(self, site: Any) -> None:
        self.site = site
        self.holdings: set[LeaseHolding] = set()
        self.connection: Any = None

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
            self._wake.notify()

    def forget(self, holding: LeaseHolding) -> None:
        with self._wake:
            site = self._sites.get(id(holding.site))
            if site is not None:
                site.holdings.discard(holding)
                if not site.holdings:
                    # The renewer thread may be using the connection right now: it
                    # closes it itself.
                    del self._sites[id(holding.site)]
                    self._retired.append(site)
                    self._wake.notify()

    def holdings(self) -> list[LeaseHolding]:
        with self._wake:
            return [holding for site in self._sites.values() for holding in site.holdings]

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
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
                if self._retired:
                    return
                holdings = [
                    h
                    for site in self._sites.values()
                    for h in site.holdings
                    if h.loss is None and not h.inherited
                ]
                if holdings:
                    wake_at = min(min(h.next_due, h.deadline) for h in holdings)
                    delay = wake_at - time.monotonic()
                    if delay <= 0:
                        return
                else:
                    delay = IDLE_WAIT
                self._wake.wait(delay)

    def _due_sites(self) -> list[_Site]:
        with self._wake:
            return list(self._sites.values())

    def _renew_site(self, site: _Site, now: float) -> None:
        with self._wake:
            holdings = [h for h in site.holdings if h.loss is None and not h.inherited]
        if not any(h.next_due <= now for h in holdings):
            return
        due = [h for h in holdings if h.next_due <= now + h.renew_every * ALIGN_FRACTION]
        by_ttl: dict[float, list[LeaseHolding]] = defaultdict(list)
        for holding in due:
            by_ttl[holding.ttl].append(holding)
        backend = site.site.backend
        size = backend.renew_batch_size
        for ttl, group in by_ttl.items():
            for start in range(0, len(group), size):
                self._renew_batch(site, ttl, group[start : start + size])

    def _renew_batch(self, site: _Site, ttl: float, batch: list[LeaseHolding]) -> None:
        backend = site.site.backend
        period = min(h.renew_every for h in batch)
        sent = time.monotonic()
        try:
            executor = site.executor(period)
            sent = time.monotonic()
            renewed = run_steps(
                on(executor, backend.renew([(h.lease_name, h.holder, h.token) for h in batch], ttl))
            )
            missing = [h for h in batch if h.lease_name not in renewed]
            rows = (
                run_steps(on(executor, backend.rows([h.lease_name for h in missing])))
                if missing
                else []
            )
        except Exception as error:
            retry = min(RETRY_MAX, period * RETRY_FRACTION)
            logger.warning(
                "lease renewer: renewing %d lease(s) failed, retrying in %.2f s: %s",
                len(batch),
                retry,
                error,
                exc_info=logger.isEnabledFor(logging.DEBUG),
            )
            site.drop_connection()
            for holding in batch:
                holding.next_due = time.monotonic() + retry
            return
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
            elif self._registered(holding):  # not released meanwhile
                _lost(holding, loss_error(holding, row, "a renewal found it no longer ours"))

    def _declare_overdue(self) -> None:
        now = time.monotonic()
        with self._wake:
            overdue = [
                (site, h)
                for site in self._sites.values()
                for h in site.holdings
                if h.loss is None and not h.inherited and h.overdue(now)
            ]
        by_site: dict[int, tuple[_Site, list[LeaseHolding]]] = {}
        for site, holding in overdue:
            by_site.setdefault(id(site), (site, []))[1].append(holding)
        for site, holdings in by_site.values():
            rows = _ask(site, holdings)
            for holding in holdings:
                row = rows.get(holding.lease_name)
                reason = (
                    f"no renewal succeeded for {now - holding.last_sent:.3g} s "
                    f"(ttl {holding.ttl:g} s)"
                )
                if self._registered(holding):
                    _lost(holding, loss_error(holding, row, reason))

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
