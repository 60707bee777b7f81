"""Status that tells the truth: ``fsagent repos status``, the controller's
``/sync``, a run's details and the Files page's Sync panel show a save that
did not happen (with its stable code) until a later save of the same thing
succeeds; each folder and each repository shows its own state; a restored
checkout names the checkpoint it came from.

Real controller and PostgreSQL, real Git, ``fsagent repos`` in processes of
their own, headless Chromium for the page."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from tests.support.agentfiles import new_agent, put, run_detail, start_agent_run
from tests.support.bridge import Run, api_client, start_run
from tests.support.browser import BROWSER_TESTS
from tests.support.constants import REPO
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)
from tests.support.gitrepos import RepoTask, Sandbox, make_origin, new_repo_task
from tests.support.lossy_proxy import LossyProxy
from tests.support.web import ViewRecorder, folder_url, sign_in

REPO_LOCK_CLASS = 0x726570
"""The first key of a task's repository advisory lock (controller/repos.py)."""

Test = Callable[..., None]


def browser_test(test: Test) -> Test:
    """A Files page test (``BROWSER_TESTS``'s marks) in a module whose other tests need no browser."""
    for mark in BROWSER_TESTS:
        test = mark(test)
    return test


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return make_origin(tmp_path / "origin")


@pytest.fixture
def repo_task(tenant: Tenant) -> RepoTask:
    return new_repo_task(tenant)


def status_run(box: Sandbox, *args: str) -> str:
    """``fsagent repos status`` of the sandbox (it takes no controller): its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "repos", "status", "--home", str(box.home),
         "--state-root", str(box.state), *args],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def repos_status(box: Sandbox) -> dict[str, dict[str, Any]]:
    """``fsagent repos status --json``, by checkout name."""
    return {r["name"]: r for r in json.loads(status_run(box, "--json"))["repos"]}


def repos_status_text(box: Sandbox) -> str:
    return status_run(box)


def through(argv: list[str], controller: str, *extra: str) -> list[str]:
    """``argv`` of ``fsagent repos ...`` with another controller URL and more options."""
    at = argv.index("--controller")
    return [*argv[: at + 1], controller, *argv[at + 2 :], *extra]


def wait_for(what: str, check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def details(tenant: Tenant, run_id: str) -> dict[str, Any]:
    r = run_detail(tenant, run_id)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def sync_of(tenant: Tenant, scope: str, owner: str, run_id: str) -> dict[str, Any]:
    """The run as ``GET /sync`` of the folder shows it."""
    with tenant.client() as c:
        r = c.get(tenant.folder(scope, owner) + "/sync")
    assert r.status_code == 200, r.text
    (shown,) = [x for x in r.json()["runs"] if x["runId"] == run_id]
    return dict(shown)


# --- fsagent repos status ----------------------------------------------------------


def test_a_final_save_that_never_reached_the_controller_is_failed_until_a_later_save(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    """The final save of ``watch`` (as ``fsagent up`` runs it) cannot list the
    task's repositories: the controller answers 503 until the client gives
    up. ``status`` must say failed, with the code, not the cadence's earlier
    "saved"; a later save that succeeds clears it."""
    repo_task.add_workspace(str(origin), primary=True)
    box = Sandbox(tmp_path / "box", repo_task)
    box.start(repo_task.start_run())
    assert box.prepare() == {"app": ("clone", "none")}
    first = box.checkpoint()["app"]
    assert first["ok"] and first["committed"]
    assert repos_status(box)["app"]["state"] == "saved"

    proxy = LossyProxy(repo_task.tenant.controller.url).start()
    try:
        log_path = tmp_path / "watch.log"
        argv = through(box.argv("watch"), proxy.url, "--interval", "3600", "--retry-deadline", "3")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log)
        try:
            wait_for("watch to start", lambda: b"fsagent repos: saving" in log_path.read_bytes())
            (box.home / "repos" / "app" / "late.txt").write_text("written before the stop\n")
            proxy.fail_next("GET", r"^/bridge/v1/repos$", count=1000)
            proc.terminate()
            assert proc.wait(timeout=120) == 4, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "final repository save failed" in log_path.read_text()
        assert proxy.failed, "the listing never reached the proxy"
    finally:
        proxy.stop()

    row = repos_status(box)["app"]
    assert row["state"] == "failed", row
    assert row["lastError"]["code"] == "controller_unavailable", row
    assert "gave up after" in row["lastError"]["message"], row
    # The last save that did happen is still named, never a newer one.
    assert row["lastSave"]["checkpointId"] == first["checkpointId"]
    text = repos_status_text(box)
    assert "app: failed" in text and "[controller_unavailable]" in text, text

    again = box.checkpoint()["app"]
    assert again["ok"] and again["committed"]
    row = repos_status(box)["app"]
    assert (row["state"], row["lastError"]) == ("saved", None), row
    assert row["lastSave"]["checkpointId"] == again["checkpointId"] != first["checkpointId"]


def test_a_restored_checkout_names_the_checkpoint_it_came_from(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    repo_task.add_workspace(str(origin), primary=True)
    old = Sandbox(tmp_path / "old", repo_task)
    old.start(repo_task.start_run())
    old.prepare()
    (old.home / "repos" / "app" / "work.txt").write_text("saved in the first sandbox\n")
    saved = old.checkpoint()["app"]
    assert saved["ok"] and saved["committed"]

    new = Sandbox(tmp_path / "new", repo_task)  # a replacement: nothing of the old one
    new.start(repo_task.start_run())
    assert new.prepare() == {"app": ("restore", "none")}
    row = repos_status(new)["app"]
    assert row["state"] == "restored", row
    assert row["restoredFrom"]["checkpointId"] == saved["checkpointId"], row
    assert row["lastError"] is None and row["lastSave"] is None, row
    text = repos_status_text(new)
    assert f"restored from checkpoint {saved['checkpointId']}" in text, text
    assert "never saved" not in text

    # Its first save finds nothing changed: saved, as that same checkpoint.
    unchanged = new.checkpoint()["app"]
    assert unchanged["ok"] and not unchanged["committed"]
    row = repos_status(new)["app"]
    assert row["state"] == "saved", row
    assert row["lastSave"]["checkpointId"] == saved["checkpointId"], row
    assert row["restoredFrom"]["checkpointId"] == saved["checkpointId"], row


def waiting_on_repo_lock(ctl: ControllerProcess) -> bool:
    with ctl.db() as db:
        row = db.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s",
            (REPO_LOCK_CLASS,),
        ).fetchone()
    assert row is not None
    return int(row[0]) > 0


def test_a_superseded_runs_refused_repository_save_is_shown_failed(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    """The old run's commit authenticated before a newer run took the sandbox
    and is refused inside its transaction (409 ``stale_lease``): its status,
    its details and its repository in them say so, with the code, and the
    newer run's save does not make the old run's save a saved one."""
    ctl = repo_task.tenant.controller
    repo_task.add_workspace(str(origin), primary=True)
    box = Sandbox(tmp_path / "box", repo_task)
    old = repo_task.start_run(sandbox="box-truth")
    box.start(old)
    box.prepare()
    first = box.checkpoint()["app"]
    assert first["committed"]
    assert details(repo_task.tenant, old.run_id)["state"] != "failed"
    (box.home / "repos" / "app" / "late.txt").write_text("the old run's last change\n")

    with ctl.db() as blocker:
        blocker.autocommit = False
        # Hold the task's repository lock: the old run's commit waits inside
        # its transaction until the newer run has the lease.
        blocker.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (REPO_LOCK_CLASS, repo_task.task)
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(box.repos, "checkpoint", "--json")
            wait_for("the commit to wait on the lock", lambda: waiting_on_repo_lock(ctl))
            newer = repo_task.start_run(sandbox="box-truth")
            blocker.rollback()
            done = pending.result(timeout=300)
    assert done.returncode == 4, done.stdout + done.stderr
    (refused,) = json.loads(done.stdout)["repos"]
    assert not refused["ok"] and "stale_lease" in refused["error"], refused

    row = repos_status(box)["app"]
    assert row["state"] == "fenced", row
    assert row["lastError"]["code"] == "stale_lease", row
    assert row["lastSave"]["checkpointId"] == first["checkpointId"], row

    shown = details(repo_task.tenant, old.run_id)
    assert shown["superseded"] is True
    assert shown["state"] == "failed" and "stale_lease" in shown["error"], shown
    (repo,) = shown["repos"]
    assert (repo["name"], repo["state"], repo["code"]) == ("app", "failed", "stale_lease"), repo
    assert repo["savedByRun"]["checkpointId"] == first["checkpointId"], repo
    # Not a folder's failure: the task folder, which the old run never saved,
    # says the run was superseded, not the repository's refusal.
    task_sync = sync_of(repo_task.tenant, "task", repo_task.task, old.run_id)
    assert (task_sync["folderState"], task_sync["folderCode"]) == ("failed", "STALE_LEASE")
    assert "repository" not in task_sync["folderError"], task_sync

    # The newer run saves the checkout (its checkpoint holds the late change).
    box.start(newer)
    assert box.prepare() == {"app": ("warm", "none")}
    saved = box.checkpoint()["app"]
    assert saved["ok"] and saved["committed"]
    assert repos_status(box)["app"]["state"] == "saved"
    people = repo_task.people_repos()["app"]
    assert (people["state"], people["checkpointId"]) == ("saved", saved["checkpointId"])
    mine = details(repo_task.tenant, newer.run_id)
    assert mine["state"] != "failed", mine
    (repo,) = mine["repos"]
    assert repo["state"] == "saved" and repo["savedByRun"]["checkpointId"] == saved["checkpointId"]
    # The old run's own save of it never happened: still failed, with the code.
    shown = details(repo_task.tenant, old.run_id)
    assert shown["state"] == "failed" and shown["repos"][0]["code"] == "stale_lease", shown


# --- /sync, a run's details and the Sync panel -------------------------------------------


def sync_item(page: Page, run_id: str) -> Any:
    return page.locator(f'.runs li[data-run-id="{run_id}"]')


def report_failed(run: Run, error: str) -> None:
    """What fsagent's folder shipper reports after a refusal: the run failed,
    naming no folder."""
    with run.client() as c:
        r = c.post("/run/report", json={"state": "failed", "error": error})
        assert r.status_code == 200, r.text


@browser_test
def test_each_folder_shows_its_own_save_state(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    """The run's task folder saved; its project folder's checkpoint was refused
    (409 ``stale_lease``) and fsagent reported the raw refusal for the run.
    The task folder shows its own save, the project folder its own refusal
    with the receipt's code; the run is failed while that stands, even after
    the task folder saves again."""
    run = start_run(tenant)
    assert run.task is not None and run.project is not None
    assert run.save("task", {"report.md": b"# Report\n"}).status_code == 200
    refused = run.commit(
        "project", [{"op": "mkdir", "path": "shared"}], leaseEpoch=run.lease_epoch + 1
    )
    assert refused.status_code == 409 and refused.json()["code"] == "stale_lease", refused.text
    raw = (
        "ControllerRefused: POST project checkpoint: HTTP 409 stale_lease"
        " Lease epoch is older than the current lease"
    )
    report_failed(run, raw)

    task = sync_of(tenant, "task", run.task, run.run_id)
    assert (task["folderState"], task["folderCode"], task["folderError"]) == ("saved", None, None)
    assert task["folderSavedAt"] is not None
    project = sync_of(tenant, "project", run.project, run.run_id)
    assert (project["folderState"], project["folderCode"]) == ("failed", "STALE_LEASE"), project
    assert project["folderError"] == "Lease epoch is older than the current lease"
    assert project["folderFailedAt"] is not None

    # Another save of the task folder records "saved" on the run: the
    # project folder's refusal still stands, for the folder and the run.
    assert run.save("task", {"report.md": b"# Report, v2\n"}).status_code == 200
    project = sync_of(tenant, "project", run.project, run.run_id)
    assert project["folderState"] == "failed" and project["state"] == "failed", project
    assert "STALE_LEASE" in project["error"]
    shown = details(tenant, run.run_id)
    assert shown["state"] == "failed", shown
    folders = {f["scope"]: f for f in shown["folders"]}
    assert (folders["task"]["state"], folders["task"]["code"]) == ("saved", None)
    assert folders["task"]["lastSavedAt"] is not None
    assert (folders["project"]["state"], folders["project"]["code"]) == ("failed", "STALE_LEASE")
    assert folders["user"]["state"] == "starting"

    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "task", run.task))
    item = sync_item(page, run.run_id)
    expect(item.locator(".state")).to_have_text("Saved")
    expect(item.locator(".run-error")).to_have_count(0)
    expect(item).not_to_contain_text("ControllerRefused")
    views.snap("sync-own-folder-saved")
    page.goto(tenant.controller.url + folder_url(tenant, "project", run.project))
    expect(item.locator(".state")).to_have_text("Save failed")
    expect(item.locator(".state")).to_have_class(re.compile(r"state-failed"))
    expect(item.locator(".run-error")).to_have_text(
        "Error: STALE_LEASE: Lease epoch is older than the current lease"
    )
    views.snap("sync-own-folder-refused")

    # A later save of the project folder succeeds: the refusal no longer stands.
    assert run.save("project", {"notes.md": b"notes\n"}).status_code == 200
    project = sync_of(tenant, "project", run.project, run.run_id)
    assert (project["folderState"], project["folderCode"]) == ("saved", None), project
    assert details(tenant, run.run_id)["state"] != "failed"
    page.reload()
    expect(item.locator(".state")).to_have_text("Saved")
    expect(item.locator(".run-error")).to_have_count(0)


@browser_test
def test_a_superseded_run_says_so_with_its_code(
    page: Page, tenant: Tenant, views: ViewRecorder
) -> None:
    """A run that a newer run of its sandbox took over, which never saved the
    user folder, says it was superseded (``STALE_LEASE``), not only that it
    ended before saving; its task folder, which it saved, stays saved."""
    run = start_run(tenant, sandbox="sbx-superseded")
    assert run.task is not None and run.save("task", {"a.txt": b"a"}).status_code == 200
    ctl = tenant.controller
    newer = ctl.admin(
        "start-run", tenant.company_id, "--agent", run.agent, "--task", run.task,
        "--user", tenant.user_id, "--sandbox", "sbx-superseded",
    )  # fmt: skip
    with run.client() as c:  # the old token is refused from now on
        assert c.post("/run/report", json={"state": "saving"}).status_code == 401

    mine = sync_of(tenant, "user", tenant.user_id, run.run_id)
    assert mine["superseded"] is True and mine["active"] is False
    assert (mine["folderState"], mine["folderCode"]) == ("failed", "STALE_LEASE"), mine
    assert "superseded" in mine["folderError"]
    task = sync_of(tenant, "task", run.task, run.run_id)
    assert (task["folderState"], task["superseded"]) == ("saved", True), task
    assert sync_of(tenant, "user", tenant.user_id, newer["run_id"])["superseded"] is False

    sign_in(page, ctl.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    item = sync_item(page, run.run_id)
    expect(item.locator(".state")).to_have_text("Ended — superseded")
    expect(item.locator(".run-reason")).to_contain_text("STALE_LEASE")
    expect(item.locator(".run-reason")).to_contain_text("newer run of the same sandbox")
    expect(item).not_to_contain_text("ended before it saved anything")
    views.snap("sync-superseded")
    page.goto(ctl.url + folder_url(tenant, "task", run.task))
    expect(item.locator(".state")).to_have_text("Ended — saved")


AGENT_FILE_MAX = 1000


@pytest.fixture(scope="module")
def small_agent_folders(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller whose agent folders hold files of at most 1000 bytes."""
    with private_controller(
        pg_cluster, "fsa-truth-", "--agent-max-file-bytes", str(AGENT_FILE_MAX)
    ) as ctl:
        yield ctl


@browser_test
def test_a_storage_limit_refusal_shows_its_code_until_a_later_save(
    page: Page, small_agent_folders: ControllerProcess, views: ViewRecorder
) -> None:
    """A save of the agent folder refused over a storage limit did not happen:
    the folder says so with ``AGENT_FILES_LIMIT_EXCEEDED`` until a later save
    succeeds, while the run itself is not failed (a warning, the run goes on)."""
    tenant = bootstrap_tenant(small_agent_folders)
    agent = new_agent(tenant, "Archivist")
    run = start_agent_run(tenant, agent, user=tenant.user_id)
    with api_client(tenant, run.token) as c:
        over = put(c, tenant, "agent", agent, "dump.bin", b"d" * (AGENT_FILE_MAX + 1))
        assert over.status_code == 422 and over.json()["code"] == "agent_files_limit_exceeded"
    mine = sync_of(tenant, "agent", agent, run.run_id)
    assert (mine["folderState"], mine["folderCode"]) == ("failed", "AGENT_FILES_LIMIT_EXCEEDED")
    assert mine["state"] != "failed" and mine["error"] is None, mine
    folders = {f["scope"]: f for f in details(tenant, run.run_id)["folders"]}
    assert (folders["agent"]["state"], folders["agent"]["code"]) == (
        "failed",
        "AGENT_FILES_LIMIT_EXCEEDED",
    ), folders

    sign_in(page, small_agent_folders.url, tenant.token, folder_url(tenant, "agent", agent))
    item = sync_item(page, run.run_id)
    expect(item.locator(".state")).to_have_text("Not saved — over a storage limit")
    expect(item.locator(".state")).not_to_have_class(re.compile(r"state-failed"))
    expect(item.locator(".run-reason")).to_contain_text("AGENT_FILES_LIMIT_EXCEEDED")
    views.snap("sync-limit-refused")

    with api_client(tenant, run.token) as c:
        small = put(c, tenant, "agent", agent, "small.txt", b"fits")
        assert small.status_code == 201, small.text
    mine = sync_of(tenant, "agent", agent, run.run_id)
    assert (mine["folderState"], mine["folderCode"]) == ("saved", None), mine
    page.reload()
    expect(item.locator(".state")).to_have_text("Saved")
