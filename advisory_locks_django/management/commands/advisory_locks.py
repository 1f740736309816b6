"""``manage.py advisory_locks list|key|leases``: the ``advisory-locks`` command, on Django.

Leases (``leases``) print the CLI's lease table for an alias's database; ``leases
--prune AGE`` clears the holders of leases expired for longer than AGE.

The listing and its table are the core CLI's (the backend's ``list_locks`` and
``advisory_locks._monitoring``, which also reads the Rails gem's query comments and guesses
a scheme per key), through ``advisory_locks_django.listing``, which the admin page shares;
this command adds the names this process can tell: those of locks it
holds itself, and any ``--name`` given, hashed with the project's key prefix and every key
scheme (a match tells the scheme). ``key`` shows what the database behind ``--database``
sees: integer keys on PostgreSQL (and SQLite, whose lock files are named by them), the ``GET_LOCK``
name on MySQL and MariaDB.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any, TextIO, cast

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections

from advisory_locks._core.prune import parse_age
from advisory_locks._dialects.lease import LEASE_TABLE
from advisory_locks._monitoring import (
    Identity,
    identify,
    key_arguments,
    key_details,
    key_document,
    lease_document,
    leases_table,
    lock_document,
    locks_table,
    mysql_key_details,
    mysql_key_document,
    mysql_lock_name,
    prune_summary,
)
from advisory_locks.errors import AdvisoryLockError
from advisory_locks.keys import KEY_SCHEMES, derive_key
from advisory_locks_django._binding import backend_for_alias
from advisory_locks_django.conf import lock_settings
from advisory_locks_django.leases import prune_leases
from advisory_locks_django.listing import known_names, list_leases, list_locks

DIALECTS = ("postgresql", "mysql")


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
        key.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            help="show the key as this alias's database sees it (default: %(default)s)",
        )
        key.add_argument(
            "--dialect",
            choices=DIALECTS,
            help="show the key as this kind of database sees it, whatever --database is: "
            "PostgreSQL's integer key(s), or the GET_LOCK name on MySQL/MariaDB",
        )
        key.add_argument("--json", action="store_true", help="print one JSON object")
        leases = actions.add_parser(
            "leases", help="lease locks: holder, fencing token, acquired, expires in"
        )
        leases.add_argument("--database", default=DEFAULT_DB_ALIAS, help="database alias")
        leases.add_argument("--json", action="store_true", help="print a JSON array")
        leases.add_argument(
            "--prune",
            type=_age,
            metavar="AGE",
            help="instead of listing, clear the holders of leases expired for more than AGE "
            "(seconds, or 90s, 15m, 2h, 7d) by the database's clock; rows and their "
            "tokens stay",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if options["action"] == "key":
                self._key(options)
            elif options["action"] == "leases":
                self._leases(options)
            else:
                self._list(options)
        except (AdvisoryLockError, TypeError, ValueError) as error:
            raise CommandError(str(error)) from error

    def _key(self, options: dict[str, Any]) -> None:
        configured = lock_settings()
        scheme = options["scheme"] or configured.key_scheme
        prefix = options["prefix"] if options["prefix"] is not None else configured.key_prefix
        key = derive_key(options["name"], scheme=scheme, prefix=prefix)
        if (options["dialect"] or _dialect(options["database"])) == "mysql":
            if options["json"]:
                self.stdout.write(json.dumps(mysql_key_document(key), ensure_ascii=False))
            else:
                self.stdout.write(mysql_lock_name(key))
                self.stdout.write(mysql_key_details(key), ending="")
            return
        shown_prefix = None if prefix is None else str(prefix)
        if options["json"]:
            self.stdout.write(json.dumps(key_document(key, scheme, shown_prefix)))
        else:
            self.stdout.write(key_arguments(key))
            self.stdout.write(key_details(key, scheme or "default", shown_prefix), ending="")

    def _list(self, options: dict[str, Any]) -> None:
        alias = options["database"]
        if alias not in connections:
            raise CommandError(f"unknown database alias {alias!r}")
        try:
            rows = list_locks(alias)
        except AdvisoryLockError as error:
            # Worded as the core CLI words it, with the alias in place of the URL.
            raise CommandError(f"cannot list locks on database {alias!r}: {error}") from error
        known = known_names(alias, options["name"])
        if options["json"]:
            documents = [lock_document(row, identify(row, known)) for row in rows]
            self.stdout.write(json.dumps(documents, ensure_ascii=False, indent=2))
            return
        # The table fits the terminal when stdout is one (OutputWrapper passes isatty on).
        self.stdout.write(locks_table(rows, cast(TextIO, self.stdout), known), ending="")
        recognised = {row.key: known.by_key[row.key] for row in rows if row.key in known}
        if recognised:
            self.stdout.write("\nNames of the keys above that this process can tell:")
            for key, identity in recognised.items():
                shown = ",".join(map(str, key)) if isinstance(key, tuple) else str(key)
                self.stdout.write(f"  {shown}  {_shown_name(identity)}")

    def _leases(self, options: dict[str, Any]) -> None:
        alias = options["database"]
        if alias not in connections:
            raise CommandError(f"unknown database alias {alias!r}")
        if options.get("prune") is not None:
            pruned = prune_leases(older_than=options["prune"], using=alias)
            if options["json"]:
                self.stdout.write(json.dumps({"pruned": pruned}))
            else:
                self.stdout.write(prune_summary(pruned, options["prune"]), ending="")
            return
        rows = list_leases(alias)
        if rows is None:
            raise CommandError(
                f"the table {LEASE_TABLE} does not exist in database {alias!r}: "
                f"create it with manage.py migrate advisory_locks_django --database {alias}"
            )
        if options["json"]:
            documents = [lease_document(row) for row in rows]
            self.stdout.write(json.dumps(documents, ensure_ascii=False, indent=2))
            return
        self.stdout.write(leases_table(rows), ending="")


def _age(text: str) -> float:
    try:
        return parse_age(text)
    except ValueError as error:
        raise ArgumentTypeError(str(error)) from None


def _dialect(alias: str) -> str:
    if alias not in connections:
        raise CommandError(f"unknown database alias {alias!r}")
    return backend_for_alias(alias).dialect_name


def _shown_name(identity: Identity) -> str:
    return repr(identity.name) if isinstance(identity.name, str) else str(identity.name)
