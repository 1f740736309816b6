"""A real browser for the admin page's tests: Debian's chromium, driven through its
chromedriver by Selenium, headless.

The browser is required (missing = failure) when ``ADVISORY_LOCKS_REQUIRE_BROWSER`` is set
to a true value or, with it unset, when ``CI`` is; otherwise a missing one skips.
Screenshots go to ``$ADVISORY_LOCKS_ARTIFACTS`` (default: ``artifacts/`` in the repository,
which git ignores).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest

REQUIRE_VARIABLE = "ADVISORY_LOCKS_REQUIRE_BROWSER"
ARTIFACTS_VARIABLE = "ADVISORY_LOCKS_ARTIFACTS"
TRUE_WORDS = {"1", "true", "yes", "on"}
CHROMIUM = ("chromium", "chromium-browser")
DRIVER = ("chromedriver",)
DEBIAN_DRIVER_PATHS = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
WINDOW = "1500,1000"


def required_by(environ: Mapping[str, str]) -> str | None:
    explicit = environ.get(REQUIRE_VARIABLE)
    if explicit is not None:
        return f"{REQUIRE_VARIABLE}={explicit}" if explicit.lower() in TRUE_WORDS else None
    return "CI is set" if environ.get("CI", "").lower() in TRUE_WORDS else None


def _unavailable(message: str) -> NoReturn:
    requirement = required_by(os.environ)
    if requirement is not None:
        pytest.fail(f"{message}, and it is required ({requirement})", pytrace=False)
    pytest.skip(message)


def _find(names: tuple[str, ...], paths: tuple[str, ...] = ()) -> str | None:
    found = next((shutil.which(name) for name in names if shutil.which(name)), None)
    return found or next((path for path in paths if Path(path).exists()), None)


def artifacts_directory() -> Path:
    default = Path(__file__).resolve().parents[2] / "artifacts"
    directory = Path(os.environ.get(ARTIFACTS_VARIABLE) or default)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless chromium under Selenium's control, quit afterwards."""
    browser_binary = _find(CHROMIUM)
    driver_binary = _find(DRIVER, DEBIAN_DRIVER_PATHS)
    if browser_binary is None or driver_binary is None:
        _unavailable(
            "chromium and chromedriver are not installed "
            "(Debian: apt-get install chromium chromium-driver)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    options = webdriver.ChromeOptions()
    # Both paths are given, so Selenium never tries to download a browser or a driver.
    options.binary_location = str(browser_binary)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={WINDOW}",
    ):
        options.add_argument(argument)
    browser = webdriver.Chrome(options=options, service=Service(executable_path=driver_binary))
    try:
        yield browser
    finally:
        browser.quit()
