"""Throughput: N worker processes taking and giving back locks as fast as they can.

"one key": every worker contends for the same lock, so the figure is bounded by how fast
the server hands it from one to the next. "many keys": each worker has its own lock, so
it is bounded by each client's own cost. Every worker is a process (no shared GIL); they
start together at an agreed CLOCK_MONOTONIC instant and stop at another, and the
operations they finished in between are added up. Variants are interleaved round by
round, and every case runs right after a run of the raw reference with the same keys:
its ratio is taken against that run, never against one a minute away.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from sqlalchemy.engine import URL, make_url

from benchmarks.clients import make_client

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
    "pglock.timeout",
    "pals.timeout",
]
REFERENCE = "raw.timeout"
START_DELAY_NS = 20_000_000  # lets every worker see the start time before it comes
REPLY_SECONDS = 120.0


def _clock() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _worker(url: str, pipe: Connection) -> None:
    while True:
        command = pipe.recv()
        if command is None:
            return
        kind, name = command
        try:
            with ExitStack() as stack:
                client = make_client(kind, name, make_url(url), stack)
                client.take()()  # connect and warm up before the start
                pipe.send(("built", 0))
                start_at, stop_at = pipe.recv()
                while _clock() < start_at:
                    time.sleep(0.0005)
                operations = 0
                while _clock() < stop_at:
                    client.take()()
                    operations += 1
            pipe.send(("done", operations))
        except BaseException as error:
            pipe.send(("error", repr(error)))


def _answer(pipe: Connection, expected: str, what: str, seconds: float) -> int:
    if not pipe.poll(seconds):
        raise RuntimeError(f"throughput {what}: a worker did not answer")
    answer, value = pipe.recv()
    if answer != expected:
        raise RuntimeError(f"throughput {what}: a worker failed: {value}")
    return int(value)


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


def run_throughput(
    url: URL,
    *,
    workers: int,
    seconds: float,
    rounds: int,
    kinds: list[str] = THROUGHPUT_KINDS,
    progress: Callable[[str], None] = lambda message: None,
) -> list[ThroughputResult]:
    context = multiprocessing.get_context("spawn")
    url_text = url.render_as_string(hide_password=False)
    pipes: list[Connection] = []
    processes: list[Any] = []
    for _ in range(workers):
        here, there = context.Pipe()
        process = context.Process(target=_worker, args=(url_text, there), daemon=True)
        process.start()
        pipes.append(here)
        processes.append(process)
    # Every case runs right after a run of the reference with the same keys, and its
    # ratio is taken against that run: on a shared VM the machine's speed drifts over
    # seconds, so a reference measured a minute earlier says little.
    others = [kind for kind in kinds if kind != REFERENCE]
    cases = [(kind, keys) for keys in ("one", "many") for kind in others]
    samples: dict[tuple[str, str], list[float]] = {
        (kind, keys): [] for keys in ("one", "many") for kind in kinds
    }
    ratios: dict[tuple[str, str], list[float]] = {case: [] for case in cases}

    def measure(kind: str, keys: str) -> float:
        what = f"{kind}/{keys}"
        for index, pipe in enumerate(pipes):
            name = f"bench.throughput.{kind}" + (f".{index}" if keys == "many" else "")
            pipe.send((kind, name))
        for pipe in pipes:
            _answer(pipe, "built", what, REPLY_SECONDS)
        start_at = _clock() + START_DELAY_NS
        stop_at = start_at + int(seconds * 1e9)
        for pipe in pipes:
            pipe.send((start_at, stop_at))
        total = sum(_answer(pipe, "done", what, REPLY_SECONDS + seconds) for pipe in pipes)
        return total / seconds

    try:
        for number in range(rounds):
            shift = number % len(cases)
            for kind, keys in [*cases[shift:], *cases[:shift]]:
                reference = measure(REFERENCE, keys)
                mine = measure(kind, keys)
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
                )
            )
    return results
