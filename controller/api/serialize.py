"""JSON shaping of the controller's rows: the wire format of the REST and bridge answers.

The domain layer returns database rows; these functions turn them into the
camelCase JSON the API documents. Receipts store answers in this format, so
an idempotent replay returns the same bytes.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controller.companies import Directory
    from controller.sessions import Session

Row = dict[str, Any]


def iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat().replace("+00:00", "Z")


def entry_json(row: Row) -> dict[str, Any]:
    return {
        "id": str(row["id"]),
        "path": row["path"],
        "kind": row["kind"],
        "byteSize": int(row["byte_size"]),
        "digest": row["digest"],
        "executable": bool(row["executable"]),
        "contentType": row["content_type"],
        "deletedAt": iso(row["deleted_at"]),
        "updatedAt": iso(row["updated_at"]),
        "version": int(row["version"]),
        "trashRoot": None if row["trash_root"] is None else str(row["trash_root"]),
    }


def run_warnings(row: Row) -> list[dict[str, Any]]:
    """The run's current warnings (``controller.receipts``), folder by folder."""
    stored: dict[str, list[dict[str, Any]]] = row.get("warnings") or {}
    out: list[dict[str, Any]] = []
    for scope in ("task", "agent", "user", "project"):
        out.extend({"scope": scope, **w} for w in stored.get(scope, []))
    return out


def run_json(row: Row, *, folder_saved_at: datetime | None = None) -> dict[str, Any]:
    """A run as /sync shows it; ``folderSavedAt`` is its last save of the folder asked
    about, ``warnings`` its current warnings (never errors on the current files)."""
    return {
        "runId": str(row["id"]),
        "agentId": str(row["agent_id"]),
        "state": row["state"],
        "lastSavedAt": iso(row["last_saved_at"]),
        "error": row["error"],
        "finalCheckpointAt": iso(row["final_checkpoint_at"]),
        "refreshRequested": bool(row["refresh_requested"]),
        "active": bool(row["active"]),
        "startedAt": iso(row["started_at"]),
        "endedAt": iso(row["ended_at"]),
        "folderSavedAt": iso(folder_saved_at),
        "warnings": run_warnings(row),
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
