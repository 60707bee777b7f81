"""The Files page on touch screens and what may cover an error, in headless
Chromium against a real controller: every visible control (links,
buttons, fields, each checkbox's label) has a hit area of at least 44 x 44
px on touch at phone (390 px) and tablet width, as the page's README
promises; the sync panel comes before the listing on a phone; and the
uploads panel never covers the sync panel's error, at phone and desktop
width."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import Page, Route, expect

from tests.support.bridge import start_run
from tests.support.browser import BROWSER_TESTS
from tests.support.controller import Tenant
from tests.support.repos import repo_run, small_repo
from tests.support.web import drop_files, folder_url, listing_row, put_file, sign_in
from tests.web.test_web_layout import PHONE, TABLET

pytestmark = BROWSER_TESTS

SHORT_DESKTOP = {"width": 1280, "height": 600}

# Every control a finger may aim at, with its hit area: a checkbox's is its
# label (the label takes the tap), anything else its own box.
_SMALL_CONTROLS_JS = """
() => [...document.querySelectorAll(
    'a[href], button, input:not([type=hidden]), select, textarea, summary,'
    + ' [role=button], [role=menuitem], [role=checkbox], [role=tab], [role=link]')]
  .filter(el => !el.closest('.skip-link, .sr-only'))
  .filter(el => el.getClientRects().length && getComputedStyle(el).visibility !== 'hidden')
  .map(el => {
    const box = el.type === 'checkbox' || el.type === 'radio'
      ? (el.closest('label') || (el.labels && el.labels[0]) || el) : el;
    return [el, box.getBoundingClientRect()];
  })
  .filter(([el, r]) => r.width < 44 || r.height < 44)
  .map(([el, r]) => `${el.tagName} ${el.getAttribute('aria-label') || el.textContent.trim()}`
       + ` ${Math.round(r.width)}x${Math.round(r.height)}`)
"""

# Whether the element's center, once scrolled to, shows the element itself.
_UNCOVERED_JS = """
(el) => {
  el.scrollIntoView({block: 'nearest'});
  const r = el.getBoundingClientRect();
  const x = r.left + r.width / 2, y = r.top + r.height / 2;
  const top = document.elementFromPoint(x, y);
  const inView = y >= 0 && y <= window.innerHeight;
  return {inView, shown: !!top && el.contains(top),
          top: top ? `${top.tagName}.${top.className}` : null};
}
"""


def small_controls(page: Page) -> list[str]:
    found: list[str] = page.evaluate(_SMALL_CONTROLS_JS)
    return found


@pytest.mark.parametrize("viewport", [PHONE, TABLET], ids=["390px", "1024px-touch"])
def test_every_control_has_a_44_px_hit_area_on_touch(
    page: Page, tenant: Tenant, viewport: dict[str, int]
) -> None:
    run = repo_run(tenant, {"app": "https://git.example/o/app.git"})
    run.save(run.ws("app"), small_repo())
    folder = tenant.folder("task", str(run.task))
    put_file(tenant, folder, "a.md", b"a\n")
    put_file(tenant, folder, "docs/readme.txt", b"hello\n")
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "task", str(run.task)))
    expect(listing_row(page, "a.md")).to_be_visible()
    panel = page.get_by_role("region", name="Repositories")
    expect(panel.get_by_role("link", name="Download app as a tar archive")).to_be_visible()
    expect(page.locator(".sync .run")).to_have_count(1)
    assert page.evaluate("() => matchMedia('(pointer: coarse)').matches")
    assert small_controls(page) == []

    # The selection bar, a row menu and the preview add controls of their own.
    page.get_by_role("checkbox", name="Select a.md").tap()
    expect(page.get_by_role("region", name="Selected items")).to_be_visible()
    assert small_controls(page) == []
    page.get_by_role("button", name="Clear selection").tap()
    listing_row(page, "a.md").get_by_role("link", name="Open a.md").tap()
    expect(page.locator(".preview pre")).to_have_text("a\n")
    assert small_controls(page) == []

    if viewport["width"] <= 720:
        # On a phone the sync panel comes before the listing.
        sync_box = page.locator(".sync").bounding_box()
        listing_box = page.locator(".files-view").bounding_box()
        assert sync_box is not None and listing_box is not None
        assert sync_box["y"] + sync_box["height"] <= listing_box["y"]


@pytest.mark.parametrize("viewport", [PHONE, SHORT_DESKTOP], ids=["390px", "desktop"])
def test_the_uploads_panel_never_covers_the_sync_panels_error(
    page: Page, tenant: Tenant, viewport: dict[str, int]
) -> None:
    folder = tenant.my_folder
    for i in range(12):
        put_file(tenant, folder, f"file-{i:02}.txt", b"x")
    for _ in range(3):  # a sync panel of some height
        assert start_run(tenant).save("user", {"from-agent.txt": b"hi"}).status_code == 200
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    expect(page.locator(".sync .run")).to_have_count(3)

    # From now on the sync state cannot be loaded; an upload asks for it.
    def unavailable(route: Route) -> None:
        body = {"error": "down", "code": "database_unavailable"}
        route.fulfill(status=503, content_type="application/json", body=json.dumps(body))

    page.route("**/sync", unavailable)
    drop_files(page, ".dropzone", [("new.txt", "text/plain", b"new\n")])
    uploads = page.get_by_role("region", name="Uploads")
    expect(uploads).to_be_visible()
    expect(listing_row(page, "new.txt")).to_be_visible()
    error = page.locator(".sync > .error")
    expect(error).to_have_text(
        "Could not load the sync state: The server's database is unavailable right now."
        " Try again shortly."
    )
    seen = error.evaluate(_UNCOVERED_JS)
    assert seen["inView"] and seen["shown"], seen
    # From the end of the page too (where the listing ends).
    page.evaluate("() => window.scrollTo(0, document.scrollingElement.scrollHeight)")
    seen = error.evaluate(_UNCOVERED_JS)
    assert seen["inView"] and seen["shown"], seen
    expect(uploads).to_be_visible()
