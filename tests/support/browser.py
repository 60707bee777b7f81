"""pytest fixtures for the Files page tests: a headless Chromium shared by a
module's tests while it is young (:data:`BROWSER_MAX_AGE_S`), a fresh browser
context per test (desktop size unless a test asks for another viewport), and
screenshots of the views a test visits.

A failing test keeps its screenshots and console log in test-artifacts/; a
test that asks for ``keep_views`` keeps them either way (the main views at
desktop and phone width).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright, sync_playwright

from tests.support.web import CHROMIUM, ViewRecorder, launch_chromium

BROWSER_TESTS = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium package"),
]
"""``pytestmark`` of a module of Files page tests."""


BROWSER_MAX_AGE_S = 90.0
"""No test starts on a browser older than this. Debian's Chromium starts its
on-device model service three minutes after launch; with no GPU backend the
service fails ("Unexpected on_device_model service disconnect ... Error
loading backend"), and twice in CI runs the browser closed with it, at 3:00
exactly, in the middle of a test (TargetClosedError, then the module's next
tests failed at setup). A test starting on a younger browser ends long before."""


class Browsers:
    """A module's Chromium, launched again when it is older than
    :data:`BROWSER_MAX_AGE_S` or no longer connected."""

    def __init__(self, pw: Playwright) -> None:
        self._pw = pw
        self._browser: Browser | None = None
        self._launched = 0.0

    def young(self) -> Browser:
        current = self._browser
        age = time.monotonic() - self._launched
        if current is None or not current.is_connected() or age > BROWSER_MAX_AGE_S:
            self.close()
            current = self._browser = launch_chromium(self._pw)
            self._launched = time.monotonic()
        return current

    def close(self) -> None:
        if self._browser is not None:
            with contextlib.suppress(Exception):  # already gone with its process
                self._browser.close()
            self._browser = None


@pytest.fixture(scope="module")
def browsers() -> Iterator[Browsers]:
    with sync_playwright() as pw:
        held = Browsers(pw)
        try:
            yield held
        finally:
            held.close()


@pytest.fixture
def browser(browsers: Browsers) -> Browser:
    """The module's browser, younger than :data:`BROWSER_MAX_AGE_S`."""
    return browsers.young()


@pytest.fixture
def views(tmp_path: Path) -> ViewRecorder:
    """Screenshots of the main views; copied to test-artifacts/ if the test fails."""
    return ViewRecorder(tmp_path)


@pytest.fixture
def viewport() -> dict[str, int]:
    """The page's size; a test module may override this fixture."""
    return {"width": 1280, "height": 900}


@pytest.fixture
def page(
    browser: Browser,
    views: ViewRecorder,
    viewport: dict[str, int],
    request: pytest.FixtureRequest,
) -> Iterator[Page]:
    # Narrow windows get touch (a phone, or a tablet at 200% zoom); phones also
    # the mobile viewport behaviour.
    # A "touch" key asks for touch at any width (a tablet).
    context = browser.new_context(
        accept_downloads=True,
        viewport={"width": viewport["width"], "height": viewport["height"]},
        has_touch=viewport["width"] <= 720 or bool(viewport.get("touch")),
        is_mobile=viewport["width"] < 600,
    )
    context.set_default_timeout(15_000)
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    views.page = page
    failed_before = request.session.testsfailed
    try:
        yield page
        # An uncaught error in the page is a failure even if every check passed.
        assert not [c for c in console if c.startswith("pageerror")], console
    finally:
        # The call phase's report is counted before fixtures are torn down.
        failed = request.session.testsfailed > failed_before
        if failed or request.node.get_closest_marker("keep_views"):
            kept = views.keep(request.node.name, console, final=failed)
            print(f"screenshots: {kept}")
        context.close()
