"""The bridge for fsagent: run-token auth, only the run's bound folders.

Contract: :mod:`common.bridge`. Nothing a sandbox sends is trusted: the owner
comes from the run's binding, objects are served only when this folder
references them, and a user folder is served only while its user is an
active member of the run's company.
"""

from __future__ import annotations

import re
from typing import Any

from psycopg import AsyncConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.bridge import MANIFEST_PAGE_MAX, PREFIX
from common.errors import (
    NotFound,
    RangeNotSatisfiable,
    Unauthenticated,
    ValidationError,
    WorkFolderError,
)
from common.paths import validate_scope
from controller import apply
from controller.api.common import authenticate, connection, json_errors
from controller.api.workfolders import parse_range, stream_object
from controller.auth import RunBinding, run_may_use_user_folder
from controller.storage.base import object_key

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class ResyncRequired(WorkFolderError):
    code = "resync_required"
    status = 410
    message = "Changes since that version are no longer complete; list from since=0"


async def bound_run(request: Request, conn: AsyncConnection[Any]) -> RunBinding:
    principal = await authenticate(request, conn)
    if principal.kind != "run" or principal.run is None:
        raise Unauthenticated("The bridge needs a run token")
    return principal.run


async def bound_folder(
    request: Request, conn: AsyncConnection[Any], run: RunBinding
) -> apply.Folder | None:
    """The folder the run is bound to for ``{scope}``; NotFound when unbound/denied."""
    scope = validate_scope(request.path_params["scope"])
    owner = run.owner_for(scope)
    if owner is None:
        raise NotFound()
    if scope == "user" and not await run_may_use_user_folder(conn, run):
        raise NotFound()
    return await apply.get_folder(conn, run.company_id, scope, owner, create=False)


def manifest_entry(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": row["path"],
        "kind": row["kind"],
        "digest": row["digest"],
        "byteSize": int(row["byte_size"]),
        "executable": bool(row["executable"]),
        "version": int(row["version"]),
        "deleted": row["deleted_at"] is not None,
    }


def int_param(request: Request, name: str, default: int, maximum: int | None = None) -> int:
    raw = request.query_params.get(name, str(default))
    if not raw.isdigit() or (maximum is not None and not 1 <= int(raw) <= maximum):
        raise ValidationError.single(
            name, "invalid_integer", f"{name} must be a non-negative integer"
        )
    return int(raw)


@json_errors
async def get_run(request: Request) -> Response:
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        user_ok = await run_may_use_user_folder(conn, run)
    return JSONResponse(
        {
            "runId": run.run_id,
            "companyId": run.company_id,
            "agentId": run.agent_id,
            "leaseEpoch": run.lease_epoch,
            "active": run.active,
            "bindings": {
                "task": run.task_id,
                "agent": run.agent_id,
                "user": run.user_id if user_ok else None,
                "project": run.project_id,
            },
        }
    )


@json_errors
async def get_manifest(request: Request) -> Response:
    since = int_param(request, "since", 0)
    limit = int_param(request, "limit", MANIFEST_PAGE_MAX, MANIFEST_PAGE_MAX)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        folder = await bound_folder(request, conn, run)
        cur = await conn.execute("SELECT last_value, is_called FROM file_version_seq")
        seq = await cur.fetchone()
        high_water = int(seq["last_value"]) if seq and seq["is_called"] else 0
        if folder is None:
            return JSONResponse({"entries": [], "nextSince": None, "highWater": high_water})
        cur = await conn.execute("SELECT purge_floor FROM folders WHERE id = %s", (folder.id,))
        floor_row = await cur.fetchone()
        if since > 0 and floor_row is not None and since < int(floor_row["purge_floor"]):
            raise ResyncRequired()
        deleted_clause = "" if since > 0 else " AND deleted_at IS NULL"
        cur = await conn.execute(
            "SELECT * FROM files WHERE folder_id = %s AND version > %s"
            + deleted_clause
            + " ORDER BY version LIMIT %s",
            (folder.id, since, limit + 1),
        )
        rows = list(await cur.fetchall())
    next_since = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_since = int(rows[-1]["version"])
    return JSONResponse(
        {
            "entries": [manifest_entry(r) for r in rows],
            "nextSince": next_since,
            "highWater": high_water,
        }
    )


@json_errors
async def get_object(request: Request) -> Response:
    digest = request.path_params["digest"]
    if not _DIGEST.match(digest):
        raise ValidationError.single(
            "digest", "invalid_digest", "digest must be lower-case hex SHA-256"
        )
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        folder = await bound_folder(request, conn, run)
        if folder is None:
            raise NotFound("Object not found")
        # Reachable only through this folder's own files: a hash alone is no key.
        cur = await conn.execute(
            "SELECT byte_size FROM files WHERE folder_id = %s AND digest = %s LIMIT 1",
            (folder.id, digest),
        )
        row = await cur.fetchone()
    if row is None:
        raise NotFound("Object not found")
    size = int(row["byte_size"])
    headers = {"Cache-Control": "private, no-store", "Accept-Ranges": "bytes"}
    start, end, status = 0, size, 200
    range_header = request.headers.get("range")
    if range_header and size > 0:
        try:
            start, end = parse_range(range_header, size)
        except RangeNotSatisfiable as exc:
            return JSONResponse(exc.to_json(), exc.status, {"Content-Range": f"bytes */{size}"})
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    headers["Content-Length"] = str(end - start)
    key = object_key(run.company_id, digest)
    if end == start:
        return Response(b"", status_code=status, headers=headers)
    return StreamingResponse(
        stream_object(request, key, start, end),
        status_code=status,
        headers=headers,
        media_type="application/octet-stream",
    )


routes = [
    Route(PREFIX + "/run", get_run, methods=["GET"]),
    Route(PREFIX + "/folders/{scope}/manifest", get_manifest, methods=["GET"]),
    Route(PREFIX + "/folders/{scope}/objects/{digest}", get_object, methods=["GET"]),
]
