"""Every ```python block in docs/**/*.md and README.md runs against a real database.

The convention the examples are written to (docs/development.md explains it to authors):

- Each block is a script, run on its own in a fresh interpreter (``python example.py``),
  so it must import what it uses. It finds the database in ``$DATABASE_URL``, a
  SQLAlchemy URL; the runner points it at a database made for that block alone (on
  PostgreSQL a schema first on the ``search_path``, on MySQL/MariaDB a database, on
  SQLite a file), so ``create_all()`` / ``CREATE TABLE`` never collide with other blocks
  or concurrent test runs, and drops it afterwards.
- Blocks run on PostgreSQL. A page that says so on a line of its own,
  ``<!-- examples: databases postgresql mysql sqlite -->``, runs each of its blocks on
  each database listed; a block can narrow that for itself with
  ``<!-- example: databases postgresql (why) -->`` right before its fence. A page with
  ``<!-- examples: run twice -->`` runs each block a second time on the same database,
  as a reader trying it again would (no "already exists" the second time).
- ``$ADVISORY_LOCKS_PREFIX`` is set to a number unique to the block, so the lock names an
  example takes ("nightly-report") do not meet another run's. An example that shows an
  exact key passes ``prefix=`` itself.
- A block titled like a file (```` ```python title="shop/models.py" ````) is also written
  to that path next to every script of its page, so later blocks can import it. A title
  of ``settings.py`` (or ``<package>/settings.py``) is a Django settings fragment, applied
  over the runner's base settings; ``DATABASES`` is then set to the runner's (from
  ``$DATABASE_URL``), so a fragment may show the project's own.
- A page's ``<app>/models.py`` blocks make ``<app>`` an installed app.
- A block that imports ``django`` or ``advisory_locks_django``, or is a ``settings.py``,
  runs with Django set up (``django.setup()``, ``makemigrations`` for the page's apps and
  ``migrate --run-syncdb``) first; so does every block of a page with a ``settings.py``
  or ``<app>/models.py`` block (a Django page, whose blocks may import only the page's
  models).
- A ```console block right after ``<!-- example: run -->`` is run too: each of its lines
  is ``python manage.py COMMAND [ARGS]``, run as ``call_command`` in that Django project.
- The only way out is a visible marker on the line(s) right before the fence:
  ``<!-- example: not-run (why) -->``. Such blocks must still compile.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from tests.databases import psycopg_connect, pymysql_connect

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_TIMEOUT_SECONDS = 90

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
TITLE = re.compile(r"""title\s*=\s*["']([^"']+)["']""")
NOT_RUN = re.compile(r"<!--\s*example:\s*not-run\s*(?:\((?P<reason>[^)]*)\))?\s*-->")
RUN_CONSOLE = re.compile(r"<!--\s*example:\s*run\s*-->")
BLOCK_DATABASES = re.compile(
    r"<!--\s*example:\s*databases\s+(?P<names>[a-z ]+?)\s*(?:\([^)]*\))?\s*-->"
)
PAGE_DATABASES = re.compile(r"^<!--\s*examples:\s*databases\s+(?P<names>[a-z ]+?)\s*-->\s*$", re.M)
RUN_TWICE = re.compile(r"^<!--\s*examples:\s*run twice\s*-->\s*$", re.M)
MANAGE_PY = re.compile(r"^\$?\s*python\s+manage\.py\s+(?P<command>.+)$")
DATABASES = ("postgresql", "mysql", "sqlite")
DJANGO_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:django|advisory_locks_django)\b", re.M)


@dataclass(frozen=True)
class Example:
    page: Path  # relative to ROOT
    line: int  # 1-based line of the opening fence
    source: str
    title: str | None
    not_run_reason: str | None  # None: runs; "": marked without a reason (an error)
    databases: tuple[str, ...] = ("postgresql",)
    # A console block of `python manage.py ...` lines, run as management commands.
    commands: tuple[str, ...] | None = None
    runs: int = 1  # 2 on pages that say "run twice"

    @property
    def id(self) -> str:
        return f"{self.page.as_posix()}:{self.line}"

    @property
    def is_settings(self) -> bool:
        return self.title is not None and (
            self.title == "settings.py" or self.title.endswith("/settings.py")
        )

    @property
    def needs_django(self) -> bool:
        return (
            self.is_settings
            or self.commands is not None
            or bool(DJANGO_IMPORT.search(self.source))
            or is_django_page(self.page)
        )

    @property
    def module(self) -> str | None:
        """The importable module a file-titled block becomes (None for scripts)."""
        if self.title is None or not self.title.endswith(".py") or self.is_settings:
            return None
        return self.title.removesuffix(".py").replace("/", ".")


@functools.cache
def is_django_page(page: Path) -> bool:
    """A page with a settings.py or <app>/models.py block describes one Django project."""
    path = page if page.is_absolute() else ROOT / page
    if not path.is_file():
        return False
    return any(
        block.is_settings or (block.title or "").endswith("/models.py")
        for block in examples_in(path)
    )


def pages() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def examples_in(page: Path) -> list[Example]:
    text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    page_databases = _database_names(PAGE_DATABASES.search(text), ("postgresql",))
    runs = 2 if RUN_TWICE.search(text) else 1
    found: list[Example] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"]
        end = index + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence) and lines[end].strip().strip(fence[0]) == ""
        ):
            end += 1
        language = info.strip().lstrip("{").strip().lstrip(".").split(" ")[0].split("{")[0]
        body = [
            line[len(indent) :] if line.startswith(indent) else line
            for line in lines[index + 1 : end]
        ]
        markers = _markers_before(lines, index)
        databases = _database_names(BLOCK_DATABASES.search(markers), page_databases)
        if language in ("python", "py"):
            title = TITLE.search(info)
            not_run = NOT_RUN.search(markers)
            found.append(
                Example(
                    page=page.relative_to(ROOT) if page.is_relative_to(ROOT) else page,
                    line=index + 1,
                    source=textwrap.dedent("\n".join(body)) + "\n",
                    title=title.group(1) if title else None,
                    not_run_reason=None if not_run is None else (not_run["reason"] or "").strip(),
                    databases=databases,
                    runs=runs,
                )
            )
        elif language == "console" and RUN_CONSOLE.search(markers):
            found.append(
                Example(
                    page=page.relative_to(ROOT) if page.is_relative_to(ROOT) else page,
                    line=index + 1,
                    source=textwrap.dedent("\n".join(body)) + "\n",
                    title=None,
                    not_run_reason=None,
                    databases=databases,
                    commands=tuple(line.strip() for line in body if line.strip()),
                    runs=runs,
                )
            )
        index = end + 1
    return found


def _markers_before(lines: list[str], fence_index: int) -> str:
    """The HTML comments on the lines just above a fence (blank lines skipped)."""
    previous = fence_index - 1
    while previous >= 0 and not lines[previous].strip():
        previous -= 1
    markers: list[str] = []
    while previous >= 0 and lines[previous].strip().startswith("<!--"):
        markers.append(lines[previous].strip())
        previous -= 1
    return "\n".join(markers)


def _database_names(marker: re.Match[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if marker is None:
        return default
    names = tuple(marker["names"].split())
    unknown = set(names) - set(DATABASES)
    if unknown:
        raise ValueError(f"unknown databases {sorted(unknown)} in {marker.group(0)!r}")
    return names


ALL_EXAMPLES = [example for page in pages() for example in examples_in(page)]
RUNNABLE = [example for example in ALL_EXAMPLES if example.not_run_reason is None]
RUNS = [(example, database) for example in RUNNABLE for database in example.databases]
NOT_RUN_EXAMPLES = [example for example in ALL_EXAMPLES if example.not_run_reason is not None]


def django_app_ready() -> str | None:
    """Why Django examples cannot run here, or None when they can."""
    if importlib.util.find_spec("django") is None:
        return "Django is not installed (pip install -e '.[django]')"
    if importlib.util.find_spec("advisory_locks_django") is None:
        return "advisory_locks_django is not importable"
    module = importlib.import_module("advisory_locks_django")
    missing = [
        name
        for name in ("advisory_lock", "AdvisoryLockManager", "AdvisoryLockQuerySet")
        if not hasattr(module, name)
    ]
    if missing:
        return f"advisory_locks_django does not provide {', '.join(missing)} yet"
    return None


# --- running one example ------------------------------------------------------------------

BASE_SETTINGS = '''\
"""Base settings for the docs' Django examples; the page's settings.py block follows."""
import os
from pathlib import Path

from sqlalchemy.engine import make_url

BASE_DIR = Path(__file__).resolve().parent  # as startproject's settings have it
_url = make_url(os.environ["DATABASE_URL"])
if _url.get_backend_name() == "sqlite":
    # A file, and a file for the test database: in memory, locks would be refused.
    _RUNNER_DATABASE = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": _url.database,
        "TEST": {"NAME": _url.database + ".test"},
    }
else:
    _RUNNER_DATABASE = {
        "ENGINE": "django.db.backends." + _url.get_backend_name(),
        "NAME": _url.database,
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.host or "",
        "PORT": str(_url.port or ""),
        # PostgreSQL: the example's schema first on the search_path.
        "OPTIONS": dict(_url.query),
    }
DATABASES = {"default": _RUNNER_DATABASE}
INSTALLED_APPS = ["advisory_locks_django", *DOCS_APPS]
SECRET_KEY = "docs-examples"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
'''

# After the page's settings: its DATABASES shows the reader's; the runner's are used.
RUNNER_DATABASES = """
DATABASES = {"default": _RUNNER_DATABASE}
"""

DJANGO_PRELUDE = """\
import django
from django.conf import settings
from django.core.management import call_command

django.setup()
if settings.DOCS_APPS:
    call_command("makemigrations", *settings.DOCS_APPS, verbosity=0)
call_command("migrate", run_syncdb=True, verbosity=0)
"""


@pytest.fixture
def example_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of its own for one example (as a URL), dropped afterwards."""
    database = request.param
    if database == "sqlite":
        yield f"sqlite:///{tmp_path / 'docs.sqlite3'}"
        return
    name = f"docs_example_{uuid.uuid4().hex[:12]}"
    if database == "postgresql":
        postgres_url: URL = request.getfixturevalue("postgres_url")
        with psycopg_connect(postgres_url, autocommit=True) as admin:
            admin.execute(f'CREATE SCHEMA "{name}"')
            try:
                url = postgres_url.update_query_dict({"options": f"-csearch_path={name}"})
                yield url.render_as_string(hide_password=False)
            finally:
                admin.execute(f'DROP SCHEMA "{name}" CASCADE')
        return
    mysql_url: URL = request.getfixturevalue("mysql_url")
    admin = pymysql_connect(mysql_url)
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}`")
        try:
            yield mysql_url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.close()


@pytest.fixture
def example_schema(postgres_url: URL) -> Iterator[str]:
    """A schema of its own for one example, dropped with everything in it afterwards."""
    schema = f"docs_example_{uuid.uuid4().hex[:12]}"
    with psycopg_connect(postgres_url, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            yield schema
        finally:
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def write_project(example: Example, directory: Path) -> None:
    """Lay out the page's file-titled blocks and this example's script in ``directory``."""
    blocks = examples_in(ROOT / example.page)
    # A page's "<app>/models.py" blocks make <app> an installed app.
    apps = sorted({b.title.split("/")[0] for b in blocks if (b.title or "").endswith("/models.py")})
    settings = [f"DOCS_APPS = {apps!r}\n" + BASE_SETTINGS]
    for block in blocks:
        if block.is_settings:
            settings.append(block.source)
        elif block.module is not None:
            path = directory / block.title  # type: ignore[operator]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.source, encoding="utf-8")
            for package in path.relative_to(directory).parents:
                if package != Path("."):
                    (directory / package / "__init__.py").touch()
    for app in apps:  # makemigrations writes here, as `manage.py startapp` would have it
        (directory / app / "migrations").mkdir(parents=True, exist_ok=True)
        (directory / app / "migrations" / "__init__.py").touch()
    settings.append(RUNNER_DATABASES)
    (directory / "docs_settings.py").write_text("\n".join(settings), encoding="utf-8")
    if example.commands is not None:
        script = "import shlex\n" + "".join(
            f"call_command(*shlex.split({_manage_py_arguments(line)!r}))\n"
            for line in example.commands
        )
    elif example.module is not None:
        script = f"import {example.module}\n"
    elif example.is_settings:
        script = "from django.core.management import call_command\ncall_command('check')\n"
    else:
        script = example.source
    if example.needs_django:
        script = DJANGO_PRELUDE + script
    (directory / "example.py").write_text(script, encoding="utf-8")


def _manage_py_arguments(line: str) -> str:
    command = MANAGE_PY.match(line)
    if command is None:
        raise ValueError(f"a run console block holds only `python manage.py ...` lines: {line!r}")
    return command["command"]


def run_example(example: Example, directory: Path, database_url: str) -> None:
    write_project(example, directory)
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ADVISORY_LOCKS_", "DJANGO_")) and name != "DATABASE_URL"
    }
    environment.update(
        DATABASE_URL=database_url,
        # Digits, so the rails scheme (integer prefixes) takes it as well as the hashed ones.
        ADVISORY_LOCKS_PREFIX=str(uuid.uuid4().int % 2**31 or 1),
        DJANGO_SETTINGS_MODULE="docs_settings",
        PYTHONPATH=os.pathsep.join([str(directory), str(ROOT)]),
        PYTHONDONTWRITEBYTECODE="1",
    )
    for run in range(1, example.runs + 1):
        result = subprocess.run(
            [sys.executable, "example.py"],
            cwd=directory,
            env=environment,
            capture_output=True,
            text=True,
            timeout=EXAMPLE_TIMEOUT_SECONDS,
            check=False,
        )
        if result.returncode != 0:
            numbered = "\n".join(
                f"{example.line + number:5d}  {text}"
                for number, text in enumerate(example.source.splitlines(), start=1)
            )
            which = f" (run {run} of {example.runs}, on the same database)" if run > 1 else ""
            pytest.fail(
                f"the example at {example.id} exited with status {result.returncode}{which}\n"
                f"{numbered}\n--- stdout\n{result.stdout}--- stderr\n{result.stderr}",
                pytrace=False,
            )


# --- the tests ----------------------------------------------------------------------------


def test_the_docs_have_examples_to_run() -> None:
    # Guards the extractor itself: a change that found no blocks would pass vacuously.
    assert len(RUNNABLE) >= 15
    assert any(example.page == Path("README.md") for example in RUNNABLE)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "example_database"),
    [
        pytest.param(
            example,
            database,
            id=f"{example.id}-{database}",
            marks=[getattr(pytest.mark, database)] if database != "sqlite" else [],
        )
        for example, database in RUNS
    ],
    indirect=["example_database"],
)
def test_example_runs(example: Example, example_database: str, tmp_path: Path) -> None:
    if example.needs_django and (reason := django_app_ready()) is not None:
        pytest.skip(f"Django example not run: {reason}")
    run_example(example, tmp_path, example_database)


def test_examples_marked_not_run_say_why_and_compile() -> None:
    # Not parametrized: with no such block (the usual case) there is nothing to skip.
    for example in NOT_RUN_EXAMPLES:
        assert example.not_run_reason, (
            f"{example.id}: write the reason: <!-- example: not-run (why) -->"
        )
        compile(example.source, example.id, "exec")


def test_the_extractor_reads_titles_indentation_and_markers(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text(
        "text\n\n"
        '```python title="shop/models.py"\nA = 1\n```\n\n'
        "<!-- example: not-run (needs a second machine) -->\n"
        "```python\nB = 2\n```\n\n"
        "!!! note\n    ```py\n    if True:\n        C = 3\n    ```\n"
        "```console\n$ not python\n```\n",
        encoding="utf-8",
    )
    found = examples_in(page)
    assert [(e.title, e.not_run_reason, e.source) for e in found] == [
        ("shop/models.py", None, "A = 1\n"),
        (None, "needs a second machine", "B = 2\n"),
        (None, None, "if True:\n    C = 3\n"),
    ]
    assert found[0].module == "shop.models"


def test_every_block_of_a_page_with_models_runs_with_django_set_up(tmp_path: Path) -> None:
    page = tmp_path / "django-page.md"
    page.write_text(
        '```python title="shop/models.py"\nA = 1\n```\n\n'
        "```python\nfrom shop.models import A\n```\n",
        encoding="utf-8",
    )
    plain = tmp_path / "plain-page.md"
    plain.write_text("```python\nimport os\n```\n", encoding="utf-8")
    assert [example.needs_django for example in examples_in(page)] == [True, True]
    assert [example.needs_django for example in examples_in(plain)] == [False]


def test_a_failing_example_fails_its_test(
    example_schema: str, postgres_url: URL, tmp_path: Path
) -> None:
    broken = Example(Path("README.md"), 1, "raise SystemExit(3)\n", None, None)
    url = postgres_url.update_query_dict({"options": f"-csearch_path={example_schema}"})
    with pytest.raises(pytest.fail.Exception, match="exited with status 3"):
        run_example(broken, tmp_path, url.render_as_string(hide_password=False))


def test_examples_see_their_own_schema_first(
    example_schema: str, postgres_url: URL, tmp_path: Path
) -> None:
    probe = Example(
        Path("README.md"),
        1,
        "import os, sqlalchemy as sa\n"
        "engine = sa.create_engine(os.environ['DATABASE_URL'])\n"
        "with engine.connect() as c:\n"
        "    print(c.scalar(sa.text('SELECT current_schema()')))\n"
        f"    assert c.scalar(sa.text('SELECT current_schema()')) == {example_schema!r}\n",
        None,
        None,
    )
    url = postgres_url.update_query_dict({"options": f"-csearch_path={example_schema}"})
    run_example(probe, tmp_path, url.render_as_string(hide_password=False))


def test_the_extractor_reads_databases_run_twice_and_run_console_blocks(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text(
        "<!-- examples: databases postgresql mysql sqlite -->\n"
        "<!-- examples: run twice -->\n\n"
        "```python\nA = 1\n```\n\n"
        "<!-- example: databases postgresql (transaction locks) -->\n"
        "```python\nB = 2\n```\n\n"
        "<!-- example: run -->\n"
        "```console\npython manage.py migrate\n$ python manage.py race --buyers 3\n```\n\n"
        "```console\n$ pip install advisory-locks\n```\n",
        encoding="utf-8",
    )
    found = examples_in(page)
    assert [(e.databases, e.runs, e.commands) for e in found] == [
        (("postgresql", "mysql", "sqlite"), 2, None),
        (("postgresql",), 2, None),
        (
            ("postgresql", "mysql", "sqlite"),
            2,
            ("python manage.py migrate", "$ python manage.py race --buyers 3"),
        ),
    ]
    assert found[2].needs_django
    assert [_manage_py_arguments(line) for line in found[2].commands or ()] == [
        "migrate",
        "race --buyers 3",
    ]


def test_a_run_console_block_holds_only_manage_py_commands() -> None:
    with pytest.raises(ValueError, match=r"only `python manage\.py"):
        _manage_py_arguments("pip install advisory-locks")


def test_a_page_may_name_only_known_databases(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text("<!-- examples: databases postgres -->\n```python\nA = 1\n```\n")
    with pytest.raises(ValueError, match="postgres"):
        examples_in(page)
