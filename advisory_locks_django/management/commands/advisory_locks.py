"""``manage.py advisory_locks list|key``: the ``advisory-locks`` command, on Django's databases.

The listing and its table are the core CLI's (the backend's ``list_locks`` and the same
formatting); this command adds the names this process can tell: those of locks it holds
itself, and any ``--name`` given, hashed with the project's key scheme and prefix.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any, TextIO, cast

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections

from advisory_locks.cli import _key_details, _key_document, _row_document, _table
from advisory_locks.errors import AdvisoryLockError
from advisory_locks.keys import KEY_SCHEMES, LockName, derive_key
from advisory_locks_django.binding import DjangoExecutor, backend_for_alias, known_names
from advisory_locks_django.conf import lock_settings


class Command(BaseCommand):
    help = "Show held and awaited advisory locks, or the key the server sees for a name."

    def add_arguments(self, parser: ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
        list_ = actions.add_parser("list", help="held and awaited advisory locks")
        list_.add_argument("--database", default=DEFAULT_DB_ALIAS, help="database alias")
        list_.add_argument("--json", action="store_true", help="print a JSON array")
        list_.add_argument(
            "--name",
            action="append",
            default=[],
            metavar="NAME",
            help="a lock name to recognise among the keys (repeatable)",
        )
        key = actions.add_parser("key", help="the key(s) the server sees for a lock name")
        key.add_argument("name", metavar="NAME")
        key.add_argument("--scheme", choices=KEY_SCHEMES, help="default: the KEY_SCHEME setting")
        key.add_argument("--prefix", help="default: the KEY_PREFIX setting")
        key.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if options["action"] == "key":
                self._key(options)
            else:
                self._list(options)
        except (AdvisoryLockError, TypeError, ValueError) as error:
            raise CommandError(str(error)) from error

    def _key(self, options: dict[str, Any]) -> None:
        configured = lock_settings()
        scheme = options["scheme"] or configured.key_scheme
        prefix = options["prefix"] if options["prefix"] is not None else configured.key_prefix
        key = derive_key(options["name"], scheme=scheme, prefix=prefix)
        shown_prefix = None if prefix is None else str(prefix)
        if options["json"]:
            self.stdout.write(json.dumps(_key_document(key, scheme, shown_prefix)))
        else:
            self.stdout.write(" ".join(str(part) for part in key.ints))
            self.stdout.write(_key_details(key, scheme or "default", shown_prefix), ending="")

    def _list(self, options: dict[str, Any]) -> None:
        alias = options["database"]
        if alias not in connections:
            raise CommandError(f"unknown database alias {alias!r}")
        backend = backend_for_alias(alias)
        wrapper = connections[alias]
        wrapper.ensure_connection()
        # Listing holds nothing client-side, so a throwaway state dict is enough.
        rows = backend.list_locks(DjangoExecutor(wrapper, wrapper.connection, {}))
        names = self._names(alias, options["name"])
        if options["json"]:
            documents = [
                {**_row_document(row), "name": _json_name(names.get(row.key))} for row in rows
            ]
            self.stdout.write(json.dumps(documents, ensure_ascii=False, indent=2))
            return
        # The table fits the terminal when stdout is one (OutputWrapper passes isatty on).
        self.stdout.write(_table(rows, cast(TextIO, self.stdout)), ending="")
        recognised = {row.key: names[row.key] for row in rows if row.key in names}
        if recognised:
            self.stdout.write("\nNames of the keys above that this process can tell:")
            for key, name in recognised.items():
                shown = ",".join(map(str, key)) if isinstance(key, tuple) else str(key)
                self.stdout.write(f"  {shown}  {name!r}")

    def _names(self, alias: str, given: list[str]) -> dict[Any, LockName]:
        configured = lock_settings()
        names: dict[Any, LockName] = {
            derive_key(name, scheme=configured.key_scheme, prefix=configured.key_prefix).value: (
                name
            )
            for name in given
        }
        names.update(known_names(alias))
        return names


def _json_name(name: LockName | None) -> object:
    return list(name) if isinstance(name, tuple) else name
