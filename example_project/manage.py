#!/usr/bin/env python3
"""Django's command-line utility for the example shop.

``--database-url URL`` (or ``DATABASE_URL``) picks the database for any command; without
either, the shop lives in ``shop.sqlite3`` next to this file.
"""

from __future__ import annotations

import os
import sys


def apply_database_url(argv: list[str]) -> list[str]:
    """Move ``--database-url URL`` from the command line into ``DATABASE_URL``.

    Django reads settings once, before any command parses its options, so the URL must
    reach the environment first; taking it out of argv lets every command accept it.
    """
    remaining: list[str] = []
    arguments = iter(argv)
    for argument in arguments:
        if argument == "--database-url":
            url = next(arguments, None)
            if url is None:
                sys.exit("manage.py: --database-url needs a URL")
            os.environ["DATABASE_URL"] = url
        elif argument.startswith("--database-url="):
            os.environ["DATABASE_URL"] = argument.partition("=")[2]
        else:
            remaining.append(argument)
    return remaining


def main() -> None:
    argv = apply_database_url(sys.argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(argv)


if __name__ == "__main__":
    main()
