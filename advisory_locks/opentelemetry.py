"""OpenTelemetry metrics and traces for every lock, from the core's lock events.

``instrument()`` once at start-up; needs ``opentelemetry-api`` (the ``otel`` extra), and
sends to whatever SDK and exporters the application configured::

    from advisory_locks import opentelemetry

    opentelemetry.instrument()

Metrics (attributes: ``db.system.name``, ``advisory_lock.mode``, ``advisory_lock.scope``,
``advisory_lock.binding``, ``advisory_lock.database`` where the binding names one, and
``advisory_lock.name`` only with ``lock_names_in_metrics=True``):

- ``advisory_lock.wait.duration`` (histogram, s): every ``acquire()`` that reached the
  database, with ``advisory_lock.outcome`` (``acquired``, ``busy``, ``timeout``,
  ``deadlock``, ``error``);
- ``advisory_lock.hold.duration`` (histogram, s): from grant to release, with
  ``advisory_lock.release_reason``;
- ``advisory_lock.not_acquired`` (counter): refusals, with ``advisory_lock.outcome``;
- ``advisory_lock.lost`` (counter): ``LockLost`` raised, or a lease lost or taken over,
  with ``advisory_lock.loss_reason`` (``stolen`` for a lease another holder took);
- ``advisory_lock.held`` (up-down counter): locks held now by this process;
- ``advisory_lock.lease.renewal_failures`` (counter): lease renewals that did not reach
  the database (the lease may still be held).

Traces: one span per wait, ``advisory lock wait``, from the start of ``acquire()`` to the
answer, a child of the span current in the code that asked; it carries the lock's name and
key, and ``error.type`` with an error status when the wait timed out, deadlocked or failed.
"""

from __future__ import annotations

import threading
import time
from typing import Final

from opentelemetry import metrics, trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.util.types import AttributeValue

from advisory_locks import events
from advisory_locks.events import LockEvent

__all__ = ["SCOPE_NAME", "SPAN_NAME", "instrument", "uninstrument"]

SCOPE_NAME: Final = "advisory_locks"
SPAN_NAME: Final = "advisory lock wait"
# Seconds. A wait is usually milliseconds and times out within a minute; a lock is
# held for as long as a request, or for as long as a nightly job.
WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
HOLD_BUCKETS: Final = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 7200, 21600)
# Outcomes that are failures of the wait (busy is the answer timeout=0 asked for).
FAILED_OUTCOMES: Final = frozenset({"timeout", "deadlock", "error"})

_installed: _Instrumentation | None = None
_installing = threading.Lock()


def instrument(
    *,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
    lock_names_in_metrics: bool = False,
) -> None:
    """Record metrics and a span per wait for every lock from now on.

    :param meter_provider: where the metrics go; default the global one
        (``opentelemetry.metrics.set_meter_provider``).
    :param tracer_provider: where the spans go; default the global one.
    :param lock_names_in_metrics: add ``advisory_lock.name`` to the metrics' attributes.
        Off by default: names that hold ids (a tenant, an order) make a time series per
        id. Spans always carry the name.

    Calling it again replaces the previous instrumentation.
    """
    global _installed
    if not isinstance(lock_names_in_metrics, bool):
        raise TypeError("lock_names_in_metrics must be True or False")
    instrumentation = _Instrumentation(meter_provider, tracer_provider, lock_names_in_metrics)
    with _installing:
        if _installed is not None:
            events.unsubscribe(_installed)
        _installed = instrumentation
        events.subscribe(instrumentation)


def uninstrument() -> None:
    """Stop recording (what was recorded stays with the providers)."""
    global _installed
    with _installing:
        if _installed is not None:
            events.unsubscribe(_installed)
            _installed = None


class _Instrumentation:
    """The lock event listener that turns events into metrics and spans."""

    def __init__(
        self,
        meter_provider: MeterProvider | None,
        tracer_provider: TracerProvider | None,
        lock_names_in_metrics: bool,
    ) -> None:
        from advisory_locks import __version__

        meter = metrics.get_meter(SCOPE_NAME, __version__, meter_provider)
        self.tracer = trace.get_tracer(SCOPE_NAME, __version__, tracer_provider)
        self.names_in_metrics = lock_names_in_metrics
        self.wait = meter.create_histogram(
            "advisory_lock.wait.duration",
            unit="s",
            description="Time from acquire() to the database's answer.",
            explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
        )
        self.hold = meter.create_histogram(
            "advisory_lock.hold.duration",
            unit="s",
            description="Time from the grant to the release.",
            explicit_bucket_boundaries_advisory=HOLD_BUCKETS,
        )
        self.not_acquired = meter.create_counter(
            "advisory_lock.not_acquired",
            unit="{attempt}",
            description="Waits that ended without the lock.",
        )
        self.lost = meter.create_counter(
            "advisory_lock.lost",
            unit="{lock}",
            description="Locks found gone while a holder counted on them (LockLost).",
        )
        self.held = meter.create_up_down_counter(
            "advisory_lock.held",
            unit="{lock}",
            description="Locks this process holds now.",
        )
        self.renewal_failures = meter.create_counter(
            "advisory_lock.lease.renewal_failures",
            unit="{renewal}",
            description="Lease renewals that did not reach the database.",
        )

    def __call__(self, event: LockEvent) -> None:
        kind = event.kind
        if kind == "acquired":
            self._waited(event, "acquired")
            self.held.add(1, self._attributes(event))
        elif kind == "not_acquired":
            outcome = event.reason or "error"
            self._waited(event, outcome)
            self.not_acquired.add(1, {**self._attributes(event), "advisory_lock.outcome": outcome})
        elif kind == "released":
            attributes = self._attributes(event)
            self.held.add(-1, attributes)
            if event.held is not None:
                self.hold.record(
                    event.held,
                    {**attributes, "advisory_lock.release_reason": event.reason or "unlock"},
                )
        elif kind in ("lost", "stolen"):
            reason = "stolen" if kind == "stolen" else event.reason or ""
            self.lost.add(1, {**self._attributes(event), "advisory_lock.loss_reason": reason})
        elif kind == "renewal_failed":
            self.renewal_failures.add(1, self._attributes(event))

    def _waited(self, event: LockEvent, outcome: str) -> None:
        waited = event.waited or 0.0
        self.wait.record(waited, {**self._attributes(event), "advisory_lock.outcome": outcome})
        ended = time.time_ns()
        attributes = {
            **self._attributes(event, with_name=True),
            "advisory_lock.outcome": outcome,
        }
        if event.key is not None:
            attributes["advisory_lock.key"] = (
                list(event.key) if isinstance(event.key, tuple) else event.key
            )
        if event.token is not None:
            attributes["advisory_lock.lease.token"] = event.token
        # The event comes at the end of the wait: the span is dated back to its start.
        span = self.tracer.start_span(
            SPAN_NAME,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=ended - int(waited * 1e9),
        )
        if outcome in FAILED_OUTCOMES:
            error = event.error
            error_type = outcome if error is None else _qualified_name(type(error))
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, str(error) if error else outcome))
            if error is not None:
                span.record_exception(error)
        span.end(end_time=ended)

    def _attributes(
        self, event: LockEvent, *, with_name: bool = False
    ) -> dict[str, AttributeValue]:
        attributes: dict[str, AttributeValue] = {
            "db.system.name": event.system,
            "advisory_lock.mode": event.mode,
            "advisory_lock.scope": event.scope,
            "advisory_lock.binding": event.binding,
        }
        if event.database is not None:
            attributes["advisory_lock.database"] = event.database
        if with_name or self.names_in_metrics:
            name = event.name
            attributes["advisory_lock.name"] = (
                ", ".join(map(str, name)) if isinstance(name, tuple) else str(name)
            )
        return attributes


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
