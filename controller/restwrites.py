"""People's single writes to a work folder: put, mkdir, delete, restore, purge.

Each is one operation of the REST API (and so of the Files page), run in
the caller's transaction through :func:`controller.foldercore.committing`:
the folder lock, authority re-checked, the receipt of its operation id (a
replay returns the stored answer with ``applied`` false), the limits, then
the answer stored. Renames and moves are :mod:`controller.moves`; a
sandbox's checkpoint is :mod:`controller.checkpoint`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection

from common.errors import FileNotFound
from controller.foldercore import (
    Authority,
    EnsureObject,
    Folder,
    PendingObject,
    Row,
    StoreMark,
    WritePolicy,
    check_restore_paths_free,
    committing,
    count_revived,
    ensure_parents,
    fingerprint,
    journal_deletion,
    make_directory,
    path_rows_query,
    rows_by_path,
    trash_batch,
    trash_path,
    write_file,
)
from controller.overwrite import Precondition, check_precondition, keep_replaced
from controller.rowjson import entry_json


def _replayed(result: dict[str, Any]) -> dict[str, Any]:
    return {**result, "applied": False}


async def put_file(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    path: str,
    digest: str,
    byte_size: int,
    executable: bool,
    content_type: str | None,
    operation_id: str | None,
    ensure_object: EnsureObject,
    gc_delay: timedelta,
    policy: WritePolicy,
    precondition: Precondition | None = None,
    guard: Authority | None = None,
    stored_after: StoreMark | None = None,
) -> dict[str, Any]:
    """A person's upload (server-accepted last-write-wins). Caller owns the transaction.

    ``precondition`` is checked under the folder lock, then ``guard`` (the
    folder's own rules for this path, e.g. the agent's instruction entry); a
    replaced file's old content goes to the trash (:mod:`controller.overwrite`).
    """
    fp = fingerprint(
        action="put",
        path=path,
        kind="file",
        digest=digest,
        executable=executable,
        contentType=content_type,
    )
    # The path and its parents in one query, sent with the folder lock; the
    # trash copy that keep_replaced adds is not live, so these rows stay what
    # write_file needs. The object is registered in that round trip too, so
    # that the row's statements need no answer of their own before the COMMIT.
    ahead = path_rows_query(folder, path)
    pending = PendingObject(digest, byte_size, stored_after)
    async with committing(
        conn, folder, operation_id, fp, policy, ahead=ahead, register=pending
    ) as commit:
        if commit.replay is not None:
            return _replayed(commit.replay)
        assert commit.ahead is not None
        found = await rows_by_path(commit.ahead)
        existing = found.get(path)
        check_precondition(existing, path, precondition)
        if guard is not None:
            await guard(conn)
        await keep_replaced(conn, folder, existing, digest)
        row, created = await write_file(
            conn,
            folder,
            path=path,
            digest=digest,
            byte_size=byte_size,
            executable=executable,
            content_type=content_type,
            ensure_object=ensure_object,
            gc_delay=gc_delay,
            found=found,
            stored_after=stored_after,
            registered=commit.registered,
        )
        commit.result = {"applied": True, "created": created, "file": entry_json(row)}
    return commit.result


async def mkdir(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    path: str,
    operation_id: str | None,
    policy: WritePolicy,
) -> dict[str, Any]:
    fp = fingerprint(action="mkdir", path=path, kind="directory")
    async with committing(conn, folder, operation_id, fp, policy) as commit:
        if commit.replay is not None:
            return _replayed(commit.replay)
        row, created = await make_directory(conn, folder, path)
        commit.result = {"applied": created, "files": [entry_json(row)]}
        commit.touch = created
    return commit.result


async def delete_path(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    path: str,
    operation_id: str | None,
    policy: WritePolicy,
    guard: Authority | None = None,
) -> dict[str, Any]:
    """A person's delete: the subtree goes to trash; a missing path is 404.
    ``guard`` (the folder's own rules) runs under the folder lock first."""
    fp = fingerprint(action="delete", path=path)
    async with committing(conn, folder, operation_id, fp, policy) as commit:
        if commit.replay is not None:
            return _replayed(commit.replay)
        if guard is not None:
            await guard(conn)
        rows = await trash_path(conn, folder, path)
        if rows is None:
            raise FileNotFound(details=[{"path": path}])
        commit.result = {"applied": True, "files": [entry_json(r) for r in rows]}
    return commit.result


async def restore(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    file_id: str,
    operation_id: str | None,
    policy: WritePolicy,
) -> dict[str, Any]:
    fp = fingerprint(action="restore", fileId=file_id)
    async with committing(conn, folder, operation_id, fp, policy) as commit:
        if commit.replay is not None:
            return _replayed(commit.replay)
        commit.result = await _restore_batch(conn, folder, file_id)
    return commit.result


async def _restore_batch(conn: AsyncConnection[Any], folder: Folder, file_id: str) -> Row:
    batch = await trash_batch(conn, folder, file_id)
    await check_restore_paths_free(conn, folder, [r["path"] for r in batch])
    await ensure_parents(conn, folder, batch[0]["path"])
    cur = await conn.execute(
        "UPDATE files f SET deleted_at = NULL, trash_root = NULL, version = %s + t.n,"
        " updated_at = now()"
        " FROM (SELECT id, row_number() OVER (ORDER BY path) AS n FROM files"
        "  WHERE id = ANY(%s)) AS t"
        " WHERE f.id = t.id RETURNING f.*",
        (folder.counters.base(), [r["id"] for r in batch]),
    )
    rows = sorted(await cur.fetchall(), key=lambda r: r["path"])
    folder.counters.take(len(rows))
    count_revived(folder, rows)
    return {"applied": True, "files": [entry_json(r) for r in rows]}


async def purge(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    file_id: str,
    operation_id: str | None,
    gc_delay: timedelta,
    policy: WritePolicy,
) -> dict[str, Any]:
    """Remove a trashed subtree for good and journal its objects for GC."""
    fp = fingerprint(action="purge", fileId=file_id)
    async with committing(conn, folder, operation_id, fp, policy) as commit:
        if commit.replay is not None:
            return _replayed(commit.replay)
        batch = await trash_batch(conn, folder, file_id)
        await conn.execute("DELETE FROM files WHERE id = ANY(%s)", ([r["id"] for r in batch],))
        await conn.execute(
            "UPDATE folders SET purge_floor = %s WHERE id = %s",
            (folder.counters.take(), folder.id),
        )
        digests = [r["digest"] for r in batch if r["digest"]]
        await journal_deletion(conn, folder.company_id, digests, "purged", gc_delay)
        commit.result = {"applied": True, "purged": len(batch)}
    return commit.result
