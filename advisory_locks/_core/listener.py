"""Prompt handoff for lease waiters: one LISTEN connection per database per process.

A lease released on PostgreSQL sends ``NOTIFY advisory_locks_lease, '<name>'`` in the
release statement itself. Waiters of a process subscribe to the names they wait for; one
thread holds a dedicated connection that LISTENs and wakes the waiters of each released
name, so a waiter retries within about a round trip of the release instead of at the
expiry it read. Where LISTEN cannot work (a transaction pooler, a driver without
notifications, another database) there is no listener and waiters sleep as before.

The connection exists only while someone waits: after ``IDLE_SECONDS`` without a
subscriber the thread closes it and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any, Final

from advisory_locks._core.executors import from_psycopg3

__all__ = [
    "LISTENING_DRIVERS",
    "AsyncReleaseListener",
    "ReleaseListener",
    "receive_notifications",
]

logger = logging.getLogger("advisory_locks")

IDLE_SECONDS: Final = 10.0
POLL_SECONDS: Final = 1.0
READY_SECONDS: Final = 5.0
RETRY_SECONDS: Final = 1.0


def receive_notifications(connection: Any, timeout: float) -> list[str] | None:
    """Payloads of the notifications that arrive on ``connection`` within ``timeout``;
    None when the driver cannot receive notifications."""
    module = type(connection).__module__
    if from_psycopg3(type(connection)):
        try:
            # stop_after: return with the first notification, not at the end of the
            # timeout.
            notifies = connection.notifies(timeout=timeout, stop_after=1)
        except TypeError:  # psycopg 3.1: notifies() takes neither (they came with 3.2)
            return _psycopg31_notifications(connection, timeout)
        return [n.payload for n in notifies]
    if module.startswith("psycopg2"):
        if not connection.notifies:
            select.select([connection], [], [], timeout)
            connection.poll()
        payloads = [notify.payload for notify in connection.notifies]
        connection.notifies.clear()
        return payloads
    return None


def _psycopg31_notifications(connection: Any, timeout: float) -> list[str]:
    """``receive_notifications`` on psycopg 3.1, whose ``notifies()`` waits with no
    timeout: wait for the connection's socket to be readable, then read what libpq
    received (the listener's connection runs nothing else)."""
    select.select([connection.fileno()], [], [], timeout)
    with connection.lock:
        pgconn = connection.pgconn
        pgconn.consume_input()
        encoding = connection.info.encoding
        payloads = []
        while (notify := pgconn.notifies()) is not None:
            payloads.append(notify.extra.decode(encoding))
        return payloads


# SQLAlchemy driver names whose connections receive notifications here.
LISTENING_DRIVERS: Final = frozenset({"psycopg", "psycopg2"})


class ReleaseListener:
    """Wakes this process's waiters when a lease they wait for is released."""

    def __init__(self, open_connection: Callable[[], Any], listen_sql: str) -> None:
        # open_connection() -> an object with .driver (an autocommit driver connection)
        # and .close().
        self._open = open_connection
        self._listen_sql = listen_sql
        self._mutex = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def subscribe(self, name: str) -> threading.Event:
        """An event set when ``name`` is released (maybe spuriously); the caller clears it.
        Returns once the listener is listening, or has given up trying for now."""
        event = threading.Event()
        with self._mutex:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._pid, self._thread = os.getpid(), None
                self._ready = threading.Event()
            self._waiters.setdefault(name, set()).add(event)
            if self._thread is None or not self._thread.is_alive():
                self._ready.clear()
                self._thread = threading.Thread(
                    target=self._run, name="advisory-locks-lease-listener", daemon=True
                )
                self._thread.start()
            ready = self._ready
        ready.wait(READY_SECONDS)
        return event

    def unsubscribe(self, name: str, event: threading.Event) -> None:
        with self._mutex:
            events = self._waiters.get(name)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[name]

    def _run(self) -> None:
        idle = 0.0
        while True:
            connection = None
            try:
                connection = self._open()
                cursor = connection.driver.cursor()
                cursor.execute(self._listen_sql)
                cursor.close()
                self._ready.set()
                while True:
                    payloads = receive_notifications(connection.driver, POLL_SECONDS)
                    if payloads is None:
                        raise TypeError(
                            f"{type(connection.driver).__name__} connections cannot receive "
                            "notifications"
                        )
                    self._wake(payloads)
                    with self._mutex:
                        if self._waiters:
                            idle = 0.0
                            continue
                        idle += POLL_SECONDS
                        if idle >= IDLE_SECONDS:
                            self._thread = None
                            self._ready.clear()
                            return
            except Exception:
                logger.debug("lease listener failed; waiters sleep until expiry", exc_info=True)
                self._ready.set()  # nobody should wait for a listener that is not coming
                self._wake_everyone()
                with self._mutex:
                    if not self._waiters:
                        self._thread = None
                        return
                threading.Event().wait(RETRY_SECONDS)
            finally:
                if connection is not None:
                    with contextlib.suppress(Exception):
                        connection.close()

    def _wake(self, names: list[str]) -> None:
        if not names:
            return
        with self._mutex:
            events = [event for name in names for event in self._waiters.get(name, ())]
        for event in events:
            event.set()

    def _wake_everyone(self) -> None:
        with self._mutex:
            events = [event for events in self._waiters.values() for event in events]
        for event in events:
            event.set()


class AsyncReleaseListener:
    """The asyncio twin of ``ReleaseListener``, for one event loop: one LISTEN connection
    (asyncpg's ``add_listener``, psycopg's ``AsyncConnection.notifies()``) wakes the
    ``asyncio.Event`` of every waiter of a released name. Opened by the first waiter,
    closed ``IDLE_SECONDS`` after the last one left."""

    def __init__(self, open_connection: Callable[[], Any], channel: str) -> None:
        # await open_connection() -> an object with .driver (an asyncpg Connection or a
        # psycopg AsyncConnection in autocommit) and an async .aclose().
        self._open = open_connection
        self._channel = channel
        self._waiters: dict[str, set[Any]] = {}
        self._connection: Any = None
        self._reader: Any = None
        self._starting: Any = None
        self._idle_handle: Any = None

    async def subscribe(self, name: str) -> Any:
        """An ``asyncio.Event`` set when ``name`` is released (maybe spuriously)."""
        event = asyncio.Event()
        self._waiters.setdefault(name, set()).add(event)
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None
        if self._connection is None or _closed(self._connection.driver):
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._start())
            starting = self._starting
            try:
                await asyncio.wait_for(asyncio.shield(starting), READY_SECONDS)
            except Exception:
                logger.debug("lease listener failed; waiters sleep until expiry", exc_info=True)
        return event

    def unsubscribe(self, name: str, event: Any) -> None:
        events = self._waiters.get(name)
        if events is not None:
            events.discard(event)
            if not events:
                del self._waiters[name]
        if not self._waiters and self._connection is not None and self._idle_handle is None:
            loop = asyncio.get_running_loop()
            self._idle_handle = loop.call_later(
                IDLE_SECONDS, lambda: loop.create_task(self._stop_if_idle())
            )

    async def _start(self) -> None:
        try:
            old, self._connection = self._connection, None
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.aclose()
            connection = await self._open()
            driver = connection.driver
            try:
                if type(driver).__module__.startswith("asyncpg"):
                    await driver.add_listener(
                        self._channel, lambda _c, _pid, _channel, payload: self._wake([payload])
                    )
                else:  # psycopg's AsyncConnection
                    await driver.execute(f"LISTEN {self._channel}")
                    self._reader = asyncio.ensure_future(self._read(driver))
            except BaseException:
                await connection.aclose()
                raise
            self._connection = connection
        finally:
            self._starting = None

    async def _read(self, driver: Any) -> None:
        try:
            async for notify in driver.notifies():
                self._wake([notify.payload])
        except Exception:
            logger.debug("lease listener lost its connection", exc_info=True)
        self._wake_everyone()

    async def _stop_if_idle(self) -> None:
        self._idle_handle = None
        if self._waiters or self._connection is None:
            return
        connection, self._connection = self._connection, None
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        with contextlib.suppress(Exception):
            await connection.aclose()

    def _wake(self, names: list[str]) -> None:
        for name in names:
            for event in self._waiters.get(name, ()):
                event.set()

    def _wake_everyone(self) -> None:
        for events in self._waiters.values():
            for event in events:
                event.set()


def _closed(driver: Any) -> bool:
    is_closed = getattr(driver, "is_closed", None)  # asyncpg
    if callable(is_closed):
        return bool(is_closed())
    return bool(getattr(driver, "closed", False))
