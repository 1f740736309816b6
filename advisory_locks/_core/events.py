"""Lock events: what the database did with a lock, told to the listeners that subscribed.

Every lock of this library -- whatever the binding (SQLAlchemy, Django, a raw driver) --
reports through here: a grant (with the time waited), a release (with the time held), a
refusal, a loss; a lease also reports a failed renewal and being stolen. The Django
signals and the OpenTelemetry instrumentation are listeners like any other.

With no listener nothing is built: each place that reports checks ``listeners`` (an
empty tuple by default) before it reads a clock or makes an event. A listener hears about
a holding (its grant, its release, its loss) only if it was subscribed when the lock was
granted, so a count of held locks kept from the events never goes below zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeAlias

from advisory_locks.keys import LockName

__all__ = [
    "EventKind",
    "EventSource",
    "Listener",
    "LockEvent",
    "Mode",
    "Scope",
    "emit",
    "listeners",
    "subscribe",
    "unsubscribe",
]

logger = logging.getLogger("advisory_locks")

EventKind: TypeAlias = Literal[
    "acquired", "released", "not_acquired", "lost", "renewal_failed", "stolen"
]
Mode: TypeAlias = Literal["exclusive", "shared"]
Scope: TypeAlias = Literal["session", "transaction", "lease"]


@dataclass(frozen=True, slots=True)
class LockEvent:
    """One thing that happened to one lock.

    :param kind: ``"acquired"`` (the server granted it), ``"released"`` (the server no
        longer holds it), ``"not_acquired"`` (a wait ended without it), ``"lost"`` (a
        holder learned that its lock was gone: ``LockLost`` was raised), and for leases
        ``"renewal_failed"`` (a renewal did not reach the database; the lease may still
        be held) and ``"stolen"`` (another holder took an expired lease over).
    :param name: the name the lock was made with.
    :param key: the key(s) the server sees (None for a lease: its ``token`` instead).
    :param system: the database, as OpenTelemetry's ``db.system.name`` says it:
        ``"postgresql"``, ``"mysql"``, ``"mariadb"`` or ``"sqlite"``.
    :param mode: ``"exclusive"`` or ``"shared"``.
    :param scope: ``"session"``, ``"transaction"`` or ``"lease"``.
    :param binding: what the lock was taken through: ``"sqlalchemy"``, ``"django"``, or the
        driver (``"psycopg"``, ...).
    :param database: the binding's name for the database, where it has one (Django's
        alias); None otherwise.
    :param waited: seconds from the start of ``acquire()`` (``acquired``, ``not_acquired``).
    :param held: seconds since the grant (``released``, ``lost``, ``stolen``; None when
        the grant was not reported).
    :param reason: ``not_acquired``: ``"busy"`` (``timeout=0``), ``"timeout"``,
        ``"deadlock"``, ``"cancelled"`` (the caller gave up: its task was cancelled, or
        KeyboardInterrupt) or ``"error"``. ``released``: ``"unlock"``, ``"commit"``,
        ``"rollback"`` (also a savepoint's), ``"transaction_ended"`` (a raw driver
        connection, which cannot tell a commit from a rollback), ``"connection_closed"``,
        ``"request_finished"`` (Django: taken in a request, still held at its end),
        ``"lost"`` or, for a lease, ``"stolen"``. ``lost``: ``"connection_closed"``,
        ``"connection_failed"``, ``"not_held"`` (the server no longer holds it),
        ``"transaction_ended"`` or ``"forked"``; for a lease ``"not_held"`` or
        ``"expired"`` (its renewals stopped for longer than its ttl).
        ``renewal_failed``: ``"error"``.
    :param error: the exception, for a ``not_acquired`` that raised and a ``lost`` caused
        by a driver error.
    :param granted_at: ``time.monotonic()`` at the grant, the same in a holding's
        ``acquired``, ``released`` and ``lost`` (None when the grant was not reported).
    :param token: a lease's fencing token (None for an advisory lock).
    """

    kind: EventKind
    name: LockName
    key: int | tuple[int, int] | None
    system: str
    mode: Mode
    scope: Scope
    binding: str
    database: str | None = None
    waited: float | None = None
    held: float | None = None
    reason: str | None = None
    error: BaseException | None = None
    granted_at: float | None = None
    token: int | None = None


class EventSource(NamedTuple):
    """Where a lock lives, as its events say it."""

    system: str
    binding: str
    database: str | None


Listener: TypeAlias = Callable[[LockEvent], None]

# Read without a lock on every lock operation: replaced whole, never changed in place.
listeners: tuple[Listener, ...] = ()
# Each listener with the time.monotonic() it was subscribed at.
_subscribed: tuple[tuple[Listener, float], ...] = ()
_changing = threading.Lock()


def subscribe(listener: Listener) -> Listener:
    """Call ``listener(event)`` for every lock event from now on; return ``listener``.

    Listeners run in the thread (or task) that took or gave back the lock, between its
    round trips: keep them quick. An exception in one is logged on the
    ``advisory_locks`` logger and goes no further, so a broken metrics client can neither
    leak a lock nor break a transaction. Subscribing a listener twice has no effect.
    Usable as a decorator.

    A lock granted before ``listener`` was subscribed is not reported to it at all: it
    hears no ``released`` or ``lost`` without the ``acquired`` before them.
    """
    global listeners, _subscribed
    if not callable(listener):
        raise TypeError(f"a listener must be callable, not {type(listener).__name__}")
    with _changing:
        if listener not in listeners:
            _subscribed = (*_subscribed, (listener, time.monotonic()))
            listeners = tuple(known for known, _ in _subscribed)
    return listener


def unsubscribe(listener: Listener) -> None:
    """Stop calling ``listener``; nothing happens if it was not subscribed."""
    global listeners, _subscribed
    with _changing:
        _subscribed = tuple(entry for entry in _subscribed if entry[0] != listener)
        listeners = tuple(known for known, _ in _subscribed)


def emit(event: LockEvent) -> None:
    """Tell every listener about ``event`` (about a holding: those that saw its grant)."""
    granted_at = event.granted_at
    for listener, since in _subscribed:
        if granted_at is not None and granted_at < since:
            continue
        try:
            listener(event)
        except Exception:
            logger.exception("lock event listener %r raised", listener)
