"""What lock events cost: client CPU per Engine lock ``acquire(timeout)`` + ``release``.

``python -m benchmarks.events_overhead --before DIR [--rounds N] [--ops N] [--variants ...]``

Each variant runs in a worker process of its own, started once and kept warm; the rounds
alternate between the workers (A B C ..., then B C ... A), so the machine's drift lands on
all alike, and each round's ratio to the first variant is taken within that round:

- ``before``: the package as it is in DIR (e.g. ``git archive <commit> advisory_locks |
  tar -x -C DIR``), the code without events; ``again``: the same, in a second worker (the
  ratio two processes running the same code show: the noise floor);
- ``none``: this tree, no listener (what every application without monitoring runs);
- ``noop``: this tree, one listener that does nothing (the cost of building events);
- ``otel``: this tree with ``advisory_locks.opentelemetry.instrument()`` on the SDK
  (only when the SDK is installed).

CPU is this thread's CPU time (``time.thread_time_ns``) over a batch of operations: the
client's own cost, unlike wall time, does not depend on how fast the kernel wakes a
process waiting on its socket.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.postgres import database_url

WORKER = r"""
import json, os, sys, time
from sqlalchemy import create_engine
import advisory_locks
from advisory_locks import advisory_lock

url, variant = sys.argv[1], sys.argv[2]
if variant == "noop":
    from advisory_locks import events
    events.subscribe(lambda event: None)
elif variant == "otel":
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from advisory_locks import opentelemetry
    opentelemetry.instrument(
        meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
        tracer_provider=TracerProvider(),
    )
engine = create_engine(url)
name = f"bench-events-{variant}-{os.getpid()}"
print(json.dumps({"package": advisory_locks.__file__}), flush=True)
for line in sys.stdin:
    operations = int(line)
    cpu_started = time.thread_time_ns()
    for _ in range(operations):
        lock = advisory_lock(engine, name, timeout=5)
        lock.acquire()
        lock.release()
    cpu = time.thread_time_ns() - cpu_started
    print(json.dumps({"cpu_us": cpu / operations / 1000}), flush=True)
"""


def _worker(variant: str, tree: Path, url: str) -> subprocess.Popen[str]:
    environment = dict(os.environ, PYTHONPATH=str(tree))
    # Variants differ only in code, not in hashing or in where names fall in dicts.
    environment["PYTHONHASHSEED"] = "0"
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, url, variant],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tree,
        env=environment,
    )
    assert worker.stdout is not None
    package = json.loads(worker.stdout.readline())["package"]
    if not Path(package).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{variant}: imported {package}, not the package in {tree}")
    return worker


def _measure(worker: subprocess.Popen[str], operations: int) -> float:
    assert worker.stdin is not None
    assert worker.stdout is not None
    worker.stdin.write(f"{operations}\n")
    worker.stdin.flush()
    return float(json.loads(worker.stdout.readline())["cpu_us"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="tree of the code before")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", type=int, default=2000, help="operations per round")
    parser.add_argument(
        "--variants",
        default="before,again,none,noop,otel",
        help="comma-separated, the first is the base",
    )
    arguments = parser.parse_args(argv)
    url = database_url().render_as_string(hide_password=False)
    here = Path(__file__).resolve().parents[1]
    # "again" is the code before in a second process: how far two processes running the
    # same code drift apart (an A/A run), the noise floor of every other ratio.
    variants = {"before": arguments.before, "again": arguments.before, "none": here, "noop": here}
    try:
        import opentelemetry.sdk  # noqa: F401

        variants["otel"] = here
    except ImportError:
        print("opentelemetry-sdk not installed: no otel variant", file=sys.stderr)
    wanted = arguments.variants.split(",")
    variants = {variant: variants[variant] for variant in wanted if variant in variants}
    workers = {variant: _worker(variant, tree, url) for variant, tree in variants.items()}
    names = list(workers)
    samples: dict[str, list[float]] = {name: [] for name in names}
    try:
        for variant in names:  # warm up: connections, caches, the first-use imports
            _measure(workers[variant], arguments.ops // 4 or 1)
        for round_number in range(arguments.rounds):
            order = names[round_number % len(names) :] + names[: round_number % len(names)]
            for variant in order:
                samples[variant].append(_measure(workers[variant], arguments.ops))
    finally:
        for worker in workers.values():
            assert worker.stdin is not None
            worker.stdin.close()
            worker.wait()
    baseline = samples[names[0]]
    print(f"Engine lock acquire(timeout=5) + release, {arguments.rounds} rounds x {arguments.ops}")
    print(f"{'variant':8} {'cpu us/op (median)':>18} {'min':>8} {'max':>8} {'x ' + names[0]:>9}")
    for variant in names:
        values = samples[variant]
        ratio = statistics.median(v / b for v, b in zip(values, baseline, strict=True))
        print(
            f"{variant:8} {statistics.median(values):18.1f} {min(values):8.1f} "
            f"{max(values):8.1f} {ratio:9.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
