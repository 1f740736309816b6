"""Pruning lease rows: clear the holders of leases expired for longer than an age.

A lease row is never deleted (its token counts acquisitions of the name for ever, and a
deleted row would start again at 1), so pruning only clears ``holder`` of rows whose
lease expired, by the DATABASE's clock, more than the given age ago. A lease that has not
expired is never touched, whatever the age. Acquiring a pruned name counts its token on.

The age is validated here, before any SQL; the statement is the dialect's
(``LeaseBackend.prune``).
"""

from __future__ import annotations

import datetime
import math
import re
from typing import Any, Final

from advisory_locks._core.contract import number_text, seconds_of
from advisory_locks._core.steps import Borrow, Settle, Steps, on, run_steps
from advisory_locks.errors import LeaseTableMissing

__all__ = ["parse_age", "prune", "prune_age", "prune_steps"]

# Ages beyond a century are refused: no lease expired that long ago, and date arithmetic
# that far back leaves some databases' ranges.
MAX_AGE_SECONDS: Final = 100 * 365 * 86400.0
AGE_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_AGE_TEXT: Final = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*")


def prune_age(older_than: object) -> float:
    """``older_than`` as seconds: a number of seconds or a ``datetime.timedelta`` from 0
    (every expired lease) to 100 years. TypeError/ValueError otherwise."""
    if isinstance(older_than, datetime.timedelta):
        seconds = older_than.total_seconds()
    elif isinstance(older_than, bool) or not isinstance(older_than, (int, float)):
        raise TypeError(
            "older_than must be seconds (int or float) or a datetime.timedelta, "
            f"not {type(older_than).__name__}"
        )
    else:
        seconds = seconds_of(older_than)
    if math.isnan(seconds) or not 0 <= seconds <= MAX_AGE_SECONDS:
        raise ValueError(
            f"older_than must be between 0 seconds and 100 years, not {number_text(older_than)}"
        )
    return seconds


def parse_age(text: str) -> float:
    """An age written on a command line: ``3600``, ``90s``, ``15m``, ``2h``, ``7d``
    (seconds without a unit). ValueError for anything else."""
    match = _AGE_TEXT.fullmatch(text)
    if match is None:
        raise ValueError(
            f"not an age: {text!r} (write seconds, or a number with s, m, h or d: 90s, 15m, 2h, 7d)"
        )
    number, unit = match.groups()
    return prune_age(float(number) * AGE_UNITS[unit or "s"])


def prune_steps(site: Any, seconds: float) -> Steps[int]:
    """Clear the holders of ``site``'s leases expired for more than ``seconds``, on a
    connection borrowed from the site in autocommit; return how many."""
    backend = site.backend
    borrowed = yield Borrow(False)
    try:
        count: int = yield from on(borrowed.executor, backend.prune(seconds))
    except BaseException as error:
        if not isinstance(error, Exception) or backend.is_connection_failure(error):
            borrowed.broken(error)
        else:
            borrowed.done()
        yield Settle(borrowed)
        if isinstance(error, Exception) and backend.is_missing_table(error):
            raise LeaseTableMissing(site.create_hint) from error
        raise
    borrowed.done()
    yield Settle(borrowed)
    return count


def prune(site: Any, older_than: object) -> int:
    """Validate ``older_than`` (before any SQL), then prune ``site``'s leases."""
    seconds = prune_age(older_than)
    return run_steps(prune_steps(site, seconds), site)
