"""Lock events: subscribe a listener to hear what the database did with every lock.

::

    from advisory_locks import events

    @events.subscribe
    def log_waits(event: events.LockEvent) -> None:
        if event.kind == "acquired" and event.waited > 1.0:
            print(f"waited {event.waited:.1f} s for {event.name!r}")

Every binding reports (SQLAlchemy, Django, the raw drivers), for every database. See
docs/monitoring.md for what each event carries and when it is sent.
"""

from __future__ import annotations

from advisory_locks._core.events import (
    EventKind,
    Listener,
    LockEvent,
    Mode,
    Scope,
    subscribe,
    unsubscribe,
)

__all__ = ["EventKind", "Listener", "LockEvent", "Mode", "Scope", "subscribe", "unsubscribe"]
