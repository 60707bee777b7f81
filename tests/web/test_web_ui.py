"""The Files page in headless Chromium against a real controller and PostgreSQL.

Every check looks at what a person would see (text, sizes, downloaded bytes)
and at the API state behind it, read with a bearer token.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import FilePayload, Locator, Page, expect
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from tests.support.browser import BROWSER_TESTS
from tests.support.controller import Tenant
from tests.support.web import (
    ViewRecorder,
    api_entries,
    build_pdf,
    drop_files,
    entry_by_path,
    escape_in_the_frame,
    folder_url,
    listing_row,
    operate_all,
    png_bytes,
    put_file,
    row_action,
    sign_in,
    sign_out,
    tab,
    trash_row,
)

pytestmark = BROWSER_TESTS

NOT_FOUND_TEXT = "This folder doesn't exist or you don't have access"
BUSY_MS = 120_000
"""How long a check waits for the page on a busy (shared, loaded) machine."""


def test_sign_in_upload_preview_download_and_sign_out(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    base = tenant.controller.url
    notes = b"".join(f"line {i}: the quick brown fox\n".encode() for i in range(40))
    image = png_bytes(3, 2, (200, 30, 60))

    # Signed out, the page asks for a token and says plainly when it is wrong.
    page.goto(base + "/files/")
    expect(page.get_by_role("heading", name="Sign in to Files")).to_be_visible()
    views.snap("sign-in")
    page.get_by_label("API token").fill("fsa_u_not-a-real-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_have_text(
        "That token was not accepted. Check it and try again."
    )

    page.get_by_label("API token").fill(tenant.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("link", name="My files")).to_be_visible()
    # After signing in, focus is on the page's heading, not lost on <body>.
    expect(page.get_by_role("heading", level=1, name="Files")).to_be_focused()
    cookie = next(c for c in page.context.cookies() if c["name"] == "fsa_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    views.snap("home")

    page.get_by_role("link", name="My files").click()
    expect(page).to_have_url(
        re.compile(re.escape(folder_url(tenant, "user", tenant.user_id)) + "$")
    )
    expect(page.get_by_role("heading", level=1)).to_have_text("My files")
    expect(page.get_by_role("heading", level=1)).to_be_focused()
    # The subtitle names the company and the kind of folder, not a raw id.
    expect(page.locator(".subtitle")).not_to_contain_text(tenant.user_id)

    # Two files dropped at once: both listed with their sizes.
    drop_files(
        page, ".dropzone", [("notes.txt", "text/plain", notes), ("pixel.png", "image/png", image)]
    )
    expect(listing_row(page, "notes.txt").locator(".col-size")).to_have_text(
        f"{len(notes) / 1024:.1f} KiB"
    )
    expect(listing_row(page, "pixel.png").locator(".col-size")).to_have_text(f"{len(image)} bytes")
    expect(listing_row(page, "notes.txt").locator(".col-size")).to_have_attribute(
        "data-bytes", str(len(notes))
    )
    expect(page.locator(".upload[data-state=done]")).to_have_count(2)
    stored = {e["path"]: e for e in api_entries(tenant, tenant.my_folder)}
    assert stored["notes.txt"]["byteSize"] == len(notes)
    assert stored["pixel.png"]["byteSize"] == len(image)
    assert stored["pixel.png"]["contentType"] == "image/png"

    # The upload button with the executable flag.
    page.get_by_label("Mark uploads as executable").check()
    page.locator("input[type=file]").set_input_files(
        [FilePayload(name="run.sh", mimeType="text/x-sh", buffer=b"#!/bin/sh\necho hi\n")]
    )
    expect(listing_row(page, "run.sh").locator(".col-exec")).to_have_text("Yes")
    expect(listing_row(page, "notes.txt").locator(".col-exec")).to_have_text("No")
    assert entry_by_path(api_entries(tenant, tenant.my_folder), "run.sh")["executable"] is True  # type: ignore[index]

    # New folder, then sorting by size puts the biggest file last (folders stay first).
    page.get_by_label("New folder").fill("reports")
    page.get_by_role("button", name="Create folder").click()
    expect(listing_row(page, "reports")).to_contain_text("reports/")
    reports = entry_by_path(api_entries(tenant, tenant.my_folder), "reports")
    assert reports is not None and reports["kind"] == "directory"
    page.get_by_role("button", name="Size", exact=True).click()
    expect(page.locator("th:has(button.sort)").nth(1)).to_have_attribute("aria-sort", "ascending")
    order = page.locator(".files-view tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.path)"
    )
    assert order == ["reports", "run.sh", "pixel.png", "notes.txt"]

    # Text preview shows the exact text; image preview decodes to the real size.
    page.get_by_role("link", name="Open notes.txt").click()
    preview = page.locator(".preview")
    expect(preview.locator("pre")).to_have_text(notes.decode())
    views.snap("folder-text-preview")
    page.get_by_role("link", name="Open pixel.png").click()
    img = preview.get_by_role("img", name="Preview of pixel.png")
    expect(img).to_be_visible()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle())
    assert img.evaluate("img => [img.naturalWidth, img.naturalHeight]") == [3, 2]
    views.snap("folder-image-preview")

    # Download through the browser: the very same bytes.
    with page.expect_download() as download_info:
        listing_row(page, "notes.txt").get_by_role("link", name="Download notes.txt").click()
    download = download_info.value
    assert download.suggested_filename == "notes.txt"
    assert Path(download.path()).read_bytes() == notes

    # Navigating into a folder updates the URL and the breadcrumbs.
    listing_row(page, "reports").get_by_role("link", name="Open folder reports").click()
    expect(page).to_have_url(re.compile(r"\?dir=reports$"))
    expect(page.locator(".crumbs [aria-current]")).to_have_text("reports")
    expect(page.locator(".files-view tbody")).to_contain_text("This directory is empty")
    expect(page.get_by_role("heading", level=1)).to_be_focused()
    # Trash and back returns to the same directory.
    tab(page, "Trash").click()
    expect(page.get_by_role("heading", name="Trash")).to_be_visible()
    expect(page.get_by_role("heading", level=1)).to_be_focused()
    tab(page, "Files").click()
    expect(page).to_have_url(re.compile(r"\?dir=reports$"))

    # Sign out: the session is gone and the folder page asks for a token again.
    sign_out(page)
    assert not [c for c in page.context.cookies() if c["name"] == "fsa_session"]
    page.goto(base + folder_url(tenant, "user", tenant.user_id))
    expect(page.get_by_role("heading", name="Sign in to Files")).to_be_visible()
    expect(page.get_by_text("notes.txt")).to_have_count(0)


def test_trash_restore_collision_and_purge(page: Page, tenant: Tenant, views: ViewRecorder) -> None:
    folder = tenant.my_folder
    put_file(tenant, folder, "docs/a.txt", b"alpha")
    put_file(tenant, folder, "docs/b.txt", b"bravo")
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    expect(listing_row(page, "docs")).to_be_visible()

    def delete_docs() -> None:
        row_action(listing_row(page, "docs"), "docs", "Delete…")
        dialog = page.get_by_role("dialog")
        expect(dialog).to_contain_text("everything in it will move to Trash")
        dialog.get_by_role("button", name="Delete").click()
        expect(listing_row(page, "docs")).to_have_count(0)

    delete_docs()
    trashed = api_entries(tenant, folder, trash=True)
    assert sorted(e["path"] for e in trashed) == ["docs", "docs/a.txt", "docs/b.txt"]
    assert len({e["deletedAt"] for e in trashed}) == 1

    # Restore brings the folder back with everything in it.
    tab(page, "Trash").click()
    expect(trash_row(page, "docs")).to_contain_text("Folder with 2 items")
    views.snap("trash")
    trash_row(page, "docs").get_by_role("button", name="Restore docs", exact=True).click()
    expect(page.get_by_role("status")).to_have_text("Restored docs.")
    expect(trash_row(page, "docs")).to_have_count(0)
    assert {e["path"] for e in api_entries(tenant, folder)} == {"docs", "docs/a.txt", "docs/b.txt"}
    tab(page, "Files").click()
    expect(listing_row(page, "docs")).to_be_visible()

    # Delete again, create the same path, and restoring collides (409).
    delete_docs()
    page.get_by_label("New folder").fill("docs")
    page.get_by_role("button", name="Create folder").click()
    expect(listing_row(page, "docs")).to_be_visible()
    tab(page, "Trash").click()
    trash_row(page, "docs").get_by_role("button", name="Restore docs", exact=True).click()
    alert = trash_row(page, "docs").get_by_role("alert")
    expect(alert).to_contain_text(
        "Cannot restore: a file or folder already exists at that path: docs"
    )
    expect(alert).to_contain_text("Use Restore as… to bring it back under another name")
    views.snap("trash-collision")
    assert len(api_entries(tenant, folder, trash=True)) == 3

    # Purge asks first; cancelling keeps the batch, confirming removes it for good.
    trash_row(page, "docs").get_by_role("button", name="Purge docs").click()
    expect(page.get_by_role("dialog")).to_contain_text("This cannot be undone")
    page.get_by_role("dialog").get_by_role("button", name="Cancel").click()
    expect(trash_row(page, "docs")).to_be_visible()
    trash_row(page, "docs").get_by_role("button", name="Purge docs").click()
    page.get_by_role("dialog").get_by_role("button", name="Purge permanently").click()
    expect(page.locator(".trash-view tbody")).to_have_text("Trash is empty.")
    assert api_entries(tenant, folder, trash=True) == []
    assert [e["path"] for e in api_entries(tenant, folder)] == ["docs"]


def test_sync_panel_shows_a_runs_save_state(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    ctl = tenant.controller
    agent = ctl.admin("create-agent", tenant.company_id, "Builder Bot")["id"]
    project = ctl.admin("create-project", tenant.company_id, "Website")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "Write the report")["id"]
    run = ctl.admin("start-run", tenant.company_id, "--agent", agent, "--task", task)

    # Reach the task's folder through the home page search.
    sign_in(page, ctl.url, tenant.token)
    page.get_by_label("Search tasks, agents and projects").fill("report")
    result = page.locator(".result", has_text="Task: Write the report")
    expect(result).to_contain_text("No files yet")
    expect(result).to_contain_text("Agent running")
    expect(page.locator(".result")).to_have_count(1)
    result.get_by_role("link").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Task: Write the report")
    item = page.locator(f'.runs li[data-run-id="{run["run_id"]}"]')
    expect(item).to_contain_text("Builder Bot")
    expect(item.locator(".state")).to_have_text("Starting")
    expect(item).to_contain_text("Last save of this folder: not yet")
    expect(item.locator(".run-activity")).to_have_text("running")
    # The page's words: "Files updated", apart from the last agent save.
    expect(page.locator(".files-updated")).to_have_text("Files updated: none yet")
    expect(page.locator(".agent-updated")).to_have_text("Last agent save: none yet")

    # A direct change updates "Files updated" and is never shown as an agent save.
    drop_files(page, ".dropzone", [("draft.md", "text/markdown", b"# Draft\n")])
    expect(listing_row(page, "draft.md")).to_be_visible()
    expect(page.locator(".files-updated time")).to_be_visible()
    expect(item).to_contain_text("Last save of this folder: not yet")

    files_updated = page.locator(".files-updated time").get_attribute("datetime")

    # The agent saves a checkpoint through the bridge with its run token.
    with httpx.Client(base_url=ctl.url, timeout=30) as bridge:
        bridge.headers["Authorization"] = f"Bearer {run['token']}"
        resp = bridge.post(
            "/bridge/v1/folders/task/checkpoints",
            json={
                "operationId": "cp-1",
                "leaseEpoch": run["lease_epoch"],
                "entries": [{"op": "mkdir", "path": "agent-notes"}],
            },
        )
        assert resp.status_code == 200, resp.text
    with tenant.client() as client:
        sync = client.get(tenant.folder("task", task) + "/sync").json()
    saved = next(r for r in sync["runs"] if r["runId"] == run["run_id"])
    assert saved["state"] == "saved" and saved["lastSavedAt"]
    page.reload()
    expect(item.locator(".state")).to_have_text("Saved")
    save_time = item.locator("p", has_text="Last save of this folder").locator("time")
    expect(save_time).to_have_attribute("datetime", saved["lastSavedAt"])
    # The agent's save is not a direct file operation.
    expect(page.locator(".files-updated time")).to_have_attribute("datetime", files_updated or "")
    expect(listing_row(page, "agent-notes")).to_be_visible()
    views.snap("sync-saved")

    # Asking for a refresh reaches the run.
    item.get_by_role("button", name="Request refresh for Builder Bot").click()
    # The note says what happens next, not only that a refresh was asked for.
    expect(item.locator(".refresh-note")).to_have_text(
        "Refresh requested: waiting for the agent. It takes this folder's new files at its"
        " next safe point, and the request clears once it has."
    )
    requested = item.get_by_role("button", name="Refresh requested for Builder Bot")
    expect(requested).to_have_attribute("aria-disabled", "true")
    expect(requested).to_be_focused()
    with tenant.client() as client:
        runs = client.get(tenant.folder("task", task) + "/sync").json()["runs"]
    assert [r["refreshRequested"] for r in runs if r["runId"] == run["run_id"]] == [True]

    # A failed save shows its error; the last good save stays listed.
    with httpx.Client(base_url=ctl.url, timeout=30) as bridge:
        bridge.headers["Authorization"] = f"Bearer {run['token']}"
        resp = bridge.post(
            "/bridge/v1/run/report", json={"state": "failed", "error": "disk quota exceeded"}
        )
        assert resp.status_code == 200, resp.text
    page.reload()
    expect(item.locator(".state")).to_have_text("Save failed")
    expect(item.locator(".run-error")).to_have_text("Error: disk quota exceeded")
    expect(save_time).to_have_attribute("datetime", saved["lastSavedAt"])
    expect(item.locator(".run-activity")).to_have_text("running")

    # The sandbox stops cleanly (its final save of the folder came): the run
    # says so at once, before the orchestrator ends it, and takes no refresh.
    with httpx.Client(base_url=ctl.url, timeout=30) as bridge:
        bridge.headers["Authorization"] = f"Bearer {run['token']}"
        resp = bridge.post(
            "/bridge/v1/folders/task/checkpoints",
            json={
                "operationId": "cp-final",
                "leaseEpoch": run["lease_epoch"],
                "final": True,
                "entries": [],
            },
        )
        assert resp.status_code == 200, resp.text
    with tenant.client() as client:
        sync = client.get(tenant.folder("task", task) + "/sync").json()
    stopped = next(r for r in sync["runs"] if r["runId"] == run["run_id"])
    assert stopped["active"] is True and stopped["folderStoppedAt"], stopped
    page.reload()
    expect(item.locator(".state")).to_have_text("Saved")
    expect(item.locator(".run-activity")).to_have_text(re.compile(r"^stopped, saved at \S"))
    expect(item.locator(".run-activity time")).to_have_attribute(
        "datetime", stopped["folderStoppedAt"]
    )
    expect(item.get_by_role("button", name=re.compile("refresh", re.I))).to_have_count(0)
    views.snap("sync-stopped")

    # Back home, the search result now says the folder has files.
    page.get_by_role("banner").get_by_role("link", name="Files").click()
    page.get_by_label("Search tasks, agents and projects").fill("report")
    expect(result).to_contain_text("Has files")
    expect(result).to_contain_text("Agent running")


def test_another_members_user_folder_looks_like_a_missing_one(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    other_id, other_token = tenant.new_member("member")
    other = Tenant(tenant.controller, tenant.company_id, other_id, other_token)
    put_file(other, other.my_folder, "secret.txt", b"private")
    sign_in(page, tenant.controller.url, tenant.token)

    page.goto(tenant.controller.url + folder_url(tenant, "user", other_id))
    expect(page.get_by_role("alert")).to_have_text(NOT_FOUND_TEXT)
    private_view = page.locator("main").inner_text()
    views.snap("not-found")

    page.goto(tenant.controller.url + folder_url(tenant, "user", str(uuid.uuid4())))
    expect(page.get_by_role("alert")).to_have_text(NOT_FOUND_TEXT)
    assert page.locator("main").inner_text() == private_view
    assert "secret.txt" not in private_view

    # The owner of that folder does see it.
    sign_out(page)
    sign_in(page, tenant.controller.url, other_token, folder_url(tenant, "user", other_id))
    expect(listing_row(page, "secret.txt")).to_be_visible()


def test_large_folder_pages_and_a_failed_upload_can_be_retried(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    folder = tenant.my_folder
    operate_all(tenant, folder, [{"action": "mkdir", "path": f"many/d{i:04d}"} for i in range(230)])
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    listing_row(page, "many").get_by_role("link", name="Open folder many").click()
    rows = page.locator(".files-view tbody tr")
    summary = page.locator(".files-view .list-summary")
    expect(rows).to_have_count(200)
    # The total comes from the server before every page is loaded.
    expect(summary).to_have_text("Showing 1–200 of 230 entries.")
    expect(page.get_by_role("button", name="Previous page")).to_be_disabled()
    page.get_by_role("button", name="Next page").click()
    # Only one page of rows is ever in the document.
    expect(rows).to_have_count(30)
    expect(summary).to_have_text("Showing 201–230 of 230 entries.")
    expect(rows.first).to_have_attribute("data-path", "many/d0200")
    expect(page.get_by_role("button", name="Next page")).to_be_disabled()
    # The page is in the address: a reload comes back to it.
    expect(page).to_have_url(re.compile(r"\?dir=many&page=2$"))
    page.reload()
    expect(summary).to_have_text("Showing 201–230 of 230 entries.")
    expect(rows.first).to_have_attribute("data-path", "many/d0200")
    # The name filter runs on the server, over entries not loaded yet too.
    page.get_by_label("Filter by name").fill("d021")
    expect(summary).to_have_text("10 entries with “d021” in the name.")
    expect(rows.first).to_have_attribute("data-path", "many/d0210")
    expect(page).to_have_url(re.compile(r"\?dir=many&q=d021$"))
    page.get_by_label("Filter by name").fill("")
    expect(summary).to_have_text("Showing 1–200 of 230 entries.")
    # Sorting by name is operable from the keyboard and covers every entry.
    page.get_by_role("button", name="Name", exact=True).focus()
    page.keyboard.press("Enter")
    expect(page.locator("th[aria-sort]")).to_have_attribute("aria-sort", "descending")
    expect(summary).to_have_text("Showing 1–200 of 230 entries.")
    expect(rows.first).to_have_attribute("data-path", "many/d0229")

    # The first attempt never reaches the server; the retry reuses its key.
    keys: list[str] = []

    def flaky(route: Any) -> None:
        keys.append(route.request.headers["idempotency-key"])
        if len(keys) == 1:
            route.abort()
        else:
            route.continue_()

    page.route("**/content?path=*", flaky)
    drop_files(page, ".dropzone", [("late.txt", "text/plain", b"arrives on retry")])
    upload = page.locator(".upload", has_text="late.txt")
    expect(upload.get_by_role("alert")).to_have_text(
        "Could not upload late.txt: Could not reach the server. Check the connection and try again."
    )
    assert entry_by_path(api_entries(tenant, folder), "many/late.txt") is None
    views.snap("upload-failed")
    upload.get_by_role("button", name="Retry upload of late.txt").click()
    expect(upload.locator(".upload-state")).to_have_text("Uploaded")
    page.get_by_role("button", name="Next page").click()  # files sort after the folders
    expect(listing_row(page, "many/late.txt").locator(".col-size")).to_have_text("16 bytes")
    assert len(keys) == 2 and keys[0] == keys[1]
    with tenant.client() as client:
        resp = client.get(folder + "/content", params={"path": "many/late.txt"})
        assert resp.content == b"arrives on retry"


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF showing `text` (Helvetica), with a correct xref table."""
    stream = f"BT /F1 24 Tf 40 100 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 300 200] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    return build_pdf(objects)


def test_previews_of_pdf_binary_and_oversized_files(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    folder = tenant.my_folder
    pdf = minimal_pdf("Hello PDF")
    with tenant.client() as client:
        resp = client.put(
            folder + "/content",
            params={"path": "hello.pdf"},
            content=pdf,
            headers={
                "Content-Type": "application/octet-stream",
                "X-File-Content-Type": "application/pdf",
            },
        )
        assert resp.status_code == 201, resp.text
    put_file(tenant, folder, "blob.bin", b"\x00\x01\x02binary")
    put_file(tenant, folder, "huge.log", b"x" * (8 * 1024 * 1024 + 1))
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    preview = page.locator(".preview")

    page.get_by_role("link", name="Open hello.pdf").click()
    frame = preview.locator("iframe[title='Preview of hello.pdf']")
    expect(frame).to_be_visible(timeout=BUSY_MS)
    assert frame.get_attribute("src") == "/files/static/pdf-viewer.html"
    expect(preview.get_by_role("status")).to_have_text("1 page", timeout=BUSY_MS)
    views.snap("pdf-preview")

    # The PDF's frame (tests/web/test_web_pdf_sandbox.py) keeps every key press
    # while it has focus; Escape in it closes the preview.
    click_into_pdf(page, frame)
    escape_in_the_frame(page, preview)
    expect(page).not_to_have_url(re.compile("preview="))
    expect(page.get_by_role("link", name="Open hello.pdf")).to_be_focused()

    # Headless Chromium's PDF viewer takes clicks meant for the page below
    # it once the page scrolls, so the next name is opened from the keyboard.
    page.get_by_role("link", name="Open blob.bin").press("Enter")
    expect(preview).to_contain_text("blob.bin is not text, an image or a PDF", timeout=BUSY_MS)
    expect(preview.get_by_role("link", name="Download blob.bin")).to_be_visible()

    page.get_by_role("link", name="Open huge.log").click()
    expect(preview).to_contain_text("larger than the 8 MiB preview limit", timeout=BUSY_MS)
    with page.expect_download() as download_info:
        preview.get_by_role("link", name="Download huge.log").click()
    assert Path(download_info.value.path()).stat().st_size == 8 * 1024 * 1024 + 1

    page.get_by_role("button", name="Close preview").click()
    expect(preview).to_be_hidden(timeout=BUSY_MS)
    # Focus returns to the file's row.
    expect(page.get_by_role("link", name="Open huge.log")).to_be_focused()


def click_into_pdf(page: Page, frame: Locator) -> None:
    """Click the PDF until it has focus. On a busy machine the viewer may
    still be starting when a click lands, and that click leaves focus on the
    page; a click once it runs must give it focus within the deadline."""
    deadline = time.monotonic() + BUSY_MS / 1000
    while True:
        frame.click()
        try:
            page.wait_for_function(
                "() => document.activeElement && document.activeElement.tagName === 'IFRAME'",
                timeout=5_000,
            )
            return
        except PlaywrightTimeoutError:
            focused = page.evaluate("() => document.activeElement.tagName")
            assert time.monotonic() < deadline, f"focus stayed on {focused}, not the PDF IFRAME"


def test_viewer_gets_a_read_only_page_and_writes_need_the_csrf_header(
    page: Page, tenant: Tenant
) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "Docs site")["id"]
    put_file(tenant, tenant.folder("project", project), "readme.md", b"# Docs\n")
    _, viewer_token = tenant.new_member("viewer")
    sign_in(page, ctl.url, viewer_token, folder_url(tenant, "project", project))
    expect(page.get_by_role("heading", level=1)).to_have_text("Project: Docs site")
    expect(listing_row(page, "readme.md")).to_be_visible()
    expect(page.get_by_text("You have view-only access to this folder.")).to_be_visible()
    for name in ("Upload files…", "Create folder"):
        expect(page.get_by_role("button", name=name)).to_have_count(0)
    expect(page.get_by_text("Drop files here")).to_have_count(0)
    page.get_by_role("button", name="Actions for readme.md").click()
    expect(page.get_by_role("menuitem")).to_have_text(["Preview", "Download"])
    page.keyboard.press("Escape")
    expect(page.get_by_role("link", name="Open readme.md")).to_be_visible()

    # Sign in as the owner: a write from the page without the CSRF header fails.
    sign_out(page)
    sign_in(page, ctl.url, tenant.token, folder_url(tenant, "project", project))
    status = page.evaluate(
        "async (url) => { const r = await fetch(url, { method: 'POST',"
        " headers: { 'Content-Type': 'application/json' },"
        " body: JSON.stringify({ action: 'mkdir', path: 'forged' }) });"
        " return [r.status, (await r.json()).code]; }",
        tenant.folder("project", project) + "/operations",
    )
    assert status == [403, "csrf_failed"]
    assert entry_by_path(api_entries(tenant, tenant.folder("project", project)), "forged") is None


def test_trash_pages_keep_each_deleted_folder_whole(page: Page, tenant: Tenant) -> None:
    folder = tenant.my_folder
    mkdirs = [f"big/d{i:03d}" for i in range(250)] + [f"small{i:03d}" for i in range(205)]
    operate_all(tenant, folder, [{"action": "mkdir", "path": p} for p in mkdirs])
    with tenant.client() as client:

        def operate(action: str, path: str) -> None:
            resp = client.post(folder + "/operations", json={"action": action, "path": path})
            assert resp.status_code == 200, resp.text

        operate("delete", "big")  # one batch of 251 entries, deleted first
        for i in range(205):
            operate("delete", f"small{i:03d}")  # 205 batches, newer than "big", in order
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    tab(page, "Trash").click()
    rows = page.locator(".trash-view tbody tr")
    summary = page.locator(".trash-view .list-summary")
    expect(rows).to_have_count(200)
    expect(summary).to_have_text(
        "Showing 1–200 of the first 200 deleted items; the trash has more."
    )
    expect(rows.first).to_have_attribute("data-path", "small204")
    page.get_by_role("button", name="Next page").click()
    expect(summary).to_have_text("Showing 201–206 of 206 deleted items.")
    expect(rows).to_have_count(6)
    # The big folder spans three API pages and still shows as one whole batch.
    expect(trash_row(page, "big")).to_contain_text("Folder with 250 items")
    trash_row(page, "big").get_by_role("button", name="Restore big", exact=True).click()
    expect(rows).to_have_count(5)
    assert len([e for e in api_entries(tenant, folder) if e["path"].startswith("big/")]) == 250
    page.get_by_role("button", name="Previous page").click()
    expect(rows).to_have_count(200)
