"""The Files page on phones and at zoom, and its accessibility, in headless
Chromium against a real controller: no horizontal page scroll from 320 px
up, every action reachable by tap with 44 px targets, an axe-core scan of the
main views, and screenshots of them at desktop and phone width (kept in
test-artifacts/)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import pytest
from playwright.sync_api import Page, Route, expect

from tests.support.bridge import start_run
from tests.support.browser import BROWSER_TESTS
from tests.support.controller import Tenant
from tests.support.web import (
    ViewRecorder,
    api_entries,
    axe_violations,
    drop_files,
    folder_url,
    listing_row,
    put_file,
    sign_in,
    tab,
    trash_row,
)

pytestmark = BROWSER_TESTS

PHONE = {"width": 390, "height": 844}
NARROWEST = {"width": 320, "height": 640}
DESKTOP = {"width": 1280, "height": 900}
ZOOMED = {"width": 640, "height": 450}  # a 1280 x 900 screen at 200% zoom
TABLET = {"width": 1024, "height": 768, "touch": 1}  # touch wider than 720 px

LONG_NAME = "quarterly-report-with-a-very-long-name-that-never-breaks-2024-final-v2.pdf"

# Controls a finger must hit: every one on screen must be 44 px both ways.
_SMALL_TARGETS_JS = """
() => [...document.querySelectorAll(
    'main button, main .button-link, main input[type=text], main input[type=search],'
    + ' .tabs a, .crumbs a, .listing a.entry-name, .result a, [role=menuitem], dialog button,'
    + ' .topbar button, .topbar a, label.check-target, main a.button-link, .sync a,'
    + ' main input[type=password]')]
  .filter(el => el.getClientRects().length && getComputedStyle(el).visibility !== 'hidden')
  .map(el => [el, el.getBoundingClientRect()])
  .filter(([el, r]) => r.width < 44 || r.height < 44)
  .map(([el, r]) => `${el.tagName} ${el.getAttribute('aria-label') || el.textContent.trim()}`
       + ` ${Math.round(r.width)}x${Math.round(r.height)}`)
"""

# Anything sticking out to the right of the window (what a person would have to scroll to).
_OUTSIDE_JS = """
() => [...document.querySelectorAll('body *')]
  .filter(el => el.getClientRects().length)
  .filter(el => el.getBoundingClientRect().right > window.innerWidth + 0.5)
  .filter(el => !el.closest('.sr-only, .skip-link'))
  .map(el => `${el.tagName}.${el.className} right=${Math.round(el.getBoundingClientRect().right)}`)
  .slice(0, 10)
"""


def assert_reflows(page: Page, where: str) -> None:
    scroll, inner = page.evaluate(
        "() => [document.scrollingElement.scrollWidth, window.innerWidth]"
    )
    assert scroll <= inner, (where, scroll, inner, page.evaluate(_OUTSIDE_JS))


def assert_tappable(page: Page, where: str) -> None:
    assert_reflows(page, where)
    small = page.evaluate(_SMALL_TARGETS_JS)
    assert small == [], (where, small)


def seed(tenant: Tenant) -> dict[str, Any]:
    folder = tenant.my_folder
    put_file(tenant, folder, LONG_NAME, b"%PDF-1.4 not really\n")
    put_file(
        tenant,
        folder,
        "notes.txt",
        b"".join(b"a fairly long line of notes %d\n" % i for i in range(60)),
    )
    put_file(tenant, folder, "reports/2024/summary.md", b"# Summary\n")
    with tenant.client() as client:
        resp = client.put(
            folder + "/content",
            params={"path": "run.sh"},
            content=b"#!/bin/sh\necho hi\n",
            headers={"Content-Type": "application/octet-stream", "X-File-Executable": "true"},
        )
        assert resp.status_code in (200, 201), resp.text
    put_file(tenant, folder, "gone.txt", b"bye")
    with tenant.client() as client:
        r = client.post(folder + "/operations", json={"action": "delete", "path": "gone.txt"})
        assert r.status_code == 200, r.text
    run = start_run(tenant)
    assert run.save("user", {"from-agent.txt": b"hello"}).status_code == 200
    return {"run": run}


@pytest.mark.keep_views
@pytest.mark.parametrize(
    "viewport",
    [PHONE, NARROWEST, ZOOMED, TABLET],
    ids=["390px", "320px", "640px-zoomed", "1024px-touch"],
)
def test_phone_widths_reflow_and_every_action_is_a_tap_away(
    page: Page, tenant: Tenant, views: ViewRecorder, viewport: dict[str, int]
) -> None:
    seed(tenant)
    width = viewport["width"]
    base = tenant.controller.url
    page.goto(base + "/files/")
    expect(page.get_by_role("heading", name="Sign in to Files")).to_be_visible()
    assert_tappable(page, "sign-in")
    views.snap(f"{width}-sign-in")
    page.get_by_label("API token").fill(tenant.token)
    page.get_by_role("button", name="Sign in").tap()
    expect(page.get_by_role("link", name="My files")).to_be_visible()
    assert_tappable(page, "home")
    views.snap(f"{width}-home")

    page.get_by_role("link", name="My files").tap()
    row = listing_row(page, LONG_NAME)
    expect(row).to_be_visible()
    assert_tappable(page, "listing")
    views.snap(f"{width}-listing")
    narrow = width <= 720
    if narrow:
        # The table became a list: one card per entry, the name on its own line.
        assert row.evaluate("tr => getComputedStyle(tr).display") == "grid"
        name_box = row.locator(".entry-name").bounding_box()
        assert name_box is not None and name_box["width"] > width / 2
    # The Executable state stays on screen in either layout.
    run_sh = listing_row(page, "run.sh")
    expect(run_sh.locator(".row-meta" if narrow else ".col-exec")).to_contain_text(
        "Executable" if narrow else "Yes"
    )
    if narrow:
        expect(listing_row(page, "notes.txt").locator(".row-meta")).not_to_contain_text(
            "Executable"
        )
    else:
        expect(listing_row(page, "notes.txt").locator(".col-exec")).to_have_text("No")

    # Every row action is reachable by tap: the menu opens inside the window.
    row.get_by_role("button", name=f"Actions for {LONG_NAME}").tap()
    menu = page.get_by_role("menu")
    expect(menu.get_by_role("menuitem")).to_have_text(
        ["Preview", "Download", "Rename…", "Move…", "Delete…"]
    )
    box = menu.bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width
    assert_tappable(page, "row menu")
    views.snap(f"{width}-row-menu")
    menu.get_by_role("menuitem", name="Rename…").tap()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_label("New name")).to_have_value(LONG_NAME)
    dialog_box = dialog.bounding_box()
    assert dialog_box is not None and dialog_box["x"] >= 0
    assert dialog_box["x"] + dialog_box["width"] <= width
    assert_tappable(page, "rename dialog")
    dialog.get_by_role("button", name="Cancel").tap()

    # Selection and the bulk bar.
    page.get_by_role("checkbox", name="Select notes.txt").tap()
    expect(page.get_by_role("region", name="Selected items")).to_be_visible()
    assert_tappable(page, "selection")
    page.get_by_role("button", name="Clear selection").tap()

    # The preview takes the full width and stays inside it.
    listing_row(page, "notes.txt").get_by_role("link", name="Open notes.txt").tap()
    preview = page.locator(".preview")
    expect(preview.locator("pre")).to_be_visible()
    pbox = preview.bounding_box()
    assert pbox is not None and pbox["x"] + pbox["width"] <= width
    assert pbox["width"] >= (width - 40 if narrow else width / 2)
    assert_tappable(page, "preview")
    views.snap(f"{width}-preview")
    preview.get_by_role("button", name="Close preview").tap()
    expect(preview).to_be_hidden()

    # Into a directory by tap, then the trash and the sync panel.
    listing_row(page, "reports").get_by_role("link", name="Open folder reports").tap()
    expect(listing_row(page, "reports/2024")).to_be_visible()
    assert_tappable(page, "subdirectory")
    tab(page, "Trash").tap()
    expect(trash_row(page, "gone.txt")).to_be_visible()
    assert_tappable(page, "trash")
    views.snap(f"{width}-trash")
    sync = page.locator(".sync")
    sync.scroll_into_view_if_needed()
    expect(sync.locator(".run")).to_have_count(1)
    assert_tappable(page, "sync")
    views.snap(f"{width}-sync")


@pytest.mark.keep_views
@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_axe_finds_no_serious_problems_on_the_main_views(
    page: Page, tenant: Tenant, views: ViewRecorder, viewport: dict[str, int]
) -> None:
    seed(tenant)
    label = "desktop" if viewport["width"] > 600 else "phone"
    found: dict[str, list[str]] = {}

    def scan(view: str) -> None:
        views.snap(f"{label}-{view}")
        problems = axe_violations(page)
        if problems:
            found[view] = problems

    page.goto(tenant.controller.url + "/files/")
    expect(page.get_by_role("heading", name="Sign in to Files")).to_be_visible()
    scan("sign-in")
    sign_in(page, tenant.controller.url, tenant.token)
    expect(page.locator(".result").first).to_be_visible()
    scan("home")
    page.get_by_role("link", name="My files").click()
    expect(listing_row(page, "notes.txt")).to_be_visible()
    scan("listing")
    page.get_by_role("checkbox", name="Select notes.txt").check()
    listing_row(page, "notes.txt").get_by_role("button", name="Actions for notes.txt").click()
    scan("menu-and-selection")
    page.keyboard.press("Escape")
    page.get_by_role("link", name="Open notes.txt").click()
    expect(page.locator(".preview pre")).to_be_visible()
    scan("preview")
    page.locator(".preview").get_by_role("link", name="Edit notes.txt").click()
    expect(page.get_by_label("Your text of notes.txt")).to_be_visible()
    scan("editor")
    page.get_by_role("button", name="Close editor").click()
    expect(page.locator(".editor")).to_be_hidden()
    tab(page, "Trash").click()
    expect(trash_row(page, "gone.txt")).to_be_visible()
    scan("trash")
    trash_row(page, "gone.txt").get_by_role("button", name="Restore gone.txt as…").click()
    expect(page.get_by_role("dialog")).to_be_visible()
    scan("restore-as-dialog")
    page.keyboard.press("Escape")
    page.goto(tenant.controller.url + folder_url(tenant, "user", str(uuid.uuid4())))
    expect(page.get_by_role("alert")).to_contain_text("doesn't exist")
    scan("not-found")
    assert found == {}, found
    # The scan can fail: a button without a name is a critical violation.
    page.evaluate("() => document.querySelector('main').append(document.createElement('button'))")
    assert any("button-name" in p for p in axe_violations(page))


_PIXELS_JS = """
async (b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const bitmap = await createImageBitmap(new Blob([bytes], { type: "image/png" }));
  const canvas = new OffscreenCanvas(bitmap.width, bitmap.height);
  const ctx = canvas.getContext("2d");
  ctx.drawImage(bitmap, 0, 0);
  const { data } = ctx.getImageData(0, 0, bitmap.width, bitmap.height);
  return { width: bitmap.width, height: bitmap.height, rgba: Array.from(data) };
}
"""

Pixel = tuple[int, int, int]


def _pixels(page: Page, box: dict[str, float], pad: int) -> tuple[int, int, list[list[Pixel]]]:
    """What the screen shows around ``box`` (``pad`` px of its surroundings),
    decoded by the browser itself: width, height and rows of RGB pixels."""
    clip = {
        "x": box["x"] - pad,
        "y": box["y"] - pad,
        "width": box["width"] + 2 * pad,
        "height": box["height"] + 2 * pad,
    }
    shot = base64.b64encode(page.screenshot(clip=clip)).decode()
    got = page.evaluate(_PIXELS_JS, shot)
    w, rgba = got["width"], got["rgba"]
    rows = [
        [tuple(rgba[(y * w + x) * 4 : (y * w + x) * 4 + 3]) for x in range(w)]
        for y in range(got["height"])
    ]
    return w, got["height"], rows  # type: ignore[return-value]


def test_the_file_icon_is_a_page_not_a_checkbox(page: Page, tenant: Tenant) -> None:
    """A file's icon is taller than wide with its top right corner folded off
    and text lines inside; the row's checkbox beside it is a plain square."""
    put_file(tenant, tenant.my_folder, "letter.txt", b"Dear reader\n")
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    row = listing_row(page, "letter.txt")
    expect(row).to_be_visible()
    icon = row.locator(".icon")
    box = icon.bounding_box()
    check = row.get_by_role("checkbox", name="Select letter.txt").bounding_box()
    assert box is not None and check is not None
    assert abs(check["width"] - check["height"]) < 1, check
    assert box["height"] >= box["width"] * 1.2, box

    pad = 3
    _, _, px = _pixels(page, box, pad)
    outside = px[0][0]
    top, left = pad, pad
    right = pad + round(box["width"]) - 1
    bottom = pad + round(box["height"]) - 1
    # Border at the top left and bottom right; the folded corner is background.
    assert px[top][left] != outside and px[bottom][right] != outside, (px[top], outside)
    assert px[top][right] == outside, (px[top], outside)
    # Inside, between the borders: paper and at least two darker text lines.
    column = [px[y][left + 3] for y in range(top + 3, bottom - 2)]
    paper = max(column, key=sum)
    lines = 0
    for above, here in zip([paper, *column], column, strict=False):
        if sum(here) < sum(paper) - 90 and sum(above) >= sum(paper) - 90:
            lines += 1
    assert lines >= 2, column


def _page_top(page: Page, path: str) -> float:
    """Where the row of ``path`` is on the page (not the window: scrolling is not moving)."""
    top: float = listing_row(page, path).evaluate(
        "tr => tr.getBoundingClientRect().top + window.scrollY"
    )
    return top


@pytest.mark.keep_views
@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_selection_uploads_and_messages_never_move_the_rows(
    page: Page, tenant: Tenant, views: ViewRecorder, viewport: dict[str, int]
) -> None:
    """Ticking a checkbox, an upload and a status message all float over the
    page: the row under the pointer stays where it was."""
    folder = tenant.my_folder
    for name in ("a.txt", "b.txt", "c.txt"):
        put_file(tenant, folder, name, name.encode())
    page.clock.install()
    # The sync state comes after the listing, and on a phone its panel is
    # above the rows: held back until the rows are measured, its answer must
    # not move them either.
    held: list[Route] = []

    def hold(route: Route) -> None:
        held.append(route)

    page.route("**/sync", hold)
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    expect(listing_row(page, "c.txt")).to_be_visible()
    width = viewport["width"]
    rows = {p: _page_top(page, p) for p in ("a.txt", "b.txt", "c.txt")}
    deadline = time.monotonic() + 60
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(50)  # Playwright hands the request over while it waits
    assert len(held) == 1, held
    held[0].continue_()
    page.unroute("**/sync", hold)
    expect(page.locator(".runs")).to_have_text("No agent runs have used this folder.")
    assert {p: _page_top(page, p) for p in rows} == rows

    box = page.get_by_role("checkbox", name="Select a.txt")
    box.tap() if width < 600 else box.click()
    bar = page.get_by_role("region", name="Selected items")
    expect(bar).to_contain_text("1 item selected")
    assert {p: _page_top(page, p) for p in rows} == rows
    # The bar is whole inside the window, every button on it reachable.
    bbox = bar.bounding_box()
    assert bbox is not None and bbox["x"] >= 0 and bbox["x"] + bbox["width"] <= width
    assert bbox["y"] + bbox["height"] <= viewport["height"]
    if width < 600:
        assert_tappable(page, "selection bar")
    views.snap(f"{width}-selection-bar")
    # The next checkbox is where it was: a second tap selects b.txt, not another row.
    second = page.get_by_role("checkbox", name="Select b.txt")
    second.tap() if width < 600 else second.click()
    expect(bar).to_contain_text("2 items selected")
    bar.get_by_role("button", name="Clear selection").click()
    expect(bar).to_be_hidden()

    drop_files(page, ".dropzone", [("z-last.txt", "text/plain", b"last")])
    uploads = page.get_by_role("region", name="Uploads")
    expect(uploads.locator(".upload-state")).to_have_text("Uploaded")
    status = page.get_by_role("status").filter(has_text="Uploaded: z-last.txt.")
    expect(status).to_be_visible()
    expect(listing_row(page, "z-last.txt")).to_be_visible()
    assert {p: _page_top(page, p) for p in rows} == rows
    assert_reflows(page, "upload panel and status")
    views.snap(f"{width}-upload-and-status")
    assert "z-last.txt" in {e["path"] for e in api_entries(tenant, folder)}
    # Scrolled to the end, everything on the page is clear of the open uploads
    # panel: nothing is out of reach behind it.
    content_bottom, panel_top = page.evaluate(
        "() => { window.scrollTo(0, document.scrollingElement.scrollHeight);"
        " return [document.querySelector('.layout').getBoundingClientRect().bottom,"
        " document.querySelector('.uploads-box').getBoundingClientRect().top]; }"
    )
    assert content_bottom <= panel_top, (content_bottom, panel_top)
    actions = listing_row(page, "z-last.txt").get_by_role("button", name="Actions for z-last.txt")
    actions.tap() if width < 600 else actions.click()
    expect(page.get_by_role("menu")).to_be_visible()
    page.keyboard.press("Escape")
    # A message goes away by itself, so it never stays over a row.
    page.clock.fast_forward(11_000)
    expect(status).to_have_count(0)
