"""What leaving the lock statements unprepared costs: the twin's two statements on two raw
psycopg connections, one that prepares them (the twin's, psycopg's default threshold
reached) and one that never does (``prepare_threshold=None``, as Django opens its
connections unless ``OPTIONS`` say otherwise).

``python -m benchmarks.prepared [--rounds N] [--ops N]``

Why: Django's bind floor (``floor.django.timeout``) runs only 1.07x the twin's client
instructions but costs much more of its CPU time, and a library that leaves Django's
connection as the application configured it sends its statements unprepared too. This
measures that part of the floor alone, with nothing of Django's: client CPU and wall time
per acquire(timeout) + release, the two connections taking turns in rounds, the client
and both backends pinned to one CPU as ``benchmarks.run`` pins them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack
from typing import Any

import psycopg

from benchmarks.pinning import Pinning
from benchmarks.postgres import database_url, raw_connection
from benchmarks.uncontended import RAW_KEY_BASE, TIMEOUT_LOCK_SQL, TIMEOUT_SECONDS, UNLOCK_SQL

__all__ = ["main"]

KEY = RAW_KEY_BASE + 90
TIMEOUT_MS = str(TIMEOUT_SECONDS * 1000)


def _round(cursor: psycopg.Cursor[Any], key: int, ops: int) -> tuple[float, float]:
    lock_params, unlock_params = (key, TIMEOUT_MS), (key,)
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(ops):
        cursor.execute(TIMEOUT_LOCK_SQL, lock_params)
        cursor.fetchone()
        cursor.execute(UNLOCK_SQL, unlock_params)
        cursor.fetchone()
    return (time.thread_time() - cpu) / ops, (time.perf_counter() - wall) / ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prepared", description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ops", type=int, default=300, help="operations per round")
    arguments = parser.parse_args(argv)
    url = database_url()
    with ExitStack() as stack:
        cursors = {
            "prepared (the twin)": psycopg.Cursor(raw_connection(url, stack, prepare_threshold=0)),
            "unprepared (prepare_threshold=None)": psycopg.Cursor(
                raw_connection(url, stack, prepare_threshold=None)
            ),
        }
        pinning = Pinning(url)
        pinning.pin()
        stack.callback(pinning.unpin)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cursors}
        for offset, cursor in enumerate(cursors.values()):
            _round(cursor, KEY + offset, 50)  # warm up; the first prepares
        for _ in range(arguments.rounds):
            for offset, (name, cursor) in enumerate(cursors.items()):
                samples[name].append(_round(cursor, KEY + offset, arguments.ops))
        print(f"# {pinning.describe()}; {arguments.rounds} rounds x {arguments.ops} operations")
        print(f"{'connection':38} {'cpu us':>8} {'wall us':>8}")
        base = None
        for name, pairs in samples.items():
            cpu = statistics.median(pair[0] for pair in pairs) * 1e6
            wall = statistics.median(pair[1] for pair in pairs) * 1e6
            base = base or (cpu, wall)
            print(f"{name:38} {cpu:8.1f} {wall:8.1f}   {cpu / base[0]:.2f}x {wall / base[1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
