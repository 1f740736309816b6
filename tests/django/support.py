"""Helpers for the Django app's tests: threads with their own connections, the server's view."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
from django.db import connections
from psycopg.rows import TupleRow

from tests.helpers import holder_pids, lock_rows, wait_for

__all__ = ["ThreadResult", "holders", "in_thread", "run_in_thread", "server_pid"]


class ThreadResult:
    """What a thread returned or raised, once it has finished."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.value: Any = None
        self.error: BaseException | None = None

    def get(self, timeout: float = 30) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def run_in_thread(function: Callable[[], Any]) -> ThreadResult:
    """Start ``function`` in a thread; it gets its own Django connections, closed at its end."""
    result: ThreadResult

    def target() -> None:
        try:
            result.value = function()
        except BaseException as error:
            result.error = error
        finally:
            connections.close_all()

    thread = threading.Thread(target=target, daemon=True)
    result = ThreadResult(thread)
    thread.start()
    return result


def in_thread(function: Callable[[], Any]) -> Any:
    """Run ``function`` in another thread (another connection) and return its result."""
    return run_in_thread(function).get()


def server_pid(using: str = "default") -> int:
    """The backend pid of this thread's connection to ``using``."""
    connection = connections[using]
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    assert isinstance(pid, int)
    return pid


def holders(admin: psycopg.Connection[TupleRow], name: Any, **key_options: Any) -> list[int]:
    return (
        holder_pids(admin, name)
        if not key_options
        else [row.pid for row in lock_rows(admin, name, **key_options) if row.granted]
    )


def end_the_lease_listener(admin: psycopg.Connection[TupleRow]) -> None:
    """End the LISTEN connection (it would idle on for 10 s), so that pytest-django can
    drop the test database; with no waiter left, the listener thread ends with it."""
    database = connections["default"].settings_dict["NAME"]
    listening = (
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND query = %s AND pid <> "
        "pg_backend_pid()"
    )
    wait_for(
        lambda: (
            not admin.execute(
                f"SELECT pg_terminate_backend(pid) FROM ({listening}) AS l",
                [database, "LISTEN advisory_locks_lease"],
            ).fetchall()
        ),
        "the lease listener's connection ended",
    )
