"""The ``ADVISORY_LOCKS`` setting: its keys, defaults and validation.

Read lazily and cached until Django reports a settings change (``override_settings``
sends ``setting_changed``), so a lock costs no dictionary validation. The same
validation feeds the system checks, which report every problem at startup; a lock
raises ``ImproperlyConfigured`` with the first one.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from advisory_locks._core.lease import MAX_TTL
from advisory_locks.keys import KEY_SCHEMES, KeyScheme

__all__ = ["POOLER_MODES", "SETTING", "LockSettings", "Problem", "lock_settings", "problems"]

SETTING: Final = "ADVISORY_LOCKS"

# Poolers that hand consecutive transactions of one client to different server
# connections: a session lock taken through them may be held by somebody else's session.
SESSION_UNSAFE_POOLERS: Final = frozenset({"pgbouncer-transaction", "pgbouncer-statement"})
POOLER_MODES: Final = frozenset({"pgbouncer-session"}) | SESSION_UNSAFE_POOLERS

DEFAULTS: Final[Mapping[str, Any]] = {
    "TIMEOUT": None,
    "TRANSACTION": False,
    "KEY_SCHEME": None,
    "KEY_PREFIX": None,
    "SEND_SIGNALS": True,
    "POOLERS": {},
    "LEASE_TTL": 30.0,
}


@dataclass(frozen=True, slots=True)
class LockSettings:
    timeout: float | None
    transaction: bool
    key_scheme: KeyScheme | None
    key_prefix: str | int | None
    send_signals: bool
    poolers: Mapping[str, str]
    lease_ttl: float


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with the setting; ``id`` is the system check's id."""

    id: str
    message: str
    hint: str | None = None


# The settings of the moment, once read: DjangoSite.borrow's fast path compares what it
# checked a connection under with this, rather than call lock_settings().
_cached: LockSettings | None = None
_app_checked = False

APP_NOT_INSTALLED: Final = (
    "advisory_locks_django is not in INSTALLED_APPS: locks work, but its system checks "
    "(settings, databases, drivers) do not run and locks a request leaves behind are not "
    'reported when it ends. Add "advisory_locks_django" to INSTALLED_APPS.'
)


def lock_settings() -> LockSettings:
    """The validated setting; raise ImproperlyConfigured when it is invalid.

    The first lock of a process that did not install the app warns (RuntimeWarning).
    """
    global _cached
    if not _app_checked:
        _check_app_installed()
    if _cached is None:
        raw = getattr(settings, SETTING, {})
        found = problems(raw)
        if found:
            raise ImproperlyConfigured(f"{SETTING}: {found[0].message}")
        merged = {**DEFAULTS, **raw}
        timeout = merged["TIMEOUT"]
        _cached = LockSettings(
            timeout=None if timeout is None else float(timeout),
            transaction=merged["TRANSACTION"],
            key_scheme=merged["KEY_SCHEME"],
            key_prefix=merged["KEY_PREFIX"],
            send_signals=merged["SEND_SIGNALS"],
            poolers=dict(merged["POOLERS"]),
            lease_ttl=float(merged["LEASE_TTL"]),
        )
    return _cached


def app_checked() -> bool:
    """Whether ``lock_settings()`` checked that the app is installed (it waits until
    Django's apps are loaded); until then each call checks."""
    return _app_checked


def _check_app_installed() -> None:
    global _app_checked
    if not apps.ready:
        return  # a lock made while apps load; the next one checks
    _app_checked = True
    if not apps.is_installed("advisory_locks_django"):
        warnings.warn(APP_NOT_INSTALLED, RuntimeWarning, stacklevel=_first_caller_outside())


def _first_caller_outside() -> int:
    """The warnings stacklevel of the first frame outside this package: the user's line
    that made the lock, however many of our calls (manager, advisory_lock()) it went
    through."""
    package = str(Path(__file__).resolve().parent)
    frame = sys._getframe(2)  # the caller of _check_app_installed()
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _forget_cached(*, setting: str, **kwargs: Any) -> None:
    global _cached
    if setting in (SETTING, "DATABASES"):
        _cached = None


setting_changed.connect(_forget_cached, dispatch_uid="advisory_locks_django.conf")


def problems(raw: object) -> list[Problem]:
    """Everything wrong with a value of ``ADVISORY_LOCKS``, in a stable order."""
    if not isinstance(raw, Mapping):
        return [Problem("advisory_locks.E001", f"{SETTING} must be a dict, not {_kind(raw)}.")]
    found: list[Problem] = []
    unknown = sorted(str(key) for key in raw if key not in DEFAULTS)
    if unknown:
        found.append(
            Problem(
                "advisory_locks.E002",
                f"{SETTING} has unknown keys {unknown}.",
                f"The known keys are {sorted(DEFAULTS)}.",
            )
        )
    timeout = raw.get("TIMEOUT")
    if timeout is not None and not _valid_timeout(timeout):
        found.append(
            Problem(
                "advisory_locks.E003",
                f"{SETTING}['TIMEOUT'] must be None or seconds >= 0, not {timeout!r}.",
                "None waits until the lock is granted; 0 tries once.",
            )
        )
    scheme = raw.get("KEY_SCHEME")
    # A function is a scheme too (name -> int | (int, int)); its results are checked
    # on each lock, as the name's are.
    if scheme is not None and not callable(scheme) and scheme not in KEY_SCHEMES:
        found.append(
            Problem(
                "advisory_locks.E004",
                f"{SETTING}['KEY_SCHEME'] must be one of {list(KEY_SCHEMES)} or a function "
                f"name -> int | (int, int), not {scheme!r}.",
            )
        )
    found += _prefix_problems(raw.get("KEY_PREFIX"), scheme)
    for flag in ("TRANSACTION", "SEND_SIGNALS"):
        if flag in raw and not isinstance(raw[flag], bool):
            found.append(
                Problem(
                    "advisory_locks.E006",
                    f"{SETTING}[{flag!r}] must be True or False, not {raw[flag]!r}.",
                )
            )
    found += _pooler_problems(raw.get("POOLERS", {}))
    lease_ttl = raw.get("LEASE_TTL", DEFAULTS["LEASE_TTL"])
    if not _valid_timeout(lease_ttl) or lease_ttl == 0 or lease_ttl > MAX_TTL:
        found.append(
            Problem(
                "advisory_locks.E009",
                f"{SETTING}['LEASE_TTL'] must be seconds > 0, at most 100 years, not "
                f"{lease_ttl!r}.",
                "The default ttl of lease_lock(): how long a lease lasts after each "
                "renewal (default 30).",
            )
        )
    return found


def _valid_timeout(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= 0


def _prefix_problems(prefix: object, scheme: object) -> list[Problem]:
    if prefix is None:
        return []
    if isinstance(prefix, bool) or not isinstance(prefix, (str, int)):
        return [
            Problem(
                "advisory_locks.E005",
                f"{SETTING}['KEY_PREFIX'] must be a str or an int, not {_kind(prefix)}.",
            )
        ]
    if scheme == "rails" and isinstance(prefix, str) and prefix and not _is_int(prefix):
        return [
            Problem(
                "advisory_locks.E005",
                f"{SETTING}['KEY_PREFIX'] is {prefix!r}, but the rails key scheme needs an "
                "integer prefix.",
                "The Ruby gem's prefix is the second int4 key; use an int.",
            )
        ]
    return []


def _pooler_problems(poolers: object) -> list[Problem]:
    if not isinstance(poolers, Mapping):
        return [
            Problem(
                "advisory_locks.E007",
                f"{SETTING}['POOLERS'] must be a dict of database alias to pooler mode, "
                f"not {_kind(poolers)}.",
            )
        ]
    found = []
    for alias, mode in poolers.items():
        if alias not in settings.DATABASES:
            found.append(
                Problem(
                    "advisory_locks.E007",
                    f"{SETTING}['POOLERS'] names {alias!r}, which is not in DATABASES.",
                )
            )
        if mode not in POOLER_MODES:
            found.append(
                Problem(
                    "advisory_locks.E007",
                    f"{SETTING}['POOLERS'][{alias!r}] must be one of {sorted(POOLER_MODES)}, "
                    f"not {mode!r}.",
                )
            )
    return found


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _kind(value: object) -> str:
    return type(value).__name__
