"""Task attachments: a task's original uploads and their working copies.

An original is stored once (content-addressed, like every file) and listed
with its task; it never changes. When a run of the task is prepared
(:func:`materialize`, at ``start-run``, on the controller: the sandbox stays
untrusted and needs no new route), each attachment not yet materialized
becomes an ordinary file of the task folder,
``attachments/<attachmentId>-<filename>``, referencing the same object. That
copy is the task's to edit, rename or delete: editing it writes a new object
and deleting it trashes the copy, while the original row keeps its digest.
A copy is made once per attachment (``materialized_at``), so a deleted copy
stays deleted; the original can always be downloaded again.

GC: an attachment's row references its object (``controller.gc``), so the
bytes outlive every copy.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection

from common.errors import AttachmentNotFound, InvalidPath
from common.paths import check_segment
from controller import foldercore
from controller.foldercore import Authority, EnsureObject, Row

ATTACHMENTS_DIR = "attachments"
COPY_PREFIX_BYTES = 37
"""``<uuid>-`` before the filename of a working copy."""
MAX_FILENAME_BYTES = 255 - COPY_PREFIX_BYTES
"""So that the working copy's name stays one valid path segment."""

_COLUMNS = "id, task_id, filename, digest, byte_size, content_type, created_by, created_at"


def validate_filename(name: str) -> str:
    """An attachment's filename: one valid path segment, short enough for its copy."""
    check_segment(name)
    size = len(name.encode("utf-8"))
    if size > MAX_FILENAME_BYTES:
        raise InvalidPath(
            "segment_too_long",
            f"an attachment's name is at most {MAX_FILENAME_BYTES} bytes; this one is {size}",
            "name",
        )
    return name


def copy_path(attachment_id: str, filename: str) -> str:
    """Where the attachment's working copy appears in the task folder."""
    return f"{ATTACHMENTS_DIR}/{attachment_id}-{filename}"


async def add(
    conn: AsyncConnection[Any],
    company_id: str,
    task_id: str,
    *,
    filename: str,
    digest: str,
    byte_size: int,
    content_type: str | None,
    created_by: str | None,
    ensure_object: EnsureObject,
    confirm: Authority,
    operation_id: str | None = None,
) -> tuple[Row, bool]:
    """Record an original whose bytes were stored (object lock and row as any
    write), after ``confirm`` re-checks the caller's authority in this
    transaction; the row, and whether this call added it.

    With an ``operation_id`` (``Idempotency-Key``) the request is remembered
    as an operation of the task's folder (``receipts``, under the folder
    lock): the same id with the same request answers the attachment it added
    (False), with another request :class:`IdempotencyConflict`. So a POST
    retried after a lost answer never adds a second attachment.
    """
    folder: foldercore.Folder | None = None
    fp = foldercore.fingerprint(
        action="attach", name=filename, digest=digest, byteSize=byte_size, contentType=content_type
    )
    if operation_id is not None:
        folder = await foldercore.get_folder(conn, company_id, "task", task_id, create=True)
        assert folder is not None
        # As every folder write: the folder lock, then the authority, then the receipt.
        await foldercore.lock_folder(conn, folder)
        await confirm(conn)
        replay = await foldercore.stored_result(conn, folder, operation_id, fp)
        if replay is not None:
            added = await get(conn, company_id, task_id, str(replay["attachmentId"]))
            if added is None:
                raise AttachmentNotFound()
            return added, False
    else:
        await confirm(conn)
    await foldercore.register_object(conn, company_id, digest, byte_size, ensure_object)
    cur = await conn.execute(
        "INSERT INTO task_attachments (id, company_id, task_id, filename, digest, byte_size,"
        f" content_type, created_by) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING {_COLUMNS}",
        (
            uuid.uuid4(),
            company_id,
            task_id,
            filename,
            digest,
            byte_size,
            content_type,
            created_by,
        ),
    )
    row: Row | None = await cur.fetchone()
    assert row is not None
    if operation_id is not None:
        assert folder is not None
        await foldercore.store_receipt(
            conn, folder, operation_id, fp, {"attachmentId": str(row["id"])}
        )
    return row, True


async def list_for_task(conn: AsyncConnection[Any], company_id: str, task_id: str) -> list[Row]:
    cur = await conn.execute(
        f"SELECT {_COLUMNS} FROM task_attachments WHERE company_id = %s AND task_id::text = %s"
        " ORDER BY created_at, id",
        (company_id, task_id),
    )
    return list(await cur.fetchall())


async def get(
    conn: AsyncConnection[Any], company_id: str, task_id: str, attachment_id: str
) -> Row | None:
    cur = await conn.execute(
        f"SELECT {_COLUMNS} FROM task_attachments"
        " WHERE company_id = %s AND task_id::text = %s AND id::text = %s",
        (company_id, task_id, attachment_id),
    )
    row: Row | None = await cur.fetchone()
    return row


async def _object_is_pinned(key: str) -> None:
    """The attachment's own row keeps its object from GC: nothing to re-upload."""


async def materialize(conn: AsyncConnection[Any], company_id: str, task_id: str) -> list[str]:
    """Working copies of the task's attachments not materialized yet; the
    paths created. A path already taken (by a file someone put there) is
    left alone and the attachment counts as materialized."""
    cur = await conn.execute(
        "SELECT id, filename, digest, byte_size, content_type FROM task_attachments"
        " WHERE company_id = %s AND task_id = %s AND materialized_at IS NULL"
        " ORDER BY created_at, id FOR UPDATE",
        (company_id, task_id),
    )
    pending = list(await cur.fetchall())
    if not pending:
        return []
    folder = await foldercore.get_folder(conn, company_id, "task", task_id, create=True)
    assert folder is not None
    await foldercore.lock_folder(conn, folder)
    created: list[str] = []
    for row in pending:
        path = copy_path(str(row["id"]), row["filename"])
        found = await foldercore.path_rows(conn, folder, path)
        if path not in found and all(r["kind"] == "directory" for r in found.values()):
            await foldercore.write_file(
                conn,
                folder,
                path=path,
                digest=row["digest"],
                byte_size=int(row["byte_size"]),
                executable=False,
                content_type=row["content_type"],
                ensure_object=_object_is_pinned,
                gc_delay=timedelta(0),  # nothing is replaced: the path is free
            )
            created.append(path)
    await folder.counters.store(conn, folder.id, touch=bool(created))
    await conn.execute(
        "UPDATE task_attachments SET materialized_at = now() WHERE id = ANY(%s)",
        ([r["id"] for r in pending],),
    )
    return created
