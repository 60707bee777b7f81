"""Workspaces of a project, the task's branch, and the per-task bindings.

A workspace names a repository (URL, optional checkout name, starting ref,
setup command, at most one primary per project). Every task of the project
binds each workspace that is not removed: a ``task_repos`` row whose checkout
name (the directory under ``$HOME/repos``) is chosen the first time and never
changes. Binding happens when a run of the task starts (:func:`bind_task`), so
a workspace added later is bound, and prepared by the sandbox, at the next run
start. Removing a workspace binds it to no new task and lists it to no
sandbox; existing bindings, their saved checkpoints and GC protection stay.

These are the domain functions of ``controller admin add-workspace``,
``remove-workspace``, ``set-task-branch`` and of ``start-run``'s binding;
they take an async connection inside the caller's transaction so the CLI and
a REST route can share them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from psycopg import AsyncConnection

from common.errors import ProjectNotFound, TaskNotFound, ValidationError, WorkspaceNotFound
from common.paths import validate_uuid
from common.repos import checkout_name, checkout_name_problem, ref_problem
from common.text import check_text

MAX_URL_CHARS = 2048
MAX_SETUP_CHARS = 8192


def _refuse(field: str, message: str) -> ValidationError:
    return ValidationError.single(field, "invalid", message)


def check_repo_url(url: str) -> str:
    """A repository URL as given, or ValidationError. Never normalized."""
    if not url or len(url) > MAX_URL_CHARS:
        raise _refuse("repoUrl", f"the repository URL has 1-{MAX_URL_CHARS} characters")
    check_text(url, "repoUrl", MAX_URL_CHARS, label="the repository URL")
    if url != url.strip():
        raise _refuse("repoUrl", "the repository URL has no surrounding spaces")
    if url.startswith("-"):
        # `git clone -u...` would read the URL as an option.
        raise _refuse("repoUrl", "the repository URL may not start with '-'")
    return url


def check_ref(value: str, field: str) -> str:
    problem = ref_problem(value)
    if problem is not None:
        raise _refuse(field, f"{field} {value!r}: {problem}")
    return value


def check_setup(command: str) -> str:
    if not command.strip() or len(command) > MAX_SETUP_CHARS:
        raise _refuse("setupCommand", f"the setup command has 1-{MAX_SETUP_CHARS} characters")
    # A shell script: lines and tabs, but no bidirectional control that would
    # show a person reviewing it another command than the one that runs.
    return check_text(
        command, "setupCommand", MAX_SETUP_CHARS, multiline=True, label="the setup command"
    )


def check_name(name: str) -> str:
    problem = checkout_name_problem(name)
    if problem is not None:
        raise _refuse("name", f"checkout name {name!r}: {problem}")
    return name


async def _project_company(conn: AsyncConnection[Any], project_id: str) -> str:
    # Primary takeovers of one project are serialized (and rows referring to
    # the project, which take FOR KEY SHARE, are not held up).
    cur = await conn.execute(
        "SELECT company_id FROM projects WHERE id = %s FOR NO KEY UPDATE", (project_id,)
    )
    row = await cur.fetchone()
    if row is None:
        raise ProjectNotFound(f"no such project: {project_id}")
    return str(row["company_id"])


async def add_workspace(
    conn: AsyncConnection[Any],
    project_id: str,
    *,
    repo_url: str,
    name: str | None = None,
    ref: str | None = None,
    primary: bool = False,
    setup_command: str | None = None,
) -> dict[str, Any]:
    """A new workspace of the project. With ``primary`` it becomes the
    project's primary workspace and the previous one (named in
    ``replaced_primary``) stops being primary."""
    project_id = validate_uuid(project_id, "project")
    check_repo_url(repo_url)
    if name is not None:
        check_name(name)
    if ref is not None:
        check_ref(ref, "ref")
    if setup_command is not None:
        check_setup(setup_command)
    company_id = await _project_company(conn, project_id)
    replaced = None
    if primary:
        cur = await conn.execute(
            "UPDATE workspaces SET is_primary = false"
            " WHERE project_id = %s AND is_primary AND removed_at IS NULL RETURNING id",
            (project_id,),
        )
        row = await cur.fetchone()
        replaced = None if row is None else str(row["id"])
    workspace_id = str(uuid.uuid4())
    await conn.execute(
        "INSERT INTO workspaces (id, company_id, project_id, repo_url, name, ref, is_primary,"
        " setup_command) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
        (workspace_id, company_id, project_id, repo_url, name, ref, primary, setup_command),
    )
    return {
        "workspace_id": workspace_id,
        "company_id": company_id,
        "project_id": project_id,
        "repo_url": repo_url,
        "name": name,
        "ref": ref,
        "primary": primary,
        "setup_command": setup_command,
        "replaced_primary": replaced,
    }


async def remove_workspace(
    conn: AsyncConnection[Any], workspace_id: str, *, company_id: str | None = None
) -> dict[str, Any]:
    """Bind the workspace to no new task and list it to no sandbox. Bindings
    and their saved checkpoints stay (and stay protected from GC). Removing a
    removed workspace changes nothing. ``company_id`` limits this to that
    company's workspaces (the admin API)."""
    workspace_id = validate_uuid(workspace_id, "workspace")
    cur = await conn.execute(
        "UPDATE workspaces SET removed_at = coalesce(removed_at, now())"
        " WHERE id = %s AND (%s::uuid IS NULL OR company_id = %s::uuid)"
        " RETURNING project_id, removed_at, is_primary",
        (workspace_id, company_id, company_id),
    )
    row = await cur.fetchone()
    if row is None:
        raise WorkspaceNotFound(f"no such workspace: {workspace_id}")
    cur = await conn.execute(
        "SELECT count(*) AS n FROM task_repos WHERE workspace_id = %s", (workspace_id,)
    )
    bound = await cur.fetchone()
    assert bound is not None
    return {
        "workspace_id": workspace_id,
        "project_id": str(row["project_id"]),
        "removed": True,
        "removed_at": row["removed_at"].isoformat(),
        "was_primary": bool(row["is_primary"]),
        "bindings_kept": int(bound["n"]),
    }


async def set_task_branch(
    conn: AsyncConnection[Any], task_id: str, branch: str, *, company_id: str | None = None
) -> dict[str, Any]:
    """The branch the task's primary checkout is cloned onto (a sandbox that
    already has the checkout keeps whatever branch it is on). ``company_id``
    limits this to that company's tasks (the admin API)."""
    task_id = validate_uuid(task_id, "task")
    check_ref(branch, "branch")
    cur = await conn.execute(
        "UPDATE tasks SET branch = %s"
        " WHERE id = %s AND (%s::uuid IS NULL OR company_id = %s::uuid) RETURNING id",
        (branch, task_id, company_id, company_id),
    )
    if await cur.fetchone() is None:
        raise TaskNotFound(f"no such task: {task_id}")
    return {"task_id": task_id, "branch": branch}


async def list_workspaces(
    conn: AsyncConnection[Any], company_id: str, project_id: str
) -> list[dict[str, Any]]:
    """The project's workspaces, removed ones too, oldest first; ProjectNotFound
    unless the project is the company's."""
    cur = await conn.execute(
        "SELECT 1 FROM projects WHERE id = %s AND company_id = %s", (project_id, company_id)
    )
    if await cur.fetchone() is None:
        raise ProjectNotFound(f"no such project: {project_id}")
    cur = await conn.execute(
        "SELECT id, repo_url, name, ref, is_primary, setup_command, created_at, removed_at"
        " FROM workspaces WHERE project_id = %s ORDER BY created_at, id",
        (project_id,),
    )
    return list(await cur.fetchall())


@dataclass(frozen=True)
class Binding:
    workspace_id: str
    name: str
    primary: bool


def _unused_name(wanted: str, workspace_id: str, taken: set[str]) -> str:
    """``wanted``, or with a suffix from the workspace id when the task already
    has a checkout of that name (case-insensitively): stable for the same
    workspace, whatever order bindings happen in."""
    compact = workspace_id.replace("-", "")
    for name in (wanted, f"{wanted}-{compact[:8]}", f"{wanted}-{compact}"):
        if name.lower() not in taken:
            return name
    raise AssertionError("a workspace id is unique within its task")


async def bind_task(conn: AsyncConnection[Any], company_id: str, task_id: str) -> list[Binding]:
    """Bind every workspace of the task's project that is not removed and not
    yet bound; answer the task's bindings of workspaces not removed, oldest
    workspace first. Names once given are kept."""
    company_id = validate_uuid(company_id, "company")
    task_id = validate_uuid(task_id, "task")
    # The task row lock serializes two bindings of one task (two runs
    # starting at once), so each sees the other's names.
    cur = await conn.execute(
        "SELECT project_id FROM tasks WHERE id = %s AND company_id = %s FOR NO KEY UPDATE",
        (task_id, company_id),
    )
    task = await cur.fetchone()
    if task is None:
        raise TaskNotFound(f"no such task: {task_id}")
    cur = await conn.execute("SELECT name FROM task_repos WHERE task_id = %s", (task_id,))
    taken = {str(r["name"]).lower() for r in await cur.fetchall()}
    cur = await conn.execute(
        "SELECT w.id, w.name, w.repo_url FROM workspaces w"
        " WHERE w.project_id = %s AND w.removed_at IS NULL AND NOT EXISTS"
        "  (SELECT 1 FROM task_repos b WHERE b.task_id = %s AND b.workspace_id = w.id)"
        " ORDER BY w.created_at, w.id",
        (task["project_id"], task_id),
    )
    for ws in await cur.fetchall():
        name = _unused_name(ws["name"] or checkout_name(ws["repo_url"]), str(ws["id"]), taken)
        taken.add(name.lower())
        await conn.execute(
            "INSERT INTO task_repos (task_id, workspace_id, company_id, name)"
            " VALUES (%s, %s, %s, %s)",
            (task_id, ws["id"], company_id, name),
        )
    cur = await conn.execute(
        "SELECT b.workspace_id, b.name, w.is_primary FROM task_repos b"
        " JOIN workspaces w ON w.id = b.workspace_id"
        " WHERE b.task_id = %s AND w.removed_at IS NULL ORDER BY w.created_at, w.id",
        (task_id,),
    )
    return [
        Binding(str(r["workspace_id"]), str(r["name"]), bool(r["is_primary"]))
        for r in await cur.fetchall()
    ]


def run_env(bindings: list[Binding], home: PurePosixPath) -> dict[str, str]:
    """What a run's environment gains from its task's repositories: nothing
    when it binds none (fsagent.commands.up.repos_env, the env file's, agrees)."""
    env: dict[str, str] = {}
    if not bindings:
        return env
    env["PAPERCLIP_REPOS_DIR"] = str(home / "repos")
    primary = next((b for b in bindings if b.primary), None)
    if primary is not None:
        env["PAPERCLIP_PRIMARY_REPO"] = str(home / "repos" / primary.name)
    return env
