"""A throwaway PostgreSQL cluster with settings of our choosing, for limits tests.

Some behaviour only shows at a server's limits: a full lock table (``max_locks_per_
transaction``), more waiters than the shared server's ``max_connections``. Driving the
shared server there would make every other client on it fail (the lock table is shared by
all sessions), so those tests and benchmarks start their own cluster from the PostgreSQL
binaries already installed, on a free port, and delete it afterwards.

PostgreSQL refuses to run as root; as root the cluster runs as the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.engine import URL

__all__ = ["PrivateServerUnavailable", "find_bindir", "private_postgres"]

START_SECONDS = 30


class PrivateServerUnavailable(RuntimeError):
    """No PostgreSQL server binaries here (or no user to run them as)."""


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``."""
    candidates = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        candidates.append(result.stdout.strip())
    # Debian keeps the server binaries out of PATH, one directory per major version.
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists():
            return Path(candidate)
    raise PrivateServerUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl) not found; Debian: apt-get install postgresql"
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def private_postgres(settings: Mapping[str, object]) -> Iterator[URL]:
    """Start a cluster with ``settings`` (postgresql.conf entries); yield its URL."""
    bindir = find_bindir()
    run_as: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            raise PrivateServerUnavailable(
                "running as root and there is no postgres user to run PostgreSQL as"
            ) from None
        run_as = ["runuser", "-u", "postgres", "--"]
    directory = Path(tempfile.mkdtemp(prefix="advisory-locks-pg-"))
    data = directory / "data"
    if owner is not None:
        os.chown(directory, owner.pw_uid, owner.pw_gid)
    port = _free_port()
    options = " ".join(f"-c {name}={value}" for name, value in settings.items())
    try:
        subprocess.run(
            [*run_as, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [
                *run_as,
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(directory / "server.log"),
                "-w",
                "-t",
                str(START_SECONDS),
                "-o",
                f"-p {port} -k {directory} -c listen_addresses=127.0.0.1 {options}",
                "start",
            ],
            check=True,
            capture_output=True,
        )
        try:
            yield URL.create(
                "postgresql+psycopg",
                username="postgres",
                host="127.0.0.1",
                port=port,
                database="postgres",
            )
        finally:
            subprocess.run(
                [*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                capture_output=True,
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
