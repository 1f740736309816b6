"""Lease lock benchmarks: round trips, handoff latency, batched renewal, against a
Locker-style implementation measured in the same run.

    python -m benchmarks.leases [--operations 500] [--trials 200] [--poll-trials 20]
                                [--leases 10000] [--json PATH]

The server is the one ``benchmarks.run`` uses (``$ADVISORY_LOCKS_TEST_POSTGRES_URL``, else
the local test server), always through psycopg 3. What is measured:

- **Round trips** of ``with lease_lock(engine, name, timeout=0): pass``, counted by the
  kernel (data segments the Engine's one pooled connection sent, ``round_trips.py``), and
  of the Locker-style acquire + release on a raw connection.
- **Handoff**: a holder (this process) releases while a waiter in another process is
  blocked in ``acquire()``; latency = CLOCK_MONOTONIC right after the waiter's acquire
  returns minus right before the holder's release call (one clock for every process of
  a host). Variants: ours with NOTIFY; ours polling (the Engine declared behind a
  transaction pooler, so no LISTEN); Locker-style (a fixed 0.5 s poll). For the polling
  variants the holder releases at a random moment, uniform over 2 s after the waiter's
  first failed attempt, as a release happens at any phase of a poll in production. The
  NOTIFY variant also times, inside the waiter process, when the listener thread woke
  the waiter (``profile``), splitting the latency into the holder's release round trip,
  NOTIFY delivery + listener wake-up, and the waiter's retry statement.
- **Renewal**: one process holds ``--leases`` leases (ttl 6 s, renewed every 2 s); the
  statements the renewer sends over three periods are counted (and the TCP segments its
  connection sent: one statement carrying 10,000 names spans several), and the time one
  batch renewal statement takes is measured; against Locker-style renewal, one UPDATE per
  lease per period, whose time per period is measured.

The rows this benchmark creates (names ``bench-lease:*``, table ``bench_locker``) are
deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url

from advisory_locks import lease_lock
from advisory_locks.sqlalchemy import create_lease_table
from benchmarks.postgres import database_url, raw_connection, server_version
from benchmarks.round_trips import data_segments_out

__all__ = ["main", "run_lease_benchmarks"]

PREFIX = "bench-lease:"
LOCKER_TABLE = "bench_locker"
LOCKER_POLL = 0.5
POLL_RELEASE_SPREAD = 2.0
TRIAL_SECONDS = 30.0
START_SECONDS = 60.0
RENEW_TTL = 6.0
RENEW_EVERY = 2.0
RENEW_PERIODS = 3
TRANSACTION_POOLER = {"advisory_locks_pooler": "transaction"}


def _clock() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# -- a Locker-style lease: the Ruby gem's design, for comparison -----------------------------


class LockerStyle:
    """The Locker gem's lease on a raw autocommit connection: a row per key with
    ``locked_by``, ``locked_until`` and ``sequence``; acquire is a conditional UPDATE
    (the row is created once), waiters re-try every 0.5 s, each held lock renews itself
    with its own UPDATE. The database's clock is used here (the gem uses the client's)."""

    CREATE = f"""
    CREATE TABLE IF NOT EXISTS {LOCKER_TABLE} (
        key varchar(255) PRIMARY KEY, locked_by varchar(255), locked_at timestamptz,
        locked_until timestamptz, sequence bigint NOT NULL DEFAULT 0
    )"""
    ACQUIRE = f"""
    UPDATE {LOCKER_TABLE} SET locked_by = %s, locked_at = clock_timestamp(),
        locked_until = clock_timestamp() + %s * interval '1 second', sequence = sequence + 1
    WHERE key = %s AND (locked_by IS NULL OR locked_until < clock_timestamp())
    RETURNING sequence"""
    RENEW = f"""
    UPDATE {LOCKER_TABLE} SET locked_until = clock_timestamp() + %s * interval '1 second'
    WHERE key = %s AND locked_by = %s"""
    RELEASE = f"UPDATE {LOCKER_TABLE} SET locked_by = NULL WHERE key = %s AND locked_by = %s"

    def __init__(self, connection: psycopg.Connection[TupleRow]) -> None:
        self.connection = connection
        self.cursor = connection.cursor()
        self.me = f"locker:{uuid.uuid4().hex[:8]}"

    def ensure_key(self, key: str) -> None:
        self.cursor.execute(
            f"INSERT INTO {LOCKER_TABLE} (key) VALUES (%s) ON CONFLICT DO NOTHING", (key,)
        )

    def try_acquire(self, key: str, ttl: float) -> bool:
        self.cursor.execute(self.ACQUIRE, (self.me, ttl, key))
        return self.cursor.fetchone() is not None

    def acquire(self, key: str, ttl: float, on_busy: Callable[[], None] | None = None) -> None:
        while not self.try_acquire(key, ttl):
            if on_busy is not None:
                on_busy()
                on_busy = None
            time.sleep(LOCKER_POLL)

    def renew(self, key: str, ttl: float) -> None:
        self.cursor.execute(self.RENEW, (ttl, key, self.me))

    def release(self, key: str) -> None:
        self.cursor.execute(self.RELEASE, (key, self.me))


# -- round trips ---------------------------------------------------------------------------


def _engine_socket(engine: Engine) -> int:
    fairy = engine.raw_connection()
    try:
        dbapi: Any = fairy.dbapi_connection
        return int(dbapi.pgconn.socket)
    finally:
        fairy.close()


def _segments_per_operation(
    fd: int, operations: int, operation: Callable[[], None]
) -> tuple[float, float]:
    """Round trips (data segments ``fd`` sent) and seconds, per operation."""
    operation()  # warm: statements prepared, rows created
    before = data_segments_out(fd)
    started = time.perf_counter()
    for _ in range(operations):
        operation()
    elapsed = time.perf_counter() - started
    after = data_segments_out(fd)
    if before is None or after is None:
        return float("nan"), elapsed / operations
    return round((after - before) / operations, 2), elapsed / operations


def round_trips(url: URL, operations: int, stack: ExitStack) -> dict[str, Any]:
    engine = create_engine(url, pool_size=1, max_overflow=0)
    stack.callback(engine.dispose)
    fd = _engine_socket(engine)
    name = f"{PREFIX}round-trips:{uuid.uuid4().hex[:8]}"

    def ours() -> None:
        with lease_lock(engine, name, timeout=0):
            pass

    ours_trips, ours_time = _segments_per_operation(fd, operations, ours)
    locker = LockerStyle(raw_connection(url, stack))
    key = f"{PREFIX}round-trips-locker"
    locker.ensure_key(key)

    def theirs() -> None:
        assert locker.try_acquire(key, 30.0)
        locker.release(key)

    locker_trips, locker_time = _segments_per_operation(
        locker.connection.pgconn.socket, operations, theirs
    )
    return {
        "ours.acquire+release": {"round_trips": ours_trips, "ms": _ms(ours_time)},
        "locker.acquire+release": {"round_trips": locker_trips, "ms": _ms(locker_time)},
    }


# -- handoff -------------------------------------------------------------------------------


def _waiter(kind: str, url_text: str, name: str, pipe: Connection, busy: Event) -> None:
    """The waiting side, in its own process: on "go", acquire (blocking), report when."""
    url = make_url(url_text)
    woken: list[int] = []
    if kind.startswith("locker"):
        connection = psycopg.connect(
            **url.translate_connect_args(username="user", database="dbname"), autocommit=True
        )
        locker = LockerStyle(connection)
        pipe.send(("ready", 0, 0))
        while pipe.recv() == "go":
            locker.acquire(name, 30.0, on_busy=busy.set)
            acquired_at = _clock()
            locker.release(name)
            pipe.send(("acquired", acquired_at, 0))
        return
    options = {"execution_options": TRANSACTION_POOLER} if kind == "ours.poll" else {}
    engine = create_engine(url, **options)
    # Each attempt borrows a pooled connection and gives it back: the first check-in after
    # "go" means the waiter found the lease held and is now waiting.
    event.listen(engine, "checkin", lambda *_: busy.set())
    if kind == "ours.notify":
        from advisory_locks._core import listener

        wake = listener.ReleaseListener._wake

        def timed_wake(self: Any, names: list[str]) -> None:
            if names:
                woken.append(_clock())
            wake(self, names)

        listener.ReleaseListener._wake = timed_wake  # type: ignore[method-assign]
    pipe.send(("ready", 0, 0))
    while pipe.recv() == "go":
        woken.clear()
        lease = lease_lock(engine, name, ttl=30.0, timeout=TRIAL_SECONDS)
        if not lease.acquire():
            pipe.send(("error", "not acquired", 0))
            return
        acquired_at = _clock()
        lease.release()
        pipe.send(("acquired", acquired_at, woken[0] if woken else 0))
    engine.dispose()


@contextmanager
def _waiter_process(kind: str, url: URL, name: str) -> Iterator[tuple[Connection, Event]]:
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    busy = context.Event()
    process = context.Process(
        target=_waiter, args=(kind, url.render_as_string(hide_password=False), name, there, busy)
    )
    process.start()
    try:
        if not here.poll(START_SECONDS) or here.recv()[0] != "ready":
            raise RuntimeError(f"{kind}: the waiter process did not start")
        yield here, busy
    finally:
        with suppress(OSError):
            here.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def handoff(url: URL, kind: str, trials: int, stack: ExitStack) -> dict[str, Any]:
    name = f"{PREFIX}handoff:{kind}:{uuid.uuid4().hex[:8]}"
    polls = kind != "ours.notify"
    if kind.startswith("locker"):
        holder_locker = LockerStyle(raw_connection(url, stack))
        holder_locker.ensure_key(name)

        def take() -> Callable[[], None]:
            holder_locker.acquire(name, 30.0)
            return lambda: holder_locker.release(name)

    else:
        engine = create_engine(url)
        stack.callback(engine.dispose)

        def take() -> Callable[[], None]:
            lease = lease_lock(engine, name, ttl=30.0, timeout=TRIAL_SECONDS)
            assert lease.acquire()
            return lease.release

    latencies: list[float] = []
    release_trips: list[float] = []
    woken_after: list[float] = []
    rng = random.Random(13)
    with _waiter_process(kind, url, name) as (pipe, busy):
        for _ in range(trials):
            release = take()
            busy.clear()
            pipe.send("go")
            if not busy.wait(TRIAL_SECONDS):
                raise RuntimeError(f"{kind}: the waiter never started waiting")
            if polls:
                time.sleep(rng.uniform(0.0, POLL_RELEASE_SPREAD))
            released_at = _clock()
            release()
            returned_at = _clock()
            if not pipe.poll(TRIAL_SECONDS):
                raise RuntimeError(f"{kind}: the waiter never got the lease")
            what, acquired_at, woken_at = pipe.recv()
            if what != "acquired":
                raise RuntimeError(f"{kind}: the waiter failed: {acquired_at}")
            latencies.append((acquired_at - released_at) / 1e9)
            release_trips.append((returned_at - released_at) / 1e9)
            if woken_at:
                woken_after.append((woken_at - released_at) / 1e9)
    result: dict[str, Any] = {
        "trials": trials,
        "p50_ms": _ms(statistics.median(latencies)),
        "p90_ms": _ms(_percentile(latencies, 0.9)),
        "max_ms": _ms(max(latencies)),
    }
    if woken_after:
        result["profile_p50_ms"] = {
            "holder release call": _ms(statistics.median(release_trips)),
            "release -> listener woke the waiter": _ms(statistics.median(woken_after)),
            "listener wake -> waiter acquired (retry)": _ms(
                statistics.median(
                    lat - woke for lat, woke in zip(latencies, woken_after, strict=False)
                )
            ),
        }
    return result


# -- renewal -------------------------------------------------------------------------------


def renewal(url: URL, leases: int, stack: ExitStack) -> dict[str, Any]:
    from advisory_locks._bindings.sqlalchemy_lease import lease_site
    from advisory_locks._core.executors import DBAPIExecutor
    from advisory_locks._core.steps import on, run_steps

    engine = create_engine(url, pool_size=1, max_overflow=0)
    stack.callback(engine.dispose)
    opened: list[Any] = []
    # The renewer's pool is a copy of the Engine's (same events): its connection shows up.
    event.listen(engine, "connect", lambda dbapi, _record: opened.append(dbapi))
    main_fd = _engine_socket(engine)
    # Statements the renewer sends, counted where they are made: one renew() is one
    # statement (a big one spans several TCP segments, so segments are reported apart).
    site = lease_site(engine)
    counted = {"renew": 0, "rows": 0}
    for method in counted:
        original = getattr(site.backend, method)

        def counting(*arguments: Any, _original: Any = original, _method: str = method) -> Any:
            counted[_method] += 1
            return _original(*arguments)

        setattr(site.backend, method, counting)
    run = uuid.uuid4().hex[:8]
    held = []
    started = time.perf_counter()
    for number in range(leases):
        lease = lease_lock(
            engine, f"{PREFIX}renew:{run}:{number}", ttl=RENEW_TTL, renew_every=RENEW_EVERY,
            timeout=0,
        )  # fmt: skip
        assert lease.acquire()
        held.append(lease)
    acquire_seconds = time.perf_counter() - started
    time.sleep(RENEW_EVERY)  # the renewer has its connection and its rhythm by now
    renewer_fds = [
        int(connection.pgconn.socket)
        for connection in opened
        if not connection.closed and int(connection.pgconn.socket) != main_fd
    ]

    def sent() -> int:
        return sum(data_segments_out(fd) or 0 for fd in renewer_fds)

    before = sent()
    statements_before = sum(counted.values())
    time.sleep(RENEW_PERIODS * RENEW_EVERY)
    segments_per_period = (sent() - before) / RENEW_PERIODS
    statements_per_period = (sum(counted.values()) - statements_before) / RENEW_PERIODS
    alive = sum(lease.held for lease in held)
    # One batch renewal statement of every lease, timed on a connection of its own.
    connection = raw_connection(url, stack)
    executor = DBAPIExecutor(connection)
    triples = [(h.lease_name, h._holding.holder, h._holding.token) for h in held]  # type: ignore[union-attr]
    batch_times = []
    for _ in range(3):
        batch_started = time.perf_counter()
        for start in range(0, len(triples), site.backend.renew_batch_size):
            chunk = triples[start : start + site.backend.renew_batch_size]
            run_steps(on(executor, site.backend.renew(chunk, RENEW_TTL)))
        batch_times.append(time.perf_counter() - batch_started)
    for lease in held:
        lease.release()
    # Locker-style: one UPDATE per held lock per period (the gem runs a thread per lock;
    # one loop on one connection here is the cheapest form of the same statements).
    locker = LockerStyle(raw_connection(url, stack))
    keys = [f"{PREFIX}renew-locker:{run}:{number}" for number in range(leases)]
    with locker.connection.transaction():
        locker.cursor.executemany(
            f"INSERT INTO {LOCKER_TABLE} (key) VALUES (%s) ON CONFLICT DO NOTHING",
            [(key,) for key in keys],
        )
    for key in keys:
        assert locker.try_acquire(key, RENEW_TTL)
    fd = locker.connection.pgconn.socket
    before = data_segments_out(fd) or 0
    period_started = time.perf_counter()
    for key in keys:
        locker.renew(key, RENEW_TTL)
    locker_period = time.perf_counter() - period_started
    locker_statements = (data_segments_out(fd) or 0) - before
    for key in keys:
        locker.release(key)
    return {
        "leases": leases,
        "ours": {
            "renew_every_s": RENEW_EVERY,
            "statements_per_period": round(statements_per_period, 2),
            "tcp_segments_per_period": round(segments_per_period, 2),
            "leases_alive_after": alive,
            "batch_renew_ms": _ms(statistics.median(batch_times)),
            "acquire_all_s": round(acquire_seconds, 2),
        },
        "locker": {
            "statements_per_period": locker_statements,
            "renew_period_work_ms": _ms(locker_period),
        },
    }


# -- the run -------------------------------------------------------------------------------


def _clean_up(url: URL) -> None:
    with ExitStack() as stack:
        connection = raw_connection(url, stack)
        connection.execute("DELETE FROM advisory_locks_lease WHERE name LIKE %s", (PREFIX + "%",))
        connection.execute(f"DROP TABLE IF EXISTS {LOCKER_TABLE}")


def run_lease_benchmarks(
    url: URL,
    *,
    operations: int = 500,
    trials: int = 200,
    poll_trials: int = 20,
    leases: int = 10_000,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Every lease measurement, in one run; the report as a dict."""
    engine = create_engine(url)
    create_lease_table(engine)
    engine.dispose()
    with ExitStack() as stack:
        raw_connection(url, stack).execute(LockerStyle.CREATE)
    report: dict[str, Any] = {"server": server_version(url)}
    try:
        with ExitStack() as stack:
            progress("round trips: acquire + release")
            report["round_trips"] = round_trips(url, operations, stack)
        report["handoff"] = {}
        for kind, count in (
            ("ours.notify", trials),
            ("ours.poll", poll_trials),
            ("locker.poll_0.5s", poll_trials),
        ):
            progress(f"handoff: {kind}, {count} trials")
            with ExitStack() as stack:
                report["handoff"][kind] = handoff(url, kind, count, stack)
        progress(f"renewal: {leases} leases held by one process")
        with ExitStack() as stack:
            report["renewal"] = renewal(url, leases, stack)
    finally:
        _clean_up(url)
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"Lease locks, PostgreSQL {report['server']}", ""]
    lines.append("acquire + release (kernel-counted round trips, ms per operation):")
    for case, figures in report["round_trips"].items():
        lines.append(f"  {case:<26} {figures['round_trips']:>5} trips  {figures['ms']:>7} ms")
    lines.append("")
    lines.append("handoff to a waiter in another process (release -> waiter acquired):")
    for kind, figures in report["handoff"].items():
        lines.append(
            f"  {kind:<18} p50 {figures['p50_ms']:>9} ms  p90 {figures['p90_ms']:>9} ms  "
            f"({figures['trials']} trials)"
        )
        for step, value in figures.get("profile_p50_ms", {}).items():
            lines.append(f"      {step:<42} p50 {value} ms")
    renewal_report = report["renewal"]
    ours, locker = renewal_report["ours"], renewal_report["locker"]
    lines.append("")
    lines.append(f"renewal of {renewal_report['leases']} held leases, per renew period:")
    lines.append(
        f"  ours     {ours['statements_per_period']} statements "
        f"({ours['tcp_segments_per_period']} TCP segments; one batch: "
        f"{ours['batch_renew_ms']} ms); {ours['leases_alive_after']} still held after "
        f"{RENEW_PERIODS} periods of {ours['renew_every_s']} s"
    )
    lines.append(
        f"  locker   {locker['statements_per_period']} statements "
        f"({locker['renew_period_work_ms']} ms of statements)"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.leases", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--operations", type=int, default=500, help="per round-trip case")
    parser.add_argument("--trials", type=int, default=200, help="NOTIFY handoff trials")
    parser.add_argument("--poll-trials", type=int, default=20, help="polling handoff trials")
    parser.add_argument("--leases", type=int, default=10_000, help="leases held for renewal")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    arguments = parser.parse_args(argv)
    report = run_lease_benchmarks(
        database_url(),
        operations=arguments.operations,
        trials=arguments.trials,
        poll_trials=arguments.poll_trials,
        leases=arguments.leases,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    sys.stdout.write(render(report))
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
