"""The built documentation site: API signatures and parameter docs render as a reader needs.

Builds the site with mkdocs (strictly, as `python3 dev.py docs` does) into a temporary
folder and reads the HTML of the API reference.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIGNATURE = re.compile(r'class="doc-signature highlight"><pre[^>]*>(.*?)</pre>', re.DOTALL)
TAG = re.compile(r"<[^>]+>")

pytestmark = pytest.mark.slow


def text_of(fragment: str) -> str:
    return html.unescape(TAG.sub("", fragment))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("site")
    completed = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(directory)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    return directory


def line_length() -> int:
    # mkdocs.yml has !!python/name tags for some extensions; only this number is needed.
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    (match,) = re.findall(r"^\s+line_length:\s*(\d+)\s*$", text, re.MULTILINE)
    return int(match)


def signatures(page: Path) -> list[str]:
    return [text_of(block).strip() for block in SIGNATURE.findall(page.read_text("utf-8"))]


def test_the_docs_extra_installs_a_signature_formatter() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (docs,) = re.findall(r"^docs = \[(.*?)^\]$", pyproject, re.MULTILINE | re.DOTALL)
    assert re.search(r'"(ruff|black)\b', docs), docs


def test_long_signatures_are_broken_one_parameter_a_line(site: Path) -> None:
    (advisory_lock,) = [
        s
        for s in signatures(site / "reference/django/index.html")
        if s.startswith("advisory_lock(")
    ]
    lines = advisory_lock.splitlines()
    assert lines[0] == "advisory_lock("
    assert "    using: str = DEFAULT_DB_ALIAS," in lines
    assert lines[-1] == ") -> DjangoAdvisoryLock"


@pytest.mark.parametrize("page", ["advisory_locks", "sqlalchemy", "django", "errors", "keys"])
def test_no_signature_line_is_wider_than_the_configured_length(site: Path, page: str) -> None:
    limit = line_length()
    found = signatures(site / f"reference/{page}/index.html")
    assert found
    too_wide = [line for s in found for line in s.splitlines() if len(line) > limit]
    assert too_wide == []


def test_the_django_reference_documents_every_parameter_of_advisory_lock(site: Path) -> None:
    page = text_of((site / "reference/django/index.html").read_text("utf-8"))
    section = page[page.index("advisory_lock(") : page.index("current_advisory_locks(")]
    parameters = " ".join(section[section.index("Parameters:") :].split())
    # Each row of the parameters table starts with the name, then its type.
    for name in (
        "name",
        "using",
        "timeout",
        "shared",
        "transaction",
        "skip_if_locked",
        "key_scheme",
        "key_prefix",
    ):
        assert re.search(rf"(^| ){name} \S+ \S", parameters), name
    assert "see docs/django.md" not in section


def test_the_managers_document_with_advisory_lock(site: Path) -> None:
    page = text_of((site / "reference/django/index.html").read_text("utf-8"))
    manager = page[page.index("A Manager with with_advisory_lock().") :]
    assert "with_advisory_lock(name: NameSpec, **options: Any)" in manager
    assert "timeout, shared, transaction" in " ".join(manager.split())
