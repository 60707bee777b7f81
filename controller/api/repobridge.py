"""The bridge's repository routes for fsagent: list the run's repositories,
upload contents, commit a repository checkpoint, and read one back for a
restore.

Contract: :mod:`common.repos`. A ``{workspaceId}`` not bound to the run's
task is 404. Uploads are the folder uploads' machinery
(:mod:`controller.api.uploads`); validation, the plan and the manifest are
:mod:`controller.repomanifest`'s; the transaction is :mod:`controller.repos`'.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from typing import Any

from psycopg import AsyncConnection
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.bridge import MAX_CHECKPOINT_BODY, PREFIX
from common.errors import (
    BaseMismatch,
    DatabaseUnavailable,
    NotFound,
    StaleLease,
    UnknownContent,
    UnsafeRepoMember,
    ValidationError,
    WorkFolderError,
)
from common.repos import FETCH_BATCH_MAX, MISSING_MAX
from common.text import MAX_ERROR_CHARS, check_text
from controller import repomanifest, repos, runs
from controller.api.common import (
    bound_run,
    connection,
    json_errors,
    read_json,
    state,
    write_transaction,
)
from controller.api.objects import (
    Body,
    in_thread,
    journal_orphan,
    put_object,
    reupload_if_missing,
)
from controller.api.serialize import repo_binding_json
from controller.api.uploads import Confirm, receive_batch, receive_upload
from controller.auth import RunBinding, confirm_run_lease
from controller.repostream import batch_body
from controller.storage.base import object_key

log = logging.getLogger(__name__)

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
PLAN_ATTEMPTS = 3
"""Plans made again when another commit of the binding landed in between."""

BASE = PREFIX + "/repos/{workspaceId}"


async def _bound(request: Request, conn: AsyncConnection[Any]) -> tuple[RunBinding, repos.Bound]:
    run = await bound_run(request, conn)
    return run, await repos.binding_for_run(conn, run, request.path_params["workspaceId"])


def _digests(body: dict[str, Any], limit: int) -> list[str]:
    digests = body.get("digests")
    if (
        set(body) != {"digests"}
        or not isinstance(digests, list)
        or len(digests) > limit
        or not all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in digests)
    ):
        raise ValidationError.single(
            "digests",
            "invalid",
            f'body must be {{"digests": [...]}}: at most {limit} lower-case hex SHA-256 digests',
        )
    return digests


@json_errors
async def list_repos(request: Request) -> Response:
    async with connection(request) as conn:
        run = await bound_run(request, conn)
        rows = await repos.list_for_run(conn, run)
    return JSONResponse({"reposDir": "repos", "repos": [repo_binding_json(r) for r in rows]})


@json_errors
async def missing(request: Request) -> Response:
    digests = _digests(await read_json(request, 1 << 20), MISSING_MAX)
    async with connection(request) as conn:
        run, bound = await _bound(request, conn)
        absent = await repos.missing(conn, run, bound, digests)
    return JSONResponse({"missing": absent})


def _upload_confirm(run: RunBinding, workspace_id: str) -> Confirm:
    """Registering a repository upload re-checks the run's lease and that the
    workspace is still bound to its task."""

    async def confirm(conn: AsyncConnection[Any]) -> None:
        await confirm_run_lease(conn, run)
        await repos.binding_for_run(conn, run, workspace_id)

    return confirm


@json_errors
async def upload(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        run, bound = await _bound(request, conn)
        await repos.mark_saving(conn, bound)
    confirm = _upload_confirm(run, bound.workspace_id)
    try:
        answer = await receive_upload(request, run, confirm, st.settings.quotas.repo_upload_ttl)
    except ClientDisconnect:
        return Response(status_code=400)
    return JSONResponse(answer)


@json_errors
async def upload_batch(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        run, bound = await _bound(request, conn)
        await repos.mark_saving(conn, bound)
    confirm = _upload_confirm(run, bound.workspace_id)
    try:
        objects = await receive_batch(request, run, confirm, st.settings.quotas.repo_upload_ttl)
    except ClientDisconnect:
        return Response(status_code=400)
    return JSONResponse({"objects": objects})


def _encode(plan: repomanifest.Plan) -> tuple[bytes, str]:
    """The manifest object's bytes and their SHA-256 (CPU work: in a thread)."""
    data = repomanifest.encode_plan(plan)
    return data, hashlib.sha256(data).hexdigest()


async def _commit_once(
    request: Request, run: RunBinding, req: repomanifest.CheckpointRequest
) -> tuple[dict[str, Any], repomanifest.Manifest | None] | None:
    """One plan and one commit: the receipt, and the new current manifest
    (None for a replay); None when the plan went stale before it committed
    (another commit of the binding landed first)."""
    st = state(request)
    async with connection(request) as conn:
        bound = await repos.binding_for_run(conn, run, request.path_params["workspaceId"])
        replay = await repos.has_receipt(conn, bound, req.operation_id)
    gc_delay = st.settings.gc_delay
    if replay:
        # The lease is checked again before the receipt is answered.
        receipt = await write_transaction(
            request, lambda c: repos.commit(c, run, bound, req, None, None, gc_delay=gc_delay)
        )
        return receipt, None
    if req.base is not None and req.base != bound.current_id:
        raise BaseMismatch(details=[{"base": req.base, "current": bound.current_id}])
    current = repomanifest.EMPTY
    if bound.manifest_digest is not None:
        current = await asyncio.to_thread(
            repomanifest.load, st.storage, bound.company_id, bound.manifest_digest
        )
    plan = await asyncio.to_thread(
        repomanifest.plan_checkpoint, req, bound.current_id, current, bound.manifest_digest
    )
    data, digest = await asyncio.to_thread(_encode, plan)
    body = Body(len(data), digest, data=data)
    created = False
    try:
        # Durable before the transaction that makes it current starts.
        created = await put_object(request, object_key(bound.company_id, digest), body)
        stored = repos.StoredManifest(digest, len(data), reupload_if_missing(request, body))
        result = await write_transaction(
            request, lambda c: repos.commit(c, run, bound, req, plan, stored, gc_delay=gc_delay)
        )
    except repos.PlanOutdated:
        if created:
            await journal_orphan(request, bound.company_id, digest)
        return None
    except BaseException:
        if created:
            await journal_orphan(request, bound.company_id, digest)
        raise
    repomanifest.CACHE.put(bound.company_id, digest, plan.manifest)
    return result, plan.manifest


@json_errors
async def commit_checkpoint(request: Request) -> Response:
    async with connection(request) as conn:
        run, bound = await _bound(request, conn)
    body = await read_json(request, MAX_CHECKPOINT_BODY)
    try:
        # Up to 100,000 members: too much work for the event loop.
        req = await asyncio.to_thread(repomanifest.parse_request, body)
        for _ in range(PLAN_ATTEMPTS):
            done = await _commit_once(request, run, req)
            if done is not None:
                result, manifest = done
                async with connection(request) as conn:
                    await runs.clear_repository_failure(conn, run.run_id, bound.name)
                if manifest is None:
                    return JSONResponse(result)
                # The next delta's copies of this manifest's tables, made
                # once the answer is sent rather than in that delta's request.
                return JSONResponse(
                    result,
                    background=BackgroundTask(
                        asyncio.to_thread, repomanifest.prepare_spare, manifest
                    ),
                )
    except (UnknownContent, UnsafeRepoMember, StaleLease) as exc:
        await _record_refusal(request, run, bound, exc)
        raise
    raise DatabaseUnavailable("the repository kept changing under this checkpoint; retry")


async def _record_refusal(
    request: Request, run: RunBinding, bound: repos.Bound, exc: WorkFolderError
) -> None:
    """A refused checkpoint fails the run's save of the repository until a
    later one succeeds (its details show it, never a folder's /sync). A
    checkpoint the run's content or members made unacceptable is also the
    repository's visible state; a ``stale_lease`` is not: the repository is
    the newer run's to save now, and its current checkpoint is as good as it
    was. A failure to record is logged, never answered instead of the refusal."""
    error = f"{exc.code}: {exc.text}"
    try:
        async with connection(request) as conn:
            if not isinstance(exc, StaleLease):
                await repos.set_state(conn, bound, "failed", error)
            await runs.record_repository_failure(conn, run.run_id, bound.name, error)
    except WorkFolderError as record_exc:
        log.warning("could not record a refused repository checkpoint: %s", record_exc)


@json_errors
async def get_manifest(request: Request) -> Response:
    st = state(request)
    wanted = request.path_params["checkpointId"]
    async with connection(request) as conn:
        _, bound = await _bound(request, conn)
    if bound.current_id is None or bound.manifest_digest is None:
        raise NotFound("Checkpoint not found")
    if wanted not in ("current", bound.current_id):
        raise NotFound("Checkpoint not found")
    body = await asyncio.to_thread(
        repomanifest.manifest_json,
        st.storage,
        bound.company_id,
        bound.manifest_digest,
        bound.current_id,
    )
    return StreamingResponse(
        in_thread(body),
        media_type="application/json",
        headers={"Cache-Control": "private, no-store"},
    )


@json_errors
async def fetch_objects(request: Request) -> Response:
    st = state(request)
    digests = _digests(await read_json(request, 256 << 10), FETCH_BATCH_MAX)
    async with connection(request) as conn:
        _, bound = await _bound(request, conn)
        sizes = await repos.current_objects(conn, bound, digests)
    unknown = [d for d in digests if d not in sizes]
    if unknown:
        # Only the binding's current checkpoint is served: a hash is no key.
        raise NotFound("Object not found", details=[{"digest": d} for d in unknown[:20]])
    body = batch_body(st.storage, bound.company_id, [(d, sizes[d]) for d in digests])
    return StreamingResponse(
        in_thread(body),
        media_type="application/octet-stream",
        headers={"Cache-Control": "private, no-store"},
    )


@json_errors
async def report(request: Request) -> Response:
    body = await read_json(request)
    new_state, error = body.get("state"), body.get("error")
    if (
        new_state not in ("saving", "failed")
        or not (error is None or isinstance(error, str))
        or set(body) - {"state", "error"}
    ):
        raise ValidationError.single(
            "state", "invalid", 'body must be {"state": "saving"|"failed", "error"?: string}'
        )
    if error is not None:
        # Shown as the repository's and the run's error: the text rule, lines allowed.
        check_text(error, "error", MAX_ERROR_CHARS, multiline=True, blank_ok=True)
    async with connection(request) as conn:
        run, bound = await _bound(request, conn)
        await repos.set_state(conn, bound, new_state, error)
        if new_state == "failed":
            # fsagent gave up on this save: the run's details show it until
            # a later save of the repository succeeds.
            await runs.record_repository_failure(
                conn, run.run_id, bound.name, error or "the save failed"
            )
    return JSONResponse({"state": new_state})


routes = [
    Route(PREFIX + "/repos", list_repos, methods=["GET"]),
    Route(BASE + "/missing", missing, methods=["POST"]),
    Route(BASE + "/uploads", upload, methods=["PUT"]),
    Route(BASE + "/uploads/batch", upload_batch, methods=["PUT"]),
    Route(BASE + "/checkpoints", commit_checkpoint, methods=["POST"]),
    Route(BASE + "/checkpoints/{checkpointId}/manifest", get_manifest, methods=["GET"]),
    Route(BASE + "/objects/batch", fetch_objects, methods=["POST"]),
    Route(BASE + "/report", report, methods=["POST"]),
]
