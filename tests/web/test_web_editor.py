"""The Files page's text editor in headless Chromium against a real controller:
an agent's "Instructions" open its entry file; a save sends the version it
read (X-Base-Digest); a save over a newer version (another tab, an agent
run) is 409 stale_save and keeps the person's draft,
shows the newer text beside it and offers overwrite, discard and copy; binary
and larger files are offered for download; the views reflow at phone width
and pass an axe-core scan."""

from __future__ import annotations

import hashlib

import pytest
from playwright.sync_api import Page, Route, expect

from tests.support.agentfiles import OCTET, new_agent
from tests.support.browser import BROWSER_TESTS
from tests.support.controller import Tenant
from tests.support.web import ViewRecorder, axe_violations, folder_url, put_file, sign_in
from tests.web.test_web_layout import NARROWEST, PHONE, assert_tappable

pytestmark = BROWSER_TESTS


def saved(tenant: Tenant, agent: str, path: str = "AGENTS.md") -> bytes:
    with tenant.client() as c:
        r = c.get(tenant.folder("agent", agent) + "/content", params={"path": path})
    assert r.status_code == 200, r.text
    return r.content


def save_elsewhere(tenant: Tenant, agent: str, data: bytes) -> None:
    """Another writer (a second tab, the API, a run) replaces the entry."""
    with tenant.client() as c:
        r = c.put(
            tenant.folder("agent", agent) + "/content",
            params={"path": "AGENTS.md"},
            content=data,
            headers=OCTET,
        )
    assert r.status_code == 200, r.text


def open_instructions(page: Page, tenant: Tenant, agent: str) -> None:
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "agent", agent))
    page.get_by_role("link", name="Instructions: edit AGENTS.md").click()
    expect(page.get_by_role("heading", name="Edit: AGENTS.md")).to_be_visible()


def etag(data: bytes) -> str:
    """The version of ``data`` as the editor's save names it (X-Base-Digest)."""
    return hashlib.sha256(data).hexdigest()


class SaveConditions:
    """Intercepts the page's writes of file contents and keeps each one's
    base (X-Base-Digest) and the controller's status; the request goes to
    the controller unchanged. HTTP's own conditions are never sent."""

    def __init__(self, page: Page) -> None:
        self.seen: list[tuple[str | None, int]] = []
        page.route("**/content?path=*", self.intercept)

    def intercept(self, route: Route) -> None:
        if route.request.method != "PUT":
            route.continue_()
            return
        headers = route.request.headers
        assert "if-match" not in headers and "if-none-match" not in headers, headers
        answer = route.fetch()
        self.seen.append((headers.get("x-base-digest"), answer.status))
        route.fulfill(response=answer)

    def take(self) -> list[tuple[str | None, int]]:
        taken, self.seen = self.seen, []
        return taken


def test_a_stale_save_keeps_the_draft_and_offers_overwrite_discard_and_copy(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    agent = new_agent(tenant)
    save_elsewhere(tenant, agent, b"# Instructions v1\n")
    saves = SaveConditions(page)
    open_instructions(page, tenant, agent)
    draft = page.get_by_label("Your text of AGENTS.md")
    expect(draft).to_have_value("# Instructions v1\n")
    expect(draft).to_be_focused()

    # A save with nothing in between lands (keyboard: Ctrl+S).
    draft.fill("# Instructions v2\n")
    expect(page.locator(".editor-state")).to_have_text("Unsaved changes")
    draft.press("Control+s")
    expect(page.get_by_role("status").filter(has_text="Saved AGENTS.md.")).to_be_visible()
    assert saved(tenant, agent) == b"# Instructions v2\n"
    # The save was conditional on the version the editor loaded.
    assert saves.take() == [(etag(b"# Instructions v1\n"), 200)]

    # Someone else saves; this editor's save is refused, nothing is written,
    # and the draft stays where it was, with the newer text beside it.
    save_elsewhere(tenant, agent, b"# Written by a run\n")
    draft.fill("# My careful draft\n")
    page.get_by_role("button", name="Save", exact=True).click()
    conflict = page.get_by_role("group", name="AGENTS.md changed since you opened it")
    expect(conflict).to_be_visible()
    expect(
        page.get_by_role("heading", name="AGENTS.md changed since you opened it")
    ).to_be_focused()
    expect(draft).to_have_value("# My careful draft\n")
    expect(page.get_by_label("Saved meanwhile (newer)")).to_have_value("# Written by a run\n")
    assert saved(tenant, agent) == b"# Written by a run\n"
    # Refused (409) because it still named the version this editor last saved.
    assert saves.take() == [(etag(b"# Instructions v2\n"), 409)]
    views.snap("conflict")

    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    conflict.get_by_role("button", name="Copy my draft").click()
    expect(page.get_by_role("status").filter(has_text="draft")).to_be_visible()
    copied = page.evaluate("() => navigator.clipboard.readText()")
    assert copied == "# My careful draft\n"

    conflict.get_by_role("button", name="Overwrite with my draft").click()
    expect(conflict).to_be_hidden()
    assert saved(tenant, agent) == b"# My careful draft\n"
    # Overwriting replaces only the newer version it showed.
    assert saves.take() == [(etag(b"# Written by a run\n"), 200)]

    # Again, and this time the draft is discarded for the newer version.
    save_elsewhere(tenant, agent, b"# Newest\n")
    draft.fill("# A draft to drop\n")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(conflict).to_be_visible()
    conflict.get_by_role("button", name="Discard my draft").click()
    expect(conflict).to_be_hidden()
    expect(draft).to_have_value("# Newest\n")
    assert saved(tenant, agent) == b"# Newest\n"
    # The editor now holds the newest version: its next save goes through.
    draft.fill("# After discarding\n")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.get_by_role("status").filter(has_text="Saved AGENTS.md.")).to_be_visible()
    assert saved(tenant, agent) == b"# After discarding\n"
    assert saves.take() == [
        (etag(b"# My careful draft\n"), 409),  # the refused one
        (etag(b"# Newest\n"), 200),  # after discarding, on the newest version
    ]

    # Closing with unsaved changes asks first.
    draft.fill("# Not kept\n")
    page.get_by_role("button", name="Close editor").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("button", name="Discard changes").click()
    expect(page.locator(".editor")).to_be_hidden()
    assert saved(tenant, agent) == b"# After discarding\n"
    assert saves.take() == []  # discarding sends nothing


def test_the_editor_takes_text_up_to_1_mib_and_offers_the_rest_for_download(
    page: Page, tenant: Tenant
) -> None:
    folder = tenant.my_folder
    put_file(tenant, folder, "notes.md", b"plain notes\n")
    put_file(tenant, folder, "big.txt", b"x" * (1024 * 1024 + 1))
    put_file(tenant, folder, "photo.bin", bytes(range(256)))
    base = f"/files/{tenant.company_id}/user/{tenant.user_id}"
    sign_in(page, tenant.controller.url, tenant.token, base + "?preview=notes.md")
    preview = page.locator(".preview")
    expect(preview.locator("pre")).to_have_text("plain notes\n")
    preview.get_by_role("link", name="Edit notes.md").click()
    draft = page.get_by_label("Your text of notes.md")
    expect(draft).to_have_value("plain notes\n")
    draft.fill("edited notes\n")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.get_by_role("status").filter(has_text="Saved notes.md.")).to_be_visible()
    with tenant.client() as c:
        got = c.get(folder + "/content", params={"path": "notes.md"})
    assert got.content == b"edited notes\n"
    digest = hashlib.sha256(b"edited notes\n").hexdigest()
    assert got.headers["etag"] == f'"{digest}"'

    page.goto(tenant.controller.url + base + "?edit=big.txt")
    editor = page.locator(".editor")
    expect(editor).to_contain_text("more than the 1 MiB the editor opens")
    expect(editor.get_by_role("link", name="Download big.txt")).to_be_visible()
    expect(page.get_by_label("Your text of big.txt")).to_be_hidden()
    page.goto(tenant.controller.url + base + "?edit=photo.bin")
    expect(editor).to_contain_text("is not UTF-8 text")
    expect(editor.get_by_role("link", name="Download photo.bin")).to_be_visible()
    # The preview of a binary file has no Edit.
    page.goto(tenant.controller.url + base + "?preview=photo.bin")
    expect(page.locator(".preview")).to_contain_text("can't be shown here")
    expect(page.get_by_role("link", name="Edit photo.bin")).to_be_hidden()


@pytest.mark.keep_views
@pytest.mark.parametrize("viewport", [PHONE, NARROWEST], ids=["390px", "320px"])
def test_the_editor_and_its_conflict_reflow_at_phone_width(
    page: Page, tenant: Tenant, views: ViewRecorder, viewport: dict[str, int]
) -> None:
    agent = new_agent(tenant)
    save_elsewhere(tenant, agent, b"# Instructions\n" + b"A long line of instructions. " * 20)
    open_instructions(page, tenant, agent)
    assert_tappable(page, "editor")
    views.snap(f"{viewport['width']}-editor")
    save_elsewhere(tenant, agent, b"# Changed by a run\n")
    page.get_by_label("Your text of AGENTS.md").fill("# Draft on a phone\n")
    page.get_by_role("button", name="Save", exact=True).tap()
    expect(page.get_by_role("group", name="AGENTS.md changed since you opened it")).to_be_visible()
    assert_tappable(page, "editor conflict")
    views.snap(f"{viewport['width']}-conflict")
    # Stacked: the newer text sits below the draft, both the window's width.
    draft_box = page.get_by_label("Your text of AGENTS.md").bounding_box()
    theirs_box = page.get_by_label("Saved meanwhile (newer)").bounding_box()
    assert draft_box is not None and theirs_box is not None
    assert theirs_box["y"] > draft_box["y"] + draft_box["height"] - 1
    assert axe_violations(page) == []
