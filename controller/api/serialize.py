"""JSON shaping of the controller's rows: the wire format of the REST and bridge answers.

The domain layer returns database rows; these functions turn them into the
camelCase JSON the API documents. Receipts store answers in this format, so
an idempotent replay returns the same bytes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

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


def run_json(row: Row) -> dict[str, Any]:
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
    }


def manifest_entry(row: Row) -> dict[str, Any]:
    return {
        "path": row["path"],
        "kind": row["kind"],
        "digest": row["digest"],
        "byteSize": int(row["byte_size"]),
        "executable": bool(row["executable"]),
        "version": int(row["version"]),
        "deleted": row["deleted_at"] is not None,
    }
