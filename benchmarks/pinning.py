"""Pin this process and the PostgreSQL backends it talks to onto one CPU while timing.

On a small VM a round trip costs the client several times more CPU when the server
backend answering it runs on another CPU (a cross-CPU wakeup) than on the same one, and
which of the two happens changes from second to second. With the client and its backends
on one CPU, every case pays the same-CPU price, so CPU per operation and the ratios
between cases stop jumping. Backends are found by the local ports of this process's TCP
sockets (``/proc/net/tcp``) matched against ``pg_stat_activity.client_port``; setting
another process's affinity needs the same user or root, and anything refused is reported,
never fatal. Linux only; elsewhere nothing is pinned.
"""

from __future__ import annotations

import os
import sys
from contextlib import suppress
from pathlib import Path

import psycopg
from sqlalchemy.engine import URL

from benchmarks.postgres import libpq_dsn

__all__ = ["Pinning", "server_sockets"]


def _socket_inodes() -> dict[str, int]:
    """Socket inode -> file descriptor, for this process's open sockets."""
    inodes = {}
    for entry in Path("/proc/self/fd").iterdir():
        with suppress(OSError):
            target = os.readlink(entry)
            if target.startswith("socket:["):
                inodes[target[8:-1]] = int(entry.name)
    return inodes


def _tcp_sockets() -> list[tuple[int, int, int]]:
    """(descriptor, local port, remote port) of this process's TCP sockets."""
    inodes = _socket_inodes()
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[9] in inodes:
                    local = int(fields[1].rpartition(":")[2], 16)
                    remote = int(fields[2].rpartition(":")[2], 16)
                    found.append((inodes[fields[9]], local, remote))
    return found


def _local_ports() -> set[int]:
    return {local for _, local, _ in _tcp_sockets()}


def server_sockets(port: int) -> list[int]:
    """Descriptors of every TCP socket this process has open to ``port`` (Linux; else [])."""
    if not sys.platform.startswith("linux"):
        return []
    return [descriptor for descriptor, _, remote in _tcp_sockets() if remote == port]


class Pinning:
    """This process and its backends on ``cpu`` (the last CPU by default)."""

    def __init__(self, url: URL, cpu: int | None = None) -> None:
        self.available = sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")
        self.cpu = (os.cpu_count() or 1) - 1 if cpu is None else cpu
        self.url = url
        self.pinned_backends: set[int] = set()
        self.refused: set[int] = set()
        self._original = os.sched_getaffinity(0) if self.available else set()

    def pin(self) -> None:
        """Pin this process and every backend it has a connection to now (repeatable)."""
        if not self.available:
            return
        os.sched_setaffinity(0, {self.cpu})
        ports = _local_ports()
        if not ports:
            return
        conninfo = libpq_dsn(self.url)
        with psycopg.connect(conninfo, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)"
                " AND pid <> pg_backend_pid()",
                (sorted(ports),),
            ).fetchall()
        for (pid,) in rows:
            if pid in self.pinned_backends or pid in self.refused:
                continue
            try:
                os.sched_setaffinity(pid, {self.cpu})
                self.pinned_backends.add(pid)
            except OSError:
                self.refused.add(pid)

    def unpin(self) -> None:
        """Give this process its CPUs back (backends end with their connections)."""
        if not self.available:
            return
        os.sched_setaffinity(0, self._original)
        for pid in self.pinned_backends:
            with suppress(OSError):
                os.sched_setaffinity(pid, self._original)

    def describe(self) -> str:
        if not self.available:
            return "not pinned (needs Linux sched_setaffinity)"
        text = f"client and {len(self.pinned_backends)} backends pinned to CPU {self.cpu}"
        if self.refused:
            text += f" ({len(self.refused)} backends refused: run as their owner or root)"
        return text
