"""The work-folder REST API under /api/companies/{companyId}/work-folders/{scope}/{ownerId}."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from psycopg import AsyncConnection
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import (
    FileNotFound,
    IsADirectory,
    PayloadTooLarge,
    Unauthenticated,
    ValidationError,
    WorkFolderError,
)
from common.limits import (
    DEFAULT_PAGE_LIMIT,
    ENTRY_MAX_BYTES,
    MAX_CONTENT_TYPE_CHARS,
    MAX_PAGE_LIMIT,
    MAX_PREVIEW_BYTES,
)
from common.paths import validate_owner_id, validate_path, validate_scope, validate_uuid
from controller import agentfiles, foldercore, folders, moves, quotas, restwrites, runs
from controller.api.common import (
    BridgeIdentity,
    api_token,
    authenticate,
    bridge_identity,
    connection,
    json_errors,
    read_json,
    single_statements,
    state,
    transact,
    write_transaction,
)
from controller.api.limits import mark_authenticated
from controller.api.objects import (
    journal_orphan,
    object_response,
    put_object,
    reupload_if_missing,
    served_type,
    spool_body,
)
from controller.api.params import (
    decode_list_cursor,
    decode_trash_cursor,
    encode_cursor,
    idempotency_key,
    query_bool,
    query_int,
    strict_query,
)
from controller.api.serialize import run_json
from controller.auth import (
    Principal,
    authorize_folder,
    authorize_purge,
    check_token_write,
    token_principal,
    token_write_access,
    write_policy,
)
from controller.overwrite import parse_precondition
from controller.rowjson import entry_json, iso
from controller.storage.base import object_key

log = logging.getLogger(__name__)

_PRINTABLE = re.compile(r"^[\x20-\x7e]+$")
MAX_NAME_FILTER_CHARS = 255


# --- request parsing -------------------------------------------------------


def folder_address(request: Request) -> tuple[str, str, str]:
    p = request.path_params
    company_id = validate_uuid(p["companyId"], "companyId")
    scope = validate_scope(p["scope"])
    owner_id = validate_owner_id(scope, p["ownerId"])
    return company_id, scope, owner_id


def query_path(request: Request) -> str:
    values = strict_query(request, "path")
    if len(values) != 1:
        raise ValidationError.single("path", "required", "exactly one path query parameter")
    return validate_path(values[0])


async def open_folder(
    request: Request, conn: AsyncConnection[Any], *, write: bool
) -> tuple[Principal, foldercore.Folder | None, tuple[str, str, str]]:
    address = folder_address(request)
    principal = await authenticate(request, conn)
    await authorize_folder(conn, principal, *address, write=write)
    folder = await foldercore.get_folder(conn, *address, create=write)
    return principal, folder, address


# --- a run's saves of its agent folder through the API bridge ---------------


def own_agent_write(request: Request) -> BridgeIdentity | None:
    """The run, when this write is sandbox code's (through the API bridge) to
    the run's own agent folder: a save attempt of the run, which leaves a
    save receipt like its checkpoints."""
    ident = bridge_identity(request.scope)
    p = request.path_params
    if ident is None or p.get("scope") != "agent":
        return None
    if p.get("ownerId") != ident.agent_id or p.get("companyId") != ident.company_id:
        return None
    return ident


async def record_agent_save(
    request: Request,
    run: BridgeIdentity,
    operation_id: str | None,
    conn: AsyncConnection[Any] | None = None,
    *,
    files_changed: int = 0,
    refusal: WorkFolderError | None = None,
) -> None:
    """The receipt of ``run``'s API save of its agent folder: in the write's
    transaction (``conn``), or for a refusal in one of its own, since the
    write's rolled back; failing to record a refusal's is logged, never
    answered instead of the refusal."""

    async def record(c: AsyncConnection[Any]) -> None:
        folder = await foldercore.get_folder(c, run.company_id, "agent", run.agent_id, create=False)
        await agentfiles.record_api_save(
            c,
            folder,
            run_id=run.run_id,
            company_id=run.company_id,
            agent_id=run.agent_id,
            operation_id=operation_id,
            limits=state(request).settings.quotas.agent,
            files_changed=files_changed,
            refusal=refusal,
        )

    if conn is not None:
        await record(conn)
        return
    try:
        async with connection(request) as own:
            await record(own)
    except WorkFolderError as exc:
        log.warning("could not record the receipt of a refused agent-folder save: %s", exc)


def receipt_key(request: Request) -> str | None:
    """The operation id a save receipt names: the ``Idempotency-Key`` as sent,
    also when the request is refused for it (unless it could never be one)."""
    key = request.headers.get("idempotency-key")
    return key if key is not None and 1 <= len(key) <= 256 else None


@asynccontextmanager
async def agent_save_receipts(
    request: Request, operation_id: str | None
) -> AsyncIterator[BridgeIdentity | None]:
    """Around a write: when it is a run's save of its own agent folder, a
    refusal records its receipt (the body records the saved one)."""
    run = own_agent_write(request)
    try:
        yield run
    except WorkFolderError as exc:
        # A 401: the run ended (or was superseded) while the call was on its way.
        if run is not None and not isinstance(exc, Unauthenticated):
            await record_agent_save(request, run, operation_id, refusal=exc)
        raise


# --- GET / -----------------------------------------------------------------


@json_errors
async def list_entries(request: Request) -> Response:
    trash = query_bool(request, "trash")
    limit = query_int(
        request,
        "limit",
        DEFAULT_PAGE_LIMIT,
        minimum=1,
        maximum=MAX_PAGE_LIMIT,
        code="invalid_limit",
    )
    cursors = strict_query(request, "cursor")
    after: dict[str, Any] | None = None
    if cursors and trash:
        deleted_at, last_path = decode_trash_cursor(cursors[0])
        after = {"d": deleted_at, "p": last_path}
    elif cursors:
        after = {"p": decode_list_cursor(cursors[0])}
    parent = query_dir(request)
    name = query_name(request)

    async with connection(request) as conn:
        _, folder, _ = await open_folder(request, conn, write=False)
        page = await folders.list_entries(
            conn, folder, parent=parent, trash=trash, limit=limit, after=after, name=name
        )
    next_cursor = None
    if page.more:
        last = page.rows[-1]
        next_cursor = encode_cursor(
            {"d": last["deleted_at"].isoformat(), "p": last["path"]}
            if trash
            else {"p": last["path"]}
        )
    return JSONResponse(
        {
            "entries": [entry_json(r) for r in page.rows],
            "nextCursor": next_cursor,
            "lastOperationAt": iso(page.last_operation_at),
            "total": page.total,
            "version": page.version,
        }
    )


def query_dir(request: Request) -> str | None:
    """``dir``: None (the whole folder), "" (the top level) or a directory path."""
    dirs = strict_query(request, "dir")
    if len(dirs) > 1:
        raise ValidationError.single("dir", "invalid_path", "at most one dir query parameter")
    if not dirs:
        return None
    return "" if dirs[0] == "" else validate_path(dirs[0], "dir")


def query_name(request: Request) -> str | None:
    values = strict_query(request, "name")
    if len(values) > 1 or (values and len(values[0]) > MAX_NAME_FILTER_CHARS):
        raise ValidationError.single(
            "name",
            "invalid_name_filter",
            f"at most one name filter of at most {MAX_NAME_FILTER_CHARS} characters",
        )
    if values and any(ord(c) < 0x20 or ord(c) == 0x7F for c in values[0]):
        raise ValidationError.single(
            "name", "invalid_name_filter", "the name filter may not hold control characters"
        )
    return values[0] if values and values[0] else None


# --- GET /changes ------------------------------------------------------------


@json_errors
async def get_changes(request: Request) -> Response:
    since = query_int(request, "since", 0, minimum=0, maximum=2**63 - 1, code="invalid_integer")
    parent = query_dir(request)
    with_entries = query_bool(request, "entries")
    name = query_name(request)
    if with_entries and parent is None:
        raise ValidationError.single("dir", "required", "entries=true needs a dir")
    async with connection(request) as conn:
        _, folder, _ = await open_folder(request, conn, write=False)
        changes = await folders.changes_since(conn, folder, since=since, parent=parent)
        answer: dict[str, Any] = {"version": changes.version, "changed": changes.changed}
        if with_entries and changes.changed and folder is not None and parent is not None:
            found = await folders.dir_changes(
                conn, folder, since=since, parent=parent, name=name, limit=DEFAULT_PAGE_LIMIT
            )
            answer.update(
                entries=[entry_json(r) for r in found.rows],
                gone=found.gone,
                complete=found.complete,
                total=found.total,
                lastOperationAt=iso(await folders.last_operation_at(conn, folder)),
            )
    return JSONResponse(answer)


# --- GET /content ----------------------------------------------------------


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
        row = None if folder is None else await foldercore.live_row(conn, folder, path)
    if row is None:
        raise FileNotFound()
    if row["kind"] == "directory":
        raise IsADirectory()
    size = int(row["byte_size"])
    if preview and size > MAX_PREVIEW_BYTES:
        raise PayloadTooLarge(f"Previews are limited to {MAX_PREVIEW_BYTES} bytes")
    key = object_key(address[0], row["digest"])
    media_type = served_type(row["content_type"])
    return await object_response(request, key, size, content_headers(row), media_type)


# --- PUT /content ----------------------------------------------------------


def upload_headers(request: Request) -> tuple[str | None, bool]:
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/octet-stream":
        raise ValidationError.single(
            "Content-Type", "invalid_content_type", "body must be application/octet-stream"
        )
    file_ctype = request.headers.get("x-file-content-type")
    if file_ctype is not None and (
        not 1 <= len(file_ctype) <= MAX_CONTENT_TYPE_CHARS or not _PRINTABLE.fullmatch(file_ctype)
    ):
        raise ValidationError.single(
            "X-File-Content-Type",
            "invalid_content_type",
            f"X-File-Content-Type must be 1-{MAX_CONTENT_TYPE_CHARS} printable characters",
        )
    return file_ctype, request.headers.get("x-file-executable") == "true"


async def authorize_upload(
    request: Request,
) -> tuple[tuple[Principal, foldercore.Folder, tuple[str, str, str]], foldercore.StoreMark]:
    """Authorize an upload before reading a single body byte, and take the
    store mark (before the bytes are stored; see foldercore.upsert_objects)
    in the same round trip.

    With a person's API token that is one statement and no transaction
    (:func:`controller.auth.token_write_access`) while the folder exists;
    every other credential, and a folder's first write (which creates it),
    take :func:`open_folder`'s way, in a transaction."""
    address = folder_address(request)
    token = api_token(request)
    if token is not None:
        async with single_statements(request) as conn:
            access = await token_write_access(conn, token, *address)
        if access is None:
            raise Unauthenticated()
        principal = token_principal(access)
        mark_authenticated(request)
        await check_token_write(access, principal, *address[1:])
        if access["folder_id"] is not None:
            folder = foldercore.Folder(int(access["folder_id"]), *address)
            return (principal, folder, address), foldercore.StoreMark(int(access["mark"]))

    async def authorize(
        c: AsyncConnection[Any],
    ) -> tuple[
        tuple[Principal, foldercore.Folder | None, tuple[str, str, str]], foldercore.StoreMark
    ]:
        opened = await open_folder(request, c, write=True)
        return opened, await foldercore.take_store_mark(c)

    (principal, opened, address), mark = await write_transaction(request, authorize)
    assert opened is not None
    return (principal, opened, address), mark


@json_errors
async def put_content(request: Request) -> Response:
    async with agent_save_receipts(request, receipt_key(request)) as run:
        return await _put_content(request, run)


async def _put_content(request: Request, run: BridgeIdentity | None) -> Response:
    st = state(request)
    path = query_path(request)
    file_ctype, executable = upload_headers(request)
    precondition = parse_precondition(
        request.headers.get("if-match"),
        request.headers.get("if-none-match"),
        request.headers.get("x-base-digest"),
    )
    op_id = idempotency_key(request)

    (principal, folder, address), mark = await authorize_upload(request)
    company_id, scope, owner_id = address
    policy = write_policy(principal, company_id, scope, owner_id, st.settings.quotas)
    try:
        body = await spool_body(request, st.settings.spool_dir, st.settings.max_file_bytes)
    except ClientDisconnect:
        log.info("upload of %r abandoned by the client; nothing published", path)
        if run is not None:
            gone = ValidationError.single("body", "client_disconnected", "the body never arrived")
            await record_agent_save(request, run, op_id, refusal=gone)
        return Response(status_code=400)
    size, digest = body.size, body.digest
    key = object_key(address[0], digest)
    created_blob = False
    guard = None
    try:
        if scope == "agent":
            # Whether these bytes could be the agent's instruction entry; the
            # entry's path is read at commit, under the folder lock.
            small = size <= ENTRY_MAX_BYTES
            problem = agentfiles.text_problem(await body.prefix(size) if small else None, size)

            async def guard(conn: AsyncConnection[Any]) -> None:
                await agentfiles.guard_entry_write(conn, company_id, owner_id, path, problem)

        async with quotas.reserved(
            transact(request), address[0], None, {digest: size}, st.settings.quotas
        ) as reservation:
            created_blob = await put_object(request, key, body)
            ensure = reupload_if_missing(request, body)

            async def put(conn: AsyncConnection[Any]) -> dict[str, Any]:
                await quotas.settle(conn, reservation)
                written = await restwrites.put_file(
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
                    policy=policy,
                    precondition=precondition,
                    guard=guard,
                    stored_after=mark,
                )
                if run is not None:
                    changed = 1 if written["applied"] else 0
                    await record_agent_save(request, run, op_id, conn, files_changed=changed)
                return written

            # Pipeline mode: put's statements are audited for it (no rowcount,
            # no error expected at a statement whose answer is not read).
            result = await write_transaction(request, put, pipeline=True)
        if created_blob and not result["applied"]:
            # A replay wrote nothing: bytes it stored anew (a sweep had taken
            # them since the first try) are referenced by nothing it did.
            await journal_orphan(request, address[0], digest)
    except BaseException:
        if created_blob:
            await journal_orphan(request, address[0], digest)
        raise
    finally:
        body.discard()
    status = 201 if result.pop("created", False) and result["applied"] else 200
    return JSONResponse(result, status_code=status)


# --- POST /operations ------------------------------------------------------

_OPERATION_FIELDS = {
    "mkdir": {"action", "path"},
    "delete": {"action", "path"},
    "move": {"action", "path", "to"},
    "restore": {"action", "fileId"},
    "purge": {"action", "fileId"},
}


@json_errors
async def post_operations(request: Request) -> Response:
    op_id = receipt_key(request)
    async with agent_save_receipts(request, op_id) as run:
        return await _post_operations(request, run)


async def _post_operations(request: Request, run: BridgeIdentity | None) -> Response:
    st = state(request)
    op_id = idempotency_key(request)
    body = await read_json(request)
    action = body.get("action")
    if not isinstance(action, str) or action not in _OPERATION_FIELDS:
        raise ValidationError.single(
            "action", "invalid_action", "action must be mkdir, delete, move, restore or purge"
        )
    # restore may name a new path for the batch ("restore as").
    extra = set(body) - _OPERATION_FIELDS[action] - ({"to"} if action == "restore" else set())
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
        principal, folder, (company_id, scope, owner_id) = await open_folder(
            request, conn, write=True
        )
        assert folder is not None
        if action == "purge":
            authorize_purge(principal)
        policy = write_policy(principal, company_id, scope, owner_id, st.settings.quotas)
        guard = None
        if scope == "agent" and action in ("delete", "move"):
            path = validate_path(body["path"])

            async def guard(c: AsyncConnection[Any]) -> None:
                await agentfiles.guard_entry_removal(c, company_id, owner_id, path)

        if action == "mkdir":
            return await restwrites.mkdir(
                conn, folder, path=validate_path(body["path"]), operation_id=op_id, policy=policy
            )
        elif action == "delete":
            return await restwrites.delete_path(
                conn,
                folder,
                path=validate_path(body["path"]),
                operation_id=op_id,
                policy=policy,
                guard=guard,
            )
        elif action == "move":
            return await moves.move(
                conn,
                folder,
                path=validate_path(body["path"]),
                to=body_path(body, "to"),
                operation_id=op_id,
                policy=policy,
                guard=guard,
            )
        else:
            file_id = body["fileId"]
            if not isinstance(file_id, str):
                raise ValidationError.single("fileId", "invalid_uuid", "fileId must be a UUID")
            file_id = validate_uuid(file_id, "fileId")
            if action == "restore" and "to" in body:
                return await moves.restore_as(
                    conn,
                    folder,
                    file_id=file_id,
                    to=body_path(body, "to"),
                    operation_id=op_id,
                    policy=policy,
                )
            if action == "restore":
                return await restwrites.restore(
                    conn, folder, file_id=file_id, operation_id=op_id, policy=policy
                )
            else:
                return await restwrites.purge(
                    conn,
                    folder,
                    file_id=file_id,
                    operation_id=op_id,
                    gc_delay=st.settings.gc_delay,
                    policy=policy,
                )

    async def operate_and_record(conn: AsyncConnection[Any]) -> dict[str, Any]:
        result = await operate(conn)
        if run is not None:
            changed = len(result.get("files") or []) if result.get("applied") else 0
            await record_agent_save(request, run, op_id, conn, files_changed=changed)
        return result

    return JSONResponse(await write_transaction(request, operate_and_record))


def body_path(body: dict[str, Any], field: str) -> str:
    value = body[field]
    if not isinstance(value, str):
        raise ValidationError.single(field, "invalid_path", f"{field} must be a path string")
    return validate_path(value, field)


# --- GET /sync and POST /refresh -------------------------------------------


@json_errors
async def get_sync(request: Request) -> Response:
    async with connection(request) as conn:
        _, folder, address = await open_folder(request, conn, write=False)
        sync = await runs.sync_status(conn, folder, *address)
        baselines = await folders.folder_saves(conn, folder)
    _, scope, owner_id = address
    out = []
    for row in sync.runs:
        run_id = str(row["id"])
        saves = sync.saves.get(run_id, [])
        saved_at = baselines.get(run_id)
        out.append(
            run_json(
                row,
                state=runs.run_state(row, saves),
                folder=runs.folder_state(row, scope, owner_id, saves, saved_at),
                folder_saved_at=saved_at,
            )
        )
    return JSONResponse({"runs": out, "lastOperationAt": iso(sync.last_operation_at)})


@json_errors
async def post_refresh(request: Request) -> Response:
    body = await read_json(request)
    run_id = body.get("runId")
    if not isinstance(run_id, str) or set(body) != {"runId"}:
        raise ValidationError.single("runId", "required", 'body must be {"runId": <uuid>}')
    run_id = validate_uuid(run_id, "runId")

    async def queue(conn: AsyncConnection[Any]) -> None:
        _, _, address = await open_folder(request, conn, write=True)
        await runs.request_refresh(conn, *address, run_id)

    await write_transaction(request, queue)
    return JSONResponse({"queued": True}, status_code=202)


BASE = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}"

routes = [
    Route(BASE, list_entries, methods=["GET"]),
    Route(BASE + "/", list_entries, methods=["GET"]),
    Route(BASE + "/content", get_content, methods=["GET", "HEAD"]),
    Route(BASE + "/content", put_content, methods=["PUT"]),
    Route(BASE + "/operations", post_operations, methods=["POST"]),
    Route(BASE + "/changes", get_changes, methods=["GET"]),
    Route(BASE + "/sync", get_sync, methods=["GET"]),
    Route(BASE + "/refresh", post_refresh, methods=["POST"]),
]
