"""A real PgBouncer in front of the test PostgreSQL, started and stopped by the tests.

One process serves two database aliases: ``advisory_locks_transaction`` (pool_mode
transaction) and ``advisory_locks_session`` (pool_mode session), each backed by at most
``SERVER_CONNECTIONS`` server connections, so more clients than that really share them.

PgBouncer is required (missing = failure) when ``ADVISORY_LOCKS_REQUIRE_PGBOUNCER`` is set
to a true value or, with it unset, when ``CI`` is; otherwise a missing binary skips.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import URL

REQUIRE_VARIABLE = "ADVISORY_LOCKS_REQUIRE_PGBOUNCER"
TRANSACTION_POOL = "advisory_locks_transaction"
SESSION_POOL = "advisory_locks_session"
SERVER_CONNECTIONS = 10
START_SECONDS = 20.0
TRUE_WORDS = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class PgBouncer:
    port: int
    server: URL  # the PostgreSQL it forwards to

    def url(self, pool: str) -> URL:
        """A SQLAlchemy URL that reaches ``pool`` through PgBouncer."""
        return self.server.set(host="127.0.0.1", port=self.port, database=pool, password=None)


def required_by(environ: Mapping[str, str]) -> str | None:
    explicit = environ.get(REQUIRE_VARIABLE)
    if explicit is not None:
        return f"{REQUIRE_VARIABLE}={explicit}" if explicit.lower() in TRUE_WORDS else None
    return "CI is set" if environ.get("CI", "").lower() in TRUE_WORDS else None


def find_binary() -> str:
    binary = shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(path).exists()),
        None,
    )
    if binary is None:
        message = "PgBouncer is not installed (Debian: apt-get install pgbouncer)"
        requirement = required_by(os.environ)
        if requirement is not None:
            pytest.fail(f"{message}, and it is required ({requirement})", pytrace=False)
        pytest.skip(message)
    return binary


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def config(server: URL, port: int, directory: Path) -> str:
    target = (
        f"host={server.host or '127.0.0.1'} port={server.port or 5432} dbname={server.database}"
    )
    if server.password:
        target += f" password={server.password}"
    user = server.username or "postgres"
    (directory / "users.txt").write_text(f'"{user}" ""\n')
    return f"""
[databases]
{TRANSACTION_POOL} = {target} pool_mode=transaction
{SESSION_POOL} = {target} pool_mode=session

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory / "users.txt"}
default_pool_size = {SERVER_CONNECTIONS}
max_client_conn = 500
server_reset_query = DISCARD ALL
"""


def run_as() -> list[str]:
    # PgBouncer refuses to run as root; CI runs as root, so it drops to another user.
    if os.geteuid() != 0:
        return []
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            continue
        return ["-u", user]
    pytest.fail("running as root, and neither a postgres nor a nobody user exists for PgBouncer")


@contextmanager
def running_pgbouncer(server: URL) -> Iterator[PgBouncer]:
    binary = find_binary()
    with tempfile.TemporaryDirectory(prefix="advisory-locks-pgbouncer-") as name:
        directory = Path(name)
        directory.chmod(0o755)  # readable by the user PgBouncer drops to
        port = free_port()
        (directory / "pgbouncer.ini").write_text(config(server, port, directory))
        for path in directory.iterdir():
            path.chmod(0o644)
        log = (directory / "pgbouncer.log").open("w")
        process = subprocess.Popen(
            [binary, *run_as(), str(directory / "pgbouncer.ini")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            bouncer = PgBouncer(port, server)
            wait_until_answering(bouncer, process, directory / "pgbouncer.log")
            yield bouncer
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def wait_until_answering(bouncer: PgBouncer, process: subprocess.Popen[bytes], log: Path) -> None:
    url = bouncer.url(SESSION_POOL)
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            psycopg.connect(
                host="127.0.0.1",
                port=bouncer.port,
                dbname=url.database,
                user=url.username,
                connect_timeout=2,
            ).close()
            return
        except psycopg.OperationalError as error:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"PgBouncer did not start ({error}):\n{log.read_text()}")
            time.sleep(0.05)
