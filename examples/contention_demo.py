"""Two "pods" run the same cron job at once; a PostgreSQL advisory lock lets one through.

    .venv/bin/python examples/contention_demo.py     # the local server, or pgserver
    DATABASE_URL=postgresql+psycopg://user@host/db .venv/bin/python examples/contention_demo.py

(``python3 dev.py demo`` sets up .venv; without a PostgreSQL server on 127.0.0.1:5432,
``pip install pgserver`` gives an embedded one, CPython 3.10-3.12.)

Three scenes, each with real processes and their own connections:

1. both pods start the job with ``timeout=0``: one runs it, the other skips at once;
2. the second pod waits instead (``timeout=None``): the server wakes it when the first
   pod releases, and we print how long the handoff took;
3. the pod holding the lock is killed with SIGKILL: the server frees the lock with the
   dead connection, and the waiting pod runs.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event

from sqlalchemy import create_engine

from advisory_locks import advisory_lock

LOCAL_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
JOB = "nightly-report"


def pod(
    url: str,
    label: str,
    timeout: float | None,
    started: Event,
    hold: Event,
    moments: Synchronized[float] | None = None,
) -> None:
    """One worker process: take the job lock, signal, and hold it until told to stop.

    ``moments`` receives, on this machine's monotonic clock (shared by all processes),
    the instant this pod began releasing or was granted the lock.
    """
    engine = create_engine(url, pool_size=1)
    lock = advisory_lock(engine, JOB, timeout=timeout)
    if not lock.acquire():
        print(f"  {label}: the job is running elsewhere, skipping", flush=True)
        return
    if moments is not None:
        moments.value = time.perf_counter()
    print(f"  {label}: got the lock, running the job", flush=True)
    started.set()
    hold.wait(30)
    if moments is not None:
        moments.value = time.perf_counter()
    lock.release()
    print(f"  {label}: done, lock released", flush=True)


def scene_skip(url: str, ctx: multiprocessing.context.SpawnContext) -> None:
    print("\n1. Two pods start the job together, timeout=0 (skip when busy)")
    started, hold = ctx.Event(), ctx.Event()
    first = ctx.Process(target=pod, args=(url, "pod-a", 0, started, hold))
    first.start()
    started.wait(30)
    unused_started, unused_hold = ctx.Event(), ctx.Event()
    second = ctx.Process(target=pod, args=(url, "pod-b", 0, unused_started, unused_hold))
    second.start()
    second.join(30)
    hold.set()
    first.join(30)


def scene_wait(url: str, ctx: multiprocessing.context.SpawnContext) -> None:
    print("\n2. pod-b waits instead (timeout=None): the server wakes it on release")
    started_a, hold_a = ctx.Event(), ctx.Event()
    started_b, hold_b = ctx.Event(), ctx.Event()
    released, granted = ctx.Value("d", 0.0), ctx.Value("d", 0.0)
    first = ctx.Process(target=pod, args=(url, "pod-a", None, started_a, hold_a, released))
    first.start()
    started_a.wait(30)
    second = ctx.Process(target=pod, args=(url, "pod-b", None, started_b, hold_b, granted))
    second.start()
    time.sleep(0.5)  # let pod-b reach the server's wait queue; only for the narrative
    hold_a.set()
    started_b.wait(30)
    hold_b.set()
    for process in (first, second):
        process.join(30)
    handoff_ms = (granted.value - released.value) * 1000
    print(f"  handoff: pod-b ran {handoff_ms:.2f} ms after pod-a began releasing")


def scene_kill(url: str, ctx: multiprocessing.context.SpawnContext) -> None:
    print("\n3. pod-a is killed with SIGKILL while holding the lock")
    started_a, hold_a = ctx.Event(), ctx.Event()
    started_b, hold_b = ctx.Event(), ctx.Event()
    first = ctx.Process(target=pod, args=(url, "pod-a", None, started_a, hold_a))
    first.start()
    started_a.wait(30)
    second = ctx.Process(target=pod, args=(url, "pod-b", None, started_b, hold_b))
    second.start()
    time.sleep(0.5)
    assert first.pid is not None
    killed = time.perf_counter()
    os.kill(first.pid, signal.SIGKILL)
    print("  pod-a: killed", flush=True)
    granted = started_b.wait(30)
    after = (time.perf_counter() - killed) * 1000
    print(f"  pod-b {'ran' if granted else 'did NOT run'} {after:.0f} ms after the kill")
    hold_b.set()
    for process in (first, second):
        process.join(30)


@contextlib.contextmanager
def database_url(explicit: str | None) -> Iterator[str]:
    """DATABASE_URL, else the local server, else an embedded PostgreSQL (pgserver)."""
    if explicit:
        yield explicit
        return
    with socket.socket() as probe:
        probe.settimeout(1)
        if probe.connect_ex(("127.0.0.1", 5432)) == 0:
            yield LOCAL_SERVER
            return
    try:
        import pgserver  # type: ignore[import-not-found]
    except ImportError:
        sys.exit(
            "No PostgreSQL found: set DATABASE_URL, start a local server on 127.0.0.1:5432, "
            "or install the embedded one (pip install pgserver; Python 3.10-3.12)."
        )
    with tempfile.TemporaryDirectory(prefix="advisory-locks-demo-") as folder:
        server = pgserver.get_server(folder, cleanup_mode="stop")
        print("(using an embedded PostgreSQL in a temporary folder)")
        yield server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL"))
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    with database_url(args.database_url) as url:
        scene_skip(url, ctx)
        scene_wait(url, ctx)
        scene_kill(url, ctx)


if __name__ == "__main__":
    main()
