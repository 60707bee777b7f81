"""pytest fixtures for the Files page tests: one headless Chromium per module,
a fresh browser context per test (desktop size unless a test asks for
another viewport), and screenshots of the views a test visits.

A failing test keeps its screenshots and console log in test-artifacts/; a
test that asks for ``keep_views`` keeps them either way (the main views at
desktop and phone width).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.support.web import CHROMIUM, ViewRecorder, launch_chromium

BROWSER_TESTS = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium package"),
]
"""``pytestmark`` of a module of Files page tests."""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            yield browser
        finally:
            browser.close()


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
