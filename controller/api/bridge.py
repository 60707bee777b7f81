"""The bridge for fsagent: run-token auth, only the run's bound folders.

Contract: :mod:`common.bridge`. Nothing a sandbox sends is trusted: the owner
comes from the run's binding, objects are served only when this folder
references them, and a user folder is served only while its user is an
active member of the run's company.
"""

from __future__ import annotations

import asyncio
import json
import re
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
    MembershipRevoked,
    NotFound,
    StaleLease,
    UnknownContent,
    ValidationError,
    WriteNotAllowed,
)
from common.paths import validate_scope
from controller import apply, folders, runs
from controller.api.common import (
    bound_run,
    connection,
    json_errors,
    read_json,
    state,
    write_transaction,
)
from controller.api.objects import object_response
from controller.api.params import BIGINT_MAX, query_int
from controller.api.uploads import Confirm, receive_batch, receive_upload
from controller.auth import (
    RunBinding,
    confirm_run_writes,
    run_may_use_user_folder,
    run_may_write_user_folder,
)
from controller.checkpoint import apply_checkpoint, parse_checkpoint
from controller.storage.base import object_key

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


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


@json_errors
async def get_run(request: Request) -> Response:
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        user_ok = await run_may_use_user_folder(conn, run)
        refresh = await runs.refresh_requested(conn, run.run_id)
    return JSONResponse(
        {
            "refreshRequested": refresh,
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
    since = query_int(request, "since", 0, minimum=0, maximum=BIGINT_MAX, code="invalid_integer")
    limit = query_int(
        request,
        "limit",
        MANIFEST_PAGE_MAX,
        minimum=1,
        maximum=MANIFEST_PAGE_MAX,
        code="invalid_integer",
    )
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        folder = await bound_folder(request, conn, run)
        page = await folders.manifest_page(conn, folder, since=since, limit=limit)
    next_since = page.last_version if page.more else None
    # The entries arrive as JSON text from the database (folders.manifest_page).
    body = (
        f'{{"entries":{page.entries_json},"nextSince":{json.dumps(next_since)},'
        f'"highWater":{page.high_water}}}'
    )
    return Response(body, media_type="application/json")


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
        size = await folders.referenced_object_size(conn, folder, digest)
    if size is None:
        raise NotFound("Object not found")
    headers = {"Cache-Control": "private, no-store", "Accept-Ranges": "bytes"}
    key = object_key(run.company_id, digest)
    return object_response(request, key, size, headers, "application/octet-stream")


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
    if scope == "user" and not await run_may_write_user_folder(conn, run):
        raise WriteNotAllowed("The run's user is a viewer; the run cannot write their folder")
    folder = await apply.get_folder(conn, run.company_id, scope, owner, create=True)
    assert folder is not None
    return folder


async def record_run_failure(request: Request, run: RunBinding, error: str) -> None:
    """Make a refused save visible on /sync (own transaction: the save rolled back)."""
    async with connection(request) as conn:
        await runs.set_state(conn, run.run_id, "failed", error)


def folder_upload_confirm(run: RunBinding, scope: str) -> Confirm:
    """What registering a folder upload re-checks: the run's lease and, for the
    user folder, its user's write right."""

    async def confirm(conn: AsyncConnection[Any]) -> None:
        await confirm_run_writes(conn, run, scope)

    return confirm


@json_errors
async def upload(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await writable_folder(request, conn, run)
        await runs.mark_saving(conn, run.run_id)
    confirm = folder_upload_confirm(run, request.path_params["scope"])
    try:
        answer = await receive_upload(request, run, confirm, st.settings.quotas.pending_upload_ttl)
    except ClientDisconnect:
        return Response(status_code=400)
    return JSONResponse(answer)


@json_errors
async def upload_batch(request: Request) -> Response:
    """Many small objects in one framed body (:mod:`controller.api.uploads`)."""
    st = state(request)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await writable_folder(request, conn, run)
        await runs.mark_saving(conn, run.run_id)
    confirm = folder_upload_confirm(run, request.path_params["scope"])
    try:
        objects = await receive_batch(request, run, confirm, st.settings.quotas.pending_upload_ttl)
    except ClientDisconnect:
        return Response(status_code=400)
    return JSONResponse({"objects": objects})


@json_errors
async def commit_checkpoint(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
    body = await read_json(request, MAX_CHECKPOINT_BODY)
    # Up to MAX_CHECKPOINT_ENTRIES entries: too much work for the event loop.
    cp = await asyncio.to_thread(parse_checkpoint, body, st.settings.quotas.max_checkpoint_rows)

    async def commit(conn: AsyncConnection[Any]) -> dict[str, Any]:
        folder = await writable_folder(request, conn, run)
        # No object check per file: every digest is pinned (checkpoint.claim_contents).
        return await apply_checkpoint(
            conn, folder, run, cp, gc_delay=st.settings.gc_delay, quotas=st.settings.quotas
        )

    try:
        result = await write_transaction(request, commit)
    except (MembershipRevoked, StaleLease, UnknownContent, WriteNotAllowed) as exc:
        await record_run_failure(request, run, f"{exc.code}: {exc.text}")
        raise
    return JSONResponse(result)


@json_errors
async def refresh_applied(request: Request) -> Response:
    """fsagent took the server's changes after its final save: the request is done."""
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await runs.clear_refresh(conn, run.run_id)
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
        await runs.set_state(conn, run.run_id, new_state, error)
    return JSONResponse({"state": new_state})


routes += [
    Route(PREFIX + "/run/report", report, methods=["POST"]),
    Route(PREFIX + "/run/refresh-applied", refresh_applied, methods=["POST"]),
    Route(PREFIX + "/folders/{scope}/uploads", upload, methods=["PUT"]),
    Route(PREFIX + "/folders/{scope}/uploads/batch", upload_batch, methods=["PUT"]),
    Route(PREFIX + "/folders/{scope}/checkpoints", commit_checkpoint, methods=["POST"]),
]
