"""The Files page's second pass in headless Chromium, against a real
controller and PostgreSQL: overwrite prompts, rename and move, restore as
another name, the keyboard, preview addresses, live listings and a run's
warnings in the sync panel.

Every check looks at what a person sees and at the API state behind it.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.support.agentfiles import new_agent, operate, put, run_detail, start_agent_run
from tests.support.bridge import api_client, start_run
from tests.support.browser import BROWSER_TESTS
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)
from tests.support.web import (
    ViewRecorder,
    api_entries,
    drop_files,
    folder_url,
    listing_row,
    operate_all,
    put_file,
    row_action,
    sign_in,
    tab,
    trash_row,
)

pytestmark = BROWSER_TESTS


def stored(tenant: Tenant, folder: str, path: str) -> bytes | None:
    with tenant.client() as client:
        resp = client.get(folder + "/content", params={"path": path})
    if resp.status_code == 404:
        return None
    assert resp.status_code == 200, resp.text
    return resp.content


def live_paths(tenant: Tenant, folder: str) -> set[str]:
    return {e["path"] for e in api_entries(tenant, folder)}


def open_my_files(page: Page, tenant: Tenant, query: str = "") -> None:
    sign_in(
        page,
        tenant.controller.url,
        tenant.token,
        folder_url(tenant, "user", tenant.user_id) + query,
    )


def test_upload_over_an_existing_name_asks_replace_keep_both_or_skip(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    folder = tenant.my_folder
    put_file(tenant, folder, "notes.txt", b"old notes")
    open_my_files(page, tenant)
    expect(listing_row(page, "notes.txt")).to_be_visible()
    uploads = page.locator(".upload")
    dialog = page.get_by_role("dialog")

    # Skip: nothing changes.
    drop_files(page, ".dropzone", [("notes.txt", "text/plain", b"skipped bytes")])
    expect(dialog).to_contain_text("A file named notes.txt is already in the top of this folder")
    views.snap("upload-conflict")
    dialog.get_by_role("button", name="Skip").click()
    expect(uploads.nth(0).locator(".upload-state")).to_have_text("Skipped")
    assert stored(tenant, folder, "notes.txt") == b"old notes"
    assert api_entries(tenant, folder, trash=True) == []

    # Keep both: the upload lands under the next free numbered name.
    drop_files(page, ".dropzone", [("notes.txt", "text/plain", b"kept too")])
    dialog.get_by_role("button", name="Keep both").click()
    expect(listing_row(page, "notes (1).txt")).to_be_visible()
    expect(uploads.nth(1).locator(".upload-name")).to_have_text("notes (1).txt")
    assert stored(tenant, folder, "notes (1).txt") == b"kept too"
    assert stored(tenant, folder, "notes.txt") == b"old notes"

    # Replace: the new bytes win and the old ones wait in the trash.
    drop_files(page, ".dropzone", [("notes.txt", "text/plain", b"replacement")])
    dialog.get_by_role("button", name="Replace").click()
    expect(uploads.nth(2).locator(".upload-state")).to_have_text("Replaced")
    assert stored(tenant, folder, "notes.txt") == b"replacement"
    trashed = api_entries(tenant, folder, trash=True)
    assert [(e["path"], e["digest"]) for e in trashed] == [
        ("notes.txt", hashlib.sha256(b"old notes").hexdigest())
    ]
    assert live_paths(tenant, folder) == {"notes.txt", "notes (1).txt"}
    # The kept copy shows in the trash like any deleted file.
    tab(page, "Trash").click()
    expect(trash_row(page, "notes.txt")).to_contain_text("1 file")


def test_rename_and_move_files_and_folders_in_the_page(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    folder = tenant.my_folder
    put_file(tenant, folder, "a.txt", b"alpha")
    put_file(tenant, folder, "b.txt", b"bravo")
    put_file(tenant, folder, "docs/x.txt", b"x-ray")
    open_my_files(page, tenant)
    dialog = page.get_by_role("dialog")

    def rename(path: str, name: str, new: str) -> None:
        row_action(listing_row(page, path), name, "Rename…")
        field = dialog.get_by_label("New name")
        expect(field).to_have_value(name)
        field.fill(new)
        dialog.get_by_role("button", name="Rename", exact=True).click()

    def move(path: str, name: str, dest: str) -> None:
        row_action(listing_row(page, path), name, "Move…")
        dialog.get_by_label("Destination folder (empty for the top level)").fill(dest)
        dialog.get_by_role("button", name="Move", exact=True).click()

    # A rename onto a taken name is refused (409) and changes nothing.
    rename("a.txt", "a.txt", "b.txt")
    expect(page.locator(".files-view .list-error")).to_contain_text(
        "Could not rename a.txt: Something with that name is already there."
    )
    assert stored(tenant, folder, "a.txt") == b"alpha"
    assert stored(tenant, folder, "b.txt") == b"bravo"

    rename("a.txt", "a.txt", "c.txt")
    expect(listing_row(page, "c.txt")).to_be_visible()
    expect(listing_row(page, "a.txt")).to_have_count(0)
    expect(page.get_by_role("link", name="Open c.txt")).to_be_focused()
    assert stored(tenant, folder, "c.txt") == b"alpha" and stored(tenant, folder, "a.txt") is None

    move("c.txt", "c.txt", "docs")
    expect(listing_row(page, "c.txt")).to_have_count(0)
    assert stored(tenant, folder, "docs/c.txt") == b"alpha"

    # A folder renames with everything in it.
    rename("docs", "docs", "papers")
    expect(listing_row(page, "papers")).to_be_visible()
    assert live_paths(tenant, folder) == {"b.txt", "papers", "papers/x.txt", "papers/c.txt"}

    # A folder cannot go into itself (409); it can go into a new folder.
    move("papers", "papers", "papers/inner")
    expect(page.locator(".files-view .list-error")).to_contain_text(
        "A folder cannot be moved into itself."
    )
    assert "papers/x.txt" in live_paths(tenant, folder)
    move("papers", "papers", "archive/2024")
    expect(listing_row(page, "archive")).to_be_visible()
    expect(listing_row(page, "papers")).to_have_count(0)
    assert stored(tenant, folder, "archive/2024/papers/x.txt") == b"x-ray"
    views.snap("after-moves")

    # Several at once: select, then move and delete in bulk.
    put_file(tenant, folder, "one.txt", b"1")
    put_file(tenant, folder, "two.txt", b"2")
    page.reload()
    for name in ("one.txt", "two.txt"):
        page.get_by_role("checkbox", name=f"Select {name}").check()
    bar = page.get_by_role("region", name="Selected items")
    expect(bar).to_contain_text("2 items selected")
    views.snap("selection")
    bar.get_by_role("button", name="Move…").click()
    dialog.get_by_label("Destination folder (empty for the top level)").fill("bulk")
    dialog.get_by_role("button", name="Move", exact=True).click()
    expect(listing_row(page, "bulk")).to_be_visible()
    assert {"bulk/one.txt", "bulk/two.txt"} <= live_paths(tenant, folder)
    page.get_by_role("checkbox", name="Select b.txt").check()
    page.get_by_role("checkbox", name="Select bulk").check()
    bar.get_by_role("button", name="Delete…").click()
    dialog.get_by_role("button", name="Delete", exact=True).click()
    expect(listing_row(page, "b.txt")).to_have_count(0)
    expect(listing_row(page, "bulk")).to_have_count(0)
    assert live_paths(tenant, folder) == {
        "archive",
        "archive/2024",
        "archive/2024/papers",
        "archive/2024/papers/x.txt",
        "archive/2024/papers/c.txt",
    }


def test_bulk_download_fetches_each_selected_file(page: Page, tenant: Tenant) -> None:
    folder = tenant.my_folder
    put_file(tenant, folder, "d1.txt", b"first")
    put_file(tenant, folder, "d2.txt", b"second")
    open_my_files(page, tenant)
    page.get_by_role("checkbox", name="Select all shown").check()
    downloads: list[Any] = []
    page.on("download", lambda d: downloads.append(d))
    page.get_by_role("region", name="Selected items").get_by_role("button", name="Download").click()
    deadline = time.monotonic() + 15
    while len(downloads) < 2 and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    got = {d.suggested_filename: Path(d.path()).read_bytes() for d in downloads}
    assert got == {"d1.txt": b"first", "d2.txt": b"second"}


def test_restore_as_another_name_after_a_collision(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    folder = tenant.my_folder
    put_file(tenant, folder, "plan.txt", b"first plan")
    with tenant.client() as client:
        r = client.post(folder + "/operations", json={"action": "delete", "path": "plan.txt"})
        assert r.status_code == 200, r.text
    put_file(tenant, folder, "plan.txt", b"second plan")
    open_my_files(page, tenant)
    tab(page, "Trash").click()
    row = trash_row(page, "plan.txt")
    row.get_by_role("button", name="Restore plan.txt", exact=True).click()
    expect(row.get_by_role("alert")).to_contain_text("Use Restore as…")
    row.get_by_role("button", name="Restore plan.txt as…").click()
    dialog = page.get_by_role("dialog")
    field = dialog.get_by_label("Restore to (path in this folder)")
    expect(field).to_have_value("plan (restored).txt")
    views.snap("restore-as")
    field.fill("old/plan v1.txt")
    dialog.get_by_role("button", name="Restore", exact=True).click()
    expect(page.get_by_role("status")).to_have_text("Restored plan.txt as old/plan v1.txt.")
    expect(row).to_have_count(0)
    assert stored(tenant, folder, "old/plan v1.txt") == b"first plan"
    assert stored(tenant, folder, "plan.txt") == b"second plan"
    assert api_entries(tenant, folder, trash=True) == []


def test_keyboard_arrows_enter_f2_delete_and_focus(page: Page, tenant: Tenant) -> None:
    folder = tenant.my_folder
    put_file(tenant, folder, "kd/inside.txt", b"in")
    for i in range(1, 5):
        put_file(tenant, folder, f"k{i}.txt", f"file {i}".encode())
    open_my_files(page, tenant)
    heading = page.get_by_role("heading", level=1)
    # Signing in and opening a folder both land on the main heading.
    expect(heading).to_be_focused()

    def focused_path() -> str:
        path: str = page.evaluate(
            "() => document.activeElement.closest('tr[data-path]')?.dataset.path ?? ''"
        )
        return path

    # One row at a time is in the Tab order: past the tabs, the toolbar and the
    # column headers, the next Tab is in the listing (it took 36 to reach one
    # file's Preview when every row's buttons were tab stops).
    presses = 0
    while not focused_path() and presses < 20:
        page.keyboard.press("Tab")
        presses += 1
    assert focused_path() == "kd" and presses <= 14, presses
    tabbable = page.locator(".files-view tbody [tabindex='0']")
    expect(tabbable).to_have_count(4)  # checkbox, name, primary action, menu button

    page.get_by_role("link", name="Open folder kd").focus()
    for key, expected in [
        ("ArrowDown", "k1.txt"),
        ("ArrowDown", "k2.txt"),
        ("End", "k4.txt"),
        ("ArrowUp", "k3.txt"),
        ("Home", "kd"),
        ("ArrowDown", "k1.txt"),
    ]:
        page.keyboard.press(key)
        assert focused_path() == expected, key
    expect(tabbable).to_have_count(4)

    # F2 renames the focused row.
    page.keyboard.press("F2")
    field = page.get_by_role("dialog").get_by_label("New name")
    expect(field).to_be_focused()
    field.fill("k1-renamed.txt")
    page.keyboard.press("Enter")
    expect(page.get_by_role("link", name="Open k1-renamed.txt")).to_be_focused()
    assert stored(tenant, folder, "k1-renamed.txt") == b"file 1"

    # Delete asks, then focus goes to the row that took its place.
    page.keyboard.press("Delete")
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("k1-renamed.txt will move to Trash")
    dialog.get_by_role("button", name="Delete", exact=True).click()
    expect(listing_row(page, "k1-renamed.txt")).to_have_count(0)
    expect(page.get_by_role("link", name="Open k2.txt")).to_be_focused()
    assert [e["path"] for e in api_entries(tenant, folder, trash=True)] == ["k1-renamed.txt"]

    # Enter opens the preview at its own address; Escape goes back to the row.
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"\?preview=k2\.txt$"))
    expect(page.get_by_role("heading", name="Preview: k2.txt")).to_be_focused()
    expect(page.locator(".preview pre")).to_have_text("file 2")
    page.keyboard.press("Escape")
    expect(page.locator(".preview")).to_be_hidden()
    expect(page).to_have_url(
        re.compile(re.escape(folder_url(tenant, "user", tenant.user_id)) + "$")
    )
    expect(page.get_by_role("link", name="Open k2.txt")).to_be_focused()

    # The file changes through the API while its row has focus: the live
    # update rebuilds the row, and focus stays on it.
    put_file(tenant, folder, "k2.txt", b"file 2, changed")
    expect(listing_row(page, "k2.txt").locator(".col-size")).to_have_text("15 bytes", timeout=8000)
    expect(page.get_by_role("link", name="Open k2.txt")).to_be_focused()

    # Enter on a folder opens it, and focus lands on the main heading again.
    page.keyboard.press("Home")
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"\?dir=kd$"))
    expect(listing_row(page, "kd/inside.txt")).to_be_visible()
    expect(heading).to_be_focused()


def test_preview_address_deep_links_and_expands(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    folder = tenant.my_folder
    text = "".join(f"line {i}\n" for i in range(300))
    put_file(tenant, folder, "deep/readme.txt", text.encode())
    open_my_files(page, tenant, "?dir=deep&preview=deep%2Freadme.txt")
    preview = page.locator(".preview")
    expect(preview.locator("pre")).to_have_text(text)
    expect(page.get_by_role("heading", name="Preview: readme.txt")).to_be_focused()
    expect(listing_row(page, "deep/readme.txt")).to_be_visible()
    # The preview spans the content column, far wider than a side panel.
    width = preview.evaluate("el => el.getBoundingClientRect().width")
    assert width > 700, width
    views.snap("preview-deep-link")

    preview.get_by_role("button", name="Expand").click()
    expect(preview).to_have_class(re.compile(r"\bexpanded\b"))
    box = preview.bounding_box()
    assert box is not None and box["width"] == 1280 and box["height"] == 900
    views.snap("preview-expanded")
    page.keyboard.press("Escape")
    expect(preview).to_be_hidden()
    expect(page).to_have_url(re.compile(r"\?dir=deep$"))
    expect(page.get_by_role("link", name="Open readme.txt")).to_be_focused()

    # Back brings the preview back: it is an address like any other.
    page.go_back()
    expect(preview.locator("pre")).to_have_text(text)
    # A preview address of a file that is not there says so.
    page.goto(
        tenant.controller.url + folder_url(tenant, "user", tenant.user_id) + "?preview=nope.txt"
    )
    expect(preview.get_by_role("alert")).to_have_text("There is no file nope.txt in this folder.")


def test_an_agent_save_appears_in_an_open_listing_without_a_reload(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    run = start_run(tenant)
    assert run.task is not None
    task_folder = tenant.folder("task", run.task)
    put_file(tenant, task_folder, "brief.md", b"# Brief\n")
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "task", run.task))
    expect(listing_row(page, "brief.md")).to_be_visible()
    item = page.locator(f'.runs li[data-run-id="{run.run_id}"]')
    expect(item.locator(".run-saved")).to_have_text("Last save of this folder: not yet")
    page.evaluate("() => { window.__stillTheSamePage = true; }")

    # With nothing changing, polls happen but no listing page is fetched.
    listings: list[str] = []
    changes: list[str] = []

    def count(request: Any) -> None:
        url = request.url
        if "/changes?" in url:
            changes.append(url)
        elif re.search(r"/work-folders/task/[^/]+/\?", url):
            listings.append(url)

    page.on("request", count)
    # Two polls answered (one every 2 s): whatever the first made the page
    # fetch has been asked for before the second is sent.
    for _ in range(2):
        with page.expect_response(lambda r: "/changes?" in r.url, timeout=15_000):
            pass
    assert changes and listings == [], (changes, listings)

    # The agent saves a checkpoint through the bridge with its run token.
    saved_at = time.monotonic()
    resp = run.save("task", {"agent-report.md": b"# Report\n", "out/data.csv": b"a,b\n"})
    assert resp.status_code == 200, resp.text
    # Polls run every 2 s; the machine may be busy, so allow a few of them.
    expect(listing_row(page, "agent-report.md")).to_be_visible(timeout=8000)
    expect(listing_row(page, "out")).to_be_visible()
    assert time.monotonic() - saved_at < 8
    assert page.evaluate("() => window.__stillTheSamePage === true")
    # The sync panel follows: this run's save of this folder, and the folder's newest.
    expect(item.locator(".run-saved time")).to_be_visible(timeout=5000)
    expect(page.locator(".agent-updated")).to_contain_text(" by ")
    views.snap("live-agent-save")

    # A run that ends without saving this folder says so, with the reason.
    other = start_run(tenant)
    tenant.controller.admin("end-run", other.run_id)
    assert other.task is not None
    page.goto(tenant.controller.url + folder_url(tenant, "task", other.task))
    ended = page.locator(f'.runs li[data-run-id="{other.run_id}"]')
    expect(ended.locator(".state")).to_have_text("Ended — not saved")
    expect(ended.locator(".run-reason")).to_have_text("The run ended before it saved anything.")
    views.snap("sync-ended-not-saved")

    # The first run saved the task folder, never the user folder: there it
    # does not read "Saved", running or ended.
    page.goto(tenant.controller.url + folder_url(tenant, "user", tenant.user_id))
    expect(item.locator(".state")).to_have_text("Running — not saved here yet")
    expect(item.locator(".run-saved")).to_have_text("Last save of this folder: not yet")
    expect(page.locator(".agent-updated")).to_have_text("Last agent save: none yet")
    tenant.controller.admin("end-run", run.run_id)
    page.reload()
    expect(item.locator(".state")).to_have_text("Ended — not saved")
    expect(item.locator(".run-reason")).to_have_text(
        "The run saved its other folders, never this one."
    )


def run_client(base_url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=30, headers={"Authorization": f"Bearer {token}"})


AGENT_FILE_MAX = 1000


@pytest.fixture(scope="module")
def small_agent_folders(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller whose agent folders hold files of at most 1000 bytes."""
    with private_controller(
        pg_cluster, "fsa-websync-", "--agent-max-file-bytes", str(AGENT_FILE_MAX)
    ) as ctl:
        yield ctl


def test_a_runs_agent_folder_limit_warnings_show_in_the_sync_panel(
    page: Page, small_agent_folders: ControllerProcess, views: ViewRecorder
) -> None:
    tenant = bootstrap_tenant(small_agent_folders)
    agent = new_agent(tenant, "Archivist")
    run = start_agent_run(tenant, agent, user=tenant.user_id)
    # Sandbox code writes the run's agent folder through the API bridge: a file
    # right at the per-file limit is saved with a warning, one over it is
    # refused (422) with a warning of its own, and the run goes on.
    with api_client(tenant, run.token) as c:
        at = put(c, tenant, "agent", agent, "index.bin", b"i" * AGENT_FILE_MAX)
        assert at.status_code == 201, at.text
        over = put(c, tenant, "agent", agent, "dump.bin", b"d" * (AGENT_FILE_MAX + 1))
        assert over.status_code == 422, over.text
        assert over.json()["code"] == "agent_files_limit_exceeded"
    detail = run_detail(tenant, run.run_id).json()
    assert [(w["code"], w["path"]) for w in detail["warnings"]] == [
        ("AGENT_FILES_LIMIT_EXCEEDED", "dump.bin"),
        ("AGENT_FILES_AT_LIMIT", "index.bin"),
    ], detail
    assert detail["state"] != "failed", detail

    sign_in(page, small_agent_folders.url, tenant.token, folder_url(tenant, "agent", agent))
    item = page.locator(f'.runs li[data-run-id="{run.run_id}"]')
    expect(item.locator(".run-head strong")).to_have_text("Archivist")
    warnings = item.get_by_role("list", name="Warnings for Archivist")
    expect(warnings.get_by_role("listitem")).to_have_text(
        [
            "Warning: None of this save's agent-folder changes were saved: dump.bin is"
            f" {AGENT_FILE_MAX + 1} bytes; an agent folder's files are limited to"
            f" {AGENT_FILE_MAX} bytes",
            f"Warning: index.bin ({AGENT_FILE_MAX} bytes) is at or over the"
            f" {AGENT_FILE_MAX}-byte limit per file of the agent folder",
        ]
    )
    # Warnings are not errors: the run is not shown as failed.
    expect(item.locator(".run-error")).to_have_count(0)
    expect(item.locator(".state")).not_to_have_class(re.compile(r"state-failed"))
    expect(listing_row(page, "index.bin")).to_be_visible()
    expect(listing_row(page, "dump.bin")).to_have_count(0)
    views.snap("sync-warnings")

    # The agent removes the big file: the folder is under every limit again and
    # the open panel drops the warnings without a reload.
    with api_client(tenant, run.token) as c:
        gone = operate(c, tenant, "agent", agent, action="delete", path="index.bin")
        assert gone.status_code == 200, gone.text
    assert run_detail(tenant, run.run_id).json()["warnings"] == []
    expect(listing_row(page, "index.bin")).to_have_count(0, timeout=8000)
    expect(item.locator(".run-warnings")).to_have_count(0, timeout=8000)


def test_the_sync_panel_names_an_agent_newer_than_the_pages_directory(
    page: Page, tenant: Tenant
) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "Night work")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "Overnight batch")["id"]
    directories: list[str] = []
    page.on("request", lambda r: directories.append(r.url) if "/directory" in r.url else None)
    sign_in(page, ctl.url, tenant.token, folder_url(tenant, "task", task))
    expect(page.locator(".runs")).to_have_text("No agent runs have used this folder.")
    fetched = len(directories)

    # The agent and its run come after the page loaded the company directory;
    # the run's save reaches the open page, which names the agent.
    agent = new_agent(tenant, "Night Shift")
    run = start_agent_run(tenant, agent, task=task)
    with run_client(ctl.url, run.token) as bridge:
        resp = bridge.post(
            "/bridge/v1/folders/task/checkpoints",
            json={
                "operationId": "cp-late",
                "leaseEpoch": run.lease_epoch,
                "entries": [{"op": "mkdir", "path": "batch"}],
            },
        )
        assert resp.status_code == 200, resp.text
    with tenant.client() as client:
        sync = client.get(tenant.folder("task", task) + "/sync").json()
    assert [(r["runId"], r["agentName"]) for r in sync["runs"]] == [(run.run_id, "Night Shift")]
    item = page.locator(f'.runs li[data-run-id="{run.run_id}"]')
    expect(item.locator(".run-head strong")).to_have_text("Night Shift", timeout=8000)
    expect(item.get_by_role("button", name="Request refresh for Night Shift")).to_be_visible()
    expect(page.locator(".agent-updated")).to_contain_text(" by Night Shift")
    expect(listing_row(page, "batch")).to_be_visible()
    assert len(directories) == fetched, directories


def test_a_live_change_fetches_only_what_changed_never_an_unchanged_page(
    page: Page, tenant: Tenant
) -> None:
    """Two pages of entries; changes to either reach the page through the
    poll's own answer: no listing page is fetched again, only the page not
    loaded yet when the user turns to it."""
    folder = tenant.my_folder
    operate_all(tenant, folder, [{"action": "mkdir", "path": f"many/d{i:04d}"} for i in range(230)])
    listings: list[str] = []
    changes: list[str] = []

    def count(request: Any) -> None:
        if "/changes?" in request.url:
            changes.append(request.url)
        elif re.search(r"/work-folders/user/[^/]+/\?", request.url):
            listings.append(request.url)

    page.on("request", count)
    open_my_files(page, tenant, "?dir=many")
    rows = page.locator(".files-view tbody tr")
    summary = page.locator(".files-view .list-summary")
    expect(summary).to_have_text("Showing 1–200 of 230 entries.")
    expect(rows).to_have_count(200)
    assert len(listings) == 1, listings

    # A file written on the loaded page and a folder past it (on page 2, not
    # fetched yet): the first shows up in place, the second only in the total.
    put_file(tenant, folder, "many/d0005.txt", b"next to d0005")
    with tenant.client() as client:
        resp = client.post(folder + "/operations", json={"action": "mkdir", "path": "many/d0250"})
        assert resp.status_code == 200, resp.text
    expect(listing_row(page, "many/d0005.txt")).to_be_visible(timeout=8000)
    expect(summary).to_have_text("Showing 1–200 of 232 entries.")
    assert rows.nth(6).get_attribute("data-path") == "many/d0005.txt"
    assert len(listings) == 1 and changes, (listings, changes)
    answered = [u for u in changes if "entries=true" in u]
    assert answered and all("dir=many" in u for u in answered), changes

    # Page 2 is fetched once, when the user turns to it, with the new folder.
    page.get_by_role("button", name="Next page").click()
    expect(listing_row(page, "many/d0250")).to_be_visible()
    expect(summary).to_have_text("Showing 201–232 of 232 entries.")
    assert len(listings) == 2, listings

    # A change on page 2 (a trashed folder, a moved-out one) reaches it with no
    # listing fetch, and the unchanged page 1 is not fetched again either.
    with tenant.client() as client:
        for body in (
            {"action": "delete", "path": "many/d0210"},
            {"action": "move", "path": "many/d0220", "to": "moved-d0220"},
        ):
            resp = client.post(folder + "/operations", json=body)
            assert resp.status_code == 200, resp.text
    expect(listing_row(page, "many/d0210")).to_have_count(0, timeout=8000)
    expect(listing_row(page, "many/d0220")).to_have_count(0, timeout=8000)
    expect(summary).to_have_text("Showing 201–230 of 230 entries.")
    page.get_by_role("button", name="Previous page").click()
    expect(listing_row(page, "many/d0005.txt")).to_be_visible()
    assert len(listings) == 2, listings
