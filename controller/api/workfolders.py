"""The work-folder REST API under /api/companies/{companyId}/work-folders/{scope}/{ownerId}."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
import re
import secrets
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote

from psycopg import AsyncConnection
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.errors import (
    FileNotFound,
    InvalidPath,
    IsADirectory,
    PayloadTooLarge,
    RangeNotSatisfiable,
    RunNotActive,
    RunNotFound,
    StorageUnavailable,
    ValidationError,
)
from common.limits import (
    DEFAULT_PAGE_LIMIT,
    MAX_CONTENT_TYPE_CHARS,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_PAGE_LIMIT,
    MAX_PREVIEW_BYTES,
)
from common.paths import validate_owner_id, validate_path, validate_scope, validate_uuid
from controller import apply
from controller.api.common import (
    authenticate,
    connection,
    json_errors,
    read_json,
    state,
)
from controller.auth import Principal, authorize_folder
from controller.db.retry import retrying
from controller.storage.base import object_key

log = logging.getLogger(__name__)

SPOOL_WRITE_BYTES = 1 << 20
_PRINTABLE = re.compile(r"^[\x20-\x7e]+$")


# --- request parsing -------------------------------------------------------


def folder_address(request: Request) -> tuple[str, str, str]:
    p = request.path_params
    company_id = validate_uuid(p["companyId"], "companyId")
    scope = validate_scope(p["scope"])
    owner_id = validate_owner_id(scope, p["ownerId"])
    return company_id, scope, owner_id


def strict_query(request: Request, name: str) -> list[str]:
    """Query values decoded strictly: invalid UTF-8 is an error, not U+FFFD."""
    raw = request.scope.get("query_string", b"").decode("latin-1")
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidPath("invalid_utf8", "query string is not valid UTF-8", name) from None
    return [v for k, v in pairs if k == name]


def query_path(request: Request) -> str:
    values = strict_query(request, "path")
    if len(values) != 1:
        raise ValidationError.single("path", "required", "exactly one path query parameter")
    return validate_path(values[0])


def query_bool(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false")
    if raw not in ("true", "false"):
        raise ValidationError.single(name, "invalid_boolean", f"{name} must be true or false")
    return raw == "true"


def idempotency_key(request: Request) -> str:
    key = request.headers.get("idempotency-key")
    if key is None:
        return "auto-" + secrets.token_hex(16)
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS or not _PRINTABLE.match(key):
        raise ValidationError.single(
            "Idempotency-Key",
            "invalid_idempotency_key",
            f"Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters",
        )
    return key


def encode_cursor(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def decode_cursor(raw: str, keys: set[str]) -> dict[str, Any]:
    try:
        data = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        data = None
    if (
        not isinstance(data, dict)
        or set(data) != keys
        or not all(isinstance(v, str) for v in data.values())
    ):
        raise ValidationError.single("cursor", "invalid_cursor", "cursor is not valid")
    return data


async def open_folder(
    request: Request, conn: AsyncConnection[Any], *, write: bool
) -> tuple[Principal, apply.Folder | None, tuple[str, str, str]]:
    address = folder_address(request)
    principal = await authenticate(request, conn)
    await authorize_folder(conn, principal, *address, write=write)
    folder = await apply.get_folder(conn, *address, create=write)
    return principal, folder, address


async def folder_last_operation(conn: AsyncConnection[Any], folder: apply.Folder | None) -> Any:
    if folder is None:
        return None
    cur = await conn.execute("SELECT last_operation_at FROM folders WHERE id = %s", (folder.id,))
    row = await cur.fetchone()
    return apply.iso(row["last_operation_at"]) if row else None


# --- GET / -----------------------------------------------------------------


@json_errors
async def list_entries(request: Request) -> Response:
    trash = query_bool(request, "trash")
    limit_raw = request.query_params.get("limit", str(DEFAULT_PAGE_LIMIT))
    if not limit_raw.isdigit() or not 1 <= int(limit_raw) <= MAX_PAGE_LIMIT:
        raise ValidationError.single(
            "limit", "invalid_limit", f"limit must be an integer 1-{MAX_PAGE_LIMIT}"
        )
    limit = int(limit_raw)
    cursor_raw = request.query_params.get("cursor")
    dirs = strict_query(request, "dir")
    dir_raw = dirs[0] if dirs else None
    parent = None if dir_raw is None else ("" if dir_raw == "" else validate_path(dir_raw, "dir"))

    async with connection(request) as conn:
        _, folder, _ = await open_folder(request, conn, write=False)
        rows: list[dict[str, Any]] = []
        if folder is not None:
            params: dict[str, Any] = {"fid": folder.id, "limit": limit + 1}
            where = ["folder_id = %(fid)s"]
            if parent is not None:
                where.append("parent = %(parent)s")
                params["parent"] = parent
            if trash:
                where.append("deleted_at IS NOT NULL")
                order = "deleted_at DESC, path"
                if cursor_raw:
                    c = decode_cursor(cursor_raw, {"d", "p"})
                    where.append(
                        "(deleted_at < %(cd)s::timestamptz OR"
                        " (deleted_at = %(cd)s::timestamptz AND path > %(cp)s))"
                    )
                    params.update(cd=c["d"], cp=c["p"])
            else:
                where.append("deleted_at IS NULL")
                order = "path"
                if cursor_raw:
                    c = decode_cursor(cursor_raw, {"p"})
                    where.append("path > %(cp)s")
                    params["cp"] = c["p"]
            cur = await conn.execute(
                f"SELECT * FROM files WHERE {' AND '.join(where)} ORDER BY {order} LIMIT %(limit)s",
                params,
            )
            rows = list(await cur.fetchall())
        next_cursor = None
        if len(rows) > limit:
            rows = rows[:limit]
            last = rows[-1]
            next_cursor = encode_cursor(
                {"d": last["deleted_at"].isoformat(), "p": last["path"]}
                if trash
                else {"p": last["path"]}
            )
        return JSONResponse(
            {
                "entries": [apply.entry_json(r) for r in rows],
                "nextCursor": next_cursor,
                "lastOperationAt": await folder_last_operation(conn, folder),
            }
        )


# --- GET /content ----------------------------------------------------------


def parse_range(header: str, size: int) -> tuple[int, int]:
    """One ``bytes=`` range → [start, end) within ``size``; 416 when unsatisfiable."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if m is None or (m.group(1) == "" and m.group(2) == ""):
        raise RangeNotSatisfiable("Only a single bytes=start-end range is supported")
    first, last = m.group(1), m.group(2)
    if first == "":
        suffix = int(last)
        if suffix == 0:
            raise RangeNotSatisfiable()
        return max(0, size - suffix), size
    start = int(first)
    end = size if last == "" else min(size, int(last) + 1)
    if start >= size or start >= end:
        raise RangeNotSatisfiable()
    return start, end


async def stream_object(request: Request, key: str, start: int, end: int) -> AsyncIterator[bytes]:
    storage = state(request).storage
    chunks = storage.read_chunks(key, start, end)
    try:
        while True:
            chunk = await asyncio.to_thread(next, chunks, None)
            if chunk is None:
                return
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


def content_headers(row: dict[str, Any]) -> dict[str, str]:
    name = row["path"].rpartition("/")[2]
    return {
        "Cache-Control": "private, no-store",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "sandbox; default-src 'none'",
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name, safe='')}",
        "Accept-Ranges": "bytes",
        "ETag": f'"{row["digest"]}"',
    }


@json_errors
async def get_content(request: Request) -> Response:
    path = query_path(request)
    preview = query_bool(request, "preview")
    async with connection(request) as conn:
        _, folder, address = await open_folder(request, conn, write=False)
        row = None if folder is None else await apply.live_row(conn, folder, path)
    if row is None:
        raise FileNotFound()
    if row["kind"] == "directory":
        raise IsADirectory()
    size = int(row["byte_size"])
    if preview and size > MAX_PREVIEW_BYTES:
        raise PayloadTooLarge(f"Previews are limited to {MAX_PREVIEW_BYTES} bytes")
    key = object_key(address[0], row["digest"])
    media_type = row["content_type"] or "application/octet-stream"
    return object_response(request, key, size, content_headers(row), media_type)


def object_response(
    request: Request, key: str, size: int, headers: dict[str, str], media_type: str
) -> Response:
    """Stream a stored object, honouring one ``Range`` (206) or refusing it (416)."""
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
    if request.method == "HEAD" or end == start:
        return Response(b"", status_code=status, headers=headers, media_type=media_type)
    return StreamingResponse(
        stream_object(request, key, start, end),
        status_code=status,
        headers=headers,
        media_type=media_type,
    )


# --- PUT /content ----------------------------------------------------------


def spool_append(fd: int, hasher: Any, data: bytes) -> None:
    hasher.update(data)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


async def spool_body(request: Request, spool_dir: Path, limit: int) -> tuple[Path, int, str]:
    """Stream the body to a spool file while hashing it; memory stays bounded.

    Crossing ``limit`` aborts at once (413), whatever Content-Length claimed.
    On any failure the spool file is removed, so nothing can be published.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Files are limited to {limit} bytes")
    fd, name = await asyncio.to_thread(tempfile.mkstemp, dir=spool_dir, prefix="upload-")
    path = Path(name)
    hasher = hashlib.sha256()
    size = 0
    buf = bytearray()
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"Files are limited to {limit} bytes")
            buf += chunk
            if len(buf) >= SPOOL_WRITE_BYTES:
                data, buf = bytes(buf), bytearray()
                await asyncio.to_thread(spool_append, fd, hasher, data)
        if buf:
            await asyncio.to_thread(spool_append, fd, hasher, bytes(buf))
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path, size, hasher.hexdigest()


def upload_headers(request: Request) -> tuple[str | None, bool]:
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/octet-stream":
        raise ValidationError.single(
            "Content-Type", "invalid_content_type", "body must be application/octet-stream"
        )
    file_ctype = request.headers.get("x-file-content-type")
    if file_ctype is not None and (
        not 1 <= len(file_ctype) <= MAX_CONTENT_TYPE_CHARS or not _PRINTABLE.match(file_ctype)
    ):
        raise ValidationError.single(
            "X-File-Content-Type",
            "invalid_content_type",
            f"X-File-Content-Type must be 1-{MAX_CONTENT_TYPE_CHARS} printable characters",
        )
    return file_ctype, request.headers.get("x-file-executable") == "true"


@json_errors
async def put_content(request: Request) -> Response:
    st = state(request)
    path = query_path(request)
    file_ctype, executable = upload_headers(request)
    op_id = idempotency_key(request)
    # Authorize before reading a single body byte.
    _, folder, address = await retrying(st.pool, lambda c: open_folder(request, c, write=True))
    assert folder is not None
    try:
        spool, size, digest = await spool_body(
            request, st.settings.spool_dir, st.settings.max_file_bytes
        )
    except ClientDisconnect:
        log.info("upload of %r abandoned by the client; nothing published", path)
        return Response(status_code=400)
    key = object_key(address[0], digest)
    created_blob = False
    try:
        created_blob = await put_object(request, key, spool, size, digest)
        ensure = reupload_if_missing(request, spool, size, digest)
        result = await retrying(
            st.pool,
            lambda conn: apply.put_file(
                conn,
                folder,
                path=path,
                digest=digest,
                byte_size=size,
                executable=executable,
                content_type=file_ctype,
                operation_id=op_id,
                ensure_object=ensure,
                gc_delay=st.settings.gc_delay,
            ),
        )
    except BaseException:
        if created_blob:
            await journal_orphan(request, address[0], digest)
        raise
    finally:
        spool.unlink(missing_ok=True)
    status = 201 if result.pop("created", False) and result["applied"] else 200
    return JSONResponse(result, status_code=status)


async def put_object(request: Request, key: str, spool: Path, size: int, digest: str) -> bool:
    try:
        return await asyncio.to_thread(state(request).storage.put_file, key, spool, size, digest)
    except StorageUnavailable:
        raise
    except OSError as exc:
        raise StorageUnavailable(f"storing object failed: {exc}") from exc


def reupload_if_missing(
    request: Request, spool: Path, size: int, digest: str
) -> apply.EnsureObject:
    """Inside the commit, with the object's row locked: bring the bytes back if a
    GC sweep removed them after our upload (see ``apply.register_object``)."""

    async def ensure(key: str) -> None:
        if not await asyncio.to_thread(state(request).storage.exists, key):
            await put_object(request, key, spool, size, digest)

    return ensure


async def journal_orphan(request: Request, company_id: str, digest: str) -> None:
    """A stored object whose commit failed is queued for GC (which keeps it if referenced)."""
    try:
        async with connection(request) as conn:
            await apply.journal_deletion(
                conn, company_id, [digest], "orphaned upload", state(request).settings.gc_delay
            )
    except Exception:
        log.exception("could not journal orphaned object %s", digest)


# --- POST /operations ------------------------------------------------------

_OPERATION_FIELDS = {
    "mkdir": {"action", "path"},
    "delete": {"action", "path"},
    "restore": {"action", "fileId"},
    "purge": {"action", "fileId"},
}


@json_errors
async def post_operations(request: Request) -> Response:
    st = state(request)
    op_id = idempotency_key(request)
    body = await read_json(request)
    action = body.get("action")
    if action not in _OPERATION_FIELDS:
        raise ValidationError.single(
            "action", "invalid_action", "action must be mkdir, delete, restore or purge"
        )
    extra = set(body) - _OPERATION_FIELDS[action]
    missing = _OPERATION_FIELDS[action] - set(body)
    if extra or missing:
        raise ValidationError(
            [
                {"field": f, "code": "unexpected_field", "message": f"{f} is not allowed"}
                for f in sorted(extra)
            ]
            + [
                {"field": f, "code": "required", "message": f"{f} is required"}
                for f in sorted(missing)
            ]
        )

    async def operate(conn: AsyncConnection[Any]) -> dict[str, Any]:
        _, folder, _ = await open_folder(request, conn, write=True)
        assert folder is not None
        if action == "mkdir":
            return await apply.mkdir(
                conn, folder, path=validate_path(body["path"]), operation_id=op_id
            )
        if action == "delete":
            return await apply.delete_path(
                conn, folder, path=validate_path(body["path"]), operation_id=op_id
            )
        file_id = body["fileId"]
        if not isinstance(file_id, str):
            raise ValidationError.single("fileId", "invalid_uuid", "fileId must be a UUID")
        file_id = validate_uuid(file_id, "fileId")
        if action == "restore":
            return await apply.restore(conn, folder, file_id=file_id, operation_id=op_id)
        return await apply.purge(
            conn, folder, file_id=file_id, operation_id=op_id, gc_delay=st.settings.gc_delay
        )

    return JSONResponse(await retrying(st.pool, operate))


# --- GET /sync and POST /refresh -------------------------------------------

_RUN_COLUMN = {"task": "task_id", "agent": "agent_id", "project": "project_id", "user": "user_id"}


def run_json(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "runId": str(row["id"]),
        "agentId": str(row["agent_id"]),
        "state": row["state"],
        "lastSavedAt": apply.iso(row["last_saved_at"]),
        "error": row["error"],
        "finalCheckpointAt": apply.iso(row["final_checkpoint_at"]),
        "refreshRequested": bool(row["refresh_requested"]),
        "active": bool(row["active"]),
        "startedAt": apply.iso(row["started_at"]),
        "endedAt": apply.iso(row["ended_at"]),
    }


async def bound_runs(
    conn: AsyncConnection[Any], company_id: str, scope: str, owner_id: str
) -> list[dict[str, Any]]:
    cur = await conn.execute(
        f"SELECT * FROM runs WHERE company_id = %s AND {_RUN_COLUMN[scope]}::text = %s"
        " ORDER BY started_at DESC, id",
        (company_id, owner_id),
    )
    return list(await cur.fetchall())


@json_errors
async def get_sync(request: Request) -> Response:
    async with connection(request) as conn:
        _, folder, address = await open_folder(request, conn, write=False)
        runs = await bound_runs(conn, *address)
        return JSONResponse(
            {
                "runs": [run_json(r) for r in runs],
                "lastOperationAt": await folder_last_operation(conn, folder),
            }
        )


@json_errors
async def post_refresh(request: Request) -> Response:
    body = await read_json(request)
    run_id = body.get("runId")
    if not isinstance(run_id, str) or set(body) != {"runId"}:
        raise ValidationError.single("runId", "required", 'body must be {"runId": <uuid>}')
    run_id = validate_uuid(run_id, "runId")

    async def queue(conn: AsyncConnection[Any]) -> None:
        _, _, address = await open_folder(request, conn, write=True)
        runs = {str(r["id"]): r for r in await bound_runs(conn, *address)}
        run = runs.get(run_id)
        if run is None:
            raise RunNotFound()
        if not run["active"]:
            raise RunNotActive()
        await conn.execute("UPDATE runs SET refresh_requested = true WHERE id = %s", (run_id,))

    await retrying(state(request).pool, queue)
    return JSONResponse({"queued": True}, status_code=202)


BASE = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}"

routes = [
    Route(BASE, list_entries, methods=["GET"]),
    Route(BASE + "/", list_entries, methods=["GET"]),
    Route(BASE + "/content", get_content, methods=["GET", "HEAD"]),
    Route(BASE + "/content", put_content, methods=["PUT"]),
    Route(BASE + "/operations", post_operations, methods=["POST"]),
    Route(BASE + "/sync", get_sync, methods=["GET"]),
    Route(BASE + "/refresh", post_refresh, methods=["POST"]),
]
