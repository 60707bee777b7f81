"""The Files page's task view lists the task's repositories, in headless
Chromium against a real controller and PostgreSQL: name, last save, size,
file count, state, error, and a download of the saved checkpoint (a tar the
test opens). Other folders have no repositories panel."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.support.browser import BROWSER_TESTS
from tests.support.controller import Tenant
from tests.support.repos import repo_run, small_repo
from tests.support.web import ViewRecorder, axe_violations, folder_url, sign_in

pytestmark = BROWSER_TESTS


@pytest.mark.keep_views
def test_the_task_view_lists_its_repositories_with_a_download(
    page: Page, tenant: Tenant, views: ViewRecorder, tmp_path: Path
) -> None:
    run = repo_run(
        tenant, {"app": "https://git.example/o/app.git", "lib": "https://git.example/o/lib.git"}
    )
    tree = small_repo()
    run.save(run.ws("app"), tree)
    with run.client() as c:
        r = c.post(
            f"/repos/{run.ws('lib')}/report",
            json={"state": "failed", "error": "a Git lock was held (index.lock)"},
        )
        assert r.status_code == 200
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "task", run.task))
    panel = page.get_by_role("region", name="Repositories")
    expect(panel).to_be_visible()
    app = panel.locator(f'li.repo[data-workspace-id="{run.ws("app")}"]')
    lib = panel.locator(f'li.repo[data-workspace-id="{run.ws("lib")}"]')
    files = [c for c in tree.values() if isinstance(c, bytes)]
    expect(app.locator(".repo-name")).to_have_text("app")
    expect(app.locator(".state")).to_have_text("Saved")
    expect(app.locator(".repo-saved time")).to_be_visible()
    size = sum(len(f) for f in files)
    expect(app.locator(".repo-size")).to_have_text(f"{size} bytes in {len(files)} files")
    expect(lib.locator(".state")).to_have_text("Save failed")
    expect(lib.locator(".repo-error")).to_have_text("Error: a Git lock was held (index.lock)")
    expect(lib.locator(".repo-saved")).to_have_text("Last save: not yet")
    expect(lib.get_by_role("link")).to_have_count(0)
    views.snap("task-repositories")
    assert axe_violations(page) == []

    with page.expect_download() as info:
        app.get_by_role("link", name="Download app as a tar archive").click()
    download = info.value
    assert download.suggested_filename == "app.tar"
    saved = tmp_path / "app.tar"
    download.save_as(saved)
    with tarfile.open(saved) as tar:
        names = set(tar.getnames())
        readme = tar.extractfile("app/README.md")
        assert readme is not None and readme.read() == tree["README.md"]
    assert names == {"app"} | {f"app/{p}" for p in tree}

    # At phone width the panel reflows below the listing, with no sideways scroll.
    page.set_viewport_size({"width": 390, "height": 844})
    expect(app.get_by_role("link", name="Download app as a tar archive")).to_be_visible()
    assert page.evaluate(
        "() => document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    )
    views.snap("task-repositories-phone")

    # A later save shows (after a reload here; the page polls every 15 s).
    run.save(run.ws("lib"), tree)
    page.reload()
    expect(lib.locator(".state")).to_have_text("Saved")
    expect(lib.locator(".repo-error")).to_have_count(0)


def test_other_folders_have_no_repositories_panel(page: Page, tenant: Tenant) -> None:
    run = repo_run(tenant)
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "project", run.project))
    expect(page.get_by_role("region", name="Sync")).to_be_visible()
    expect(page.get_by_role("region", name="Repositories")).to_have_count(0)
    # A task without repositories says so.
    task = tenant.controller.admin("create-task", tenant.company_id, run.project, "bare")["id"]
    page.goto(tenant.controller.url + folder_url(tenant, "task", task))
    panel = page.get_by_role("region", name="Repositories")
    # Its project has a workspace, but no run of this task has bound it yet.
    expect(panel).to_contain_text("This task has no repositories yet.")
