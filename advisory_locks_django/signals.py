"""Signals sent when the server grants, refuses or gives back a lock.

Every signal is sent with ``sender`` =
[DjangoAdvisoryLock][advisory_locks_django.DjangoAdvisoryLock] and these keyword arguments:

``name``, ``key``
    the lock's name and the key(s) the server sees;
``using``
    the database alias;
``mode``
    ``"exclusive"`` or ``"shared"``;
``scope``
    ``"session"`` or ``"transaction"``.

``lock_acquired`` adds ``waited`` (seconds). ``lock_failed`` adds ``waited``, ``reason``
(``"busy"``, ``"timeout"``, ``"deadlock"``, ``"cancelled"`` or ``"error"``) and ``error``
(the exception, or None when ``acquire()`` returned False). ``lock_released`` adds ``held``
(seconds) and ``reason``: ``"unlock"``, ``"commit"``, ``"rollback"`` (also a savepoint
rollback), ``"connection_closed"`` (Django closed the connection, or gave it back to its
pool, with the lock held: the app unlocked it first), ``"request_finished"`` (taken during a
request and still held at its end) or ``"lost"``.

A re-entrant acquire on a connection that already holds the lock sends nothing: the
signals follow what the server does. While no receiver is connected to any of the three
lock signals, the lock events are not forwarded (nor built: locks then read no clock), so
a lock granted in that time sends no ``lock_released`` later either: receivers that count
held locks never see a release without its grant. Receivers run through
``send_robust``: an exception in one is logged and can neither leak a lock nor break the
transaction it fired in.

The signals are the core's lock events (``advisory_locks.events``) of this app's locks,
forwarded: a listener subscribed there sees the same, for every binding.

Leases taken with ``advisory_locks_django.lease_lock`` send their own signals, with
``sender`` = [DjangoLeaseLock][advisory_locks_django.DjangoLeaseLock] and ``name``,
``using`` and ``token`` (the fencing token of the holding; None in ``lease_failed``):
``lease_acquired`` adds ``waited``; ``lease_failed`` adds ``waited``, ``reason``
(``"busy"``, ``"timeout"`` or ``"error"``) and ``error``; ``lease_released`` adds ``held``
and ``reason`` (``"unlock"``, ``"stolen"`` or ``"lost"``); ``lease_lost`` adds ``reason``
(``"stolen"``: another holder took it over; ``"expired"`` or ``"not_held"``) and ``error``
(the ``LockStolen`` / ``LockLost``); ``lease_renewal_failed`` adds ``error`` (a renewal
that could not reach the database; the renewer retries). ``lease_lost`` and
``lease_renewal_failed`` are sent from the renewer's thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

from django.dispatch import Signal

from advisory_locks._core import events
from advisory_locks._core.events import LockEvent
from advisory_locks_django.conf import lock_settings

__all__ = [
    "forward_lease_events",
    "forward_lock_events",
    "lease_acquired",
    "lease_failed",
    "lease_lost",
    "lease_released",
    "lease_renewal_failed",
    "lock_acquired",
    "lock_failed",
    "lock_released",
]

logger = logging.getLogger("advisory_locks_django")


class _Forwarding:
    """Forwards the core's lock events to a group of signals only while one of them has
    a receiver: with no listener subscribed, the core builds no events and reads no clock
    on a lock's hot path."""

    def __init__(self) -> None:
        self.signals: list[_ForwardedSignal] = []
        self.listener: Callable[[LockEvent], None] | None = None
        self._mutex = threading.Lock()

    def forward_with(self, listener: Callable[[LockEvent], None]) -> None:
        with self._mutex:
            if self.listener is not None:
                events.unsubscribe(self.listener)
            self.listener = listener
        self.update()

    def update(self) -> None:
        """Subscribe the listener when some signal of the group has a receiver (dead weak
        receivers included: they may be alive), unsubscribe it when none has."""
        with self._mutex:
            if self.listener is None:
                return
            if any(signal.receivers for signal in self.signals):
                events.subscribe(self.listener)  # no effect when subscribed already
            else:
                events.unsubscribe(self.listener)


class _ForwardedSignal(Signal):
    """A ``Signal`` that tells its forwarding when receivers come and go."""

    def __init__(self, forwarding: _Forwarding) -> None:
        super().__init__()
        self._forwarding = forwarding
        forwarding.signals.append(self)

    def connect(
        self,
        receiver: Callable[..., Any],
        sender: object | None = None,
        weak: bool = True,
        dispatch_uid: Hashable | None = None,
    ) -> None:
        super().connect(receiver, sender, weak, dispatch_uid)
        self._forwarding.update()

    def disconnect(
        self,
        receiver: Callable[..., Any] | None = None,
        sender: object | None = None,
        dispatch_uid: Hashable | None = None,
    ) -> bool:
        removed = super().disconnect(receiver, sender, dispatch_uid)
        self._forwarding.update()
        return removed


_lock_forwarding = _Forwarding()
_lease_forwarding = _Forwarding()

lock_acquired: Signal = _ForwardedSignal(_lock_forwarding)
lock_released: Signal = _ForwardedSignal(_lock_forwarding)
lock_failed: Signal = _ForwardedSignal(_lock_forwarding)

lease_acquired: Signal = _ForwardedSignal(_lease_forwarding)
lease_released: Signal = _ForwardedSignal(_lease_forwarding)
lease_failed: Signal = _ForwardedSignal(_lease_forwarding)
lease_lost: Signal = _ForwardedSignal(_lease_forwarding)
lease_renewal_failed: Signal = _ForwardedSignal(_lease_forwarding)


def forward_lock_events(sender: type) -> None:
    """Send the signals, as ``sender``, for the lock events of Django's binding."""

    def forward(event: LockEvent) -> None:
        # The signals are DjangoAdvisoryLock's: not SQLAlchemy's locks, nor leases.
        if event.binding != "django" or event.scope == "lease":
            return
        if event.kind == "acquired":
            send(lock_acquired, sender, event, waited=event.waited)
        elif event.kind == "released":
            send(lock_released, sender, event, held=event.held, reason=event.reason)
        elif event.kind == "not_acquired":
            send(
                lock_failed,
                sender,
                event,
                waited=event.waited,
                reason=event.reason,
                error=event.error,
            )

    _lock_forwarding.forward_with(forward)


def forward_lease_events(sender: type) -> None:
    """Send the lease signals, as ``sender``, for the lease events of Django's binding."""

    def forward(event: LockEvent) -> None:
        if event.binding != "django" or event.scope != "lease":
            return
        kind = event.kind
        if kind == "acquired":
            send_lease(lease_acquired, sender, event, waited=event.waited)
        elif kind == "released":
            send_lease(lease_released, sender, event, held=event.held, reason=event.reason)
        elif kind == "not_acquired":
            send_lease(
                lease_failed,
                sender,
                event,
                waited=event.waited,
                reason=event.reason,
                error=event.error,
            )
        elif kind == "stolen":
            send_lease(lease_lost, sender, event, reason="stolen", error=event.error)
        elif kind == "lost":
            send_lease(lease_lost, sender, event, reason=event.reason, error=event.error)
        elif kind == "renewal_failed":
            send_lease(lease_renewal_failed, sender, event, error=event.error)

    _lease_forwarding.forward_with(forward)


def send_lease(signal: Signal, sender: type, event: LockEvent, **extra: Any) -> None:
    """Send ``signal`` about one lease, unless signals are switched off or unheard."""
    if not signal.receivers or not lock_settings().send_signals:
        return
    _log_failures(
        signal.send_robust(
            sender, name=event.name, using=event.database, token=event.token, **extra
        )
    )


def _log_failures(responses: list[tuple[Any, Any]]) -> None:
    for receiver, response in responses:
        if isinstance(response, Exception):
            logger.error(
                "advisory lock signal receiver %r raised",
                receiver,
                exc_info=(type(response), response, response.__traceback__),
            )


def send(signal: Signal, sender: type, event: LockEvent, **extra: Any) -> None:
    """Send ``signal`` about one lock, unless signals are switched off or unheard."""
    if not signal.receivers or not lock_settings().send_signals:
        return
    responses = signal.send_robust(
        sender,
        name=event.name,
        key=event.key,
        using=event.database,
        mode=event.mode,
        scope=event.scope,
        **extra,
    )
    for receiver, response in responses:
        if isinstance(response, Exception):
            logger.error(
                "advisory lock signal receiver %r raised",
                receiver,
                exc_info=(type(response), response, response.__traceback__),
            )
