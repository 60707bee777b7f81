"""JSON shaping of the controller's rows: the wire format of the REST and bridge answers.

The domain layer returns database rows; these functions turn them into the
camelCase JSON the API documents. Receipts store answers in this format, so
an idempotent replay returns the same bytes; what the domain itself puts in
a stored answer (timestamps, entries) is shaped by ``controller/rowjson.py``,
which this module shares.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from controller.rowjson import Row, iso
from controller.runs import superseded

if TYPE_CHECKING:
    from controller.companies import Directory
    from controller.orgs import NewUser
    from controller.runs import SaveState, StartedRun
    from controller.sessions import Session
    from controller.tokens import NewOperatorToken


def run_warnings(row: Row) -> list[dict[str, Any]]:
    """The run's current warnings (``controller.receipts``), folder by folder."""
    stored: dict[str, list[dict[str, Any]]] = row.get("warnings") or {}
    out: list[dict[str, Any]] = []
    for scope in ("task", "agent", "user", "project"):
        out.extend({"scope": scope, **w} for w in stored.get(scope, []))
    return out


def run_json(
    row: Row,
    *,
    state: tuple[str, str | None],
    folder: SaveState,
    folder_saved_at: datetime | None = None,
) -> dict[str, Any]:
    """A run as /sync shows it: ``state`` and ``error`` are the run's
    (:func:`controller.runs.run_state`), ``folderState``, ``folderCode``,
    ``folderError`` and ``folderFailedAt`` its save state of the folder asked
    about (:func:`controller.runs.folder_state`), ``folderSavedAt`` its last
    save of that folder, ``folderStoppedAt`` when its sandbox stopped with
    that folder (its final save, before the orchestrator ends the run),
    ``warnings`` its current warnings (never errors on the current files)."""
    return {
        "runId": str(row["id"]),
        "agentId": str(row["agent_id"]),
        "agentName": row["agent_name"],
        "state": state[0],
        "lastSavedAt": iso(row["last_saved_at"]),
        "error": state[1],
        "finalCheckpointAt": iso(row["final_checkpoint_at"]),
        "refreshRequested": bool(row["refresh_requested"]),
        "active": bool(row["active"]),
        "superseded": superseded(row),
        "startedAt": iso(row["started_at"]),
        "endedAt": iso(row["ended_at"]),
        "folderSavedAt": iso(folder_saved_at),
        "folderState": folder.state,
        "folderCode": folder.code,
        "folderError": folder.error,
        "folderFailedAt": iso(folder.failed_at),
        "folderStoppedAt": iso(folder.stopped_at),
        "warnings": run_warnings(row),
    }


def folder_state_json(
    scope: str, owner_id: str, saved_at: datetime | None, st: SaveState
) -> dict[str, Any]:
    """One folder of a run's details: the run's save state of it."""
    return {
        "scope": scope,
        "ownerId": owner_id,
        "state": st.state,
        "code": st.code,
        "error": st.error,
        "failedAt": iso(st.failed_at),
        "lastSavedAt": iso(saved_at),
        "stoppedAt": iso(st.stopped_at),
    }


def run_repo_json(
    repo: Row, state: str, error: str | None, code: str | None, saved: Row | None
) -> dict[str, Any]:
    """One repository of a run's details: its save state as the run shows it
    (``state``, ``code``, ``error``), its current checkpoint, and this run's
    newest checkpoint of it (``savedByRun``)."""
    return {
        "workspaceId": str(repo["workspace_id"]),
        "name": repo["name"],
        "state": state,
        "code": code,
        "error": error,
        "lastSavedAt": iso(repo["last_saved_at"]),
        "checkpointId": None if repo["checkpoint_id"] is None else str(repo["checkpoint_id"]),
        "savedByRun": None
        if saved is None
        else {"checkpointId": str(saved["id"]), "savedAt": iso(saved["created_at"])},
    }


def session_json(session: Session) -> dict[str, Any]:
    return {
        "userId": session.user_id,
        "email": session.email,
        "csrfToken": session.csrf_token,
        "companies": [
            {"id": str(r["id"]), "name": r["name"], "role": r["role"]} for r in session.companies
        ],
    }


def directory_json(d: Directory, *, members_private: bool = False) -> dict[str, Any]:
    """The company directory; ``members_private`` (a run asking) leaves out emails and roles."""

    def owner(r: Row, **fields: Any) -> dict[str, Any]:
        out = {"id": str(r["id"]), **fields}
        if d.activity:
            out.update(hasFiles=r["has_files"], activeRun=r["active_run"])
        return out

    return {
        "agents": [owner(r, name=r["name"]) for r in d.agents],
        "projects": [owner(r, name=r["name"]) for r in d.projects],
        "tasks": [owner(r, title=r["title"], projectId=str(r["project_id"])) for r in d.tasks],
        "members": [
            {"userId": str(r["id"])}
            if members_private
            else {"userId": str(r["id"]), "email": r["email"], "role": r["role"]}
            for r in d.members
        ],
    }


def repo_binding_json(row: Row) -> dict[str, Any]:
    """A bound repository as ``GET /bridge/v1/repos`` lists it (common/repos.py)."""
    current = None
    if row["checkpoint_id"] is not None:
        current = {
            "checkpointId": str(row["checkpoint_id"]),
            "entries": int(row["entries"]),
            "byteSize": int(row["byte_size"]),
            "savedAt": iso(row["created_at"]),
        }
    return {
        "workspaceId": str(row["workspace_id"]),
        "name": row["name"],
        "repoUrl": row["repo_url"],
        "ref": row["ref"],
        "primary": bool(row["is_primary"]),
        "branch": row["branch"] if row["is_primary"] else None,
        "setupCommand": row["setup_command"],
        "current": current,
    }


def task_repo_json(row: Row) -> dict[str, Any]:
    """A bound repository as people see it (``GET .../tasks/{taskId}/repos``)."""
    saved = row["checkpoint_id"] is not None
    return {
        "workspaceId": str(row["workspace_id"]),
        "name": row["name"],
        "repoUrl": row["repo_url"],
        "state": row["state"],
        "lastSavedAt": iso(row["last_saved_at"]),
        "byteSize": int(row["byte_size"]) if saved else 0,
        "fileCount": int(row["files"]) if saved else 0,
        "entries": int(row["entries"]) if saved else 0,
        "error": row["error"],
        "checkpointId": str(row["checkpoint_id"]) if saved else None,
        "removed": bool(row["removed"]),
    }


# --- the company admin API ----------------------------------------------------------


def _id(value: Any) -> str | None:
    return None if value is None else str(value)


def member_json(row: Row) -> dict[str, Any]:
    return {
        "userId": str(row["id"]),
        "email": row["email"],
        "role": row["role"],
        "createdAt": iso(row["created_at"]),
    }


def new_member_json(user: NewUser, role: str) -> dict[str, Any]:
    """A member created by the API: the user's first API token, shown once."""
    return {
        "userId": user.user_id,
        "email": user.email,
        "role": role,
        "token": user.token,
        "tokenId": user.token_id,
    }


def named_json(row: Row) -> dict[str, Any]:
    """An agent or a project."""
    return {"id": str(row["id"]), "name": row["name"], "createdAt": iso(row["created_at"])}


def task_json(row: Row) -> dict[str, Any]:
    return {
        "id": str(row["id"]),
        "title": row["title"],
        "projectId": str(row["project_id"]),
        "createdAt": iso(row["created_at"]),
    }


def bindings_json(bindings: dict[str, str | None]) -> dict[str, str | None]:
    return {scope: bindings[scope] for scope in ("task", "agent", "user", "project")}


def run_record_json(row: Row) -> dict[str, Any]:
    """A run as the admin API shows it (never its token)."""
    return {
        "runId": str(row["id"]),
        "sandbox": row["sandbox_key"],
        "leaseEpoch": int(row["lease_epoch"]),
        "superseded": superseded(row),
        "bindings": bindings_json(
            {
                "task": _id(row["task_id"]),
                "agent": _id(row["agent_id"]),
                "user": _id(row["user_id"]),
                "project": _id(row["project_id"]),
            }
        ),
        "active": bool(row["active"]),
        "state": row["state"],
        "error": row["error"],
        "lastSavedAt": iso(row["last_saved_at"]),
        "finalCheckpointAt": iso(row["final_checkpoint_at"]),
        "refreshRequested": bool(row["refresh_requested"]),
        "startedAt": iso(row["started_at"]),
        "endedAt": iso(row["ended_at"]),
    }


def started_run_json(run: StartedRun) -> dict[str, Any]:
    """A run just started: its token, shown once, the lease, the agent's env
    and the task's repositories."""
    return {
        "runId": run.run_id,
        "token": run.token,
        "leaseEpoch": run.lease_epoch,
        "sandbox": run.sandbox,
        "bindings": bindings_json(run.bindings),
        "env": run.env,
        "repos": [
            {"workspaceId": b.workspace_id, "name": b.name, "primary": b.primary} for b in run.repos
        ],
    }


def operator_token_json(row: Row) -> dict[str, Any]:
    return {
        "tokenId": str(row["id"]),
        "name": row["name"],
        "createdAt": iso(row["created_at"]),
        "revokedAt": iso(row["revoked_at"]),
    }


def token_json(row: Row) -> dict[str, Any]:
    """A person's API token or an operator token, as a company's admins list
    it (never the token itself): a person's names its user, an operator
    token its name."""
    return {
        "tokenId": str(row["id"]),
        "kind": row["kind"],
        "userId": None if row["user_id"] is None else str(row["user_id"]),
        "email": row["email"],
        "name": row["name"],
        "createdAt": iso(row["created_at"]),
        "revokedAt": iso(row["revoked_at"]),
    }


def new_operator_token_json(made: NewOperatorToken) -> dict[str, Any]:
    return {
        "tokenId": made.token_id,
        "name": made.name,
        "token": made.token,
        "createdAt": iso(made.created_at),
        "revokedAt": None,
    }


def workspace_json(row: Row) -> dict[str, Any]:
    """A project's workspace as the admin API lists it."""
    return {
        "workspaceId": str(row["id"]),
        "repoUrl": row["repo_url"],
        "name": row["name"],
        "ref": row["ref"],
        "primary": bool(row["is_primary"]),
        "setupCommand": row["setup_command"],
        "createdAt": iso(row["created_at"]),
        "removedAt": iso(row["removed_at"]),
    }


def added_workspace_json(added: dict[str, Any]) -> dict[str, Any]:
    """``workspaces.add_workspace``'s answer (the command's shape) for the API."""
    return {
        "workspaceId": added["workspace_id"],
        "projectId": added["project_id"],
        "repoUrl": added["repo_url"],
        "name": added["name"],
        "ref": added["ref"],
        "primary": added["primary"],
        "setupCommand": added["setup_command"],
        "replacedPrimary": added["replaced_primary"],
    }


def removed_workspace_json(removed: dict[str, Any]) -> dict[str, Any]:
    return {
        "workspaceId": removed["workspace_id"],
        "projectId": removed["project_id"],
        "removed": True,
        "removedAt": removed["removed_at"].replace("+00:00", "Z"),
        "wasPrimary": removed["was_primary"],
        "bindingsKept": removed["bindings_kept"],
    }


def agent_entry_change_json(changed: dict[str, Any]) -> dict[str, Any]:
    """``agentfiles.set_entry``'s answer (the command's shape) for the API."""
    return {
        "agentId": changed["agent_id"],
        "entryPath": changed["entry_path"],
        "created": changed["created"],
    }


def grant_json(row: Row) -> dict[str, Any]:
    """A member's grant on an agent, as ``GET …/agents/{agentId}/grants`` lists it."""
    return {
        "userId": str(row["user_id"]),
        "role": row["role"],
        "permission": row["permission"],
        "grantedAt": iso(row["granted_at"]),
    }


def grant_change_json(changed: dict[str, Any]) -> dict[str, Any]:
    """``grants.grant_configure`` / ``revoke_configure``'s answer for the API:
    ``granted``, or ``revoked`` (false when there was no grant to take back)."""
    out = {
        "agentId": changed["agent_id"],
        "userId": changed["user_id"],
        "permission": changed["permission"],
    }
    for flag in ("granted", "revoked"):
        if flag in changed:
            out[flag] = changed[flag]
    return out
