"""``advisory_lock()`` for Django: a context manager, a decorator and an acquire/release pair.

The lock itself is the core's ``AdvisoryLock`` on a
``DjangoSite`` (``advisory_locks_django._binding``); this module adds what Django code
expects around it: defaults from settings, ``atomic()`` for ``transaction=True``, names
computed from a decorated function's arguments, and ``async`` support. Its signals are
the core's lock events, forwarded (``advisory_locks_django.signals``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import string
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from asgiref.sync import sync_to_async
from django.core.signals import setting_changed
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db import transaction as django_transaction

from advisory_locks._core.advisory import AdvisoryLock
from advisory_locks._core.connection import AbandonableWait, Holding
from advisory_locks._core.contract import (
    LockOptions,
    Timeout,
    lock_options,
)
from advisory_locks._core.executors import StatementRefused
from advisory_locks.errors import (
    AdvisoryLockError,
    LockConnectionLost,
    LockLost,
    LockUsageError,
    UnsupportedFeature,
)
from advisory_locks.keys import KeyScheme, LockKey, LockName, derive_key
from advisory_locks_django import signals
from advisory_locks_django._binding import (
    DjangoConnectionLocks,
    DjangoExecutor,
    DjangoSite,
    connection_locks,
    open_other_connection,
    own_connection,
    release_pending,
    site_for_alias,
)
from advisory_locks_django._compat import connection_usable
from advisory_locks_django.conf import SETTING, LockSettings, app_checked, lock_settings

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["DjangoAdvisoryLock", "NameSpec", "advisory_lock", "current_advisory_locks"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

logger = logging.getLogger("advisory_locks_django")

NameSpec = LockName | Callable[..., LockName]


class _Default:
    def __repr__(self) -> str:
        return "<from settings>"


DEFAULT: Final = _Default()


def advisory_lock(
    name: NameSpec,
    *,
    using: str = DEFAULT_DB_ALIAS,
    timeout: Timeout | _Default = DEFAULT,
    shared: bool = False,
    transaction: bool | _Default = DEFAULT,
    skip_if_locked: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> DjangoAdvisoryLock:
    """A named lock held by the database ``using``: a context manager and a decorator.

    ``with advisory_lock(name): ...`` takes the lock on the thread's connection to
    ``using`` and gives it back at the end of the block, also when the block raises.
    Decorating a function takes the lock around each call. ``acquire()`` / ``release()``
    is the explicit form.

    :param name: a non-empty ``str`` (hashed to a key), an ``int`` (a signed 64-bit key)
        or an ``(int, int)`` pair (PostgreSQL's two-key form). When decorating, a ``str``
        may use ``{argument}`` fields filled from each call's arguments
        (``"sync-{account_id}"``), or ``name`` may be a callable that takes the call's
        arguments and returns the name.
    :param using: the database alias whose connection holds the lock.
    :param timeout: ``None`` waits until granted, ``0`` never waits, ``t > 0`` lets the
        server wait at most ``t`` seconds. Default: ``ADVISORY_LOCKS["TIMEOUT"]`` (None).
    :param shared: take a shared (reader) lock; PostgreSQL and SQLite only.
    :param transaction: tie the lock to ``atomic()``: one is opened when none is open,
        and the lock is released when the outermost transaction ends (PostgreSQL only;
        elsewhere ``UnsupportedFeature``). Default: ``ADVISORY_LOCKS["TRANSACTION"]``
        (False: a session lock, released at the end of the block).
    :param skip_if_locked: as a decorator, return ``None`` without calling the function
        when the lock is busy, instead of raising ``LockNotAcquired``.
    :param key_scheme: how a ``str`` name becomes a key: ``"sha256"``, ``"pglock"``,
        ``"rails"``, ``"hashtext"``, or a function ``name -> int | (int, int)``. Default:
        ``ADVISORY_LOCKS["KEY_SCHEME"]``, else ``"sha256"``.
    :param key_prefix: a namespace for ``str`` names. Default:
        ``ADVISORY_LOCKS["KEY_PREFIX"]``, else none.
    :returns: a [DjangoAdvisoryLock][advisory_locks_django.DjangoAdvisoryLock].
    :raises TypeError: for a name, alias or flag of the wrong type, before any SQL.
    :raises ValueError: for an empty name, an out-of-range key or a negative timeout.
    :raises UnsupportedFeature: when the database cannot honour the options (at
        ``acquire()``: ``transaction=True`` on MySQL/MariaDB or SQLite, ``shared=True``
        on MySQL/MariaDB).
    :raises LockNotAcquired: from ``with`` (and a decorated call), when the lock stayed
        busy for the whole timeout; ``LockTimeout`` when a timeout > 0 ran out.
    """
    # DjangoAdvisoryLock(name, using=using, ...), without the dict Python builds for the
    # keyword arguments of a call to a class.
    lock: DjangoAdvisoryLock = _new(DjangoAdvisoryLock)
    lock._setup(name, using, timeout, shared, transaction, skip_if_locked, key_scheme, key_prefix)
    return lock


def current_advisory_locks(using: str = DEFAULT_DB_ALIAS) -> list[LockName]:
    """Names this thread's connection to ``using`` holds through this library.

    :param using: the database alias.
    :returns: one name per lock held (a re-entered lock is counted, not listed again),
        session and transaction locks alike.
    """
    return site_for_alias(using).held_names()


class DjangoAdvisoryLock(AdvisoryLock):
    """What [advisory_lock][advisory_locks_django.advisory_lock] returns.

    Takes the same parameters as ``advisory_lock()``. Usable as ``with`` / ``async with``,
    as a decorator, or through ``acquire()`` / ``release()`` (``aacquire()`` /
    ``arelease()`` from async code). Re-entry on one connection is counted: the lock is
    released when the outermost holder releases it.

    It is the core's [AdvisoryLock][advisory_locks.AdvisoryLock] on the alias's site,
    with what Django code expects around it: one object per lock, not a wrapper around
    another one, since a lock is made, taken and given back on every use.
    """

    __slots__ = (
        "_atomic_on",
        "_atomics",
        "_name",
        "key_prefix",
        "key_scheme",
        "skip_if_locked",
        "using",
    )

    # None for a decorator's lock, whose name comes from each call's arguments.
    _atomics: list[django_transaction.Atomic | None] | None
    # The connection (its thread's) that the atomic() block this lock opened is on,
    # while the block is open. Only the first holder opens one: re-entries run inside it.
    _atomic_on: BaseDatabaseWrapper | None

    def __init__(
        self,
        name: NameSpec,
        *,
        using: str = DEFAULT_DB_ALIAS,
        timeout: Timeout | _Default = DEFAULT,
        shared: bool = False,
        transaction: bool | _Default = DEFAULT,
        skip_if_locked: bool = False,
        key_scheme: KeyScheme | None = None,
        key_prefix: str | int | None = None,
    ) -> None:
        self._setup(
            name, using, timeout, shared, transaction, skip_if_locked, key_scheme, key_prefix
        )

    def _setup(
        self,
        name: NameSpec,
        using: str,
        timeout: Timeout | _Default,
        shared: bool,
        transaction: bool | _Default,
        skip_if_locked: bool,
        key_scheme: KeyScheme | None,
        key_prefix: str | int | None,
    ) -> None:
        # Exact types in the key: True and 1 are equal keys, and only one is valid.
        seen = (
            using,
            timeout,
            timeout.__class__,
            shared,
            shared.__class__,
            transaction,
            transaction.__class__,
            skip_if_locked,
            skip_if_locked.__class__,
        )
        try:
            prepared = _prepared[seen]
        except (KeyError, TypeError):  # TypeError: unhashable, refused by _prepare
            prepared = _prepare(seen, using, timeout, shared, transaction, skip_if_locked)
        defaults, options, site = prepared
        self.using = using
        self.skip_if_locked = skip_if_locked
        self.key_scheme = scheme = defaults.key_scheme if key_scheme is None else key_scheme
        self.key_prefix = prefix = defaults.key_prefix if key_prefix is None else key_prefix
        self._name = name
        if callable(name):
            # A decorator's, with no key of its own (key_info stays unset): each call
            # makes its own lock from the call's arguments.
            self._atomics = None
            self._atomic_on = None
            self._site = site
            self.options = options
            self._count = 0
            self._owner = None
            self._borrowed = self._holding = None
            return
        # Per holder of a transaction lock (re-entry adds one): the atomic() block its
        # acquire opened (outside one), or None. A session lock opens none, and keeps
        # it empty.
        self._atomics = []
        self._atomic_on = None
        # Bad names and options fail here, before any SQL.
        AdvisoryLock.__init__(self, site, derive_key(name, scheme=scheme, prefix=prefix), options)

    # -- the lock -------------------------------------------------------------------------

    @property
    def name(self) -> LockName:
        """The lock's name, as given."""
        return self._key_info().name

    @property
    def key(self) -> int | tuple[int, int]:
        """The key(s) the server sees."""
        return self._key_info().value

    def acquire(self) -> bool:
        """Take the lock; False when it stayed busy for the whole timeout.

        :raises LockDeadlock: when the server detected a deadlock.
        :raises UnsupportedFeature: when the database cannot honour the options.
        """
        atomics = self._atomics
        if atomics is None:
            raise _decorator_only()
        if not self.options.transaction:
            # A session lock opens no atomic() block, so its holders need no list of
            # blocks (``_atomics`` stays empty): the core's acquire, with Django's
            # reading of a failed connection.
            try:
                return AdvisoryLock.acquire(self)
            except DatabaseError as error:
                self._raise_if_connection_gone(error)
                raise
        atomic = None
        if not (wrapper := connections[self.using]).in_atomic_block:
            if not wrapper.get_autocommit():
                raise UnsupportedFeature(
                    "transaction=True needs atomic(): manual transaction management "
                    "(set_autocommit(False)) gives Django no transaction end to tie it to"
                )
            atomic = django_transaction.atomic(using=self.using)
            atomic.__enter__()
        try:
            try:
                granted = AdvisoryLock.acquire(self)
            except DatabaseError as error:
                self._raise_if_connection_gone(error)
                raise
        except BaseException as error:
            if atomic is not None:
                atomic.__exit__(type(error), error, error.__traceback__)
            raise
        if not granted:
            if atomic is not None:
                atomic.__exit__(None, None, None)
            return False
        if atomic is not None:
            # Set once granted: a failed acquire's block is closed already.
            self._atomic_on = wrapper
        atomics.append(atomic)
        return True

    def release(self) -> None:
        """Give the lock back; a transaction lock stays until its transaction ends."""
        if self.options.transaction:
            self._release(None, None, None)
            return
        # A session lock opened no atomic() block: the core's release, with Django's
        # reading of a lost lock or a failed connection (written here rather than called,
        # since a waiter's handoff waits for the unlock it sends).
        borrowed, holding = self._borrowed, self._holding
        try:
            AdvisoryLock.release(self)  # raises the core's "not held" error when not held
        except LockUsageError:
            if self._atomics is None:  # a decorator's lock, never held
                raise _decorator_only() from None
            raise
        except LockLost as error:
            assert borrowed is not None
            assert holding is not None
            locks: DjangoConnectionLocks = borrowed.state  # type: ignore[assignment]
            locks.released(holding, "lost")
            raise self._lost(locks, holding, error) from error.__cause__
        except DatabaseError as error:
            assert borrowed is not None
            assert holding is not None
            if not self._connection_gone(error):
                raise
            locks = borrowed.state  # type: ignore[assignment]
            locks.released(holding, "lost")
            raise self._lost_connection(error) from error
        # An unlock the server ran was forgotten and reported by the lock already; only a
        # request's list of its locks may still name it.
        if holding is not None and not holding.active:
            locks = borrowed.state  # type: ignore[union-attr, assignment]
            if locks.request_holdings and holding not in locks.pending_release:
                locks.released(holding, "unlock")

    def ensure_held(self) -> None:
        """Ask the database whether it still holds this lock; raise LockLost if not.

        One round trip on the lock's connection: call it before an irreversible step.
        """
        if self._atomics is None:
            raise _decorator_only()
        held = self._held_on()
        try:
            AdvisoryLock.ensure_held(self)
        except LockLost as error:
            if held is None:
                raise
            locks, holding = held
            locks.released(holding, "lost")
            raise self._lost(locks, holding, error) from error.__cause__
        except DatabaseError as error:
            if held is None or not self._connection_gone(error):
                raise
            locks, holding = held
            locks.released(holding, "lost")
            raise self._lost_connection(error) from error

    def _held_on(self) -> tuple[DjangoConnectionLocks, Holding] | None:
        """The registry and holding this object's holders count on, while it holds them."""
        borrowed, holding = self._borrowed, self._holding
        if not self._count or borrowed is None or holding is None:
            return None
        return borrowed.state, holding  # type: ignore[return-value]

    def _release(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        atomics = self._atomics
        if atomics is None:
            raise _decorator_only()
        if not self.options.transaction:
            self.release()
            return
        borrowed, holding = self._borrowed, self._holding
        if not atomics or borrowed is None or holding is None:
            AdvisoryLock.release(self)  # raises the core's "not held" error
            return
        locks: DjangoConnectionLocks = borrowed.state  # type: ignore[assignment]
        opened_on = self._atomic_on
        if opened_on is not None and connections[self.using] is not opened_on:
            # The atomic() block this lock opened belongs to its thread's connection:
            # another thread's release would pop a holder and, at the block's holder,
            # run __exit__ on its own thread's connection, leaving this one in a
            # transaction that keeps the lock while the object says it let go.
            raise LockUsageError(
                f"transaction lock {self.name!r} opened an atomic() block in the thread "
                "that acquired it; release it in that thread (Django's transactions "
                "belong to their thread)"
            )
        # Inside the caller's own atomic() block too, before a holder is counted out.
        self._refuse_another_thread(locks)
        atomic = atomics.pop()
        if atomic is not None:
            self._atomic_on = None
        try:
            try:
                AdvisoryLock.release(self)
            except LockLost as error:
                locks.released(holding, "lost")
                raise self._lost(locks, holding, error) from error.__cause__
            except DatabaseError as error:
                if not self._connection_gone(error):
                    raise
                locks.released(holding, "lost")
                raise self._lost_connection(error) from error
            # An unlock the server ran was forgotten and reported by the lock already;
            # only a request's list of its locks may still name it.
            if (
                not holding.active
                and locks.request_holdings
                and holding not in locks.pending_release
            ):
                locks.released(holding, "unlock")
        except StatementRefused:
            # Refused unsent (a psycopg pipeline): still held, by the server and this
            # object, to be released again.
            atomics.append(atomic)
            if atomic is not None:
                self._atomic_on = opened_on
            raise
        except BaseException as error:
            if atomic is not None:
                atomic.__exit__(type(error), error, error.__traceback__)
            raise
        if atomic is not None:
            # Commits (or, after an exception in the block, rolls back) the transaction
            # this lock opened; its commit hook then reports the release.
            atomic.__exit__(exc_type, exc, traceback)
            self._finish_pending()

    def _lost(self, locks: DjangoConnectionLocks, holding: Holding, error: LockLost) -> LockLost:
        """``error``, or a LockLost that says why this app let go of the lock."""
        reason = locks.end_reason(holding)
        if reason is None:
            return error
        return LockLost(f"advisory lock {self.name!r} was released: {reason}", name=self.name)

    def _raise_if_connection_gone(self, error: DatabaseError) -> None:
        """An acquire failed with ``error``: when the connection is gone, say so."""
        if self._connection_gone(error):
            raise LockConnectionLost(
                f"could not take advisory lock {self.name!r}: the connection to "
                f"database {self.using!r} failed ({error}); Django opens a new one "
                "at its next use",
                name=self.name,
            ) from error

    def _lost_connection(self, error: DatabaseError) -> LockLost:
        return LockLost(
            f"advisory lock {self.name!r} was lost: the connection to database "
            f"{self.using!r} failed ({error})",
            name=self.name,
        )

    def _connection_gone(self, error: DatabaseError) -> bool:
        """Whether ``error`` means this thread's connection to the database is gone, by
        the backend's error codes or else by Django's own health check; Django then
        opens a new connection at its next use (as it would after any query failed so)."""
        wrapper = connections[self.using]
        gone = self._site.backend.is_connection_failure(error) or (
            # Only outside a transaction: inside one, a failed statement fails the health
            # check's query too, although the connection is fine.
            wrapper.connection is not None
            and wrapper.get_autocommit()
            and not connection_usable(wrapper)
        )
        if gone and wrapper.connection is not None:
            wrapper.close()
        return gone

    def _finish_pending(self) -> None:
        wrapper = connections[self.using]
        if wrapper.connection is not None and not wrapper.in_atomic_block:
            locks = connection_locks(wrapper)
            if locks.pending_release:
                release_pending(
                    locks, DjangoExecutor(wrapper, wrapper.connection, locks.driver_state)
                )

    def __enter__(self) -> DjangoAdvisoryLock:
        if self.skip_if_locked:
            raise TypeError(
                "skip_if_locked=True only works when decorating a function; in a with "
                "block use `if lock.acquire():` ... `lock.release()`"
            )
        if not self.acquire():
            raise self._not_acquired()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.options.transaction:
            self._release(exc_type, exc, traceback)
        else:
            self.release()

    # -- async ----------------------------------------------------------------------------

    async def aacquire(self) -> bool:
        """[acquire][advisory_locks_django.DjangoAdvisoryLock.acquire] from async code.

        It runs in the thread Django gives sync work (``thread_sensitive=True``).
        Cancelling the awaiting task (``asyncio.wait_for``, ``asyncio.timeout``, a client
        that went away) ends the wait at once: the server is asked to cancel it, and a
        grant that raced the cancel is given back, so an abandoned wait never holds the
        lock afterwards.
        """
        self._refuse_async_transaction()
        wait = AbandonableWait()
        acquiring = asyncio.ensure_future(
            sync_to_async(self._acquire_unless_abandoned, thread_sensitive=True)(wait)
        )
        try:
            return await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            await self._abandon(wait, acquiring)
            raise

    def _acquire_unless_abandoned(self, wait: AbandonableWait) -> bool:
        """``acquire()`` in the worker thread, bracketed so the awaiting task can abandon
        it (see ``AbandonableWait``)."""
        wrapper = connections[self.using]
        own_connection(wrapper)
        backend = self._site.backend
        state = connection_locks(wrapper, backend).driver_state
        opener = functools.partial(open_other_connection, self.using)
        if not wait.begin(backend, state, wrapper.connection, opener):
            return False
        try:
            granted = self.acquire()
        except BaseException as error:
            if not wait.end():
                raise
            if not isinstance(error, AdvisoryLockError):
                # An abandoned wait that ended some other way than a refusal: make sure
                # nothing it may have been granted lives on.
                _close_quietly(self.using)
            return False
        if wait.end() and granted:
            self._give_back()
            return False
        return granted

    async def _abandon(self, wait: AbandonableWait, acquiring: asyncio.Future[bool]) -> None:
        phase = wait.abandon()
        if phase == AbandonableWait.PENDING:
            # The worker had not started; it will see the wait abandoned and not acquire.
            acquiring.add_done_callback(_retrieve)
            return
        if phase == AbandonableWait.WAITING:
            interrupting = asyncio.get_running_loop().run_in_executor(None, wait.interrupt)
            try:
                await _finish(interrupting)
            except Exception:
                logger.warning(
                    "could not cancel the wait for advisory lock %r; it is given back when granted",
                    self.name,
                    exc_info=True,
                )
                acquiring.add_done_callback(_retrieve)
                return
        # Interrupted, the worker ends within a round trip (and gives back a grant that
        # raced the cancel); finished, its grant is ours to give back.
        try:
            granted = await _finish(acquiring)
        except Exception:
            return
        if granted and phase == AbandonableWait.FINISHED:
            await _finish(
                asyncio.ensure_future(sync_to_async(self._give_back, thread_sensitive=True)())
            )

    def _give_back(self) -> None:
        try:
            self.release()
        except Exception:
            logger.warning(
                "giving back advisory lock %r after its wait was abandoned failed; closing "
                "the connection",
                self.name,
                exc_info=True,
            )
            _close_quietly(self.using)

    async def arelease(self) -> None:
        """[release][advisory_locks_django.DjangoAdvisoryLock.release] from async code."""
        await sync_to_async(self.release, thread_sensitive=True)()

    async def __aenter__(self) -> DjangoAdvisoryLock:
        if self.skip_if_locked:
            raise TypeError("skip_if_locked=True only works when decorating a function")
        if not await self.aacquire():
            raise self._not_acquired()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.arelease()

    def _refuse_async_transaction(self) -> None:
        if self.transaction:
            raise UnsupportedFeature(
                "transaction=True cannot be held across awaits: Django runs transactions "
                "in sync code only. Decorate a sync function with this lock and call it "
                "through sync_to_async()"
            )

    # -- decorator ------------------------------------------------------------------------

    def __call__(self, function: F) -> F:
        """Decorate ``function``: each call runs under its own lock.

        A ``str`` name may use ``{argument}`` fields, formatted from the call's arguments
        (``"sync-account-{account_id}"``, ``"{self.pk}"``); a callable name is called with
        the same arguments as the function and returns the name.
        """
        name_for = _name_factory(self._name, function)
        using, timeout, shared, transaction = (
            self.using,
            self.timeout,
            self.shared,
            self.transaction,
        )
        scheme, prefix = self.key_scheme, self.key_prefix

        def make_lock(name: LockName) -> DjangoAdvisoryLock:
            # As advisory_lock() makes one: positional, no keyword dict.
            lock: DjangoAdvisoryLock = _new(DjangoAdvisoryLock)
            lock._setup(name, using, timeout, shared, transaction, False, scheme, prefix)
            return lock

        skip = self.skip_if_locked

        if inspect.iscoroutinefunction(function):
            self._refuse_async_transaction()

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                lock = make_lock(name_for(args, kwargs))
                if not await lock.aacquire():
                    if skip:
                        return None
                    raise lock._not_acquired()
                try:
                    return await function(*args, **kwargs)
                finally:
                    await lock.arelease()

            return cast(F, run_async)

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            lock = make_lock(name_for(args, kwargs))
            if not lock.acquire():
                if skip:
                    return None
                raise lock._not_acquired()
            try:
                result = function(*args, **kwargs)
            except BaseException as error:
                lock._release(type(error), error, error.__traceback__)
                raise
            lock._release(None, None, None)
            return result

        return cast(F, run)

    # -- helpers --------------------------------------------------------------------------

    def _key_info(self) -> LockKey:
        if self._atomics is None:
            raise _decorator_only()
        return self.key_info

    def __repr__(self) -> str:
        if self._atomics is None:
            return f"<DjangoAdvisoryLock {self._name!r} using={self.using!r}>"
        state = "held" if self.held else "not held"
        return f"<DjangoAdvisoryLock {self.name!r} key={self.key!r} using={self.using!r} {state}>"


_new = object.__new__

# What a lock's arguments other than its name and key options decide -- that they are
# valid, the settings it defaults from, its LockOptions and its alias's site -- for each
# combination already seen, since an application makes its locks with a handful of
# them. Found under the settings of the moment: emptied when ADVISORY_LOCKS or DATABASES
# change (as the settings' own cache and the sites are).
_prepared: dict[tuple[object, ...], tuple[LockSettings, LockOptions, DjangoSite]] = {}
_PREPARED_LIMIT: Final = 256


def _prepare(
    seen: tuple[object, ...],
    using: object,
    timeout: Timeout | _Default,
    shared: bool,
    transaction: bool | _Default,
    skip_if_locked: bool,
) -> tuple[LockSettings, LockOptions, DjangoSite]:
    """Validate a lock's arguments (but its name and key options) and find what they
    decide; remember it under ``seen`` (the arguments with their types) for the next
    lock made with the same ones."""
    defaults = lock_settings()
    if not isinstance(using, str):
        raise TypeError(f"using must be a database alias, not {type(using).__name__}")
    options = lock_options(
        defaults.timeout if timeout is DEFAULT else timeout,
        shared,
        defaults.transaction if transaction is DEFAULT else transaction,
        timeout_first=True,
    )
    if not isinstance(skip_if_locked, bool):
        raise TypeError("skip_if_locked must be True or False")
    prepared = defaults, options, site_for_alias(using)
    # Not before the app's installation was checked (apps still loading), so that the
    # next lock's lock_settings() checks it.
    if app_checked() and len(_prepared) < _PREPARED_LIMIT:
        # (Arguments that passed are hashable: a str alias, bools, None or a number.)
        _prepared[seen] = prepared
    return prepared


def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in (SETTING, "DATABASES"):
        _prepared.clear()


setting_changed.connect(_settings_changed, dispatch_uid="advisory_locks_django.locks")


def _decorator_only() -> TypeError:
    return TypeError(
        "this lock's name is computed from a function's arguments; use it as a decorator"
    )


def _name_factory(
    name: NameSpec, function: Callable[..., Any]
) -> Callable[[tuple[Any, ...], Mapping[str, Any]], LockName]:
    """How a decorated function's call arguments become its lock name."""
    if callable(name):
        compute = name
        return lambda args, kwargs: compute(*args, **kwargs)
    if not isinstance(name, str):
        return lambda args, kwargs: name
    fields = {
        field.split(".")[0].split("[")[0]
        for _, field, _, _ in string.Formatter().parse(name)
        if field is not None
    }
    if not fields:
        literal = name.format_map({})  # "{{" stands for a literal brace
        return lambda args, kwargs: literal
    signature = inspect.signature(function)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    missing = sorted(fields - set(signature.parameters))
    if "" in fields or (missing and not accepts_any):
        raise TypeError(
            f"lock name {name!r} uses {missing or ['{}']}, which {function.__qualname__}() "
            "has no parameter for; write {{ and }} for literal braces"
        )

    def format_name(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> LockName:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for parameter in signature.parameters.values():
            if parameter.kind is parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
        return name.format_map(arguments)

    return format_name


async def _finish(future: asyncio.Future[T]) -> T:
    """Await ``future`` to its end even if this task is cancelled again meanwhile."""
    while True:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                raise


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Nobody awaits an abandoned acquire any more; consume its outcome quietly.
    if not future.cancelled():
        future.exception()


def _close_quietly(using: str) -> None:
    try:
        connections[using].close()
    except DatabaseError:
        logger.warning("closing the connection to %r failed", using, exc_info=True)


# Django's signals are sent for this app's locks, from the core's lock events.
signals.forward_lock_events(DjangoAdvisoryLock)
