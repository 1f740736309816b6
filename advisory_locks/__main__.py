"""``python -m advisory_locks``: the same command line as ``advisory-locks``."""

from __future__ import annotations

from advisory_locks.cli import main

raise SystemExit(main())
