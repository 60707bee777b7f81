"""Workspaces and bindings from the operator's side: add-workspace,
remove-workspace, set-task-branch, start-run's binding and env, and checkout
names that stay once given. Real controller and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from fsagent.bridge.base import RepoList, RunInfo
from fsagent.commands.up import env_for, repos_env
from tests.support.constants import REPO
from tests.support.controller import Tenant
from tests.support.repos import add_workspace, repo_run, restart, small_repo


def names(listing: dict[str, Any]) -> list[str]:
    return [r["name"] for r in listing["repos"]]


def test_add_workspace_start_run_binds_and_sets_the_primary_repo(tenant: Tenant) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    app = add_workspace(
        tenant,
        project,
        "https://git.example/o/app.git",
        "--primary",
        "--ref",
        "develop",
        "--setup",
        "make deps\nmake build",
    )
    assert app["primary"] is True and app["replaced_primary"] is None
    assert (app["ref"], app["setup_command"]) == ("develop", "make deps\nmake build")
    lib = add_workspace(tenant, project, "git@git.example:o/lib.git", "--name", "shared-lib")
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    assert ctl.admin("set-task-branch", task, "feature/login") == {
        "task_id": task,
        "branch": "feature/login",
    }
    run = repo_run(tenant, {}, project=project, task=task)
    assert run.env["PAPERCLIP_PRIMARY_REPO"] == "/home/agent/repos/app"
    assert run.env["PAPERCLIP_REPOS_DIR"] == "/home/agent/repos"
    assert run.repos == [
        {"workspace_id": app["workspace_id"], "name": "app", "primary": True},
        {"workspace_id": lib["workspace_id"], "name": "shared-lib", "primary": False},
    ]
    listing = run.listing()
    assert listing["reposDir"] == "repos"
    assert listing["repos"] == [
        {
            "workspaceId": app["workspace_id"],
            "name": "app",
            "repoUrl": "https://git.example/o/app.git",
            "ref": "develop",
            "primary": True,
            "branch": "feature/login",
            "setupCommand": "make deps\nmake build",
            "current": None,
        },
        {
            "workspaceId": lib["workspace_id"],
            "name": "shared-lib",
            "repoUrl": "git@git.example:o/lib.git",
            "ref": None,
            "primary": False,
            "branch": None,
            "setupCommand": None,
            "current": None,
        },
    ]
    # A run without a task has no repositories and no primary.
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    bare = ctl.admin("start-run", tenant.company_id, "--agent", agent)
    assert "PAPERCLIP_PRIMARY_REPO" not in bare["env"] and bare["repos"] == []


def test_start_run_env_is_the_env_file_fsagent_writes(tenant: Tenant) -> None:
    """start-run's ``env`` and the env file fsagent writes from the same run
    (fsagent.commands.up.env_for of GET /bridge/v1/run, repos_env of /bridge/v1/repos)
    name the same variables: a run without a task, or of a task that binds no
    repository, has no PAPERCLIP_REPOS_DIR in either."""
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    bare_task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    starts = {
        "no task": ["--agent", agent],
        "task, no repos": ["--agent", agent, "--task", bare_task],
    }
    envs: dict[str, dict[str, str]] = {}
    for name, args in starts.items():
        out = ctl.admin("start-run", tenant.company_id, *args, "--home", "/home/agent",
                        "--sandbox", name.replace(" ", "-").replace(",", ""))  # fmt: skip
        envs[name] = {"env": out["env"], "file": env_file_of(tenant, out["token"])}
    with_repo = repo_run(tenant, {"app": "https://git.example/o/app.git"}, primary="app")
    envs["task with a repo"] = {"env": with_repo.env, "file": env_file_of(tenant, with_repo.token)}
    for name, got in envs.items():
        assert got["env"] == got["file"], name
    assert "PAPERCLIP_REPOS_DIR" not in envs["no task"]["env"]
    assert "PAPERCLIP_REPOS_DIR" not in envs["task, no repos"]["env"]
    assert envs["task with a repo"]["env"]["PAPERCLIP_REPOS_DIR"] == "/home/agent/repos"
    assert envs["task with a repo"]["env"]["PAPERCLIP_PRIMARY_REPO"] == "/home/agent/repos/app"


def env_file_of(tenant: Tenant, token: str) -> dict[str, str]:
    """The folder and repository variables fsagent's env file holds for the
    run of ``token`` (home /home/agent)."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=tenant.controller.url, headers=headers, timeout=120) as c:
        run, repos = c.get("/bridge/v1/run"), c.get("/bridge/v1/repos")
    assert run.status_code == 200 and repos.status_code == 200, (run.text, repos.text)
    home = Path("/home/agent")
    return env_for(home, RunInfo.from_json(run.json())) | repos_env(
        home, RepoList.from_json(repos.json())
    )


def test_a_new_primary_takes_over_and_says_so(tenant: Tenant) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    first = add_workspace(tenant, project, "https://h/one.git", "--primary")
    code, out, err = ctl.cli(
        "admin", "add-workspace", project, "--repo-url", "https://h/two.git", "--primary"
    )
    assert code == 0, err
    assert "primary workspace" in out and first["workspace_id"] in out
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    run = repo_run(tenant, {}, project=project, task=task)
    assert [(r["name"], r["primary"]) for r in run.listing()["repos"]] == [
        ("one", False),
        ("two", True),
    ]
    assert run.env["PAPERCLIP_PRIMARY_REPO"] == "/home/agent/repos/two"


def test_name_collisions_get_stable_suffixes_and_names_never_change(tenant: Tenant) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    a = add_workspace(tenant, project, "https://one.example/app.git")["workspace_id"]
    b = add_workspace(tenant, project, "https://two.example/x/app")["workspace_id"]
    c = add_workspace(tenant, project, "https://three.example/App.git")["workspace_id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    run = repo_run(tenant, {}, project=project, task=task)

    def suffix(workspace: str) -> str:
        return workspace.replace("-", "")[:8]

    # The oldest workspace gets the plain name; App is taken case-insensitively.
    assert names(run.listing()) == ["app", f"app-{suffix(b)}", f"App-{suffix(c)}"]
    # Names stay once given, whatever happens to the project later.
    ctl.admin("remove-workspace", a)
    d = add_workspace(tenant, project, "https://four.example/app.git")["workspace_id"]
    again = restart(run)
    assert names(again.listing()) == [f"app-{suffix(b)}", f"App-{suffix(c)}", f"app-{suffix(d)}"]
    # Another task binds the same workspaces under names of its own.
    other = ctl.admin("create-task", tenant.company_id, project, "t2")["id"]
    fresh = repo_run(tenant, {}, project=project, task=other)
    assert names(fresh.listing()) == ["app", f"App-{suffix(c)}", f"app-{suffix(d)}"]


def test_a_workspace_added_later_is_bound_at_the_next_run_start(tenant: Tenant) -> None:
    run = repo_run(tenant)
    assert names(run.listing()) == ["app"]
    add_workspace(tenant, run.project, "https://h/docs.git")
    assert names(run.listing()) == ["app"]  # not during this run
    later = restart(run)
    assert names(later.listing()) == ["app", "docs"]
    assert [r["name"] for r in later.repos] == ["app", "docs"]


def test_a_removed_workspace_keeps_its_binding_and_saved_checkpoint(tenant: Tenant) -> None:
    ctl = tenant.controller
    run = repo_run(tenant, {"app": "https://h/app.git"}, primary="app")
    ws = run.ws()
    saved = run.save(ws, small_repo())
    removed = ctl.admin("remove-workspace", ws)
    assert removed["removed"] is True and removed["bindings_kept"] == 1
    assert removed["was_primary"] is True
    # Removing again changes nothing.
    assert ctl.admin("remove-workspace", ws)["removed_at"] == removed["removed_at"]
    later = restart(run)
    assert later.listing()["repos"] == []
    assert "PAPERCLIP_PRIMARY_REPO" not in later.env
    # The saved checkpoint stays readable by people and by the task's runs.
    with tenant.client() as c:
        (repo,) = c.get(f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos").json()[
            "repos"
        ]
        assert repo["removed"] is True and repo["checkpointId"] == saved["checkpointId"]
        r = c.get(f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos/{ws}/archive")
        assert r.status_code == 200
    assert later.manifest(ws).json()["checkpointId"] == saved["checkpointId"]
    # A task created after the removal never binds it.
    task = ctl.admin("create-task", tenant.company_id, run.project, "t2")["id"]
    assert repo_run(tenant, {}, project=run.project, task=task).listing()["repos"] == []


def test_bad_input_is_refused_with_one_line(tenant: Tenant) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    cases = [
        (["add-workspace", project, "--repo-url", ""], "repository URL"),
        (["add-workspace", project, "--repo-url", "https://h/a\n.git"], "control characters"),
        (["add-workspace", project, "--repo-url=-uevil"], "may not start with '-'"),
        (["add-workspace", project, "--repo-url", " https://h/a.git"], "surrounding spaces"),
        (
            ["add-workspace", project, "--repo-url", "https://h/a.git", "--name", "../x"],
            "checkout name",
        ),
        (
            ["add-workspace", project, "--repo-url", "https://h/a.git", "--name", ".git"],
            "checkout name",
        ),
        (["add-workspace", project, "--repo-url", "https://h/a.git", "--ref", "a..b"], "ref"),
        (["add-workspace", project, "--repo-url", "https://h/a.git", "--ref=-x"], "ref"),
        (
            ["add-workspace", project, "--repo-url", "https://h/a.git", "--setup", "a\x00b"],
            "setup command",
        ),
        (
            ["add-workspace", "not-a-uuid", "--repo-url", "https://h/a.git"],
            "project must be a UUID",
        ),
        (
            [
                "add-workspace",
                "00000000-0000-4000-8000-000000000000",
                "--repo-url",
                "https://h/a.git",
            ],
            "no such project",
        ),
        (["remove-workspace", "00000000-0000-4000-8000-000000000000"], "no such workspace"),
        (["set-task-branch", task, "bad branch"], "branch"),
        (["set-task-branch", "00000000-0000-4000-8000-000000000000", "main"], "no such task"),
    ]
    for args, said in cases:
        code, out, err = ctl.cli("admin", *args)
        assert code == 1, (args, out, err)
        assert err.startswith("controller: ") and said in err and err.count("\n") == 1, (args, err)
    with ctl.db() as db:
        row = db.execute(
            "SELECT count(*) FROM workspaces WHERE project_id = %s", (project,)
        ).fetchone()
    assert row is not None and row[0] == 0


def test_set_task_branch_shows_on_the_primary_only(tenant: Tenant) -> None:
    run = repo_run(tenant, {"app": "https://h/app.git", "lib": "https://h/lib.git"}, primary="app")
    tenant.controller.admin("set-task-branch", run.task, "agent/fix-123")
    listing = run.listing()["repos"]
    assert [(r["name"], r["branch"]) for r in listing] == [
        ("app", "agent/fix-123"),
        ("lib", None),
    ]


def test_runs_starting_at_once_bind_each_workspace_once(tenant: Tenant) -> None:
    """Four `start-run` processes of one task at once, three workspaces whose
    URLs suggest one name: each gets exactly one binding and a name of its own."""
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    for host in ("one", "two", "three"):
        add_workspace(tenant, project, f"https://{host}.example/app.git")
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    command = [
        sys.executable, "-m", "controller.cli", "admin", "start-run", tenant.company_id,
        "--agent", agent, "--task", task, "--json", "--database-url", ctl.db_url,
    ]  # fmt: skip
    procs = [
        subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outputs]
    seen = [
        [(r["workspace_id"], r["name"]) for r in json.loads(out)["repos"]] for out, _ in outputs
    ]
    assert all(s == seen[0] for s in seen)
    assert len({name.lower() for _, name in seen[0]}) == 3
    with ctl.db() as db:
        row = db.execute("SELECT count(*) FROM task_repos WHERE task_id = %s", (task,)).fetchone()
    assert row is not None and row[0] == 3
