"""A task's checkouts across runs of a sandbox, each step its own
``fsagent repos`` process (as systemd runs them) against a real controller
and real Git: a restart warms what is there, a workspace added to the project
is cloned beside it, and a removed binding's checkout and saved checkpoint
are left alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from fsagent.repos.prepare import BINDING_RECORD, SETUP_RECORD
from tests.support.bridge import Run
from tests.support.controller import Tenant
from tests.support.gitrepos import (
    RepoTask,
    Sandbox,
    checkout_snapshot,
    git,
    make_local_state,
    make_origin,
    new_repo_task,
)

SETUP = 'echo ran >> "$SETUP_COUNT"'


@pytest.fixture
def setup_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "setup-count"
    monkeypatch.setenv("SETUP_COUNT", str(path))
    return path


def people_repos(task: RepoTask) -> dict[str, dict[str, Any]]:
    tenant = task.tenant
    with tenant.client() as c:
        r = c.get(f"/api/companies/{tenant.company_id}/tasks/{task.task}/repos")
    assert r.status_code == 200, r.text
    return {row["name"]: row for row in r.json()["repos"]}


def saved_paths(task: RepoTask, run: Run, workspace: str) -> tuple[str, set[str]]:
    """The current checkpoint of ``workspace`` as the run reads it: its id and paths."""
    client = task.client(run)

    async def read() -> tuple[str, set[str]]:
        try:
            manifest = await client.repo_manifest(workspace)
            return manifest.checkpoint_id, {str(m["path"]) for m in manifest.members}
        finally:
            await client.aclose()

    return trio.run(read)


def test_a_restart_warms_the_checkout_with_its_branch_edits_and_setup(
    tmp_path: Path, tenant: Tenant, setup_count: Path
) -> None:
    task = new_repo_task(tenant)
    origin = make_origin(tmp_path / "origin")
    task.add_workspace(str(origin), primary=True, setup=SETUP)
    box = Sandbox(tmp_path / "box", task)
    box.start(task.start_run(sandbox="box"))
    assert box.prepare() == {"app": ("clone", "done")}
    checkout = box.home / "repos" / "app"
    local = make_local_state(checkout)
    first = box.checkpoint()["app"]
    assert first["ok"] and first["committed"] and first["full"]

    # The sandbox restarts: a new run, new processes, nothing kept in memory.
    before = checkout_snapshot(checkout)
    box.start(task.start_run(sandbox="box"))
    assert box.prepare() == {"app": ("warm", "skipped")}
    assert checkout_snapshot(checkout) == before  # not a byte, mode or mtime changed
    assert git(checkout, "symbolic-ref", "--short", "HEAD").strip() == local.branch
    assert git(checkout, "rev-parse", "HEAD").strip() == local.commit
    assert (checkout / local.edited_path).read_text() == local.edited_text
    assert git(checkout, "diff", "--name-only").split() == [local.edited_path]
    assert json.loads((checkout / SETUP_RECORD).read_text())["state"] == "done"
    assert setup_count.read_text().splitlines() == ["ran"]  # setup ran once, at the clone

    # The new run's saver starts from the saved checkpoint: nothing to send.
    again = box.checkpoint()["app"]
    assert again["ok"] and not again["committed"]
    assert again["checkpointId"] == first["checkpointId"]
    (checkout / "after-restart.txt").write_text("written in the second run\n")
    delta = box.checkpoint()["app"]
    assert delta["committed"] and not delta["full"]
    assert (delta["changed"], delta["removed"], delta["uploaded"]) == (1, 0, 1)
    assert people_repos(task)["app"]["checkpointId"] == delta["checkpointId"]


def test_an_added_workspace_is_cloned_and_a_removed_one_is_left_alone(
    tmp_path: Path, tenant: Tenant
) -> None:
    task = new_repo_task(tenant)
    app_origin = make_origin(tmp_path / "origin", "app")
    docs_origin = make_origin(tmp_path / "origin", "docs")
    app_ws = task.add_workspace(str(app_origin), primary=True)
    box = Sandbox(tmp_path / "box", task)
    box.start(task.start_run(sandbox="box"))
    assert box.prepare() == {"app": ("clone", "none")}
    app = box.home / "repos" / "app"
    (app / "notes.md").write_text("saved before the removal\n")
    saved = box.checkpoint()["app"]
    assert saved["committed"]

    docs_ws = task.add_workspace(str(docs_origin))
    removed = task.tenant.controller.admin("remove-workspace", app_ws)
    assert removed["removed"] is True and removed["bindings_kept"] == 1
    (app / "after-removal.txt").write_text("written after the removal\n")
    before = checkout_snapshot(app)
    run = task.start_run(sandbox="box")
    box.start(run)
    assert box.prepare() == {"docs": ("clone", "none")}  # the removed one is not touched
    docs = box.home / "repos" / "docs"
    assert git(docs, "rev-parse", "HEAD") == git(docs_origin, "rev-parse", "main")
    record = json.loads((docs / BINDING_RECORD).read_text())
    assert (record["workspaceId"], record["prepared"]) == (docs_ws, "clone")
    assert checkout_snapshot(app) == before
    assert sorted(p.name for p in (box.home / "repos").iterdir()) == ["app", "docs"]

    # Saving covers the bound checkouts only: app's edit is never sent, and
    # its saved checkpoint stays current (and readable by the task's runs).
    results = box.checkpoint()
    assert sorted(results) == ["docs"] and results["docs"]["committed"]
    assert checkout_snapshot(app) == before
    one = box.repos("checkpoint", "app")
    assert one.returncode == 1 and one.stderr.strip() == "fsagent: no prepared checkout named app"
    rows = people_repos(task)
    assert rows["app"]["removed"] is True and rows["app"]["state"] == "saved"
    assert rows["app"]["checkpointId"] == saved["checkpointId"]
    assert rows["docs"]["checkpointId"] == results["docs"]["checkpointId"]
    current, paths = saved_paths(task, run, app_ws)
    assert current == saved["checkpointId"]
    assert "notes.md" in paths and "after-removal.txt" not in paths
