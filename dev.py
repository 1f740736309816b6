#!/usr/bin/env python3
"""Set up the project's virtualenv and run its checks, needing only Python 3.10+.

    python3 dev.py test [pytest args...]   install .[test], run pytest
    python3 dev.py test --matrix oldest|newest [pytest args...]
                                           the same in .venv-oldest / .venv-newest: the
                                           oldest supported Python, Django and SQLAlchemy
                                           this machine has, or the newest
    python3 dev.py lint                    install .[dev], run ruff and mypy
    python3 dev.py demo [args...]          install .[demo], run example_project's checkout race
    python3 dev.py docs [args...]          install .[docs], build the docs strictly into site/
    python3 dev.py bench [args...]         install .[benchmark], run python -m benchmarks.run
    python3 dev.py bench leases [args...]  the same for the lease benchmarks (benchmarks.leases)

The virtualenv lives in .venv. Each set of extras is reinstalled when pyproject.toml is
newer than the stamp file its last install left behind; an existing .venv is never
deleted, only installed into.

--matrix runs the suite where the README's support claims end: "oldest" is the lowest
supported Python found on this machine (on PATH, or installed by pyenv) with Django 4.2,
SQLAlchemy 2.0 and psycopg 3.1; "newest" the highest supported Python with the latest
releases of the newest Django and SQLAlchemy series claimed (6.0, 2.1) it can run
(Django 6.0 needs Python 3.12+).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts" if os.name == "nt" else "bin") / "python"
PYPROJECT = ROOT / "pyproject.toml"

PYTEST_NO_TESTS_COLLECTED = 5

# The Python versions pyproject.toml's classifiers claim.
SUPPORTED_PYTHONS = ((3, 10), (3, 11), (3, 12), (3, 13))


@dataclass(frozen=True)
class Matrix:
    """One end of the supported range: which Python, and which releases to pin."""

    python: str  # "oldest" or "newest" of the supported Pythons found here
    requirements: tuple[str, ...]  # installed with .[test]
    upgrade: bool  # always fetch the latest releases the pins allow


MATRIX = {
    "oldest": Matrix(
        "oldest", ("Django~=4.2.0", "SQLAlchemy~=2.0.0", "psycopg[binary]~=3.1.0"), upgrade=False
    ),
    # The newest releases of the series the README claims, not beyond them.
    "newest": Matrix("newest", ("Django<6.1", "SQLAlchemy<2.2"), upgrade=True),
}


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
    if pytest_args[:1] == ["--matrix"] or (pytest_args and pytest_args[0].startswith("--matrix=")):
        name = pytest_args[0].partition("=")[2] or (pytest_args[1:2] or [""])[0]
        rest = pytest_args[1:] if "=" in pytest_args[0] else pytest_args[2:]
        if name not in MATRIX:
            sys.exit(f"dev.py: --matrix takes one of {', '.join(MATRIX)}, not {name!r}")
        return pytest_exit(run(matrix_python(name), "-m", "pytest", *rest))
    ensure_installed("test")
    return pytest_exit(run(PYTHON, "-m", "pytest", *pytest_args))


def pytest_exit(code: int) -> int:
    if code == PYTEST_NO_TESTS_COLLECTED:
        print("dev.py: pytest collected no tests; treating that as a failure", file=sys.stderr)
        return 1
    return code


def matrix_python(name: str) -> Path:
    """The interpreter of .venv-NAME, created and installed for that end of the matrix."""
    matrix = MATRIX[name]
    environment = ROOT / f".venv-{name}"
    python = environment / ("Scripts" if os.name == "nt" else "bin") / "python"
    base = find_python(matrix.python)
    if python.exists() and _version(python) != _version(base):
        sys.exit(f"dev.py: {environment} runs another Python than {base}; delete it")
    if not python.exists():
        print(f"+ creating {environment} with {base}", file=sys.stderr, flush=True)
        if run(base, "-m", "venv", environment) != 0:
            sys.exit(f"dev.py: could not create {environment}")
    stamp = environment / ".dev-py-installed-test"
    if matrix.upgrade or not stamp.exists() or stamp.stat().st_mtime < PYPROJECT.stat().st_mtime:
        requirements = list(matrix.requirements)
        # CI requires the mysqlclient driver's tests (tests/databases.py): build it here too.
        if os.environ.get("ADVISORY_LOCKS_REQUIRE_MYSQLCLIENT") == "1":
            requirements.append("mysqlclient")
        upgrade = ["--upgrade", "--upgrade-strategy", "eager"] if matrix.upgrade else []
        command = ["-m", "pip", "install", "--quiet", *upgrade, "--editable", ".[test]"]
        if run(python, *command, *requirements) != 0:
            sys.exit(f"dev.py: pip install into {environment} failed")
        stamp.touch()
    report = (
        "import sys, django, sqlalchemy, psycopg; print(sys.version.split()[0], "
        "django.__version__, sqlalchemy.__version__, psycopg.__version__)"
    )
    versions = subprocess.run(
        [str(python), "-c", report], capture_output=True, text=True, check=True
    ).stdout.split()
    print(
        f"dev.py: matrix {name}: Python {versions[0]}, Django {versions[1]}, "
        f"SQLAlchemy {versions[2]}, psycopg {versions[3]}",
        file=sys.stderr,
        flush=True,
    )
    return python


def find_python(which: str) -> Path:
    """The oldest or newest supported Python found here, on PATH or installed by pyenv."""
    found = {}
    for version in SUPPORTED_PYTHONS:
        for candidate in _python_candidates(version):
            if _version(candidate) == version:
                found[version] = candidate
                break
    if not found:
        supported = ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED_PYTHONS)
        sys.exit(f"dev.py: no supported Python ({supported}) found on PATH or in pyenv")
    return found[min(found) if which == "oldest" else max(found)]


def _python_candidates(version: tuple[int, int]) -> list[Path]:
    name = f"python{version[0]}.{version[1]}"
    candidates = [Path(path) for path in [shutil.which(name)] if path]
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    pattern = os.path.join(pyenv_root, "versions", f"{version[0]}.{version[1]}.*", "bin", name)
    candidates += [Path(path) for path in sorted(glob.glob(pattern), reverse=True)]
    return candidates


def _version(python: Path) -> tuple[int, int] | None:
    # pyenv's shims exist for every installed version but fail unless it is selected.
    try:
        completed = subprocess.run(
            [str(python), "-c", "import sys, venv; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError:
        return None
    if completed.returncode != 0:
        return None
    major, minor = completed.stdout.split()
    return int(major), int(minor)


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
    if bench_args[:1] == ["leases"]:
        return run(PYTHON, "-m", "benchmarks.leases", *bench_args[1:])
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
