"""Handoff latency: how long after a holder lets go does a blocked waiter run?

The waiter is a separate PROCESS (one per variant, kept for the whole run), as it is in
production: a waiter thread in the holder's process would share its GIL, and the
scheduler's choice of which thread runs first would show up as latency.

Per trial: the holder (this process) takes the lock; it tells the waiter to take it; it
confirms the waiter is really waiting (queued in ``pg_locks`` for a server-side wait, an
event for client polling); then t0 = CLOCK_MONOTONIC right before the holder's release
call, and t1 = CLOCK_MONOTONIC in the waiter right after its acquire returns. Latency =
t1 - t0: the holder's release round trip, the server waking the waiter, and the waiter's
driver and library returning. CLOCK_MONOTONIC is one clock for all processes of a host.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL, make_url

from benchmarks.clients import CLIENTS, Client, make_client
from benchmarks.pinning import Pinning
from benchmarks.postgres import raw_connection

__all__ = ["HANDOFF_VARIANTS", "HandoffRun", "run_handoffs"]

WAIT_CONFIRM_SECONDS = 10.0
TRIAL_SECONDS = 60.0
START_SECONDS = 60.0

# (case name, client kind); the first is the reference the ratios are taken against. A
# bind's floor (benchmarks.floors) is the handoff the bind itself allows, which no
# library on it can beat; listed before ours on that bind (they run in shuffled turns).
HANDOFF_VARIANTS = [
    ("raw.handoff", "raw"),
    ("raw.handoff.timeout", "raw.timeout"),
    ("ours.handoff", "ours.engine"),
    ("floor.engine.handoff.timeout", "floor.engine.timeout"),
    ("floor.engine.contract.handoff", "floor.engine.contract"),
    ("ours.handoff.timeout", "ours.engine.timeout"),
    ("floor.connection.handoff.timeout", "floor.connection.timeout"),
    ("floor.connection.contract.handoff", "floor.connection.contract"),
    ("ours.connection.handoff.timeout", "ours.connection.timeout"),
    ("floor.session.handoff.timeout", "floor.session.timeout"),
    ("floor.session.contract.handoff", "floor.session.contract"),
    ("ours.session.handoff.timeout", "ours.session.timeout"),
    ("floor.django.handoff.timeout", "floor.django.timeout"),
    ("floor.django.contract.handoff", "floor.django.contract"),
    ("ours.django.handoff.timeout", "ours.django.timeout"),
    ("pglock.handoff.timeout", "pglock.timeout"),
    ("pals.handoff.timeout", "pals.timeout"),
    ("raw.handoff.client_polling", "raw.client_polling"),
]
SLOW_KINDS = {"raw.client_polling"}


def _clock() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _waiter_process(
    kind: str, name: str, url: str, pipe: Connection, busy: Event, cpu: int | None
) -> None:
    with ExitStack() as stack:
        try:
            client = make_client(kind, name, make_url(url), stack, on_busy=busy.set)
        except BaseException as error:
            pipe.send(("error", repr(error)))
            return
        pipe.send(("ready", 0))
        pinning = None if cpu is None else Pinning(make_url(url), cpu)
        while pipe.recv() == "go":
            try:
                release = client.take()
                acquired_at = _clock()
                release()
                if pinning is not None:
                    # After the first (warm-up) trial: the client's connections are open.
                    pinning.pin()
                    pinning = None
            except BaseException as error:
                pipe.send(("error", repr(error)))
                return
            pipe.send(("acquired", acquired_at))


@dataclass
class HandoffRun:
    """One variant: its holder here, its waiter process, and the latencies so far."""

    name: str
    kind: str
    holder: Client
    admin: psycopg.Cursor[TupleRow]
    process: Any
    pipe: Connection
    busy: Event
    latencies: list[float] = field(default_factory=list)

    @property
    def slow(self) -> bool:
        return self.kind in SLOW_KINDS

    def trial(self, *, counted: bool = True) -> None:
        release = self.holder.take()
        self.busy.clear()
        self.pipe.send("go")
        deadline = time.monotonic() + WAIT_CONFIRM_SECONDS
        while not self._waiting():
            if self.pipe.poll() or time.monotonic() > deadline:
                release()
                raise RuntimeError(f"{self.name}: the waiter never started waiting")
            time.sleep(0.0002)
        released_at = _clock()
        release()
        if not self.pipe.poll(TRIAL_SECONDS):
            raise RuntimeError(f"{self.name}: the waiter never got the lock")
        what, value = self.pipe.recv()
        if what != "acquired":
            raise RuntimeError(f"{self.name}: the waiter failed: {value}")
        if counted:
            self.latencies.append((value - released_at) / 1e9)

    def _waiting(self) -> bool:
        if self.holder.polls:
            return self.busy.is_set()
        self.admin.execute(
            "SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' "
            "AND NOT granted AND classid::int8 = %s AND objid::int8 = %s AND objsubid = %s",
            self.holder.pg_ids,
        )
        row = self.admin.fetchone()
        return row is not None and row[0] > 0

    def close(self) -> None:
        with suppress(OSError):
            self.pipe.send("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def start_runs(
    variants: list[tuple[str, str]], url: URL, stack: ExitStack, waiter_cpu: int | None = None
) -> list[HandoffRun]:
    context = multiprocessing.get_context("spawn")
    admin = raw_connection(url, stack).cursor()
    url_text = url.render_as_string(hide_password=False)
    runs = []
    for name, kind in variants:
        lock_name = f"bench.{name}"
        here, there = context.Pipe()
        busy = context.Event()
        process = context.Process(
            target=_waiter_process,
            args=(kind, lock_name, url_text, there, busy, waiter_cpu),
            name=f"waiter {name}",
            daemon=True,
        )
        process.start()
        run = HandoffRun(
            name, kind, make_client(kind, lock_name, url, stack), admin, process, here, busy
        )
        stack.callback(run.close)
        runs.append(run)
    for run in runs:
        if not run.pipe.poll(START_SECONDS):
            raise RuntimeError(f"{run.name}: the waiter process did not start")
        what, value = run.pipe.recv()
        if what != "ready":
            raise RuntimeError(f"{run.name}: the waiter process failed to start: {value}")
    return runs


def run_handoffs(
    variants: list[tuple[str, str]],
    url: URL,
    stack: ExitStack,
    *,
    rounds: int,
    trials: int,
    slow_trials: int,
    pin: bool = True,
    progress: Callable[[str], None] = lambda message: None,
) -> tuple[dict[str, list[float]], str]:
    """Latencies in seconds per variant, the variants taking turns one trial at a time,
    and how the processes were pinned.

    With ``pin`` (and two CPUs or more), the holders (this process) and their backends
    run on one CPU and each waiter process and its backend on another, as a holder and a
    waiter on two machines would: every handoff then takes the same path through the
    scheduler (the holder's backend wakes the waiter's on the other CPU), instead of
    whichever the scheduler picks (pinning alone did not steady the medians: they still
    moved by up to 0.2x of the raw one from run to run, until the variants took turns
    trial by trial, in shuffled order, and ran 1,000 trials or more). Each variant's
    first trial is a warm-up, not counted: it opens the clients' connections, whose
    backends are pinned after it."""
    cpus = os.cpu_count() or 1
    pinning = Pinning(url, 0) if pin and cpus > 1 else None
    runs = start_runs(variants, url, stack, None if pinning is None else 1)
    for run in runs:
        run.trial(counted=False)
    if pinning is None:
        described = "not pinned" + ("" if pin else " (--no-pin)")
    else:
        pinning.pin()
        stack.callback(pinning.unpin)
        described = (
            "holders and their backends pinned to CPU 0, each waiter and its backends to CPU 1"
        )
    # One trial of each variant in turn, so that every variant's trials are spread over
    # the same seconds as the reference's: the machine's wake-up latency changes from
    # one second to the next, and a block of one variant's trials would catch one state.
    # Each turn goes in a new order: a variant whose trial always came right after the
    # same other variant's would always find the caches as that one left them (in a
    # fixed order a contract floor came out faster than its own bind floor).
    order = random.Random(0)
    for number in range(rounds):
        turn = list(runs)
        counts = {
            run.name: (total := slow_trials if run.slow else trials) // rounds
            # The first rounds take any remainder.
            + (1 if number < total % rounds else 0)
            for run in turn
        }
        for index in range(max(counts.values(), default=0)):
            order.shuffle(turn)
            for run in turn:
                if index < counts[run.name]:
                    run.trial()
        progress(f"handoff round {number + 1}/{rounds} done")
    return {run.name: run.latencies for run in runs}, described


def descriptions() -> dict[str, str]:
    return {name: CLIENTS[kind] for name, kind in HANDOFF_VARIANTS}
