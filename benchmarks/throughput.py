"""Throughput: N worker processes taking and giving back locks as fast as they can.

"one key": every worker contends for the same lock, so the figure is bounded by how fast
the server hands it from one to the next. "many keys": each worker has its own lock, so
it is bounded by each client's own cost. Every worker is a process (no shared GIL).

A case is always measured against the raw reference in the same stretch of time: every
worker builds both clients, then they all run them in turns of short slots that start
and stop at agreed CLOCK_MONOTONIC instants, in the order reference, case, case,
reference, reference, case, ... (so a machine that speeds up or slows down over the
stretch weighs on both alike), and the round's ratio is the case's operations over the
reference's. On a shared VM the machine's speed drifts over seconds; a reference run
half a second away from its case already differs from it by 0.1x or more.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from sqlalchemy.engine import URL, make_url

from benchmarks.clients import Take, make_client
from benchmarks.pinning import Pinning

__all__ = ["THROUGHPUT_KINDS", "ThroughputResult", "run_throughput"]

# Each bind's floor (benchmarks.floors) runs right before ours on that bind: what the
# bind itself leaves of the raw throughput, which no library on it can exceed.
THROUGHPUT_KINDS = [
    "raw.timeout",
    "floor.engine.timeout",
    "floor.engine.contract",
    "ours.engine.timeout",
    "floor.connection.timeout",
    "floor.connection.contract",
    "ours.connection.timeout",
    "floor.session.timeout",
    "floor.session.contract",
    "ours.session.timeout",
    "floor.django.timeout",
    "floor.django.contract",
    "ours.django.timeout",
    "floor.psycopg.contract",
    "ours.psycopg.timeout",
    # The pool bind is judged against its own twin (the pool by hand), each measured
    # against the reference like every case.
    "raw.psycopg_pool.timeout",
    "ours.psycopg_pool.timeout",
    # So are asyncpg's connection and pool, each against its twin by hand, with their
    # contract floors; these six are asyncio clients, run in the worker's event loop.
    "raw.asyncpg.timeout",
    "floor.asyncpg.contract",
    "ours.asyncpg.timeout",
    "raw.asyncpg_pool.timeout",
    "floor.asyncpg_pool.contract",
    "ours.asyncpg_pool.timeout",
    "pglock.timeout",
    "pals.timeout",
]
REFERENCE = "raw.timeout"
START_DELAY_NS = 20_000_000  # lets every worker see the start time before it comes
REPLY_SECONDS = 120.0


def _clock() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _worker(url: str, pipe: Connection, cpu: int | None) -> None:
    pinning = None if cpu is None else Pinning(make_url(url), cpu)
    while True:
        command = pipe.recv()
        if command is None:
            return
        try:
            with ExitStack() as stack:
                clients = []
                for kind, name in command:
                    client = make_client(kind, name, make_url(url), stack)
                    client.take()()  # connect and warm up before the start
                    clients.append(client)
                if pinning is not None:
                    pinning.pin()  # this worker and its backends on its CPU
                pipe.send(("built", 0))
                counts = []
                for side, start_at, stop_at in pipe.recv():
                    client = clients[side]
                    while _clock() < start_at:  # only the first slot waits
                        time.sleep(0.0005)
                    if client.operation is not None and client.loop is not None:
                        operations = client.loop.run_until_complete(
                            _async_slot(client.operation, stop_at)
                        )
                    else:
                        operations = _slot(client.take, stop_at)
                    counts.append(operations)
            pipe.send(("done", counts))
        except BaseException as error:
            pipe.send(("error", repr(error)))


def _slot(take: Take, stop_at: int) -> int:
    operations = 0
    while _clock() < stop_at:
        take()()
        operations += 1
    return operations


async def _async_slot(operation: Callable[[], Awaitable[None]], stop_at: int) -> int:
    """An asyncio client's slot: its operations awaited one after another in one task."""
    operations = 0
    while _clock() < stop_at:
        await operation()
        operations += 1
    return operations


def _answer(pipe: Connection, expected: str, what: str, seconds: float) -> Any:
    if not pipe.poll(seconds):
        raise RuntimeError(f"throughput {what}: a worker did not answer")
    answer, value = pipe.recv()
    if answer != expected:
        raise RuntimeError(f"throughput {what}: a worker failed: {value}")
    return value


@dataclass
class ThroughputResult:
    name: str
    kind: str
    keys: str
    workers: int
    # Operations per second, one figure per round.
    rounds: list[float]
    ops_per_second: float
    ratio_to_raw: float | None
    # The ratio to the reference, one figure per round (empty for the reference).
    round_ratios: list[float] = field(default_factory=list)


def slot_plan(start_at: int, seconds: float, slots: int) -> list[tuple[int, int, int]]:
    """(side, start, stop) in ns: ``slots`` turns of each side (an even number) in the
    order 0 1 1 0 0 1 1 0 ..., ``seconds`` in all per side."""
    length = int(seconds * 1e9) // slots
    plan = []
    at = start_at
    for turn in range(slots):
        for side in (0, 1) if turn % 2 == 0 else (1, 0):
            plan.append((side, at, at + length))
            at += length
    return plan


def run_throughput(
    url: URL,
    *,
    workers: int,
    seconds: float,
    rounds: int,
    slots: int = 10,
    pin: bool = True,
    kinds: list[str] = THROUGHPUT_KINDS,
    progress: Callable[[str], None] = lambda message: None,
) -> list[ThroughputResult]:
    """Per case and round, ``seconds`` of the case and as much of the reference, in
    ``slots`` turns each (rounded up to an even number)."""
    slots += slots % 2
    context = multiprocessing.get_context("spawn")
    url_text = url.render_as_string(hide_password=False)
    pipes: list[Connection] = []
    processes: list[Any] = []
    cpus = os.cpu_count() or 1
    for index in range(workers):
        here, there = context.Pipe()
        cpu = index % cpus if pin and cpus > 1 else None
        process = context.Process(target=_worker, args=(url_text, there, cpu), daemon=True)
        process.start()
        pipes.append(here)
        processes.append(process)
    others = [kind for kind in kinds if kind != REFERENCE]
    cases = [(kind, keys) for keys in ("one", "many") for kind in others]
    samples: dict[tuple[str, str], list[float]] = {
        (kind, keys): [] for keys in ("one", "many") for kind in kinds
    }
    ratios: dict[tuple[str, str], list[float]] = {case: [] for case in cases}

    def measure(kind: str, keys: str) -> tuple[float, float]:
        """Operations per second of the reference and of ``kind``, in alternating slots."""
        what = f"{kind}/{keys}"
        for index, pipe in enumerate(pipes):
            suffix = f".{index}" if keys == "many" else ""
            pipe.send([(side, f"bench.throughput.{side}{suffix}") for side in (REFERENCE, kind)])
        for pipe in pipes:
            _answer(pipe, "built", what, REPLY_SECONDS)
        plan = slot_plan(_clock() + START_DELAY_NS, seconds, slots)
        for pipe in pipes:
            pipe.send(plan)
        totals = [0, 0]
        for pipe in pipes:
            for (side, _, _), operations in zip(
                plan, _answer(pipe, "done", what, REPLY_SECONDS + 2 * seconds), strict=True
            ):
                totals[side] += operations
        return totals[0] / seconds, totals[1] / seconds

    try:
        for number in range(rounds):
            shift = number % len(cases)
            for kind, keys in [*cases[shift:], *cases[:shift]]:
                reference, mine = measure(kind, keys)
                samples[(REFERENCE, keys)].append(reference)
                samples[(kind, keys)].append(mine)
                ratios[(kind, keys)].append(mine / reference)
            progress(f"throughput round {number + 1}/{rounds} done")
    finally:
        for pipe in pipes:
            with suppress(OSError):
                pipe.send(None)
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    results = []
    for keys in ("one", "many"):
        for kind in kinds:
            per_round = samples[(kind, keys)]
            if not per_round:
                continue
            results.append(
                ThroughputResult(
                    name=f"{kind} [{keys} key{'s' if keys == 'many' else ''}]",
                    kind=kind,
                    keys=keys,
                    workers=workers,
                    rounds=per_round,
                    ops_per_second=statistics.median(per_round),
                    ratio_to_raw=(
                        1.0 if kind == REFERENCE else statistics.median(ratios[(kind, keys)])
                    ),
                    round_ratios=ratios.get((kind, keys), []),
                )
            )
    return results
