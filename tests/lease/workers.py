"""Lease holders run in their own processes (spawned: they share nothing with the test
but the database and the queues/events handed to them)."""

from __future__ import annotations

import asyncio
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

from sqlalchemy import create_engine, text

from advisory_locks import LockLost, lease_lock
from tests.lease.conftest import fenced_write


def hold_until_resumed(
    url: str, name: str, ttl: float, renew_every: float, report: Queue[Any], resumed: Event
) -> None:
    """Hold ``name``; once ``resumed`` is set (after the test froze and thawed this
    process), report what the holder learns: how soon ``lost`` was set, what
    ``ensure_held()``, a fenced write and the ``with`` exit raised."""
    engine = create_engine(url)
    outcome: dict[str, Any] = {}
    try:
        with lease_lock(engine, name, ttl=ttl, renew_every=renew_every, timeout=10) as lease:
            report.put(("acquired", lease.token))
            resumed.wait()
            start = time.monotonic()
            outcome["lost_after"] = (
                time.monotonic() - start if lease.lost.wait(renew_every) else None
            )
            outcome["held"] = lease.held
            for step, action in (
                ("ensure_held", lease.ensure_held),
                ("fence", lambda: fenced_write(lease, engine, "stale")),
            ):
                try:
                    action()
                    outcome[step] = None
                except LockLost as error:
                    outcome[step] = type(error).__name__
    except LockLost as error:
        outcome["exit"] = type(error).__name__
    else:
        outcome["exit"] = None
    engine.dispose()
    report.put(("done", outcome))


def increment(url: str, name: str, times: int, ttl: float, writer: str, start: Event) -> None:
    """``times`` read-modify-write increments of one counter, each under the lease and
    guarded by its fence: value = highest value so far + 1, recorded with the token."""
    engine = create_engine(url)
    start.wait()
    for _ in range(times):
        with lease_lock(engine, name, ttl=ttl, timeout=120) as lease, engine.begin() as connection:
            lease.fence(connection)
            current = connection.execute(
                text("SELECT MAX(value) FROM lease_test_writes WHERE name = :name"),
                {"name": lease.lease_name},
            ).scalar()
            connection.execute(
                text(
                    "INSERT INTO lease_test_writes (name, token, writer, value) "
                    "VALUES (:name, :token, :writer, :value)"
                ),
                {
                    "name": lease.lease_name,
                    "token": lease.token,
                    "writer": writer,
                    "value": (current or 0) + 1,
                },
            )
    engine.dispose()


def increment_through_pooler(
    url: str, name: str, table: str, times: int, start: Event, report: Queue[Any]
) -> None:
    """``times`` read-modify-write increments of ``table``'s counter through a transaction
    pooler (the engine declared so), each under the lease and guarded by its fence; report
    the tokens held, the server connections used and whether a LISTEN was set up."""
    from advisory_locks._bindings.sqlalchemy_lease import lease_site

    engine = create_engine(
        url,
        pool_size=1,
        max_overflow=0,
        connect_args={"prepare_threshold": None},
        execution_options={"advisory_locks_pooler": "transaction"},
    )
    tokens: list[int] = []
    server_pids: set[int] = set()
    start.wait()
    for _ in range(times):
        with lease_lock(engine, name, ttl=10, timeout=120) as lease, engine.begin() as connection:
            lease.fence(connection)
            value = connection.scalar(text(f'SELECT value FROM "{table}"'))
            server_pids.add(int(connection.scalar(text("SELECT pg_backend_pid()"))))
            connection.execute(text(f'UPDATE "{table}" SET value = :value'), {"value": value + 1})
            assert lease.token is not None
            tokens.append(lease.token)
    listened = lease_site(engine)._listener is not None
    engine.dispose()
    report.put((tokens, sorted(server_pids), listened))


def async_hold(kind: str, url: str, name: str, report: Queue[Any], release: Event) -> None:
    """Hold ``name`` through an async bind of ``kind`` until ``release`` is set."""
    from tests.lease.async_binds import AsyncBind, url_of

    async def hold() -> None:
        bind = await AsyncBind(kind, url_of(url)).open()
        try:
            async with bind.lease(name, ttl=30, timeout=10) as lease:
                report.put(("acquired", lease.token))
                await asyncio.to_thread(release.wait)
        finally:
            await bind.close()
        report.put(("released", None))

    asyncio.run(hold())


def async_hold_until_resumed(
    kind: str,
    url: str,
    name: str,
    ttl: float,
    renew_every: float,
    report: Queue[Any],
    resumed: Event,
) -> None:
    """``hold_until_resumed`` through an async bind of ``kind``: once resumed, how soon
    ``lost`` was set, and what ``ensure_held()``, a fenced write and the ``async with``
    exit raised."""
    from tests.lease.async_binds import AsyncBind, url_of

    async def hold() -> dict[str, Any]:
        bind = await AsyncBind(kind, url_of(url)).open()
        outcome: dict[str, Any] = {}
        try:
            async with bind.lease(name, ttl=ttl, renew_every=renew_every, timeout=10) as lease:
                report.put(("acquired", lease.token))
                await asyncio.to_thread(resumed.wait)
                start = time.monotonic()
                try:
                    await asyncio.wait_for(lease.lost.wait(), renew_every)
                    outcome["lost_after"] = time.monotonic() - start
                except asyncio.TimeoutError:
                    outcome["lost_after"] = None
                outcome["held"] = lease.held
                for step, action in (
                    ("ensure_held", lease.ensure_held),
                    ("fence", lambda: bind.fenced_write(lease, "stale")),
                ):
                    try:
                        await action()
                        outcome[step] = None
                    except LockLost as error:
                        outcome[step] = type(error).__name__
        except LockLost as error:
            outcome["exit"] = type(error).__name__
        else:
            outcome["exit"] = None
        finally:
            await bind.close()
        return outcome

    report.put(("done", asyncio.run(hold())))


def raw_hold(kind: str, url: str, name: str, report: Queue[Any], release: Event) -> None:
    """Hold ``name`` through a blocking raw bind of ``kind`` until ``release`` is set."""
    from sqlalchemy.engine import make_url

    from tests.lease.raw_binds import RawBind

    bind = RawBind(kind, make_url(url)).open()
    try:
        with bind.lease(name, ttl=30, timeout=10) as lease:
            report.put(("acquired", lease.token))
            release.wait()
    finally:
        bind.close()
    report.put(("released", None))


def raw_hold_until_resumed(
    kind: str,
    url: str,
    name: str,
    ttl: float,
    renew_every: float,
    report: Queue[Any],
    resumed: Event,
) -> None:
    """``hold_until_resumed`` through a blocking raw bind of ``kind``."""
    from sqlalchemy.engine import make_url

    from tests.lease.raw_binds import RawBind

    bind = RawBind(kind, make_url(url)).open()
    outcome: dict[str, Any] = {}
    try:
        with bind.lease(name, ttl=ttl, renew_every=renew_every, timeout=10) as lease:
            report.put(("acquired", lease.token))
            resumed.wait()
            start = time.monotonic()
            outcome["lost_after"] = (
                time.monotonic() - start if lease.lost.wait(renew_every) else None
            )
            outcome["held"] = lease.held
            for step, action in (
                ("ensure_held", lease.ensure_held),
                ("fence", lambda: bind.fenced_write(lease, "stale")),
            ):
                try:
                    action()
                    outcome[step] = None
                except LockLost as error:
                    outcome[step] = type(error).__name__
    except LockLost as error:
        outcome["exit"] = type(error).__name__
    else:
        outcome["exit"] = None
    finally:
        bind.close()
    report.put(("done", outcome))
