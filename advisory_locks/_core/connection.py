"""What one driver connection holds, and the machinery every binding needs for it.

Holdings are counted per connection (per SQLAlchemy Session for session locks taken
through a Session), never per thread or per lock object: two threads or tasks sharing one
connection would otherwise both believe they own the lock.

A binding keeps one ``ConnectionState`` per driver connection, for exactly as long as
that connection lives (SQLAlchemy: in the pool entry's ``info``; Django: on the
``DatabaseWrapper`` beside the DB-API connection it describes; raw drivers: keyed by the
connection object). The rules that do not depend on the binding live here, once: the
server check (imitations, poolers), postponed unlocks, and forgetting a connection that is
gone.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final

from advisory_locks._core import events
from advisory_locks._core.events import EventSource, LockEvent
from advisory_locks._core.executors import (
    StatementRefused,
    protocol_session_id,
    socket_descriptor,
)
from advisory_locks._core.steps import Executor, Statement, Steps, on
from advisory_locks._dialects.base import SERVER_SESSION_STATE, WAIT_CANCELLED_STATE
from advisory_locks.errors import LockUsageError, UnsupportedFeature
from advisory_locks.keys import LockKey, LockName

if TYPE_CHECKING:
    from advisory_locks._dialects.base import Backend

__all__ = [
    "AbandonableWait",
    "ConnectionState",
    "Holding",
    "PoolerMode",
    "check_server",
    "current_process_id",
    "finish_pending_releases",
    "inherited_connection_error",
    "opened_before_fork",
    "report_grant",
    "report_loss",
    "server_checked",
]

logger = logging.getLogger("advisory_locks")

HoldingKey = tuple[Hashable, bool, bool]

POOLER_MODES: Final = ("transaction", "session", "none")
PoolerMode = str

TRANSACTION_POOLING: Final = (
    "A transaction pooler (PgBouncer pool_mode=transaction) may run each transaction on "
    "another server connection, leaving a session lock behind on one that other clients "
    "then use: take the lock with transaction=True inside a transaction instead."
)


class Holding:
    """One lock the server holds for a connection, however many times it was taken.

    Made for every acquisition (see ``ConnectionState.find_or_prepare``), so the attributes a
    new holding shares with every other are class attributes until set on it: its
    ``__init__`` sets five, not twelve.
    """

    # Savepoint depth at which a transaction lock was taken: rolling back a savepoint
    # at or above it makes PostgreSQL release the lock.
    depth: int
    # Where its connection's state files it (ConnectionState._entry).
    entry: HoldingKey | None
    count: int = 0
    active: bool = True
    # Set when the grant was reported to event listeners (``advisory_locks._core.events``):
    # only then is its end reported, once.
    granted_at: float | None = None
    source: EventSource | None = None
    end_reported: bool = False
    loss_reported: bool = False
    # The statement that gives a session lock back, made before the lock statement was
    # sent (None: made at release), so that a release sends its unlock at once.
    unlock: Statement | None = None
    # Filed in its connection's state (``ConnectionState.insert``): granted.
    filed: bool = False

    def __init__(
        self,
        key: LockKey,
        shared: bool,
        transaction: bool,
        depth: int = 0,
        entry: HoldingKey | None = None,
    ) -> None:
        self.key = key
        self.shared = shared
        self.transaction = transaction
        self.depth = depth
        self.entry = entry

    def __repr__(self) -> str:
        return (
            f"Holding(key={self.key!r}, shared={self.shared}, transaction={self.transaction}, "
            f"depth={self.depth}, count={self.count}, active={self.active})"
        )

    def event(
        self,
        kind: events.EventKind,
        source: EventSource,
        *,
        waited: float | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
    ) -> LockEvent:
        """An event about this holding (``held`` counted from a reported grant)."""
        granted_at = self.granted_at
        held = None
        if granted_at is not None and kind != "acquired":
            held = time.monotonic() - granted_at
        return LockEvent(
            kind,
            self.key.name,
            self.key.value,
            source.system,
            "shared" if self.shared else "exclusive",
            "transaction" if self.transaction else "session",
            source.binding,
            source.database,
            waited=waited,
            held=held,
            reason=reason,
            error=error,
            granted_at=granted_at,
        )


def report_grant(holding: Holding, source: EventSource, waited: float) -> None:
    """The server just granted ``holding``; tell the listeners."""
    holding.granted_at = time.monotonic()
    holding.source = source
    events.emit(holding.event("acquired", source, waited=waited))


def report_end(holding: Holding, reason: str) -> None:
    """The server let go of ``holding``: tell the listeners, once, if they saw the grant."""
    source = holding.source
    if source is None or holding.end_reported or not events.listeners:
        return
    holding.end_reported = True
    events.emit(holding.event("released", source, reason=reason))


def report_loss(
    holding: Holding, source: EventSource, reason: str, error: BaseException | None = None
) -> None:
    """A holder just learned (LockLost) that ``holding`` is gone; tell the listeners once."""
    if holding.loss_reported or not events.listeners:
        return
    holding.loss_reported = True
    events.emit(holding.event("lost", holding.source or source, reason=reason, error=error))


@dataclass(eq=False)
class ConnectionState:
    """Locks taken through this library on one driver connection, and what is known of it."""

    holdings: dict[HoldingKey, Holding] = field(default_factory=dict)
    savepoints: list[str] = field(default_factory=list)
    # Session locks whose unlock could not run because the caller's transaction had
    # failed; they are released as soon as that transaction ends.
    pending_release: list[Holding] = field(default_factory=list)
    mutex: threading.RLock = field(default_factory=threading.RLock)
    # The backend that took them, so a pool guard can give them back.
    backend: Backend | None = None
    # Lives exactly as long as the driver connection: backends keep their per-connection
    # cache here (SQLite's open lock files, whether the server is MariaDB).
    driver_state: dict[str, Any] = field(default_factory=dict)
    # Whether statements reach another server session than the driver connected to (a
    # pooler or proxy in between); None until the server was asked.
    behind_proxy: bool | None = None
    # The process that opened the driver connection (a binding that learns it at connect
    # passes it; else the one that made this state). A forked child inherits the
    # connection's socket or file descriptors, but not the locks: those stay the parent's.
    pid: int = field(default_factory=lambda: current_process_id())
    # Called in a forked child for a connection that carries locks of the parent: the
    # binding cuts the child's handles on it (an ORM pool would otherwise roll it back,
    # reset or close it when the child drops them, through the parent's socket).
    fork_hook: Callable[[], None] | None = None
    # Whether this process is a fork of the one that opened the connection: asked several
    # times per lock, so kept rather than computed (the fork hook below sets it again).
    inherited: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.inherited = self.pid != _process_id
        _STATES.add(self)

    # Whether observe() has anything to do: the lock asks before each call.
    observes: ClassVar[bool] = False
    # Whether the binding learns of every end of a transaction or savepoint on this
    # connection as it happens (SQLAlchemy's and Django's hooks), so that an active
    # transaction holding is certainly one of the current transaction. A raw driver
    # connection may commit and begin the next transaction between two calls of the
    # library: there, a lock object holding a transaction lock asks the server again.
    sees_transaction_ends: ClassVar[bool] = True

    def observe(self) -> None:
        """Catch up, without a round trip, with what happened to the driver connection
        since the library last looked.

        Bindings that get events (SQLAlchemy, Django) keep the record current as things
        happen and need nothing here. A raw driver connection has no events: its state
        overrides this (and sets ``observes``) to read the driver (closed, handed back
        to a pool that reset it, transaction ended), and the lock calls it before
        trusting a holding.
        """

    def find(self, key: LockKey, *, shared: bool, transaction: bool) -> Holding | None:
        backend = self.backend  # _entry(), written out: asked on every acquire
        identity = (
            key.ints if backend is None or backend.locks_by_ints else backend.lock_identity(key)
        )
        holding = self.holdings.get((identity, shared, transaction))
        return holding if holding is not None and holding.active else None

    def find_or_prepare(self, key: LockKey, shared: bool, transaction: bool) -> Holding:
        """``find`` in one lookup, and where it finds nothing, the holding a grant of
        ``key`` will add (not ``filed`` yet), made before the lock statement is sent:
        between the grant and ``acquire()`` returning, a waiter that was handed the lock
        then only files it (``insert``), which shortens every handoff."""
        backend = self.backend  # _entry(), written out: run on every acquisition
        identity = (
            key.ints if backend is None or backend.locks_by_ints else backend.lock_identity(key)
        )
        entry = (identity, shared, transaction)
        holding = self.holdings.get(entry)
        if holding is not None and holding.active:
            return holding
        # The savepoint depth cannot change while this connection runs the lock statement.
        return Holding(key, shared, transaction, len(self.savepoints), entry)

    def insert(self, holding: Holding) -> Holding:
        """File ``holding`` (from ``find_or_prepare``, so with its ``entry``), which the
        server just granted."""
        holding.filed = True
        with self.mutex:
            self.holdings[holding.entry] = holding  # type: ignore[index]
        return holding

    def forget(self, holding: Holding) -> None:
        entry = holding.entry
        if entry is None:
            entry = self._entry(holding.key, holding.shared, holding.transaction)
        with self.mutex:
            holding.active = False
            if self.holdings.get(entry) is holding:
                del self.holdings[entry]

    def end(self, holding: Holding, reason: str) -> None:
        """The server no longer holds ``holding`` (``reason`` as a ``released`` event
        says it): forget it, and report its end."""
        self.forget(holding)  # a binding's state may forget more (Django's commit hooks)
        if holding.source is not None:  # report_end's first test, asked before the call
            report_end(holding, reason)

    def _entry(self, key: LockKey, shared: bool, transaction: bool) -> HoldingKey:
        # What the server locks on decides which holdings are one lock: the integer key
        # on PostgreSQL, the GET_LOCK name on MySQL (two names whose keys collide are two
        # locks there).
        identity = key.ints if self.backend is None else self.backend.lock_identity(key)
        return identity, shared, transaction

    def session_holdings(self) -> list[Holding]:
        return [h for h in self.holdings.values() if not h.transaction] + self.pending_release

    def holds_session_locks(self) -> bool:
        """``bool(session_holdings())``, without building the list."""
        # A copy of the holdings: see names().
        return bool(self.pending_release) or any(
            not holding.transaction for holding in list(self.holdings.values())
        )

    def names(self) -> list[LockName]:
        # A copy first: another thread's lock may file or forget a holding meanwhile
        # (current_advisory_locks(pool) reads every borrow's state).
        return [h.key.name for h in list(self.holdings.values()) if h.active]

    def transaction_ended(self, reason: str) -> None:
        """The server released every transaction lock (``reason``: ``"commit"``,
        ``"rollback"``, or ``"transaction_ended"`` where the binding cannot tell which);
        forget them."""
        with self.mutex:
            self.savepoints.clear()
            ended = [h for h in self.holdings.values() if h.transaction]
            for holding in ended:
                self.forget(holding)
        for holding in ended:
            report_end(holding, reason)

    def savepoint_started(self, name: str) -> None:
        with self.mutex:
            self.savepoints.append(name)

    def savepoint_rolled_back(self, name: str) -> None:
        with self.mutex:
            depth = self._truncate_savepoints(name)
            if depth is None:
                return
            ended = [h for h in self.holdings.values() if h.transaction and h.depth > depth]
            for holding in ended:
                self.forget(holding)
        for holding in ended:
            report_end(holding, "rollback")

    def savepoint_released(self, name: str) -> None:
        with self.mutex:
            depth = self._truncate_savepoints(name)
            if depth is None:
                return
            # Locks taken inside a released savepoint now belong to its parent.
            for holding in self.holdings.values():
                if holding.transaction and holding.depth > depth:
                    holding.depth = depth

    def _truncate_savepoints(self, name: str) -> int | None:
        for depth in range(len(self.savepoints) - 1, -1, -1):
            if self.savepoints[depth] == name:
                del self.savepoints[depth:]
                return depth
        return None

    def connection_gone(self) -> list[Holding]:
        """The driver connection closed or was discarded: the server let go of its locks.

        Forget them all (so a release reports LockLost instead of reaching for a
        connection that is gone), let a backend that holds locks in this process (SQLite's
        files) free them now, and return what was held.
        """
        with self.mutex:
            gone = [*self.holdings.values(), *self.pending_release]
            for holding in gone:
                self.forget(holding)
            self.pending_release.clear()
            self.savepoints.clear()
        backend: object = self.backend
        closed = getattr(backend, "connection_closed", None)
        if callable(closed) and not self.inherited:
            closed(self.driver_state)
        if not self.inherited:
            for holding in gone:
                report_end(holding, "connection_closed")
        return gone


def inherited_connection_error(name: LockName, state: ConnectionState) -> LockUsageError:
    """The error for taking a lock, in a forked child, on a connection its parent opened."""
    return LockUsageError(
        f"lock {name!r} cannot be taken on this connection: process {state.pid} opened it, "
        "and this process is a fork of that one, so the connection (and every lock on it) "
        "is the parent's. Open the child's own connections and pools after the fork (with "
        "SQLAlchemy, call engine.dispose(close=False) first thing in the child; with "
        "Django, close the connections before forking)"
    )


def server_checked(state: ConnectionState, pooler: object) -> bool:
    """Whether ``check_server`` would send nothing and refuse nothing: the server was asked
    already, statements reach it directly, and no pooler is declared. Every lock after a
    connection's first is this case; testing it costs less than running the steps."""
    return pooler is None and state.behind_proxy is False


def check_server(
    state: ConnectionState,
    executor: object,
    driver_connection: Any,
    *,
    pooler: object,
    session_lock: bool,
    declare_pooler: str,
    transaction_pooler_declared: str = "it is declared to be behind a transaction pooler",
) -> Steps[None]:
    """Refuse servers that only imitate advisory locks, and session locks through a
    pooler or proxy that is not declared; the server is asked once per connection.

    ``pooler`` is what the application declared ("transaction", "session", "none" or
    None); ``declare_pooler`` says how to declare one with this binding, and
    ``transaction_pooler_declared`` where the application declared a transaction pooler.
    """
    if pooler is not None and pooler not in POOLER_MODES:
        raise ValueError(f"the pooler declaration must be one of {POOLER_MODES}, not {pooler!r}")
    if session_lock and pooler == "transaction":
        raise UnsupportedFeature(
            f"session advisory locks are refused: {transaction_pooler_declared}. "
            f"{TRANSACTION_POOLING}"
        )
    if state.behind_proxy is None and not state.inherited:
        # (An inherited connection is refused before any lock statement; asking its
        # server would already be a statement in the parent's session.)
        assert state.backend is not None
        server_id = yield from on(executor, state.backend.inspect_server(state.driver_state))
        state.driver_state[SERVER_SESSION_STATE] = server_id
        client_id = protocol_session_id(driver_connection)
        state.behind_proxy = client_id is not None and client_id != server_id
    if session_lock and state.behind_proxy and pooler is None:
        raise UnsupportedFeature(
            "session advisory locks are refused on this connection: it reaches the server "
            "through a pooler or proxy (the server process id the driver was told at "
            f"connect is not the one its statements run in). {TRANSACTION_POOLING} If the "
            f"pooler pins each client to one server connection (pool_mode=session), declare "
            f"it: {declare_pooler}"
        )


def finish_pending_releases(state: ConnectionState, executor: object) -> Steps[list[Holding]]:
    """Unlock the session locks whose release waited for a failed transaction to end.

    Run once that transaction has ended; taking one of these names again first would
    stack on the server, and the later unlock would leave it held.
    """
    holdings = list(state.pending_release)
    state.pending_release.clear()
    backend = state.backend
    if backend is None or state.inherited:
        return []
    for done, holding in enumerate(holdings):
        try:
            yield from on(
                executor, backend.release(state.driver_state, holding.key, shared=holding.shared)
            )
        except StatementRefused:
            # Refused unsent (a psycopg pipeline): the server still holds these, so they
            # stay postponed, for the next lock or transaction end on the connection.
            state.pending_release[:0] = holdings[done:]
            return holdings[:done]
        report_end(holding, "unlock")
    return holdings


def release_session_locks(state: ConnectionState, executor: object) -> Steps[list[Holding]]:
    """Unlock every session lock still recorded on a connection that is about to be reused
    by someone else (each was taken once on the server); return them. Their end is
    reported as ``"connection_closed"``: their holders' connection went back to its pool."""
    holdings = state.session_holdings()
    state.pending_release.clear()
    for holding in holdings:
        state.forget(holding)
    backend = state.backend
    if backend is None or state.inherited:
        return holdings
    for holding in holdings:
        yield from on(
            executor, backend.release(state.driver_state, holding.key, shared=holding.shared)
        )
        report_end(holding, "connection_closed")
    return holdings


# Every live state, so that a forked child can find the connections its parent's locks
# are on (weak: a state lives exactly as long as its driver connection).
_STATES: weakref.WeakSet[ConnectionState] = weakref.WeakSet()


# This process's id, kept current by the fork hook below: asked on every lock, and a
# system call each time otherwise.
_process_id: int = os.getpid()


def current_process_id() -> int:
    """``os.getpid()``, without the system call."""
    return _process_id


# Set in a forked child: the process it was forked from, and the sockets open at the fork,
# as (device, inode). A driver connection on one of those sockets was opened before the
# fork, by that process or one before it, whether or not this library had seen it there:
# its server session is the parent's.
_forked_from: int = 0
_inherited_sockets: frozenset[tuple[int, int]] = frozenset()


def opened_before_fork(
    connection: Any, socket_of: Callable[[Any], int | None] | None = None
) -> int:
    """The process a driver connection belongs to, when this process is a fork and the
    connection's socket was open at the fork (0 otherwise: opened here, or no socket).

    ``socket_of`` finds the socket's descriptor (``socket_descriptor`` by default). For
    bindings that may first meet a connection in a forked child (the raw drivers have no
    connect hook; a SQLAlchemy pool's connection may predate the hook; Django's may carry
    no lock yet): asked when a binding first meets a connection. A socket's inode is its own
    for as long as it is open, so a socket the child opened later is never mistaken for
    an inherited one, even on a reused descriptor number.
    """
    if not _inherited_sockets:  # not a fork: nothing to look at
        return 0
    fd = (socket_of or socket_descriptor)(connection)
    if fd is None:
        return 0
    try:
        status = os.fstat(fd)
    except (OSError, ValueError):
        return 0
    return _forked_from if (status.st_dev, status.st_ino) in _inherited_sockets else 0


def _open_sockets() -> frozenset[tuple[int, int]]:
    """The sockets this process has open now, as (device, inode)."""
    try:
        # Linux: /proc/self/fd. Elsewhere /dev/fd may list only some (FreeBSD without
        # fdescfs: 0 to 2), and the check then misses what it does not list.
        descriptors = os.listdir("/dev/fd")
    except OSError:
        return frozenset()
    found = set()
    for descriptor in descriptors:
        try:
            status = os.fstat(int(descriptor))
        except (OSError, ValueError):
            continue  # the listing's own descriptor, closed by now
        if stat.S_ISSOCK(status.st_mode):
            found.add((status.st_dev, status.st_ino))
    return frozenset(found)


def _after_fork_in_child() -> None:
    global _process_id, _forked_from, _inherited_sockets
    _forked_from = _process_id
    _process_id = os.getpid()
    _inherited_sockets = _open_sockets()
    for state in list(_STATES):
        state.inherited = state.pid != _process_id
        # A thread of the parent may have held it at the fork; none in the child will
        # ever let it go.
        state.mutex = threading.RLock()
        if state.fork_hook is not None and (state.holdings or state.pending_release):
            try:
                state.fork_hook()
            except Exception:  # a fork must go on; the state stays inherited either way
                logger.debug("cutting an inherited connection failed", exc_info=True)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Opens another connection to the same server, for statements the waiting one cannot run;
# returns its executor and how to close it.
OpenOtherConnection = Callable[[], "tuple[Executor, Callable[[], None]]"]


class AbandonableWait:
    """One acquire, run by a worker thread, that an asyncio task may abandon midway.

    Bindings whose locks block a thread (Django's ``sync_to_async``) use it so that a
    cancelled task neither waits for the lock nor is granted it afterwards. The worker
    calls ``begin()`` before the acquire and ``end()`` after it; the task calls
    ``abandon()``, and ``interrupt()`` (blocking, so from a helper thread) when the wait
    had begun. One mutex orders them, which is what makes it exact:

    - abandoned before ``begin()``: the acquire never runs;
    - abandoned between the two: the server is asked to cancel the wait while the worker
      is still in it (it cannot run another statement before the cancel request has
      reached the server), and ``end()`` tells the worker to give back a grant that won
      the race;
    - abandoned after ``end()``: the worker's outcome stands, and the task owns it.
    """

    PENDING: Final = "pending"
    WAITING: Final = "waiting"
    FINISHED: Final = "finished"

    __slots__ = ("_abandoned", "_cancelled", "_mutex", "_phase", "_target")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._phase = self.PENDING
        self._abandoned = False
        self._cancelled = threading.Event()
        self._target: tuple[Backend, dict[str, Any], Any, OpenOtherConnection] | None = None

    def begin(
        self,
        backend: Backend,
        state: dict[str, Any],
        driver_connection: Any,
        open_other: OpenOtherConnection,
    ) -> bool:
        """The worker is about to wait on ``driver_connection``; False if abandoned already."""
        with self._mutex:
            if self._abandoned:
                return False
            self._target = (backend, state, driver_connection, open_other)
            state[WAIT_CANCELLED_STATE] = self._cancelled
            self._phase = self.WAITING
            return True

    def end(self) -> bool:
        """The worker's acquire has returned or raised; True if it was abandoned meanwhile
        (then the worker must give back what it was granted)."""
        with self._mutex:
            self._phase = self.FINISHED
            if self._target is not None:
                state = self._target[1]
                if state.get(WAIT_CANCELLED_STATE) is self._cancelled:
                    del state[WAIT_CANCELLED_STATE]
            return self._abandoned

    def abandon(self) -> str:
        """The task gives up; returns the phase the worker was in (PENDING, WAITING or
        FINISHED). After WAITING, call ``interrupt()``."""
        with self._mutex:
            if self._phase != self.FINISHED:
                self._abandoned = True
            return self._phase

    def interrupt(self) -> None:
        """Ask the server (or the poll) to end the wait, if the worker is still in it."""
        with self._mutex:
            if self._phase != self.WAITING or self._target is None:
                return
            backend, state, driver_connection, open_other = self._target
            self._cancelled.set()
            _run_elsewhere(backend.cancel_wait(state, driver_connection), open_other)


def _run_elsewhere(steps: Steps[None], open_other: OpenOtherConnection) -> None:
    """Run a backend's statement steps on another connection, opened only if one is yielded."""
    opened: tuple[Executor, Callable[[], None]] | None = None
    result: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                statement = steps.send(result) if error is None else steps.throw(error)
            except StopIteration:
                return
            assert isinstance(statement, Statement)
            if opened is None:
                opened = open_other()
            result = error = None
            try:
                result = opened[0].execute(statement)
            except Exception as raised:
                error = raised
    finally:
        if opened is not None:
            opened[1]()
