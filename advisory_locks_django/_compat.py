"""Every use of Django's private API in this app, in one place.

Checked against Django 4.2, 5.2 and 6.0 (the tests/django suite and the Django fault
specs pass on each; tox.ini's django42/django52/django60 environments run them). Each
function says what it relies on, so a new Django release is checked here and nowhere
else.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend
from django.utils.asyncio import async_unsafe

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "CHECKED_DJANGO_VERSIONS",
    "autocommit",
    "connection_usable",
    "django_errors",
    "health_check_due",
    "install_close_hook",
    "install_savepoint_rollback_hook",
    "new_wrapper",
    "on_commit_callbacks",
    "refuse_broken_transaction",
    "run_health_check",
    "savepoint_number",
    "savepoints_made",
    "uses_pool",
]

CHECKED_DJANGO_VERSIONS: Final = ((4, 2), (5, 2), (6, 0))

# Marks the wrapped close() and savepoint_rollback(), so installing twice (two app
# registries in one process, tests that call ready() again) wraps once.
_HOOK_MARK: Final = "__advisory_locks_close_hook__"


def install_close_hook(before_close: Callable[[BaseDatabaseWrapper], None]) -> None:
    """Call ``before_close(wrapper)`` each time Django is about to close a connection.

    Django sends no signal when it closes a DB-API connection or, with Django 5.1+'s
    native pool, puts it back in the pool. Every path goes through
    ``BaseDatabaseWrapper.close()``: ``connection.close()``, ``close_old_connections()``
    at a request's start and end (``CONN_MAX_AGE``, errors, failed health checks),
    ``connections.close_all()``. The PostgreSQL and MySQL wrappers inherit that method
    (the pool's ``putconn`` is in PostgreSQL's ``_close()``, which it calls); SQLite's
    overrides it but calls ``BaseDatabaseWrapper.close(self)`` by name, which is why the
    wrapped function is put on the base class itself. A third-party backend that overrides
    ``close()`` without calling the base class's is not seen.

    ``before_close`` runs in the thread that owns the connection, while
    ``wrapper.connection`` is still the open DB-API connection; it is not called when
    there is nothing to close.
    """
    original = BaseDatabaseWrapper.close
    if getattr(original, _HOOK_MARK, False):
        return

    @functools.wraps(original)
    def close(self: BaseDatabaseWrapper) -> None:
        if self.connection is not None and not self.closed_in_transaction:
            # Django checks this first too; a foreign thread must not touch the connection.
            self.validate_thread_sharing()
            before_close(self)
        original(self)

    setattr(close, _HOOK_MARK, True)
    BaseDatabaseWrapper.close = close  # type: ignore[method-assign]


def install_savepoint_rollback_hook(
    after_rollback: Callable[[BaseDatabaseWrapper, str], None],
) -> None:
    """Call ``after_rollback(wrapper, sid)`` each time Django has rolled a transaction
    back to savepoint ``sid``.

    Django forgets what a savepoint rollback undid only for ``on_commit()`` callbacks,
    and only for the savepoints of ``atomic()`` blocks (``savepoint_ids``): the id that
    ``transaction.savepoint()`` returns is in no callback's set, so rolling back to it
    drops nothing. Both kinds are rolled back by ``BaseDatabaseWrapper.savepoint_rollback()``
    (``atomic()``'s ``__exit__`` and ``transaction.savepoint_rollback()`` call it; no
    backend in Django overrides it), so the wrapped function is put on the base class,
    like the close hook. ``after_rollback`` runs in the connection's thread once the
    rollback succeeded (also where Django did nothing: no transaction, so no transaction
    lock either).
    """
    original = BaseDatabaseWrapper.savepoint_rollback
    if getattr(original, _HOOK_MARK, False):
        return

    @functools.wraps(original)
    def savepoint_rollback(self: BaseDatabaseWrapper, sid: str) -> None:
        original(self, sid)
        if isinstance(sid, str):  # None: savepoint() made none (autocommit)
            after_rollback(self, sid)

    setattr(savepoint_rollback, _HOOK_MARK, True)
    BaseDatabaseWrapper.savepoint_rollback = savepoint_rollback  # type: ignore[method-assign]


def savepoints_made(wrapper: BaseDatabaseWrapper) -> int:
    """How many savepoints ``wrapper.savepoint()`` has made: ``savepoint_state``, the
    counter it numbers them with, which only ``clean_savepoints()`` sets back to 0."""
    return int(wrapper.savepoint_state)


def savepoint_number(sid: str) -> int | None:
    """The number ``savepoint()`` gave savepoint ``sid``: its id is
    ``"s<thread id>_x<savepoint_state>"`` (the same from Django 1.6 to 6.0). None for an
    id of another form (a backend that names its savepoints itself)."""
    prefix, mark, number = sid.rpartition("_x")
    if not (mark and prefix.startswith("s") and number.isdigit()):
        return None
    return int(number)


def on_commit_callbacks(wrapper: BaseDatabaseWrapper) -> Iterator[Callable[[], Any]]:
    """The callables ``transaction.on_commit()`` registered and not yet run or dropped.

    ``run_on_commit`` is a list of ``(savepoint ids, callable, robust)`` tuples (the third
    item since 4.2); Django drops the entries of a rolled-back savepoint or transaction.
    """
    for entry in wrapper.run_on_commit:
        yield entry[1]


def uses_pool(wrapper: BaseDatabaseWrapper) -> bool:
    """Whether ``wrapper`` takes its connections from Django 5.1+'s native pool.

    ``DatabaseWrapper.pool`` exists on PostgreSQL's wrapper from 5.1 (None without the
    ``"pool"`` option); other backends have no such attribute.
    """
    return getattr(wrapper, "pool", None) is not None


def django_errors(wrapper: BaseDatabaseWrapper) -> AbstractContextManager[None]:
    """Turn DB-API errors raised inside into ``django.db`` errors, as Django's cursors do.

    ``wrap_database_errors`` also sets ``errors_occurred``, which Django's end-of-request
    health check reads: Django learns of a failed lock statement as of a failed query.
    """
    return wrapper.wrap_database_errors


def autocommit(wrapper: BaseDatabaseWrapper) -> bool:
    """``wrapper.get_autocommit()`` for a wrapper whose connection is open.

    ``get_autocommit()`` is ``ensure_connection()`` (``@async_unsafe``: it raises
    ``SynchronousOnlyOperation`` when an event loop runs in this thread, unless
    ``DJANGO_ALLOW_ASYNC_UNSAFE`` is set; it reads the environment for that on every
    call) and then the ``autocommit`` attribute. With no event loop running that is the
    attribute alone; with one, Django's own method answers or refuses.
    """
    if asyncio._get_running_loop() is not None:
        return bool(wrapper.get_autocommit())
    return bool(wrapper.autocommit)


def refuse_broken_transaction(wrapper: BaseDatabaseWrapper) -> None:
    """Raise ``TransactionManagementError`` inside an ``atomic()`` block that must roll
    back, as every query Django runs there would (``validate_no_broken_transaction``)."""
    wrapper.validate_no_broken_transaction()


def connection_usable(wrapper: BaseDatabaseWrapper) -> bool:
    """Django's own health check of an open connection (``is_usable()``: ``SELECT 1`` on
    PostgreSQL, ``ping()`` on MySQL, always True on SQLite); never raises."""
    return bool(wrapper.is_usable())


def health_check_due(wrapper: BaseDatabaseWrapper) -> bool:
    """Whether Django's health check of the open connection is due before its next use:
    ``CONN_HEALTH_CHECKS`` is on and no use in this request has checked it yet.

    Attributes alone, no round trip: ``health_check_enabled`` is the setting, read at
    ``connect()``; ``health_check_done`` is set by ``connect()`` and by the check, and
    cleared by ``close_if_unusable_or_obsolete()`` at each request's start and end.
    """
    return (
        wrapper.connection is not None
        and bool(wrapper.health_check_enabled)  # type: ignore[attr-defined]
        and not wrapper.health_check_done  # type: ignore[attr-defined]
    )


@async_unsafe
def run_health_check(wrapper: BaseDatabaseWrapper) -> None:
    """Django's health check as its cursor runs it before ``ensure_connection()``
    (``_cursor()``): ``close_if_health_check_failed()``, one ``is_usable()`` round trip
    when due, closes a connection that fails it, so the next use connects anew.
    ``@async_unsafe`` as Django's ``cursor()`` is."""
    wrapper.close_if_health_check_failed()


def new_wrapper(alias: str, *, pooled: bool = True) -> BaseDatabaseWrapper:
    """A connection wrapper for ``alias`` that is no thread's (``create_connection``, the
    factory ``connections[alias]`` uses); the caller closes it. ``pooled=False``: one
    that opens a connection of its own even where the alias has Django's connection
    pool (``OPTIONS["pool"]``, Django 5.1+ on PostgreSQL), made as that factory makes
    one, from the alias's settings without the pool."""
    settings = connections.settings[alias]
    options = settings.get("OPTIONS") or {}
    if pooled or not options.get("pool"):
        return connections.create_connection(alias)
    unpooled = {**settings, "OPTIONS": {k: v for k, v in options.items() if k != "pool"}}
    wrapper: BaseDatabaseWrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(unpooled, alias)
    return wrapper
