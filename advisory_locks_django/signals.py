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
signals follow what the server does. Receivers run through ``send_robust``: an exception
in one is logged and can neither leak a lock nor break the transaction it fired in.

The signals are the core's lock events (``advisory_locks.events``) of this app's locks,
forwarded: a listener subscribed there sees the same, for every binding.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

from advisory_locks._core import events
from advisory_locks._core.events import LockEvent
from advisory_locks_django.conf import lock_settings

__all__ = ["forward_lock_events", "lock_acquired", "lock_failed", "lock_released"]

logger = logging.getLogger("advisory_locks_django")

lock_acquired = Signal()
lock_released = Signal()
lock_failed = Signal()


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

    events.subscribe(forward)


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
