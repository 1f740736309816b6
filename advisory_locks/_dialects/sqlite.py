"""SQLite named locks: OS file locks in a directory next to the database file.

SQLite has no lock a client can name, so each lock is a whole-file lock (``flock`` on
POSIX, ``LockFileEx`` on Windows, through portalocker) on ``<database>.advisory-locks/
<key>.lock``. They exclude every process on this host that opens the same database file,
shared locks admit each other, and the operating system frees them when the holding
process dies. They are tied to the SQLite connection that took them: the open lock files
live in that connection's pool entry and close with it.

Limits, each refused with UnsupportedFeature: in-memory and temporary databases (no
file), network filesystems (their file locks are unreliable), transaction locks (SQLite
cannot release them at the real end of a transaction), and asking one connection for
the same name in both modes (two file locks of one process would wait for each other).

Waiting: ``timeout=None`` blocks in the operating system and wakes as soon as the file
is unlocked. No operating system offers a file lock with a time limit, so ``timeout=t``
polls a non-blocking attempt, at most every 10 ms, until ``t`` has passed. A wait that a
binding may abandon (``state[WAIT_CANCELLED_STATE]``, asyncio cancellation) polls too,
whatever the timeout, since a blocked ``flock`` cannot be interrupted from another thread.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time
from collections.abc import Hashable
from pathlib import Path
from typing import IO, Any, Final

import portalocker

from advisory_locks._core.contract import Timeout
from advisory_locks._core.steps import ROWS, VALUE, Statement
from advisory_locks._dialects.base import WAIT_CANCELLED_STATE, LockedRow, StatementSteps
from advisory_locks.errors import LockTimeout, UnsupportedDatabase, UnsupportedFeature
from advisory_locks.keys import LockKey

__all__ = ["SQLiteBackend", "lock_file_path"]

LOCK_DIRECTORY_SUFFIX: Final = ".advisory-locks"
FIRST_POLL_SECONDS: Final = 0.001
MAX_POLL_SECONDS: Final = 0.01
NETWORK_FILESYSTEMS: Final = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "fuse.sshfs", "ceph"}
)
DIRECTORY_STATE: Final = "sqlite.lock_directory"
FILES_STATE: Final = "sqlite.lock_files"

TRANSACTION_REFUSED: Final = (
    "SQLite file locks cannot be tied to the end of a transaction: take a session lock "
    "(transaction=False) around the transaction instead"
)


def lock_file_path(database: str | os.PathLike[str], key: LockKey) -> Path:
    """The file whose OS lock stands for ``key`` on the SQLite database at ``database``."""
    database_path = Path(database).resolve()
    return database_path.parent / (database_path.name + LOCK_DIRECTORY_SUFFIX) / _file_name(key)


class SQLiteBackend:
    """Shared and exclusive file locks next to the database file."""

    dialect_name = "sqlite"
    locks_on_server = False
    locks_by_ints = True

    def system_name(self, state: dict[str, Any]) -> str:
        return "sqlite"

    def check_options(self, *, shared: bool, transaction: bool, timeout: Timeout) -> None:
        if transaction:
            raise UnsupportedFeature(TRANSACTION_REFUSED)

    def acquire(
        self,
        state: dict[str, Any],
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> StatementSteps[bool]:
        self.check_options(shared=shared, transaction=transaction, timeout=timeout)
        files = _open_files(state)
        if (key.ints, not shared) in files:
            held, wanted = ("shared", "exclusive") if not shared else ("exclusive", "shared")
            raise UnsupportedFeature(
                f"this connection holds {key.name!r} as a {held} lock; on SQLite it cannot "
                f"also take it as {wanted} (the two file locks would wait for each other)"
            )
        if DIRECTORY_STATE in state:
            # The lock ends with its connection, as a server's does: never grant one on a
            # connection closed under the binding (the first lock's PRAGMA asks anyway).
            yield Statement(VALUE, "SELECT 1")
        directory = yield from _lock_directory(state)
        handle = open(directory / _file_name(key), "a+b")  # noqa: SIM115 - kept open while held
        cancelled: threading.Event | None = state.get(WAIT_CANCELLED_STATE)
        try:
            granted = _lock(handle, shared=shared, timeout=timeout, cancelled=cancelled)
        except BaseException:
            handle.close()
            raise
        if granted is None:
            handle.close()
            raise LockTimeout(f"waiting for lock {key.name!r} was canceled", name=key.name)
        if not granted:
            handle.close()
            return False
        files[(key.ints, shared)] = handle
        return True

    def lock_statement(
        self,
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> Statement | None:
        # The lock is a file this process locks; the statement only checks the connection.
        return None

    def lock_statements(
        self,
        key: LockKey,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> tuple[Statement | None, Statement | None]:
        return None, None

    def lock_identity(self, key: LockKey) -> Hashable:
        return key.ints  # the lock file is named after the key

    def release(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        handle = _open_files(state).pop((key.ints, shared), None)
        if handle is None:
            return False
        try:
            _LOCKER.unlock(handle)
        finally:
            handle.close()  # closing frees the lock even if the unlock failed
        # The locks end with their connection, as a server's do; a binding that learns of a
        # close only later (Django has no signal for it) still has the files open. One
        # statement tells a closed connection (is_connection_failure: LockLost) apart.
        yield Statement(VALUE, "SELECT 1")
        return True

    def unlock_statement(self, key: LockKey, *, shared: bool) -> Statement | None:
        return None  # the file is unlocked here, before the statement

    def is_held(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        if (key.ints, shared) not in _open_files(state):
            return False
        # The file stays locked after its SQLite connection was closed behind the
        # binding's back, but the lock ends with its connection, as a server's does: ask
        # the connection, and let go of its files at once if it is gone.
        try:
            yield Statement(VALUE, "SELECT 1")
        except Exception as error:
            if self.is_connection_failure(error):
                self.connection_closed(state)
            raise
        return True

    def connection_closed(self, state: dict[str, Any]) -> None:
        # Closing a file frees its OS lock; a binding calls this when it sees the SQLite
        # connection gone, so the locks do not wait for the garbage collector.
        files: dict[object, IO[bytes]] = state.pop(FILES_STATE, {})
        for handle in files.values():
            handle.close()

    def cancel_wait(self, state: dict[str, Any], driver_connection: Any) -> StatementSteps[None]:
        # The wait is this process polling its lock file: the flag stops the poll.
        cancelled: threading.Event | None = state.get(WAIT_CANCELLED_STATE)
        if cancelled is not None:
            cancelled.set()
        yield from ()

    def inspect_server(self, state: dict[str, Any]) -> StatementSteps[int]:
        # No server: the locks belong to this process.
        yield from ()
        return os.getpid()

    def list_locks(self, state: dict[str, Any]) -> StatementSteps[list[LockedRow]]:
        raise UnsupportedFeature(
            "SQLite locks are operating-system file locks, not server state; see them "
            f"with `lsof +D <database>{LOCK_DIRECTORY_SUFFIX}` (or /proc/locks on Linux)"
        )

    def is_connection_failure(self, error: BaseException) -> bool:
        # sqlite3 raises ProgrammingError on a closed connection; ORMs wrap it (SQLAlchemy
        # in .orig, Django as the __cause__ of its own ProgrammingError).
        seen: BaseException | None = error
        for _ in range(3):
            if isinstance(seen, sqlite3.ProgrammingError) and "closed" in str(seen):
                return True
            seen = getattr(seen, "orig", None) or getattr(seen, "__cause__", None)
        return False

    def is_failed_transaction(self, error: BaseException) -> bool:
        return False


def _open_files(state: dict[str, Any]) -> dict[tuple[tuple[int, ...], bool], IO[bytes]]:
    files: dict[tuple[tuple[int, ...], bool], IO[bytes]] = state.setdefault(FILES_STATE, {})
    return files


def _lock_directory(state: dict[str, Any]) -> StatementSteps[Path]:
    directory: Path | None = state.get(DIRECTORY_STATE)
    if directory is not None:
        return directory
    database = yield from _main_database_file()
    directory = lock_file_path(database, _PLACEHOLDER_KEY).parent
    directory.mkdir(exist_ok=True)
    filesystem = _network_filesystem(directory)
    if filesystem is not None:
        raise UnsupportedFeature(
            f"{database} is on a {filesystem} network filesystem, whose file locks do not "
            "reliably exclude other hosts; keep SQLite databases that need locks on a "
            "local disk"
        )
    state[DIRECTORY_STATE] = directory
    return directory


def _main_database_file() -> StatementSteps[str]:
    databases = yield Statement(ROWS, "PRAGMA database_list")
    for _sequence, schema, file in databases:
        if schema == "main":
            if not file:
                raise UnsupportedFeature(
                    "advisory locks on SQLite are file locks next to the database file, and "
                    "an in-memory or temporary database has none: use a database file, or "
                    "a threading.Lock if one process is all that needs excluding (Django's "
                    "test runner makes SQLite test databases in memory unless "
                    'DATABASES[alias]["TEST"]["NAME"] names a file)'
                )
            return str(file)
    raise UnsupportedDatabase("SQLite reported no main database for this connection")


def _file_name(key: LockKey) -> str:
    if len(key.ints) == 1:
        return f"{key.ints[0] & 0xFFFFFFFFFFFFFFFF:016x}.lock"
    first, second = key.ints
    return f"{first & 0xFFFFFFFF:08x}-{second & 0xFFFFFFFF:08x}.lock"


_PLACEHOLDER_KEY: Final = LockKey(0, (0,))

# flock, pinned: its locks belong to an open file, so two connections of one process
# (each opening its own lock file) exclude each other. portalocker.lock() would follow
# the process-wide portalocker.LOCKER, and code elsewhere switching that to lockf (whose
# locks belong to the process) would silently let two connections of a process in.
_LOCKER: Final[Any] = (
    portalocker.portalocker.FlockLocker() if os.name == "posix" else portalocker  # LockFileEx
)


def _lock(
    handle: IO[bytes], *, shared: bool, timeout: Timeout, cancelled: threading.Event | None
) -> bool | None:
    """True when granted, False when busy for ``timeout``, None when ``cancelled``."""
    mode = portalocker.LockFlags.SHARED if shared else portalocker.LockFlags.EXCLUSIVE
    if timeout is None and cancelled is None:
        _LOCKER.lock(handle, mode)  # the operating system does the waiting
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = FIRST_POLL_SECONDS
    while True:
        if cancelled is not None and cancelled.is_set():
            return None
        try:
            _LOCKER.lock(handle, mode | portalocker.LockFlags.NON_BLOCKING)
        except portalocker.AlreadyLocked:
            remaining = MAX_POLL_SECONDS if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            if cancelled is not None:
                cancelled.wait(min(pause, remaining))
            else:
                time.sleep(min(pause, remaining))
            pause = min(pause * 2, MAX_POLL_SECONDS)
        else:
            return True


def _network_filesystem(directory: Path) -> str | None:
    """The type of network filesystem ``directory`` is on, where the OS tells (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    target = str(directory)
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) > best[0]):
            best = (len(mount_point), fields[2])
    if best is not None and best[1] in NETWORK_FILESYSTEMS:
        return best[1]
    return None
