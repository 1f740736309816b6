"""The core's layering: what importing it costs, and first use from many threads."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from advisory_locks import LockUsageError, advisory_lock


def run_python(code: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_importing_the_core_loads_no_orm_and_no_driver() -> None:
    loaded = run_python(
        """
        import sys
        import advisory_locks, advisory_locks.errors, advisory_locks.keys
        print(" ".join(sorted(
            name for name in ("sqlalchemy", "django", "psycopg", "psycopg2", "asyncpg",
                              "pymysql", "MySQLdb", "greenlet", "portalocker")
            if name in sys.modules
        )))
        """
    )
    assert loaded.strip() == ""


def test_a_sqlalchemy_bind_loads_its_binding_on_first_use() -> None:
    output = run_python(
        """
        import sys
        from sqlalchemy import create_engine
        import advisory_locks
        assert "advisory_locks._bindings.sqlalchemy" not in sys.modules
        lock = advisory_locks.advisory_lock(create_engine("sqlite://"), "job")
        print(type(lock).__name__, "advisory_locks._bindings.sqlalchemy" in sys.modules)
        """
    )
    assert output.split() == ["AdvisoryLock", "True"]


def test_a_subclass_of_a_driver_connection_loads_its_binding_on_first_use(tmp_path: Path) -> None:
    # sqlite3.connect(factory=...) makes an application's class, from the application's
    # module: the binding is found through the class it derives from.
    output = run_python(
        f"""
        import sqlite3, sys
        import advisory_locks

        class AppConnection(sqlite3.Connection):
            pass

        connection = sqlite3.connect({str(tmp_path / "app.sqlite3")!r}, factory=AppConnection)
        assert "advisory_locks._bindings.sqlite3" not in sys.modules
        with advisory_locks.advisory_lock(connection, "job", timeout=0) as lock:
            print(type(lock).__name__, lock.held)
        """
    )
    assert output.split() == ["AdvisoryLock", "True"]


def test_first_use_from_many_threads_gets_one_clear_error_each() -> None:
    # Without the sqlite extra every thread must learn what to install, not some of them
    # a half-imported module's "cannot import name".
    output = run_python(
        """
        import sys, threading
        sys.modules["portalocker"] = None  # as if the sqlite extra were not installed
        from advisory_locks._dialects import backend_for_dialect
        barrier = threading.Barrier(8)
        errors = []

        def first_use():
            barrier.wait()
            try:
                backend_for_dialect("sqlite")
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")

        threads = [threading.Thread(target=first_use) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print("\\n".join(errors))
        """
    )
    lines = output.strip().splitlines()
    assert len(lines) == 8
    assert all(
        line.startswith("UnsupportedDatabase: SQLite locks need portalocker: pip install")
        for line in lines
    ), lines


def test_an_unknown_bind_is_a_type_error_naming_what_is_accepted() -> None:
    with pytest.raises(TypeError, match=r"SQLAlchemy Session.*not builtins\.dict"):
        advisory_lock({}, "job")


def test_a_sync_lock_in_async_with_says_to_use_with() -> None:
    lock = advisory_lock(create_engine("sqlite://"), "job")

    async def enter() -> None:
        async with lock:
            pass

    with pytest.raises(LockUsageError, match="use `with`"):
        asyncio.run(enter())


def test_an_async_lock_in_with_says_to_use_async_with() -> None:
    # Making the lock connects nowhere, so no server is needed.
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:9/none")
    lock = advisory_lock(engine, "job")
    with pytest.raises(LockUsageError, match="use `async with`"), lock:
        pass
