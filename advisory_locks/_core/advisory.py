"""The advisory lock: the lock contract implemented on a connection-bound database lock.

The rules (re-entrancy per connection, who may hold the object, what a failed wait or a
lost connection means) are written once, as steps (``advisory_locks._core.steps``); the
sync lock runs them with blocking calls and the async lock awaits them. A binding supplies
the *site*: which connection a lock of each scope runs on, as a ``Borrowed`` connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from advisory_locks._core import events
from advisory_locks._core.connection import (
    ConnectionState,
    Holding,
    inherited_connection_error,
    report_grant,
    report_loss,
)
from advisory_locks._core.contract import (
    AsyncLockContract,
    LockContract,
    LockOptions,
    Timeout,
    Uncopyable,
    not_acquired_error,
    validate_timeout,
)
from advisory_locks._core.events import EventSource, LockEvent
from advisory_locks._core.executors import StatementRefused
from advisory_locks._core.steps import (
    Settle,
    Steps,
    aperform,
    arun_steps,
    on,
    perform,
    run_steps,
)
from advisory_locks._dialects.base import WAIT_CANCELLED_STATE
from advisory_locks.errors import (
    LockConnectionLost,
    LockDeadlock,
    LockLost,
    LockNotAcquired,
    LockTimeout,
    LockUsageError,
)
from advisory_locks.keys import LockKey, LockName

if TYPE_CHECKING:
    from advisory_locks._dialects.base import Backend, StatementSteps

__all__ = [
    "AdvisoryLock",
    "AdvisoryLockSet",
    "AsyncAdvisoryLock",
    "AsyncAdvisoryLockSet",
    "Borrowed",
    "LockSite",
    "StepRunner",
]

logger = logging.getLogger("advisory_locks")

T = TypeVar("T")

# How an async lock runs its steps: SQLAlchemy's asyncio binds run them with blocking
# calls inside SQLAlchemy's greenlet bridge, native asyncio drivers await each request.
StepRunner = Callable[[Steps[Any]], Awaitable[Any]]
# How an async lock runs a blocking lock's acquire or release (SQLAlchemy's greenlet bridge).
BlockingRunner = Callable[[Callable[[], Any]], Awaitable[Any]]


class Borrowed(Protocol):
    """The connection a lock runs on, lent by the binding for as long as the lock is held.

    A binding whose ORM has its own disconnect detection may also give it a method
    ``is_disconnect(error) -> bool``, asked when the backend does not recognise ``error``
    as a lost connection. A site's ``borrow`` raises ``LockConnectionLost`` (from the
    driver's error) when the connection died under a statement the borrow itself ran;
    errors of *opening* a connection are raised as the framework raises them (a refused
    connection and a wrong password look alike there).
    """

    executor: Any
    state: ConnectionState
    in_transaction: bool
    # True where ``done`` gives the connection back itself, leaving ``settle`` nothing
    # to do: a released lock then skips that request.
    settled_by_done: bool

    def done(self) -> None:
        """The lock no longer needs the connection (given back at ``settle``)."""

    def broken(self, error: BaseException) -> None:
        """The connection failed; it must never go back to a pool as if healthy."""

    def settle(self) -> None:
        """Carry out ``done``/``broken`` (blocking)."""

    async def asettle(self) -> None:
        """Carry out ``done``/``broken`` (awaiting)."""


class LockSite(Protocol):
    """Where locks for one bind live (made by a binding).

    Its events name it by a ``binding`` attribute (``"sqlalchemy"``) and, where the
    binding has a name for the database (Django's alias), a ``database`` one.
    """

    backend: Backend

    def held_names(self) -> list[LockName]:
        """Names this library holds through this bind."""


class AdvisoryLock(LockContract):
    """A named database lock, made by [`advisory_lock`][advisory_locks.advisory_lock].

    A context manager (``with`` acquires, raising ``LockNotAcquired`` / ``LockTimeout``
    when busy, and releases at the end, also on an exception) and an explicit
    ``acquire()`` / ``release()`` pair. Do not construct it directly.
    """

    __slots__ = ("_borrowed", "_count", "_holding", "_owner", "_site", "key_info", "options")

    def __init__(self, site: Any, key: LockKey, options: LockOptions) -> None:
        backend = site.backend
        if options.checked_by is not backend:
            backend.check_options(
                shared=options.shared, transaction=options.transaction, timeout=options.timeout
            )
            object.__setattr__(options, "checked_by", backend)
        self._site = site
        self.key_info = key
        self.options = options
        self._count = 0
        # The thread that holds this object (its id), or the task ((thread id, task id)).
        self._owner: int | tuple[int, int] | None = None
        self._borrowed: Borrowed | None = None
        self._holding: Holding | None = None

    # -- the contract ---------------------------------------------------------------------

    @property
    def name(self) -> LockName:
        """The name this lock was made with."""
        return self.key_info.name

    @property
    def key(self) -> int | tuple[int, int]:
        """The key(s) sent to the server."""
        return self.key_info.value

    @property
    def timeout(self) -> Timeout:
        return self.options.timeout

    @property
    def shared(self) -> bool:
        return self.options.shared

    @property
    def transaction(self) -> bool:
        return self.options.transaction

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (a transaction lock until its transaction ends)."""
        holding, borrowed = self._holding, self._borrowed
        if not self._count or holding is None or borrowed is None:
            return False
        state = borrowed.state
        if state.observes:
            state.observe()
        return holding.active and not state.inherited

    @property
    def holding(self) -> Holding | None:
        """The holding this object counts on while it holds the lock."""
        return self._holding if self._count else None

    def acquire(self) -> bool:
        """Take the lock; False when it stayed busy for the whole timeout."""
        # Blocking calls directly, no step driver between the lock and its connection;
        # aacquire() is the same rules, awaited.
        if self._borrowed is None:
            # An object that holds nothing (the usual case: a new one) only needs
            # claiming; _reenter() does that and more.
            self._claim()
            self._count = 0
        elif self._reenter():
            return True
        # A transaction lock this object may still hold, which the server must confirm
        # (see _reenter): its holders are counted in again only if it does.
        kept, carried = self._holding, self._count
        self._count = 0
        site = self._site
        options = self.options
        # No clock is read unless someone listens for events.
        started = time.monotonic() if events.listeners else None
        try:
            try:
                borrowed: Borrowed = site.borrow(transaction=options.transaction)
            except BaseException as error:
                self._borrow_failed(started, error)
            state = borrowed.state
            if state.inherited:
                run_steps(self._refuse_inherited(borrowed), site)
            # The active holding, or one made now and filed once granted: a waiter that
            # is handed the lock returns sooner (see ConnectionState.find_or_prepare),
            # and its release sends the unlock sooner too.
            granting = state.find_or_prepare(self.key_info, options.shared, options.transaction)
            if granting.filed and not carried:
                holding = granting
            else:
                executor = borrowed.executor
                statement, unlock = site.backend.lock_statements(
                    self.key_info,
                    options.shared,
                    options.transaction,
                    options.timeout,
                    borrowed.in_transaction,
                )
                try:
                    if statement is None:
                        granted = perform(executor, self._acquire_steps(borrowed))
                    else:
                        # The usual case: one statement, sent without the steps.
                        try:
                            answer = executor.execute(statement)
                        except BaseException as error:
                            granted = perform(executor, self._acquire_steps(borrowed), error)
                        else:
                            granted = options.timeout != 0 or bool(answer)
                except BaseException as error:
                    run_steps(self._acquire_failed(started, borrowed, error), site)
                if not granted:
                    run_steps(self._refused(started, borrowed), site)
                    return False
                # A holding the server granted again (see _reenter) is filed already, and
                # its grant was reported.
                holding = granting
                if not granting.filed:
                    granting.unlock = unlock
                    state.insert(granting)
                    if started is not None and events.listeners:
                        report_grant(holding, self._source(state), time.monotonic() - started)
            holding.count += 1
            self._count = carried + 1 if holding is kept else 1
            self._borrowed = borrowed
            self._holding = holding
            return True
        finally:
            if not self._count:
                self._owner = None
                if kept is not None:
                    kept.count -= carried

    def release(self) -> None:
        """Give the lock back (a transaction lock stays with its transaction)."""
        # arelease() is the same rules, awaited. First this holder is counted out; the
        # rest runs only for the object's last holder.
        holding, borrowed = self._holding, self._borrowed
        if not self._count or holding is None or borrowed is None:
            raise self._not_held()
        state = borrowed.state
        if state.observes:
            state.observe()
        owner = self._owner
        if owner is not None and owner != _thread_id():  # another thread's (or a task's)
            self._refuse_another_thread(state)
        self._count -= 1
        holding.count -= 1
        if self._count:
            return
        if holding.count > 0 or holding.transaction or state.inherited or not holding.active:
            self._let_go()
            run_steps(self._release_without_unlock(holding, borrowed), self._site)
            return
        # The object lets go after the unlock (see below, "The parts of a release"),
        # which a waiter on the lock need not wait for either.
        statement = holding.unlock
        if statement is None:
            statement = self._site.backend.unlock_statement(
                self.key_info, shared=self.options.shared
            )
        try:
            if statement is None:
                released = perform(borrowed.executor, self._release_steps(state))
            else:
                released = bool(borrowed.executor.execute(statement))
        except StatementRefused:
            self._count_in_again(holding)
            raise
        except BaseException as error:
            self._let_go()
            run_steps(self._release_failed(holding, borrowed, error), self._site)
            return
        self._holding = self._borrowed = None  # self._let_go(), without the call
        self._owner = None
        state.end(holding, "unlock" if released else "lost")
        borrowed.done()
        if not borrowed.settled_by_done:
            borrowed.settle()
        if not released:
            raise self._not_released(holding, state)

    def ensure_held(self) -> None:
        """Ask the server whether it still holds this lock; raise LockLost if not.

        One round trip on the lock's own connection, so call it at safe points of the
        block (before an irreversible step), never from another thread.
        """
        run_steps(self.ensure_held_steps(), self._site)

    def _not_acquired(self) -> LockNotAcquired:
        return not_acquired_error(self.name, self.options.timeout)

    def _connection_lost(self, error: BaseException) -> LockConnectionLost:
        return LockConnectionLost(
            f"advisory lock {self.name!r} was not taken: its connection is gone ({error})",
            name=self.name,
        )

    async def aacquire(self) -> bool:
        """``acquire()`` on a site whose connections are awaited (``aborrow``, awaiting
        executors): the same rules, each request awaited directly."""
        if self._borrowed is None:  # as in acquire()
            self._claim()
            self._count = 0
        elif self._reenter():
            return True
        kept, carried = self._holding, self._count
        self._count = 0
        site = self._site
        options = self.options
        started = time.monotonic() if events.listeners else None
        try:
            try:
                borrowed: Borrowed = await site.aborrow(transaction=options.transaction)
            except BaseException as error:
                self._borrow_failed(started, error)
            state = borrowed.state
            if state.inherited:
                await arun_steps(self._refuse_inherited(borrowed), site)
            # As in acquire(): the active holding, or the one a grant files.
            granting = state.find_or_prepare(self.key_info, options.shared, options.transaction)
            if granting.filed and not carried:
                holding = granting
            else:
                executor = borrowed.executor
                statement, unlock = site.backend.lock_statements(
                    self.key_info,
                    options.shared,
                    options.transaction,
                    options.timeout,
                    borrowed.in_transaction,
                )
                try:
                    if statement is None:
                        granted = await aperform(executor, self._acquire_steps(borrowed))
                    else:
                        try:
                            answer = await executor.execute(statement)
                        except BaseException as error:
                            granted = await aperform(executor, self._acquire_steps(borrowed), error)
                        else:
                            granted = options.timeout != 0 or bool(answer)
                except BaseException as error:
                    await arun_steps(self._acquire_failed(started, borrowed, error), site)
                if not granted:
                    return await arun_steps(self._refused(started, borrowed), site)
                holding = granting
                if not granting.filed:
                    granting.unlock = unlock
                    state.insert(granting)
                    if started is not None and events.listeners:
                        report_grant(holding, self._source(state), time.monotonic() - started)
            holding.count += 1
            self._count = carried + 1 if holding is kept else 1
            self._borrowed = borrowed
            self._holding = holding
            return True
        finally:
            if not self._count:
                self._owner = None
                if kept is not None:
                    kept.count -= carried

    # The parts of an acquire that every way of running it shares.

    def _reenter(self) -> bool:
        """Claim the object for this thread or task; True when it already holds the lock
        (a re-entry: counted, no request).

        False with ``_count`` left set: the object holds a transaction lock on a
        connection whose transaction ends the binding does not see (a raw driver's, whose
        caller may commit and begin the next transaction, or roll a savepoint back,
        between two calls of the library). Counted without a request, it could stand for
        a transaction that has ended, the lock free for anyone: the acquire sends the
        lock statement instead (PostgreSQL grants a transaction lock its own transaction
        holds at once, stacked, so in the same transaction that costs a round trip and
        nothing else). Its holders are counted in again if the holding is still filed
        once the connection is borrowed (a raw borrow asks the server first, and ends
        the holdings of a transaction that ended); otherwise the grant is a new holding.
        """
        kept = self._borrowed
        if kept is not None and kept.state.inherited:
            # A forked child's copy of a held lock: the parent holds it, this process
            # does not, so taking it again is a new acquisition, never a re-entry.
            self._count = 0
            self._holding = self._borrowed = None
            self._owner = None
        self._claim()
        borrowed = self._borrowed
        if borrowed is None:  # a new object, or one whose holders all released it
            self._count = 0
            return False
        state = borrowed.state
        if state.observes:
            state.observe()
        holding = self._holding
        if self._count and holding is not None and holding.active:
            if holding.transaction and not state.sees_transaction_ends:
                return False
            self._count += 1
            holding.count += 1
            return True
        self._count = 0
        return False

    def _claim(self) -> None:
        """Claim the object for this thread or task.

        A lock object's own count stands for one holder. Shared by two threads (a
        module-level lock used like threading.Lock) or two asyncio tasks, the second
        would count itself in without any lock on its own connection: refused instead.
        The owner is the thread, with the asyncio task within it where there is one.
        """
        loop = _running_loop()
        task = None if loop is None else asyncio.current_task(loop)
        owner = _thread_id() if task is None else (_thread_id(), id(task))
        with _CLAIMS:
            if self._owner is not None and self._owner != owner:
                raise LockUsageError(
                    f"lock object {self.name!r} is held by another thread or task; make "
                    "one lock object per use (call advisory_lock(...) where the lock is "
                    "needed)"
                )
            self._owner = owner

    def _refuse_another_thread(self, state: ConnectionState) -> None:
        """Refuse a release from a thread other than the holder's, before any SQL, where
        the lock's connection is its thread's (``site.thread_connections``: Django's).

        The unlock would go out on the holder's thread's connection, which that thread
        may be using for a query right now (on MySQL that breaks the connection), and
        counted out from here the holder's own release would find nothing to release.
        Elsewhere the lock's connection is its own (an Engine's checkout) or the caller's
        to share, and handing a held lock to another thread for its release (an acquire
        run in ``asyncio.to_thread()`` or a worker) stays allowed. Another asyncio task of
        the same thread may release (wait_for() before Python 3.12, gather() and task
        groups run an acquire in a task of their own); a forked child's copy of its
        parent's lock sends nothing, and is let go from any thread.
        """
        owner = self._owner
        if owner is None or state.inherited or not getattr(self._site, "thread_connections", False):
            return
        thread = owner if isinstance(owner, int) else owner[0]
        if thread != _thread_id():
            raise LockUsageError(
                f"lock object {self.name!r} was acquired in another thread; release it in "
                "that thread (its connection belongs to that thread, which may be running "
                "a query on it)"
            )

    def _acquire_steps(self, borrowed: Borrowed) -> StatementSteps[bool]:
        """The backend's whole acquire: where it has no ``lock_statement``, or that raised."""
        options = self.options
        return self._site.backend.acquire(  # type: ignore[no-any-return]
            borrowed.state.driver_state,
            self.key_info,
            shared=options.shared,
            transaction=options.transaction,
            timeout=options.timeout,
            in_transaction=borrowed.in_transaction,
        )

    def _release_steps(self, state: ConnectionState) -> StatementSteps[bool]:
        return self._site.backend.release(  # type: ignore[no-any-return]
            state.driver_state, self.key_info, shared=self.options.shared
        )

    def _borrow_failed(self, started: float | None, error: BaseException) -> NoReturn:
        """The binding could not lend a connection: report it, and raise what it means."""
        if isinstance(error, LockConnectionLost):
            cause = _driver_error(error)
            connection_lost = self._connection_lost(cause)
            self._report_refusal(started, None, connection_lost)
            raise connection_lost from cause
        self._report_refusal(started, None, error)
        raise error

    def _refuse_inherited(self, borrowed: Borrowed) -> Steps[NoReturn]:
        """A forked child may not lock on its parent's connection."""
        borrowed.done()
        yield Settle(borrowed)
        raise inherited_connection_error(self.name, borrowed.state)

    def _acquire_failed(
        self, started: float | None, borrowed: Borrowed, error: BaseException
    ) -> Steps[NoReturn]:
        """The lock statement raised: settle the connection as the error says, then raise."""
        state = borrowed.state
        backend = self._site.backend
        # An interrupted wait (task cancelled, KeyboardInterrupt) leaves the server's
        # answer unknown: asyncpg, for one, stops listening while the server may still
        # grant the lock. Only discarding the connection ensures no one inherits it.
        interrupted = not isinstance(error, Exception)
        gone = isinstance(error, Exception) and _connection_failed(backend, borrowed, error)
        if interrupted or gone:
            borrowed.broken(error)
        else:
            borrowed.done()
        yield Settle(borrowed)
        if gone:
            cause = _driver_error(error)
            connection_lost = self._connection_lost(cause)
            self._report_refusal(started, state, connection_lost)
            raise connection_lost from cause
        self._report_refusal(started, state, error)
        raise error

    def _refused(self, started: float | None, borrowed: Borrowed) -> Steps[bool]:
        """The lock stayed busy: give the connection back; False."""
        borrowed.done()
        yield Settle(borrowed)
        self._report_refusal(started, borrowed.state, None)
        return False

    def _not_held(self) -> LockUsageError:
        message = f"lock {self.name!r} is not held by this lock object"
        held_elsewhere = getattr(self._site, "holds_anywhere", None)
        if callable(held_elsewhere) and held_elsewhere(self.key_info):
            return LockUsageError(
                f"{message}: this process holds it through another lock object (another "
                "thread's or connection's); release it through the object that acquired it"
            )
        return LockUsageError(f"{message}: acquire() it first (or it was already released)")

    def _source(self, state: ConnectionState | None) -> EventSource:
        site = self._site
        binding = getattr(site, "binding", None) or type(site).__module__.rpartition(".")[2]
        return EventSource(
            site.backend.system_name({} if state is None else state.driver_state),
            binding,
            getattr(site, "database", None),
        )

    def _report_refusal(
        self, started: float | None, state: ConnectionState | None, error: BaseException | None
    ) -> None:
        if started is None or not events.listeners:
            return
        if (error is not None and not isinstance(error, Exception)) or _wait_cancelled(state):
            # The caller gave up: a task cancelled (Django's async acquire asks the server
            # to end the wait, which it reports as a timeout), or KeyboardInterrupt.
            reason = "cancelled"
        elif error is None:
            reason = "busy" if self.options.timeout == 0 else "timeout"
        elif isinstance(error, LockDeadlock):
            reason = "deadlock"
        elif isinstance(error, LockTimeout):
            reason = "timeout"
        else:
            reason = "error"
        source = self._source(state)
        options = self.options
        events.emit(
            LockEvent(
                "not_acquired",
                self.name,
                self.key,
                source.system,
                "shared" if options.shared else "exclusive",
                "transaction" if options.transaction else "session",
                source.binding,
                source.database,
                waited=time.monotonic() - started,
                reason=reason,
                error=error,
            )
        )

    def _report_loss(
        self, holding: Holding, state: ConnectionState, reason: str, error: BaseException | None
    ) -> None:
        if events.listeners:
            report_loss(holding, self._source(state), reason, error)

    async def arelease(self) -> None:
        """``release()`` on a site whose connections are awaited (see ``aacquire``)."""
        # Counted out as in release().
        holding, borrowed = self._holding, self._borrowed
        if not self._count or holding is None or borrowed is None:
            raise self._not_held()
        state = borrowed.state
        if state.observes:
            state.observe()
        owner = self._owner
        # A task's owner is (thread, task): another task of this thread may release.
        if owner is not None and (owner if isinstance(owner, int) else owner[0]) != _thread_id():
            self._refuse_another_thread(state)
        self._count -= 1
        holding.count -= 1
        if self._count:
            return
        site = self._site
        if holding.count > 0 or holding.transaction or state.inherited or not holding.active:
            self._let_go()
            await arun_steps(self._release_without_unlock(holding, borrowed), site)
            return
        executor = borrowed.executor
        statement = holding.unlock
        if statement is None:
            statement = site.backend.unlock_statement(self.key_info, shared=self.options.shared)
        try:
            if statement is None:
                released = await aperform(executor, self._release_steps(state))
            else:
                released = bool(await executor.execute(statement))
        except StatementRefused:
            self._count_in_again(holding)
            raise
        except BaseException as error:
            self._let_go()
            await arun_steps(self._release_failed(holding, borrowed, error), site)
            return
        self._let_go()
        state.end(holding, "unlock" if released else "lost")
        borrowed.done()
        if not borrowed.settled_by_done:
            await borrowed.asettle()
        if not released:
            raise self._not_released(holding, state)

    # The parts of a release that every way of running it shares. A release lets go of
    # its holding only once the unlock is sent: until then the object keeps its owner, so
    # no other thread or task can claim it and count itself into a holding that unlock
    # is about to end (see _reenter()).

    def _let_go(self) -> None:
        """The object no longer holds anything, nor belongs to a thread or task."""
        self._holding = self._borrowed = None
        self._owner = None

    def _count_in_again(self, holding: Holding) -> None:
        """Undo the counting out: the unlock was refused before anything was sent (a psycopg
        pipeline), so the server still holds the lock, and this object for its owner."""
        self._count = 1
        holding.count += 1

    def _release_without_unlock(self, holding: Holding, borrowed: Borrowed) -> Steps[None]:
        """The end of a holding that sends no unlock (see the conditions in release())."""
        borrowed.done()
        yield Settle(borrowed)
        if holding.count > 0 or holding.transaction or borrowed.state.inherited:
            # Another holder on this connection still counts on it; a transaction lock
            # is freed by the server when its transaction ends (until then the holding
            # stays registered: taking it again on this connection sends nothing where
            # the binding sees transactions end, one lock statement where it does not);
            # and a forked child never gives back its parent's lock.
            return
        self._report_loss(holding, borrowed.state, "connection_closed", None)
        raise LockLost(
            f"advisory lock {self.name!r} was lost before its block ended (its "
            "connection failed, was closed, or was returned to the pool)",
            name=self.name,
        )

    def _release_failed(
        self, holding: Holding, borrowed: Borrowed, error: BaseException
    ) -> Steps[None]:
        """The unlock statement raised: decide what that means for the lock."""
        state = borrowed.state
        backend = self._site.backend
        if not isinstance(error, Exception):
            # Interrupted (task cancelled, KeyboardInterrupt): whether the server ran
            # the unlock is unknown. Discarding the connection ends the lock either
            # way, and gives the connection back now rather than to the collector.
            state.forget(holding)
            borrowed.broken(error)
            yield Settle(borrowed)
            raise error
        if backend.is_failed_transaction(error):
            # The caller's transaction failed inside the block; the server rejects
            # every statement until it ends, and session locks survive its rollback.
            state.forget(holding)
            state.pending_release.append(holding)
            borrowed.done()
            yield Settle(borrowed)
            logger.debug("release of %r deferred to the end of the transaction", self.name)
            return
        # The library stops tracking it either way; whether the server still holds
        # it is unknown, so its end is reported as a loss, not an unlock.
        state.end(holding, "lost")
        if _connection_failed(backend, borrowed, error):
            borrowed.broken(error)
            yield Settle(borrowed)
            self._report_loss(holding, state, "connection_failed", error)
            raise LockLost(
                f"advisory lock {self.name!r} was lost: its connection failed ({error})",
                name=self.name,
            ) from error
        borrowed.done()
        yield Settle(borrowed)
        raise error

    def _not_released(self, holding: Holding, state: ConnectionState) -> LockLost:
        """The server said it did not hold the lock at the unlock: report the loss."""
        self._report_loss(holding, state, "not_held", None)
        return LockLost(
            f"the server did not hold advisory lock {self.name!r} at release", name=self.name
        )

    def ensure_held_steps(self) -> Steps[None]:
        holding, borrowed = self._holding, self._borrowed
        if not self._count or holding is None or borrowed is None:
            raise self._not_held()
        state = borrowed.state
        state.observe()
        if state.inherited:
            self._report_loss(holding, state, "forked", None)
            raise LockLost(
                f"advisory lock {self.name!r} belongs to the process that took it (pid "
                f"{state.pid}), not to this forked child",
                name=self.name,
            )
        if not holding.active:
            self._report_loss(
                holding,
                state,
                "transaction_ended" if holding.transaction else "connection_closed",
                None,
            )
            reason = (
                "its transaction ended"
                if holding.transaction
                else "its connection failed, was closed, or was returned to the pool"
            )
            raise LockLost(
                f"advisory lock {self.name!r} is no longer held: {reason}", name=self.name
            )
        backend = self._site.backend
        try:
            held = yield from on(
                borrowed.executor,
                backend.is_held(state.driver_state, self.key_info, shared=self.options.shared),
            )
        except Exception as error:
            if not _connection_failed(backend, borrowed, error):
                raise
            state.end(holding, "lost")
            borrowed.broken(error)
            yield Settle(borrowed)
            self._report_loss(holding, state, "connection_failed", error)
            raise LockLost(
                f"advisory lock {self.name!r} was lost: its connection failed ({error})",
                name=self.name,
            ) from error
        if not held:
            # Someone unlocked it on our connection (pg_advisory_unlock_all(), DISCARD ALL):
            # the block must not go on believing it is protected.
            state.end(holding, "lost")
            self._report_loss(holding, state, "not_held", None)
            raise LockLost(
                f"the server no longer holds advisory lock {self.name!r}", name=self.name
            )

    def __repr__(self) -> str:
        state = "held" if self.held else "not held"
        return f"<AdvisoryLock {self.name!r} key={self.key!r} {state}>"


class AsyncAdvisoryLock(AsyncLockContract):
    """The awaitable twin of [`AdvisoryLock`][advisory_locks.AdvisoryLock], for asyncio
    binds: ``async with``, ``await acquire()``, ``await release()``."""

    __slots__ = ("_call", "_lock", "_run")

    def __init__(
        self, lock: AdvisoryLock, run: StepRunner, *, call: BlockingRunner | None = None
    ) -> None:
        self._lock = lock
        # ensure_held() runs as steps, by ``run``.
        self._run = run
        # How acquire and release reach the connection: given ``call``, a runner of
        # blocking code (SQLAlchemy's greenlet bridge), the blocking lock's own acquire
        # and release run in it; without, the site's connections are awaited (aborrow,
        # awaiting executors: asyncpg, psycopg's AsyncConnection) directly.
        self._call = call

    @property
    def name(self) -> LockName:
        return self._lock.name

    @property
    def key(self) -> int | tuple[int, int]:
        return self._lock.key

    @property
    def held(self) -> bool:
        return self._lock.held

    async def acquire(self) -> bool:
        """Take the lock; False when it stayed busy for the whole timeout."""
        call = self._call
        if call is None:
            return await self._lock.aacquire()
        granted: bool = await call(self._lock.acquire)
        return granted

    async def release(self) -> None:
        """Give the lock back (a transaction lock stays with its transaction)."""
        call = self._call
        if call is None:
            await self._lock.arelease()
        else:
            await call(self._lock.release)

    async def ensure_held(self) -> None:
        """Ask the server whether it still holds this lock; raise LockLost if not."""
        await self._run(self._lock.ensure_held_steps())

    def _not_acquired(self) -> LockNotAcquired:
        return self._lock._not_acquired()

    def __repr__(self) -> str:
        return "<Async" + repr(self._lock)[1:]


class AdvisoryLockSet(Uncopyable):
    """Several locks taken in one canonical order (by key) and given back together.

    Two holders that take overlapping sets through this class queue behind each other
    instead of deadlocking, whatever order their names were listed in: both ask for the
    lowest key first. A ``timeout`` bounds the whole acquisition, not each lock.
    """

    __slots__ = ("_refused", "_site", "_taken", "locks", "timeout")

    def __init__(
        self, site: Any, locks: Iterable[AdvisoryLock], *, timeout: Timeout = None
    ) -> None:
        self.timeout = validate_timeout(timeout)
        self._site = site
        unique: dict[tuple[int, tuple[int, ...]], AdvisoryLock] = {}
        for lock in locks:
            ints = lock.key_info.ints
            unique.setdefault((len(ints), ints), lock)
        self.locks: tuple[AdvisoryLock, ...] = tuple(unique[order] for order in sorted(unique))
        self._taken: list[AdvisoryLock] = []
        self._refused: AdvisoryLock | None = None

    @property
    def names(self) -> list[LockName]:
        """The names in the order they are taken."""
        return [lock.name for lock in self.locks]

    @property
    def held(self) -> bool:
        return bool(self._taken) and all(lock.held for lock in self._taken)

    def acquire(self) -> bool:
        """Take every lock in key order; False (holding none) when one stayed busy."""
        deadline = self._deadline()
        taken: list[AdvisoryLock] = []
        try:
            for lock in self.locks:
                self._limit(lock, deadline)
                if not lock.acquire():
                    self._refused = lock
                    _release_all(taken)
                    return False
                taken.append(lock)
        except BaseException:
            _release_all(taken, quietly=True)
            raise
        return self._took(taken)

    def release(self) -> None:
        """Give every lock back, newest first; the first failure is raised after all ran."""
        taken = self._give_back()
        try:
            _release_all(taken)
        except BaseException:
            # A lock whose unlock was refused unsent (StatementRefused) is still held,
            # and so is the set, to be released again.
            self._taken = [lock for lock in taken if lock.held]
            raise

    def ensure_held(self) -> None:
        """[AdvisoryLock.ensure_held][advisory_locks.AdvisoryLock.ensure_held] for every lock of
        the set."""
        run_steps(self.ensure_held_steps(), self._site)

    def ensure_held_steps(self) -> Steps[None]:
        for lock in self._taken:
            yield from lock.ensure_held_steps()

    # The parts of acquire and release that the blocking and the awaiting set share.

    def _deadline(self) -> float | None:
        if self._taken:
            raise LockUsageError("this lock set is already held; release it first")
        return None if not self.timeout else time.monotonic() + self.timeout

    @staticmethod
    def _limit(lock: AdvisoryLock, deadline: float | None) -> None:
        """Give ``lock`` what is left of the set's timeout."""
        if deadline is not None:
            # Zero left means "try once", which is still an answer, not a hang.
            remaining = max(0.0, deadline - time.monotonic())
            lock.options = LockOptions(
                timeout=remaining,
                shared=lock.options.shared,
                transaction=lock.options.transaction,
            )

    def _took(self, taken: list[AdvisoryLock]) -> bool:
        self._taken = taken
        self._refused = None
        return bool(taken) or not self.locks

    def _give_back(self) -> list[AdvisoryLock]:
        if not self._taken and self.locks:
            raise LockUsageError("this lock set is not held")
        taken, self._taken = self._taken, []
        return taken

    def _not_acquired(self) -> LockNotAcquired:
        assert self._refused is not None
        return not_acquired_error(self._refused.name, self.timeout)

    def __enter__(self) -> AdvisoryLockSet:
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
            if not isinstance(exc, LockLost):
                raise

    def __repr__(self) -> str:
        state = "held" if self.held else "not held"
        return f"<AdvisoryLockSet {self.names!r} {state}>"


class AsyncAdvisoryLockSet(Uncopyable):
    """The awaitable twin of [AdvisoryLockSet][advisory_locks.AdvisoryLockSet]."""

    __slots__ = ("_call", "_run", "_set")

    def __init__(
        self, lock_set: AdvisoryLockSet, run: StepRunner, *, call: BlockingRunner | None = None
    ) -> None:
        self._set = lock_set
        # As for AsyncAdvisoryLock: ensure_held() runs as steps, by ``run``; given
        # ``call``, the blocking set's acquire and release run in it, else each lock's
        # are awaited directly.
        self._run = run
        self._call = call

    @property
    def names(self) -> list[LockName]:
        return self._set.names

    @property
    def held(self) -> bool:
        return self._set.held

    async def acquire(self) -> bool:
        """Take every lock in key order; False (holding none) when one stayed busy."""
        lock_set = self._set
        if self._call is not None:
            granted: bool = await self._call(lock_set.acquire)
            return granted
        deadline = lock_set._deadline()
        taken: list[AdvisoryLock] = []
        try:
            for lock in lock_set.locks:
                lock_set._limit(lock, deadline)
                if not await lock.aacquire():
                    lock_set._refused = lock
                    await _arelease_all(taken)
                    return False
                taken.append(lock)
        except BaseException:
            await _arelease_all(taken, quietly=True)
            raise
        return lock_set._took(taken)

    async def release(self) -> None:
        """Give every lock back, newest first; the first failure is raised after all ran."""
        if self._call is not None:
            await self._call(self._set.release)
        else:
            lock_set = self._set
            taken = lock_set._give_back()
            try:
                await _arelease_all(taken)
            except BaseException:
                lock_set._taken = [lock for lock in taken if lock.held]
                raise

    async def ensure_held(self) -> None:
        await self._run(self._set.ensure_held_steps())

    async def __aenter__(self) -> AsyncAdvisoryLockSet:
        if not await self.acquire():
            raise self._set._not_acquired()
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
            if not isinstance(exc, LockLost):
                raise

    def __repr__(self) -> str:
        return "<Async" + repr(self._set)[1:]


def _connection_failed(backend: Backend, borrowed: Borrowed, error: Exception) -> bool:
    """Whether ``error`` means the connection is gone: the backend knows its database's
    codes; the binding's ORM may know more of the driver's ways of saying it."""
    if backend.is_connection_failure(error):
        return True
    is_disconnect = getattr(borrowed, "is_disconnect", None)
    return is_disconnect is not None and bool(is_disconnect(error))


def _wait_cancelled(state: ConnectionState | None) -> bool:
    """Whether an ``AbandonableWait`` asked the server to end this connection's wait."""
    if state is None:
        return False
    cancelled = state.driver_state.get(WAIT_CANCELLED_STATE)
    return isinstance(cancelled, threading.Event) and cancelled.is_set()


def _driver_error(error: BaseException) -> BaseException:
    """The driver's own error behind a binding's LockConnectionLost, else ``error``."""
    if isinstance(error, LockConnectionLost) and error.__cause__ is not None:
        return error.__cause__
    return error


def _release_all(locks: list[AdvisoryLock], *, quietly: bool = False) -> None:
    """Release ``locks`` newest first, every one of them; then raise the first failure
    (unless ``quietly``: the set is already failing with another error)."""
    first_error: BaseException | None = None
    for lock in reversed(locks):
        try:
            lock.release()
        except Exception as error:
            logger.debug("releasing %r from a lock set failed: %s", lock.name, error)
            first_error = first_error or error
    if first_error is not None and not quietly:
        raise first_error


async def _arelease_all(locks: list[AdvisoryLock], *, quietly: bool = False) -> None:
    """``_release_all`` for locks whose connections are awaited."""
    first_error: BaseException | None = None
    for lock in reversed(locks):
        try:
            await lock.arelease()
        except Exception as error:
            logger.debug("releasing %r from a lock set failed: %s", lock.name, error)
            first_error = first_error or error
    if first_error is not None and not quietly:
        raise first_error


_CLAIMS = threading.Lock()
# Read by every acquire (_reenter), without the module attribute lookups.
_running_loop = asyncio._get_running_loop
_thread_id = threading.get_ident


def _new_claims_lock() -> None:
    # In a forked child: a thread of the parent may have held it at the fork.
    global _CLAIMS
    _CLAIMS = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_new_claims_lock)
