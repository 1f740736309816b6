"""Count round trips per operation from the kernel's TCP counters.

Every request libpq sends (a simple query, even one holding several statements, or an
extended-protocol Parse/Bind/Execute/Sync) is written in one go, and the client waits for
the answer before the next one; so the data segments a client socket sent during N
operations, divided by N, is the round trips per operation. Counting in the kernel sees
everything: the library's SQL, the driver's implicit BEGIN, the pool's reset on return.
Linux only (``TCP_INFO``); elsewhere the count is reported as unknown.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import sys
from collections.abc import Callable

from benchmarks.measure import Case, Timer

__all__ = ["SegmentCounter", "count_round_trips", "data_segments_out"]

# Offset of tcpi_data_segs_out in Linux's struct tcp_info (kernel 4.6 and later).
DATA_SEGS_OUT_OFFSET = 156
TCP_INFO_LENGTH = 232


def data_segments_out(fd: int) -> int | None:
    """Data segments the TCP socket ``fd`` has sent, or None where that is unknowable."""
    if not sys.platform.startswith("linux"):
        return None
    probe = socket.socket(fileno=fd)
    try:
        if probe.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        info = probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LENGTH)
    finally:
        # detach, not close: the descriptor belongs to the driver.
        probe.detach()
    if len(info) < DATA_SEGS_OUT_OFFSET + 4:
        return None
    return int(struct.unpack_from("I", info, DATA_SEGS_OUT_OFFSET)[0])


class SegmentCounter:
    """A stopwatch that adds up the data segments sent between start and stop."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.segments: int | None = 0
        self._started: int | None = None

    def start(self) -> None:
        self._started = self._total()

    def stop(self) -> None:
        stopped = self._total()
        if self.segments is None or self._started is None or stopped is None:
            self.segments = None
        else:
            self.segments += stopped - self._started

    def _total(self) -> int | None:
        total = 0
        for fd in self.case.sockets():
            sent = data_segments_out(fd)
            if sent is None:
                return None
            total += sent
        return total


def count_round_trips(
    case: Case, operations: int, fallback: Callable[[], list[int]] = list
) -> float | None:
    """Round trips one operation of ``case`` costs, averaged over ``operations`` runs.

    A case that names no sockets (a driver's own pool) is counted on ``fallback``: every
    socket this process has open to the server, which is exact because no other case runs
    meanwhile.
    """
    case.before_round()
    try:
        case.operation(Timer())  # let pools open their connections first
        if not case.sockets():
            case = dataclasses.replace(case, sockets=fallback)
        counter = SegmentCounter(case)
        for _ in range(operations):
            case.operation(counter)
    finally:
        case.after_round()
    return None if counter.segments is None else counter.segments / operations
