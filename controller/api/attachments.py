"""Task attachments (``controller.attachments``):
``POST /api/companies/{companyId}/tasks/{taskId}/attachments?name=F`` stores an
original upload (``Idempotency-Key``: a retry adds nothing); ``GET
…/attachments`` lists them and ``GET …/attachments/{attachmentId}`` downloads
one. Access is the task folder's: reading its attachments needs read access,
adding one write access."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from psycopg import AsyncConnection
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import AttachmentNotFound, ValidationError
from common.paths import validate_uuid
from controller import attachments, quotas
from controller.api.common import (
    authenticate,
    connection,
    json_errors,
    state,
    transact,
    write_transaction,
)
from controller.api.objects import (
    journal_orphan,
    object_response,
    put_object,
    reupload_if_missing,
    served_type,
    spool_body,
)
from controller.api.params import idempotency_key, strict_query
from controller.auth import Principal, authorize_folder, write_policy
from controller.rowjson import iso
from controller.storage.base import object_key

log = logging.getLogger(__name__)
_PRINTABLE = set(map(chr, range(0x20, 0x7F)))


def _attachment_json(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": str(row["id"]),
        "taskId": str(row["task_id"]),
        "filename": row["filename"],
        "byteSize": int(row["byte_size"]),
        "digest": row["digest"],
        "contentType": row["content_type"],
        "createdBy": None if row["created_by"] is None else str(row["created_by"]),
        "createdAt": iso(row["created_at"]),
        "copyPath": attachments.copy_path(str(row["id"]), row["filename"]),
    }


def _task_address(request: Request) -> tuple[str, str]:
    company_id = validate_uuid(request.path_params["companyId"], "companyId")
    task_id = validate_uuid(request.path_params["taskId"], "taskId")
    return company_id, task_id


async def _open_task(
    request: Request, conn: AsyncConnection[Any], *, write: bool
) -> tuple[Principal, str, str]:
    company_id, task_id = _task_address(request)
    principal = await authenticate(request, conn)
    await authorize_folder(conn, principal, company_id, "task", task_id, write=write)
    return principal, company_id, task_id


def _filename(request: Request) -> str:
    names = strict_query(request, "name")
    if len(names) != 1:
        raise ValidationError.single("name", "required", "exactly one name query parameter")
    return attachments.validate_filename(names[0])


def _content_type(request: Request) -> str | None:
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/octet-stream":
        raise ValidationError.single(
            "Content-Type", "invalid_content_type", "body must be application/octet-stream"
        )
    declared = request.headers.get("x-file-content-type")
    if declared is not None and (not 1 <= len(declared) <= 256 or not set(declared) <= _PRINTABLE):
        raise ValidationError.single(
            "X-File-Content-Type", "invalid_content_type", "1-256 printable characters"
        )
    return declared


@json_errors
async def post_attachment(request: Request) -> Response:
    st = state(request)
    name = _filename(request)
    content_type = _content_type(request)
    op_id = idempotency_key(request)
    # Authorize before reading a single body byte.
    principal, company_id, task_id = await write_transaction(
        request, lambda c: _open_task(request, c, write=True)
    )
    policy = write_policy(principal, company_id, "task", task_id, st.settings.quotas)
    try:
        body = await spool_body(request, st.settings.spool_dir, st.settings.max_file_bytes)
    except ClientDisconnect:
        log.info("attachment upload abandoned by the client; nothing stored")
        return Response(status_code=400)
    size, digest = body.size, body.digest
    created_blob = False
    try:
        async with quotas.reserved(
            transact(request), company_id, None, {digest: size}, st.settings.quotas
        ) as reservation:
            created_blob = await put_object(request, object_key(company_id, digest), body)
            ensure = reupload_if_missing(request, body)

            async def add(conn: AsyncConnection[Any]) -> tuple[dict[str, Any], bool]:
                await quotas.settle(conn, reservation)
                return await attachments.add(
                    conn,
                    company_id,
                    task_id,
                    filename=name,
                    digest=digest,
                    byte_size=size,
                    content_type=content_type,
                    created_by=principal.user_id,
                    ensure_object=ensure,
                    confirm=policy.confirm,  # authority again, inside the committing transaction
                    operation_id=op_id,
                )

            row, applied = await write_transaction(request, add)
    except BaseException:
        if created_blob:
            await journal_orphan(request, company_id, digest)
        raise
    finally:
        body.discard()
    return JSONResponse(
        {"applied": applied, "attachment": _attachment_json(row)},
        status_code=201 if applied else 200,
    )


@json_errors
async def list_attachments(request: Request) -> Response:
    async with connection(request) as conn:
        _, company_id, task_id = await _open_task(request, conn, write=False)
        rows = await attachments.list_for_task(conn, company_id, task_id)
    return JSONResponse({"attachments": [_attachment_json(r) for r in rows]})


@json_errors
async def get_attachment(request: Request) -> Response:
    attachment_id = validate_uuid(request.path_params["attachmentId"], "attachmentId")
    async with connection(request) as conn:
        _, company_id, task_id = await _open_task(request, conn, write=False)
        row = await attachments.get(conn, company_id, task_id, attachment_id)
    if row is None:
        raise AttachmentNotFound()
    headers = {
        "Cache-Control": "private, no-store",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "sandbox; default-src 'none'",
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(row['filename'], safe='')}",
        "Accept-Ranges": "bytes",
        "ETag": f'"{row["digest"]}"',
    }
    key = object_key(company_id, row["digest"])
    media_type = served_type(row["content_type"])
    return await object_response(request, key, int(row["byte_size"]), headers, media_type)


BASE = "/api/companies/{companyId}/tasks/{taskId}/attachments"
routes = [
    Route(BASE, post_attachment, methods=["POST"]),
    Route(BASE, list_attachments, methods=["GET"]),
    Route(BASE + "/{attachmentId}", get_attachment, methods=["GET", "HEAD"]),
]
