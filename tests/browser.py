"""A headless browser for the tests that read pages as a person does: Debian's ``chromium``
(``make browser``) driven by Playwright for Python, which downloads no browser of its own.

The browser is ``$RLHF_CHROMIUM`` when set, else the first of :data:`CHROMIUM_NAMES` on the
``PATH``. Where there is none, or Playwright is not installed, every test that asks for
:func:`browser` is skipped with :data:`BROWSER_MISSING`, one line that says how to get one.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

#: The executables looked for on the PATH: Debian's package, and other distributions' name for it.
CHROMIUM_NAMES = ("chromium", "chromium-browser")

BROWSER_MISSING = (
    "no browser for the browser tests: run `make browser` (installs Debian's chromium as root), "
    "or set RLHF_CHROMIUM to a Chromium binary"
)

#: Phone width and a laptop's screen, in CSS pixels.
PHONE = {"width": 390, "height": 844}
LAPTOP = {"width": 1280, "height": 800}


def find_chromium() -> str | None:
    """The Chromium binary the browser tests drive: ``$RLHF_CHROMIUM`` (which must exist), else
    the first of :data:`CHROMIUM_NAMES` on the PATH; ``None`` when there is none."""
    configured = os.environ.get("RLHF_CHROMIUM")
    if configured:
        if not Path(configured).is_file():
            raise FileNotFoundError(f"RLHF_CHROMIUM={configured} is no file: unset it or point it at a Chromium binary")
        return configured
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


def one_skip_line(report: pytest.TestReport) -> None:
    """Give a test skipped for want of a browser this module's place, so that pytest's summary
    (``-ra``) says :data:`BROWSER_MISSING` once, not once for each test: pytest reports a skip
    raised in a fixture at the test's own line (called from tests/conftest.py's
    ``pytest_runtest_makereport``)."""
    if report.skipped and isinstance(report.longrepr, tuple) and report.longrepr[2].endswith(BROWSER_MISSING):
        report.longrepr = (__file__, 1, report.longrepr[2])


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """A headless Chromium (a Playwright ``Browser``), one per test module: Playwright's synchronous
    API runs an event loop of its own, which is stopped before other modules' tests run."""
    executable = find_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        executable = None
    if executable is None:
        pytest.skip(BROWSER_MISSING)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable)
        yield chromium
        chromium.close()


@dataclass
class Visit:
    """A page open in the browser and what the browser reported while loading it."""

    page: object
    console_errors: list[str] = field(default_factory=list)


@pytest.fixture
def visit(browser) -> Iterator[Callable[..., Visit]]:
    """``visit(url, viewport)``: the page at ``url`` opened in a fresh browser context of
    ``viewport`` (e.g. :data:`PHONE`), loaded, with the console errors and uncaught page errors
    it reported. Contexts are closed after the test."""
    contexts = []

    def open_page(url: str, viewport: dict[str, int]) -> Visit:
        context = browser.new_context(viewport=viewport)
        contexts.append(context)
        page = context.new_page()
        seen = Visit(page)
        page.on("console", lambda m: seen.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: seen.console_errors.append(str(e)))
        page.goto(url, wait_until="load")
        return seen

    yield open_page
    for context in contexts:
        context.close()


def broken_images(page) -> list[str]:
    """The ``alt`` (or the start of the ``src``) of each ``<img>`` on ``page`` that did not load
    (not complete, or of no natural width) or, inline as a ``data:`` URI, whose data Pillow cannot
    decode to its end: Chromium reports a truncated PNG loaded, at its full width, and draws the
    rows it has."""
    images = page.evaluate(
        "() => [...document.images].map(i => [i.alt || i.src.slice(0, 60), i.complete && i.naturalWidth > 0, i.src])"
    )
    return [name for name, loaded, src in images if not loaded or (src.startswith("data:") and not _decodes(src))]


def _decodes(data_uri: str) -> bool:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(base64.b64decode(data_uri.partition(",")[2]))) as image:
            image.load()
    except (OSError, SyntaxError, ValueError):
        return False
    return True


def horizontal_overflow(page) -> int:
    """How many CSS pixels the document is wider than the window (0 when it needs no horizontal scroll)."""
    return page.evaluate("() => Math.max(0, document.documentElement.scrollWidth - window.innerWidth)")


def unresolved_links(page, base: Path) -> list[str]:
    """The ``href`` of each link on ``page`` that leads nowhere: an ``#anchor`` with no element of
    that id, a relative path with no file under ``base``, or any other scheme than those (the
    report holds no external reference)."""
    hrefs = page.evaluate("() => [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'))")
    bad = []
    for href in hrefs:
        parts = urlsplit(href)
        if parts.scheme or parts.netloc:
            bad.append(href)
        elif parts.path:
            if not (base / unquote(parts.path)).exists():
                bad.append(href)
        elif parts.fragment:
            if not page.evaluate("id => document.getElementById(id) !== null", unquote(parts.fragment)):
                bad.append(href)
    return bad


def close_mlflow_assistant(page, wait_ms: int = 10_000) -> bool:
    """Close the MLflow UI's Assistant panel, as a person does once: MLflow 3.x opens it by itself
    on a browser's first visit to a server on loopback, a third of a laptop's screen wide, and
    keeps it closed once closed (the browser's local storage), so later pages in the same browser
    context come without it. Waits up to ``wait_ms`` for it to open; an MLflow without the panel
    loses that wait once. Returns whether it was open."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    new_chat = page.get_by_role("button", name="New Chat")  # the panel's own buttons
    try:
        new_chat.wait_for(timeout=wait_ms)
    except PlaywrightTimeout:
        return False
    panel = page.locator("div").filter(has=new_chat).filter(has=page.get_by_role("button", name="Close")).last
    panel.get_by_role("button", name="Close").click()
    new_chat.wait_for(state="hidden", timeout=wait_ms)
    return True
