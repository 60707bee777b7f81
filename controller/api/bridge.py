"""The bridge for fsagent: run-token auth, only the run's bound folders.

Contract: :mod:`common.bridge`. Nothing a sandbox sends is trusted: the owner
comes from the run's binding, objects are served only when this folder
references them, and a user folder is served only while its user is an
active member of the run's company.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.bridge import (
    MANIFEST_PAGE_MAX,
    MAX_CHECKPOINT_BODY,
    PREFIX,
)
from common.errors import (
    DigestMismatch,
    MembershipRevoked,
    NotFound,
    PayloadTooLarge,
    ResyncRequired,
    StaleLease,
    Unauthenticated,
    UnknownContent,
    ValidationError,
)
from common.paths import validate_scope
from controller import apply
from controller.api.common import authenticate, connection, json_errors, read_json, state
from controller.api.workfolders import (
    object_response,
    put_object,
    reupload_if_missing,
    spool_append,
)
from controller.auth import RunBinding, run_may_use_user_folder
from controller.checkpoint import apply_checkpoint, parse_checkpoint
from controller.db.retry import retrying
from controller.frames import Frame, FrameSplitter, decode_frame
from controller.storage.base import ObjectMissing, object_key

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


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
        cur = await conn.execute("SELECT refresh_requested FROM runs WHERE id = %s", (run.run_id,))
        row = await cur.fetchone()
    return JSONResponse(
        {
            "refreshRequested": bool(row and row["refresh_requested"]),
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
    headers = {"Cache-Control": "private, no-store", "Accept-Ranges": "bytes"}
    key = object_key(run.company_id, digest)
    return object_response(request, key, int(row["byte_size"]), headers, "application/octet-stream")


routes = [
    Route(PREFIX + "/run", get_run, methods=["GET"]),
    Route(PREFIX + "/folders/{scope}/manifest", get_manifest, methods=["GET"]),
    Route(PREFIX + "/folders/{scope}/objects/{digest}", get_object, methods=["GET"]),
]


# --- writes ------------------------------------------------------------------


async def writable_folder(
    request: Request, conn: AsyncConnection[Any], run: RunBinding
) -> apply.Folder:
    """The run's folder for ``{scope}``, created if needed; re-checks user membership."""
    scope = validate_scope(request.path_params["scope"])
    owner = run.owner_for(scope)
    if owner is None:
        raise NotFound()
    if scope == "user" and not await run_may_use_user_folder(conn, run):
        raise MembershipRevoked()
    folder = await apply.get_folder(conn, run.company_id, scope, owner, create=True)
    assert folder is not None
    return folder


async def record_run_failure(request: Request, run: RunBinding, error: str) -> None:
    """Make a refused save visible on /sync (own transaction: the save rolled back)."""
    async with connection(request) as conn:
        await conn.execute(
            "UPDATE runs SET state = 'failed', error = %s WHERE id = %s", (error[:2000], run.run_id)
        )


def store_frame(frame: Frame, fd: int, hasher: Any) -> None:
    """Decode, verify, hash and spool one frame: CPU and disk work, run in a thread."""
    spool_append(fd, hasher, decode_frame(frame))


@json_errors
async def upload(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await writable_folder(request, conn, run)
        await conn.execute(
            "UPDATE runs SET state = 'saving' WHERE id = %s AND state <> 'saving'", (run.run_id,)
        )
    hint = request.headers.get("x-content-sha256")
    hint_len = request.headers.get("x-content-length")
    limit = st.settings.max_file_bytes
    splitter = FrameSplitter()
    size = 0
    fd, name = await asyncio.to_thread(
        tempfile.mkstemp, dir=st.settings.spool_dir, prefix="bridge-"
    )
    spool = Path(name)
    hasher = hashlib.sha256()
    try:
        try:
            async for chunk in request.stream():
                for frame in splitter.feed(chunk):
                    # Checked on the declared length, before any decompression.
                    size += frame.raw_len
                    if size > limit:
                        raise PayloadTooLarge(f"Files are limited to {limit} bytes")
                    await asyncio.to_thread(store_frame, frame, fd, hasher)
        finally:
            os.close(fd)
        splitter.finish()
        digest = hasher.hexdigest()
        if (hint is not None and hint != digest) or (
            hint_len is not None and hint_len != str(size)
        ):
            raise DigestMismatch(details=[{"digest": digest, "byteSize": size}])
        key = object_key(run.company_id, digest)
        await put_object(request, key, spool, size, digest)
        ensure = reupload_if_missing(request, spool, size, digest)
        async with connection(request) as conn:
            await apply.register_object(conn, run.company_id, digest, size, ensure)
            await conn.execute(
                "INSERT INTO run_uploads (run_id, company_id, digest, byte_size)"
                " VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (run.run_id, run.company_id, digest, size),
            )
            # Collected later unless a checkpoint references it.
            await apply.journal_deletion(
                conn, run.company_id, [digest], "bridge upload", st.settings.gc_delay
            )
    except ClientDisconnect:
        return Response(status_code=400)
    finally:
        # Unlinking one spool file is a single metadata update; a thread hop
        # here would also be skipped on cancellation, leaking the file.
        spool.unlink(missing_ok=True)  # noqa: ASYNC240
    return JSONResponse({"digest": digest, "byteSize": size})


@json_errors
async def commit_checkpoint(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
    body = await read_json(request, MAX_CHECKPOINT_BODY)
    # Up to MAX_CHECKPOINT_ENTRIES entries: too much work for the event loop.
    cp = await asyncio.to_thread(parse_checkpoint, body)

    async def ensure(k: str) -> None:
        if not await asyncio.to_thread(st.storage.exists, k):
            raise ObjectMissing(f"uploaded object {k} is gone; upload it again")

    async def commit(conn: AsyncConnection[Any]) -> dict[str, Any]:
        folder = await writable_folder(request, conn, run)
        return await apply_checkpoint(
            conn, folder, run, cp, ensure_object=ensure, gc_delay=st.settings.gc_delay
        )

    try:
        result = await retrying(st.pool, commit)
    except (MembershipRevoked, StaleLease, UnknownContent) as exc:
        await record_run_failure(request, run, f"{exc.code}: {exc.text}")
        raise
    return JSONResponse(result)


@json_errors
async def refresh_applied(request: Request) -> Response:
    """fsagent took the server's changes after its final save: the request is done."""
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await conn.execute("UPDATE runs SET refresh_requested = false WHERE id = %s", (run.run_id,))
    return JSONResponse({"refreshRequested": False})


@json_errors
async def report(request: Request) -> Response:
    async with connection(request) as conn:
        await bound_run(request, conn)
    body = await read_json(request)
    new_state = body.get("state")
    error = body.get("error")
    if new_state not in ("saving", "failed") or not (error is None or isinstance(error, str)):
        raise ValidationError.single("state", "invalid", "state must be saving or failed")
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await conn.execute(
            "UPDATE runs SET state = %s, error = %s WHERE id = %s",
            (new_state, (error or None) and error[:2000], run.run_id),
        )
    return JSONResponse({"state": new_state})


routes += [
    Route(PREFIX + "/run/report", report, methods=["POST"]),
    Route(PREFIX + "/run/refresh-applied", refresh_applied, methods=["POST"]),
    Route(PREFIX + "/folders/{scope}/uploads", upload, methods=["PUT"]),
    Route(PREFIX + "/folders/{scope}/checkpoints", commit_checkpoint, methods=["POST"]),
]
