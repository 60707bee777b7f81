"""The JSON form of what the domain layer puts in a stored answer.

A receipt keeps an operation's answer body, so that a replay returns the
same bytes; the domain functions that build those answers (single writes,
moves, checkpoints, repository checkpoints, save receipts) shape timestamps
and entries here. ``controller/api/serialize.py`` uses the same functions
for everything else the API returns, so both agree on the wire format.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

Row = dict[str, Any]


def iso(ts: datetime | None) -> str | None:
    """A timestamp as the API writes it: ISO 8601, UTC as ``Z``."""
    return None if ts is None else ts.isoformat().replace("+00:00", "Z")


def entry_json(row: Row) -> dict[str, Any]:
    """A ``files`` row as the API shows an entry."""
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
