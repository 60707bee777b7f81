"""A run whose sandbox stopped: ``/sync``'s ``folderStoppedAt`` and the run
details' ``stoppedAt`` say so as soon as the final saves came, before the
orchestrator ends the run (real controller and PostgreSQL, the bridge with a
run token as fsagent uses it)."""

from __future__ import annotations

from typing import Any

from tests.support.agentfiles import run_detail
from tests.support.bridge import Run, start_run
from tests.support.controller import Tenant

SCOPES = ("task", "agent", "user", "project")


def owner(run: Run, tenant: Tenant, scope: str) -> str:
    return {"task": run.task, "agent": run.agent, "user": tenant.user_id, "project": run.project}[
        scope
    ]


def sync_run(tenant: Tenant, run: Run, scope: str) -> dict[str, Any]:
    with tenant.client() as c:
        r = c.get(tenant.folder(scope, owner(run, tenant, scope)) + "/sync")
    assert r.status_code == 200, r.text
    found: dict[str, Any] = next(x for x in r.json()["runs"] if x["runId"] == run.run_id)
    return found


def details(tenant: Tenant, run: Run) -> dict[str, Any]:
    r = run_detail(tenant, run.run_id)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_a_run_that_stopped_cleanly_says_so_before_it_ends(tenant: Tenant) -> None:
    run = start_run(tenant)
    assert run.save("task", {"a.txt": b"one"}).status_code == 200
    # Saving, not stopped: a later save may come.
    assert sync_run(tenant, run, "task")["folderStoppedAt"] is None
    assert details(tenant, run)["stoppedAt"] is None

    # fsagent's final save of the task folder (at its stop boundary).
    final = run.save("task", {"b.txt": b"two"}, final=True)
    assert final.status_code == 200, final.text
    task = sync_run(tenant, run, "task")
    assert task["active"] is True and task["folderState"] == "saved"
    assert task["folderStoppedAt"] is not None
    assert task["folderStoppedAt"] >= task["folderSavedAt"]
    # Another folder of the run has not stopped yet, nor has the run.
    assert sync_run(tenant, run, "agent")["folderStoppedAt"] is None
    body = details(tenant, run)
    by_scope = {f["scope"]: f for f in body["folders"]}
    assert by_scope["task"]["stoppedAt"] == task["folderStoppedAt"]
    assert by_scope["agent"]["stoppedAt"] is None
    assert body["stoppedAt"] is None and body["active"] is True

    # The other folders' final saves: one saved with nothing to save, one
    # given up (the failure fsagent reports at the stop boundary).
    for scope in ("agent", "user"):
        assert run.commit(scope, [], final=True).status_code == 200
    with run.client() as c:
        r = c.post(
            "/run/report",
            json={"state": "failed", "error": "disk gone", "scope": "project", "final": True},
        )
    assert r.status_code == 200, r.text
    project = sync_run(tenant, run, "project")
    assert project["folderState"] == "failed" and project["folderStoppedAt"] is not None
    body = details(tenant, run)
    stops = {f["scope"]: f["stoppedAt"] for f in body["folders"]}
    assert set(stops) == set(SCOPES) and all(stops.values()), stops
    assert body["stoppedAt"] == max(stops.values())
    assert body["active"] is True and body["endedAt"] is None

    # The sandbox runs again with the same run (a restart): a later,
    # non-final save means it is no longer stopped.
    assert run.save("task", {"c.txt": b"three"}).status_code == 200
    assert sync_run(tenant, run, "task")["folderStoppedAt"] is None
    assert details(tenant, run)["stoppedAt"] is None
    tenant.controller.admin("end-run", run.run_id)


def test_a_refused_part_of_a_final_save_is_its_receipt(tenant: Tenant) -> None:
    """Only the last part of a final save is ``final``; every part says
    ``finalSave``. A refused part (here one naming content never uploaded)
    is the final save's receipt: the folder shows the stop. A refusal
    without it does not, and ``finalSave`` must be a boolean."""
    run = start_run(tenant)
    unknown = {"op": "put", "path": "a.txt", "digest": "ab" * 32, "executable": False}
    r = run.commit("task", [unknown])
    assert r.status_code == 422, r.text
    assert sync_run(tenant, run, "task")["folderStoppedAt"] is None
    r = run.commit("task", [unknown], finalSave="yes")
    assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
    assert sync_run(tenant, run, "task")["folderStoppedAt"] is None

    r = run.commit("task", [unknown], finalSave=True)
    assert r.status_code == 422, r.text
    task = sync_run(tenant, run, "task")
    assert task["folderState"] == "failed" and task["folderStoppedAt"] is not None, task
    # A part that saves is not the end of the final save unless it is the last.
    assert run.save("task", {"b.txt": b"b"}, finalSave=True).status_code == 200
    assert sync_run(tenant, run, "task")["folderStoppedAt"] is None
    assert run.save("task", {"c.txt": b"c"}, final=True, finalSave=True).status_code == 200
    assert sync_run(tenant, run, "task")["folderStoppedAt"] is not None
