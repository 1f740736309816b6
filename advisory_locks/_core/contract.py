"""The lock contract: what every lock object of this library is and does.

An advisory lock and (later) a lease lock are different mechanisms behind one surface:
``name``, ``held``, ``acquire() -> bool``, ``release()``, ``ensure_held()``, and a
context manager that raises ``LockNotAcquired`` when the lock stays busy and releases
at the end of the block, also on an exception. The enter/exit rules are written here,
once; a mechanism implements the three methods. The options every lock takes are one
typed structure, validated once, before any SQL.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, TypeAlias

from advisory_locks.errors import LockLost, LockNotAcquired, LockTimeout, LockUsageError
from advisory_locks.keys import LockName

__all__ = [
    "AsyncLockContract",
    "LockContract",
    "LockOptions",
    "Timeout",
    "Uncopyable",
    "lock_options",
    "not_acquired_error",
    "number_text",
    "seconds_of",
    "validate_flags",
    "validate_timeout",
]

Timeout: TypeAlias = float | None


@dataclass(frozen=True, slots=True)
class LockOptions:
    """How a lock is taken, the same for every binding (validated on construction)."""

    timeout: Timeout = None
    shared: bool = False
    transaction: bool = False
    # The backend that last found these options possible on its database: a lock made
    # with them on that backend again skips the check (options are made once per
    # combination and shared, see lock_options).
    checked_by: object = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_flags(shared=self.shared, transaction=self.transaction)
        object.__setattr__(self, "timeout", validate_timeout(self.timeout))


_made: dict[tuple[object, ...], LockOptions] = {}
_MADE_LIMIT = 256
# The options of a session lock (shared and transaction False), by timeout, for the
# timeouts of the types below (hashable, and never a bool): advisory_lock() reads them
# without calling lock_options(). Filled by lock_options().
session_options: dict[object, LockOptions] = {}
SESSION_TIMEOUT_TYPES: Final = frozenset({type(None), int, float})


def lock_options(
    timeout: object, shared: object, transaction: object, *, timeout_first: bool = False
) -> LockOptions:
    """``LockOptions(...)``, validated once per distinct set of options: an application
    takes its locks with a handful of them, and validating costs more than looking up.

    Only options of exact types are remembered (``True`` and ``1`` are equal as keys, and
    only one of them is valid), at most ``_MADE_LIMIT`` of them.
    """
    key = (timeout, timeout.__class__, shared, shared.__class__, transaction, transaction.__class__)
    try:
        return _made[key]
    except (KeyError, TypeError):  # TypeError: an unhashable timeout, refused below
        pass
    if timeout_first:  # Django's locks always named a bad timeout before a bad flag
        validate_timeout(timeout)
    options = LockOptions(timeout, shared, transaction)  # type: ignore[arg-type]
    if len(_made) < _MADE_LIMIT:
        _made[key] = options
        if shared is False and transaction is False and timeout.__class__ in SESSION_TIMEOUT_TYPES:
            session_options[timeout] = options
    return options


def validate_flags(*, shared: object, transaction: object) -> None:
    """``shared`` and ``transaction`` must be real bools: ``"no"`` is truthy."""
    for option, value in (("shared", shared), ("transaction", transaction)):
        if not isinstance(value, bool):
            raise TypeError(f"{option} must be True or False, not {type(value).__name__}")


def validate_timeout(timeout: object) -> Timeout:
    """None, or finite seconds >= 0; raise TypeError/ValueError otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout must be None or a number of seconds, not {type(timeout).__name__}"
        )
    seconds = seconds_of(timeout)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise ValueError(
            f"timeout must be None (wait forever), 0 (do not wait) or finite seconds > 0, "
            f"not {number_text(timeout)}"
        )
    return seconds


def seconds_of(number: int | float) -> float:
    """``float(number)``, or infinity for an int too large for a float (which ``float()``
    refuses with OverflowError): the caller's range check then refuses it with the
    ValueError it gives any other out-of-range value."""
    try:
        return float(number)
    except OverflowError:
        return math.inf if number > 0 else -math.inf


def number_text(number: object) -> str:
    """``repr(number)`` for an error message; an int too large for a float may have more
    digits than ``repr()`` converts (ValueError past ``sys.get_int_max_str_digits()``)."""
    if isinstance(number, int) and math.isinf(seconds_of(number)):
        return f"{'a negative' if number < 0 else 'an'} integer of {number.bit_length()} bits"
    return repr(number)


def not_acquired_error(name: LockName, timeout: Timeout) -> LockNotAcquired:
    """The error for a lock that stayed busy: LockTimeout whenever a wait ran out.

    With ``timeout=None`` the library sets no limit, so a refusal means the connection's
    own ``lock_timeout`` ended the wait: a timeout all the same.
    """
    if timeout == 0:
        return LockNotAcquired(f"lock {name!r} is held elsewhere", name=name)
    if timeout is None:
        return LockTimeout(
            f"lock {name!r} was not granted before the connection's own lock_timeout ran out",
            name=name,
        )
    return LockTimeout(f"lock {name!r} was not granted within {timeout} s", name=name)


def reported_inside(exc: BaseException | None, name: object) -> bool:
    """Whether the block already raised this lock's loss (``ensure_held()``): a second
    LockLost from the release would only bury the first under "during handling ..."."""
    return isinstance(exc, LockLost) and exc.name == name


class Uncopyable:
    """A lock object is one holder: a copy (``copy.copy``, ``copy.deepcopy``) or a pickle
    of a held one would count itself a holder too, and its release would unlock what the
    original still holds. Refused, held or not, as ``threading.Lock`` refuses."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{type(self).__name__} objects cannot be copied or pickled: a copy would share "
            "this object's hold on the lock. Make another lock object where one is needed "
            "(call advisory_lock(...) again)"
        )


class LockContract(Uncopyable, abc.ABC):
    """A lock for blocking code: ``with lock:`` or ``acquire()`` / ``release()``."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def name(self) -> LockName:
        """The name this lock was made with."""

    @property
    @abc.abstractmethod
    def held(self) -> bool:
        """Whether this object holds the lock now."""

    @abc.abstractmethod
    def acquire(self) -> bool:
        """Take the lock; False when it stayed busy for the whole timeout."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the lock back; LockLost if it turned out to be lost meanwhile."""

    @abc.abstractmethod
    def ensure_held(self) -> None:
        """Raise LockLost unless the database still holds this lock for us."""

    @abc.abstractmethod
    def _not_acquired(self) -> LockNotAcquired:
        """The error ``with`` raises when ``acquire()`` returned False."""

    def __enter__(self) -> Any:
        if not self.acquire():
            raise self._not_acquired()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockLost:
            if not reported_inside(exc, self.name):
                raise

    async def __aenter__(self) -> Any:
        raise LockUsageError(
            f"{type(self).__name__} is for blocking code: use `with`, not `async with` "
            "(an async bind gives an async lock)"
        )

    async def __aexit__(self, *exc_info: object) -> None:  # pragma: no cover - never entered
        return None


class AsyncLockContract(Uncopyable, abc.ABC):
    """A lock for asyncio code: ``async with lock:`` or ``await acquire()`` / ``release()``."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def name(self) -> LockName:
        """The name this lock was made with."""

    @property
    @abc.abstractmethod
    def held(self) -> bool:
        """Whether this object holds the lock now."""

    @abc.abstractmethod
    async def acquire(self) -> bool:
        """Take the lock; False when it stayed busy for the whole timeout."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Give the lock back; LockLost if it turned out to be lost meanwhile."""

    @abc.abstractmethod
    async def ensure_held(self) -> None:
        """Raise LockLost unless the database still holds this lock for us."""

    @abc.abstractmethod
    def _not_acquired(self) -> LockNotAcquired:
        """The error ``async with`` raises when ``acquire()`` returned False."""

    async def __aenter__(self) -> Any:
        if not await self.acquire():
            raise self._not_acquired()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except LockLost:
            if not reported_inside(exc, self.name):
                raise

    def __enter__(self) -> Any:
        raise LockUsageError(
            f"{type(self).__name__} belongs to an async bind: use `async with`, not `with`"
        )

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover - never entered
        return None
