#!/usr/bin/env python3
"""Set up the project's virtualenv and run its checks, needing only Python 3.10+.

    python3 dev.py test [pytest args...]   install .[test], run pytest
    python3 dev.py lint                    install .[dev], run ruff and mypy
    python3 dev.py demo [args...]          install .[demo], run example_project's checkout race
    python3 dev.py docs [args...]          install .[docs], build the docs strictly into site/
    python3 dev.py bench [args...]         install .[benchmark], run python -m benchmarks.run

The virtualenv lives in .venv. Each set of extras is reinstalled when pyproject.toml is
newer than the stamp file its last install left behind; an existing .venv is never
deleted, only installed into.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts" if os.name == "nt" else "bin") / "python"
PYPROJECT = ROOT / "pyproject.toml"

PYTEST_NO_TESTS_COLLECTED = 5


def run(*command: str | Path) -> int:
    # On stderr, so that a command's own stdout (`dev.py demo --json`) stays clean.
    print("+", " ".join(str(part) for part in command), file=sys.stderr, flush=True)
    return subprocess.call([str(part) for part in command], cwd=ROOT)


def ensure_installed(extras: str) -> None:
    if not PYTHON.exists():
        print(f"+ creating {VENV}", file=sys.stderr, flush=True)
        venv.create(VENV, with_pip=True)
    stamp = VENV / f".dev-py-installed-{extras.replace(',', '-')}"
    if stamp.exists() and stamp.stat().st_mtime >= PYPROJECT.stat().st_mtime:
        return
    if run(PYTHON, "-m", "pip", "install", "--quiet", "--editable", f".[{extras}]") != 0:
        sys.exit("dev.py: pip install failed")
    stamp.touch()


def test(pytest_args: list[str]) -> int:
    ensure_installed("test")
    code = run(PYTHON, "-m", "pytest", *pytest_args)
    if code == PYTEST_NO_TESTS_COLLECTED:
        print("dev.py: pytest collected no tests; treating that as a failure", file=sys.stderr)
        return 1
    return code


def lint(paths: list[str]) -> int:
    ensure_installed("dev")
    targets = paths or ["."]
    failures = [
        run(PYTHON, "-m", "ruff", "check", *targets),
        run(PYTHON, "-m", "ruff", "format", "--check", *targets),
        # mypy takes its file list from pyproject.toml unless paths are given.
        run(PYTHON, "-m", "mypy", *paths),
    ]
    return 1 if any(failures) else 0


def demo(demo_args: list[str]) -> int:
    ensure_installed("demo")
    return run(PYTHON, ROOT / "example_project" / "manage.py", "checkout_race", *demo_args)


def docs(mkdocs_args: list[str]) -> int:
    ensure_installed("docs")
    # Material prints a banner about MkDocs 2 on every build; it is not about this site.
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    return run(PYTHON, "-m", "mkdocs", "build", "--strict", "--site-dir", "site", *mkdocs_args)


def bench(bench_args: list[str]) -> int:
    ensure_installed("benchmark")
    return run(PYTHON, "-m", "benchmarks.run", *bench_args)


COMMANDS = {"test": test, "lint": lint, "demo": demo, "docs": docs, "bench": bench}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the tool")
    arguments = parser.parse_args()
    return COMMANDS[arguments.command](arguments.args)


if __name__ == "__main__":
    sys.exit(main())
