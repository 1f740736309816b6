"""Handoff latency: how long after a holder lets go does a blocked waiter run?

Per trial: the holder takes the lock; a waiter thread on its own connection starts to
wait; the holder confirms the waiter is really waiting (in ``pg_locks`` for a server-side
wait, by an event for client polling); then t0 = ``perf_counter()`` right before the
holder's release call, and t1 = ``perf_counter()`` right after the waiter's acquire
returns. Latency = t1 - t0, so it includes the holder's release round trip, the server
waking the waiter, and the waiter's driver and library returning.

Both sides live in one process, so the GIL is shared; psycopg releases it while it waits
on the socket, and raw and ours pay the same tax.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL

from advisory_locks.keys import derive_key
from advisory_locks.sqlalchemy import advisory_lock
from benchmarks.postgres import TrackedEngine, raw_connection

__all__ = ["HandoffRun", "HandoffVariant", "handoff_variants", "run_handoffs"]

# Take the lock and return the function that gives it back.
Take = Callable[[], Callable[[], None]]

RAW_KEY = 7_246_100
WAIT_CONFIRM_SECONDS = 10.0
TRIAL_SECONDS = 60.0
POLL_MIN_SECONDS = 0.05
POLL_MAX_SECONDS = 0.15


@dataclass
class HandoffVariant:
    name: str
    description: str
    take_holder: Take
    take_waiter: Take
    # None: the waiter waits in the server, seen in pg_locks under this key.
    is_waiting: Callable[[], bool] | None = None
    reference: bool = False
    # Fewer trials for variants whose every trial costs tens of milliseconds.
    slow: bool = False
    key_name: object = None


@dataclass
class HandoffRun:
    """One variant's waiter thread, kept alive across rounds; each trial is one handoff."""

    variant: HandoffVariant
    admin: psycopg.Cursor[TupleRow]
    latencies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._go = threading.Event()
        self._done = threading.Event()
        self._stop = False
        self._acquired_at = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._wait_loop, name=self.variant.name, daemon=True)
        self._thread.start()
        if self.variant.is_waiting is None:
            self._waiting = self._waits_in_server(derive_key(self.variant.key_name).pg_locks_ids())
        else:
            self._waiting = self.variant.is_waiting

    def trial(self) -> None:
        release = self.variant.take_holder()
        self._done.clear()
        self._go.set()
        deadline = time.monotonic() + WAIT_CONFIRM_SECONDS
        while not self._waiting():
            if self._done.is_set() or time.monotonic() > deadline:
                release()
                raise RuntimeError(f"{self.variant.name}: the waiter never started waiting")
            time.sleep(0.0002)
        released_at = time.perf_counter()
        release()
        if not self._done.wait(TRIAL_SECONDS):
            raise RuntimeError(f"{self.variant.name}: the waiter never got the lock")
        if self._error is not None:
            raise self._error
        self.latencies.append(self._acquired_at - released_at)

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join(TRIAL_SECONDS)

    def _wait_loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            try:
                release = self.variant.take_waiter()
                self._acquired_at = time.perf_counter()
                release()
            except BaseException as error:
                self._error = error
            self._done.set()

    def _waits_in_server(self, ids: tuple[int, int, int]) -> Callable[[], bool]:
        def waiting() -> bool:
            self.admin.execute(
                "SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' "
                "AND NOT granted AND classid::int8 = %s AND objid::int8 = %s "
                "AND objsubid = %s",
                ids,
            )
            row = self.admin.fetchone()
            return row is not None and row[0] > 0

        return waiting


def _raw_take(connection: psycopg.Connection[TupleRow], key: int) -> Take:
    cursor = connection.cursor()

    def release() -> None:
        cursor.execute("SELECT pg_advisory_unlock(%s)", (key,))

    def take() -> Callable[[], None]:
        cursor.execute("SELECT pg_advisory_lock(%s)", (key,))
        return release

    return take


def _polling_take(
    connection: psycopg.Connection[TupleRow], key: int, waiting: threading.Event
) -> Take:
    cursor = connection.cursor()
    chance = random.Random(key)

    def release() -> None:
        cursor.execute("SELECT pg_advisory_unlock(%s)", (key,))

    def take() -> Callable[[], None]:
        while True:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            row = cursor.fetchone()
            if row is not None and row[0]:
                return release
            waiting.set()
            time.sleep(chance.uniform(POLL_MIN_SECONDS, POLL_MAX_SECONDS))

    return take


def _library_take(tracked: TrackedEngine, name: str, timeout: float | None) -> Take:
    def take() -> Callable[[], None]:
        lock = advisory_lock(tracked.engine, name, timeout=timeout)
        if not lock.acquire():
            raise RuntimeError(f"{name}: not granted within {timeout} s")
        return lock.release

    return take


def handoff_variants(url: URL, stack: ExitStack) -> list[HandoffVariant]:
    variants = [
        HandoffVariant(
            "raw.handoff",
            "raw psycopg: holder pg_advisory_unlock, waiter blocked in pg_advisory_lock",
            _raw_take(raw_connection(url, stack), RAW_KEY),
            _raw_take(raw_connection(url, stack), RAW_KEY),
            reference=True,
            key_name=RAW_KEY,
        )
    ]
    for name, timeout in (("ours.handoff", None), ("ours.handoff.timeout", 30.0)):
        tracked = TrackedEngine(url, stack)
        variants.append(
            HandoffVariant(
                name,
                f"advisory_lock(engine, timeout={timeout}) for holder and waiter",
                _library_take(tracked, name, None),
                _library_take(tracked, name, timeout),
                key_name=name,
            )
        )
    polling_key = RAW_KEY + 1
    polling = threading.Event()
    raw_take_holder = _raw_take(raw_connection(url, stack), polling_key)

    def polling_started() -> bool:
        return polling.is_set()

    def take_holder() -> Callable[[], None]:
        polling.clear()
        return raw_take_holder()

    variants.append(
        HandoffVariant(
            "raw.handoff.client_polling",
            "waiter polls pg_try_advisory_lock, sleeping 50-150 ms between tries (the Rails "
            "gem's way)",
            take_holder,
            _polling_take(raw_connection(url, stack), polling_key, polling),
            is_waiting=polling_started,
            slow=True,
        )
    )
    return variants


def run_handoffs(
    variants: list[HandoffVariant],
    url: URL,
    stack: ExitStack,
    *,
    rounds: int,
    trials: int,
    slow_trials: int,
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, list[float]]:
    """Latencies in seconds per variant, the variants interleaved round by round."""
    admin = raw_connection(url, stack).cursor()
    runs = [HandoffRun(variant, admin) for variant in variants]
    try:
        for number in range(rounds):
            shift = number % len(runs)
            for run in [*runs[shift:], *runs[:shift]]:
                total = slow_trials if run.variant.slow else trials
                # Spread the trials over the rounds; the first rounds take any remainder.
                for _ in range(total // rounds + (1 if number < total % rounds else 0)):
                    run.trial()
            progress(f"handoff round {number + 1}/{rounds} done")
    finally:
        for run in runs:
            run.close()
    return {run.variant.name: run.latencies for run in runs}
