"""The bridge for fsagent: run-token auth, only the run's bound folders.

Contract: :mod:`common.bridge`. Nothing a sandbox sends is trusted: the owner
comes from the run's binding, objects are served only when this folder
references them, and a user folder is served only while its user is an
active member of the run's company.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Sequence
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
    AgentFilesLimitExceeded,
    MembershipRevoked,
    NotFound,
    ValidationError,
    WorkFolderError,
    WriteNotAllowed,
)
from common.limits import ENTRY_MAX_BYTES
from common.paths import validate_scope
from common.text import MAX_ERROR_CHARS, check_operation_id, check_text, is_operation_id
from controller import agentfiles, foldercore, folders, receipts, runs
from controller.api.common import (
    bound_run,
    connection,
    json_errors,
    read_json,
    state,
    write_transaction,
)
from controller.api.objects import object_response, read_object_bytes
from controller.api.params import BIGINT_MAX, query_int
from controller.api.serialize import run_warnings
from controller.api.uploads import Confirm, receive_batch, receive_upload
from controller.auth import (
    RunBinding,
    confirm_run_writes,
    run_may_use_user_folder,
    run_may_write_agent_folder,
    run_may_write_user_folder,
)
from controller.changeset import Entry
from controller.checkpoint import Checkpoint, Screen, apply_checkpoint, parse_checkpoint
from controller.storage.base import object_key

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
log = logging.getLogger(__name__)


async def bound_folder(
    request: Request, conn: AsyncConnection[Any], run: RunBinding
) -> foldercore.Folder | None:
    """The folder the run is bound to for ``{scope}``; NotFound when unbound/denied."""
    scope = validate_scope(request.path_params["scope"])
    owner = run.owner_for(scope)
    if owner is None:
        raise NotFound()
    if scope == "user" and not await run_may_use_user_folder(conn, run):
        raise NotFound()
    return await foldercore.get_folder(conn, run.company_id, scope, owner, create=False)


@json_errors
async def get_run(request: Request) -> Response:
    quotas = state(request).settings.quotas
    limits = quotas.agent
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        user_ok = await run_may_use_user_folder(conn, run)
        refresh = await runs.refresh_requested(conn, run.run_id)
        entry = await agentfiles.agent_entry(conn, run.company_id, run.agent_id)
        if not await receipts.warnings_known(conn, run.run_id, "agent"):
            # The run is starting: a folder at or over a limit warns on each run.
            folder = await foldercore.get_folder(
                conn, run.company_id, "agent", run.agent_id, create=False
            )
            usage = await agentfiles.folder_usage(conn, folder, limits)
            await receipts.set_warnings(
                conn, run.run_id, "agent", agentfiles.limit_warnings(usage, limits)
            )
        row = await receipts.run_row(conn, run.company_id, run.run_id)
    assert row is not None
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
            "agentEntry": entry,
            "warnings": run_warnings(row),
            # fsagent commits a large change set in parts within these (fsagent.checkpoint.ship).
            "maxPendingUploadBytes": quotas.max_pending_upload_bytes,
            "maxCheckpointEntries": quotas.max_checkpoint_entries,
            "maxCheckpointRows": quotas.max_checkpoint_rows,
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
    if not _DIGEST.fullmatch(digest):
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
    return await object_response(request, key, size, headers, "application/octet-stream")


routes = [
    Route(PREFIX + "/run", get_run, methods=["GET"]),
    Route(PREFIX + "/folders/{scope}/manifest", get_manifest, methods=["GET"]),
    Route(PREFIX + "/folders/{scope}/objects/{digest}", get_object, methods=["GET"]),
]


# --- writes ------------------------------------------------------------------


async def writable_folder(
    request: Request, conn: AsyncConnection[Any], run: RunBinding
) -> foldercore.Folder:
    """The run's folder for ``{scope}``, created if needed; re-checks user membership."""
    scope = validate_scope(request.path_params["scope"])
    owner = run.owner_for(scope)
    if owner is None:
        raise NotFound()
    if scope == "user" and not await run_may_use_user_folder(conn, run):
        raise MembershipRevoked()
    if scope == "user" and not await run_may_write_user_folder(conn, run):
        raise WriteNotAllowed("The run's user is a viewer; the run cannot write their folder")
    # Saving the agent's folder needs its responsible user's configure permission.
    if scope == "agent" and not await run_may_write_agent_folder(conn, run):
        raise NotFound()
    folder = await foldercore.get_folder(conn, run.company_id, scope, owner, create=True)
    assert folder is not None
    return folder


async def record_refusal(
    request: Request,
    run: RunBinding,
    scope: str,
    operation_id: str | None,
    final: bool,
    exc: WorkFolderError,
) -> None:
    """The save receipt of a checkpoint that was not applied (own transaction:
    the save rolled back). A failure to record it is logged, never answered
    instead of the refusal."""
    warnings = [agentfiles.refusal_warning(exc)] if isinstance(exc, AgentFilesLimitExceeded) else []
    try:
        async with connection(request) as conn:
            await receipts.record(
                conn,
                run_id=run.run_id,
                company_id=run.company_id,
                scope=scope,
                owner_id=run.owner_for(scope) or "",
                operation_id=operation_id,
                outcome="failed" if exc.status >= 500 else "refused",
                code=exc.code.upper(),
                error=exc.text,
                details=exc.details,
                warnings=warnings,
                final=final,
            )
            # A storage limit is a warning of the run, which goes on
            # (a recorded refusal): it does not fail the run.
            if isinstance(exc, receipts.FAILS_THE_RUN):
                await runs.set_state(conn, run.run_id, "failed", f"{exc.code}: {exc.text}")
            elif isinstance(exc, AgentFilesLimitExceeded):
                await runs.settle_saving(conn, run.run_id)
    except WorkFolderError as record_exc:
        log.warning("could not record the receipt of a refused save: %s", record_exc)


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


def entry_screen(request: Request, run: RunBinding) -> Screen:
    """The agent folder's screen of checkpoint entries against the instruction
    entry's rules, reading a put entry's bytes (at most 1 MiB) from storage."""

    async def read_small(digest: str) -> bytes:
        return await read_object_bytes(request, object_key(run.company_id, digest), ENTRY_MAX_BYTES)

    async def screen(
        conn: AsyncConnection[Any], entries: Sequence[Entry], sizes: dict[str, int]
    ) -> tuple[list[Entry], list[dict[str, Any]]]:
        return await agentfiles.screen_checkpoint(
            conn, run.company_id, run.agent_id, entries, sizes, read_small
        )

    return screen


@json_errors
async def commit_checkpoint(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
    scope = validate_scope(request.path_params["scope"])
    body = await read_json(request, MAX_CHECKPOINT_BODY)
    # The receipt of a refused body names its operation id only when it is one
    # (a NUL could not even be stored: PostgreSQL text holds none).
    raw_id = body.get("operationId")
    op_id = raw_id if is_operation_id(raw_id) else None
    # A refusal of any part of the sandbox's final save is that save's
    # receipt (only its last part is ``final``): the run shows the folder stopped.
    final = body.get("final") is True or body.get("finalSave") is True
    cp: Checkpoint | None = None
    screen = entry_screen(request, run) if scope == "agent" else None

    async def commit(conn: AsyncConnection[Any]) -> dict[str, Any]:
        folder = await writable_folder(request, conn, run)
        assert cp is not None
        # No object check per file: every digest is pinned (checkpoint.claim_contents).
        return await apply_checkpoint(
            conn,
            folder,
            run,
            cp,
            gc_delay=st.settings.gc_delay,
            quotas=st.settings.quotas,
            screen=screen,
        )

    try:
        # Up to MAX_CHECKPOINT_ENTRIES entries: too much work for the event loop.
        quotas = st.settings.quotas
        cp = await asyncio.to_thread(
            parse_checkpoint,
            body,
            quotas.max_checkpoint_rows,
            max_entries=quotas.max_checkpoint_entries,
            agent_max_entries=quotas.agent_max_entries if scope == "agent" else None,
        )
        result = await write_transaction(request, commit)
    except WorkFolderError as exc:
        await record_refusal(request, run, scope, op_id, final, exc)
        raise
    return JSONResponse(result)


@json_errors
async def refresh_applied(request: Request) -> Response:
    """fsagent took the server's changes after its final save: the request is done."""
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await runs.clear_refresh(conn, run.run_id)
    return JSONResponse({"refreshRequested": False})


_REPORT_FIELDS = {"state", "error", "scope", "operationId", "final"}


@json_errors
async def report(request: Request) -> Response:
    async with connection(request) as conn:
        await bound_run(request, conn)
    body = await read_json(request)
    new_state = body.get("state")
    error = body.get("error")
    if new_state not in ("saving", "failed") or not (error is None or isinstance(error, str)):
        raise ValidationError.single("state", "invalid", "state must be saving or failed")
    scope = body.get("scope")
    op_id = body.get("operationId")
    if (
        set(body) - _REPORT_FIELDS
        or (scope is not None and (not isinstance(scope, str) or new_state != "failed"))
        or not (op_id is None or isinstance(op_id, str))
        or not isinstance(body.get("final", False), bool)
    ):
        raise ValidationError.single(
            "body", "invalid", "scope (with state failed), operationId and final are optional"
        )
    if op_id is not None:
        check_operation_id(op_id)
    if error is not None:
        # Shown as the run's (and the receipt's) error: the text rule, lines allowed.
        check_text(error, "error", MAX_ERROR_CHARS, multiline=True, blank_ok=True)
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        await runs.set_state(conn, run.run_id, new_state, error)
        if scope is not None:
            # fsagent gave up on a save of this folder: its explicit failure receipt.
            scope = validate_scope(scope)
            owner = run.owner_for(scope)
            if owner is None:
                raise NotFound()
            await receipts.record(
                conn,
                run_id=run.run_id,
                company_id=run.company_id,
                scope=scope,
                owner_id=owner,
                operation_id=op_id,
                outcome="failed",
                code="SAVE_FAILED",
                error=error or "the save failed",
                final=bool(body.get("final", False)),
            )
    return JSONResponse({"state": new_state})


routes += [
    Route(PREFIX + "/run/report", report, methods=["POST"]),
    Route(PREFIX + "/run/refresh-applied", refresh_applied, methods=["POST"]),
    Route(PREFIX + "/folders/{scope}/uploads", upload, methods=["PUT"]),
    Route(PREFIX + "/folders/{scope}/uploads/batch", upload_batch, methods=["PUT"]),
    Route(PREFIX + "/folders/{scope}/checkpoints", commit_checkpoint, methods=["POST"]),
]
