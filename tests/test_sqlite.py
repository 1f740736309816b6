"""SQLite-only behaviour: where the lock files live and what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine

from advisory_locks import UnsupportedFeature, advisory_lock
from advisory_locks._core.executors import DBAPIExecutor
from advisory_locks._core.steps import on, run_steps
from advisory_locks._dialects import backend_for_dialect
from advisory_locks._dialects.sqlite import lock_file_path
from advisory_locks.keys import derive_key


def test_an_in_memory_database_is_refused_with_a_clear_error() -> None:
    engine = create_engine("sqlite://")
    with engine.connect() as connection, pytest.raises(UnsupportedFeature, match="in-memory"):
        advisory_lock(connection, "job").acquire()
    engine.dispose()


def test_lock_files_live_next_to_the_database_file(tmp_path: Path) -> None:
    database = tmp_path / "app.sqlite"
    engine = create_engine(f"sqlite:///{database}")
    with engine.connect() as connection, advisory_lock(connection, "job"):
        path = lock_file_path(database, derive_key("job"))
        assert path.parent == tmp_path / "app.sqlite.advisory-locks"
        assert path.exists()
    engine.dispose()


def test_one_connection_cannot_hold_a_name_in_both_modes(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.sqlite'}")
    with (
        engine.connect() as connection,
        advisory_lock(connection, "job", shared=True),
        pytest.raises(UnsupportedFeature, match="shared"),
    ):
        advisory_lock(connection, "job").acquire()
    engine.dispose()


def test_closing_the_connection_frees_its_locks(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.sqlite'}")
    with engine.connect() as connection:
        advisory_lock(connection, "job").acquire()
        connection.invalidate()
    with engine.connect() as other:
        lock = advisory_lock(other, "job", timeout=0)
        assert lock.acquire() is True
        lock.release()
    engine.dispose()


def test_listing_locks_is_refused_and_points_to_the_lock_files(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.sqlite'}")
    with engine.connect() as connection:
        pooled = connection.connection
        executor = DBAPIExecutor(pooled.dbapi_connection)
        with pytest.raises(UnsupportedFeature, match="lsof"):
            run_steps(on(executor, backend_for_dialect("sqlite").list_locks(executor.state)))
    engine.dispose()


def test_invalidating_the_connection_frees_its_locks_at_once(tmp_path: Path) -> None:
    # Not when the pool next reuses the slot: another process or engine may be waiting.
    database = tmp_path / "app.sqlite"
    engine, other_engine = (
        create_engine(f"sqlite:///{database}"),
        create_engine(f"sqlite:///{database}"),
    )
    with engine.connect() as connection:
        lock = advisory_lock(connection, "job")
        lock.acquire()
        connection.invalidate()
        with other_engine.connect() as other:
            rival = advisory_lock(other, "job", timeout=0)
            assert rival.acquire() is True
            rival.release()
    engine.dispose()
    other_engine.dispose()


def test_two_connections_of_one_process_exclude_each_other_whatever_portalockers_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # lockf locks belong to the process: if the library followed portalocker's
    # process-wide default, code elsewhere switching it would let both connections in.
    fcntl = pytest.importorskip("fcntl", reason="flock and lockf are POSIX")
    import portalocker.portalocker

    monkeypatch.setattr(portalocker.portalocker, "LOCKER", fcntl.lockf)
    database = tmp_path / "app.sqlite"
    first, second = create_engine(f"sqlite:///{database}"), create_engine(f"sqlite:///{database}")
    with first.connect() as holder, second.connect() as rival, advisory_lock(holder, "job"):
        assert advisory_lock(rival, "job", timeout=0).acquire() is False
    first.dispose()
    second.dispose()
