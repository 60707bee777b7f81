"""Renames and moves inside one work folder, and what a move leaves behind.

A move keeps each row (its id, content, trash history) and rewrites its path
in one transaction under the folder lock. The old paths go to
``path_tombstones`` with versions drawn before the new paths' versions, so a
reader of "changes since" (the bridge manifest, the Files page's live
listing) sees the old path leave before the new one appears.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from common.errors import FileNotFound, MoveIntoItself, MoveTargetExists
from common.paths import parent_of, validate_path
from controller.foldercore import (
    LIVE_SUBTREE_SQL,
    Authority,
    Folder,
    Row,
    WritePolicy,
    check_restore_paths_free,
    committing,
    count_revived,
    ensure_parents,
    fingerprint,
    live_row,
    subtree_params,
    trash_batch,
)
from controller.rowjson import entry_json


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def moved_path(path: str, source: str, target: str) -> str:
    """``path`` (``source`` or below it) re-rooted at ``target``, checked against the path rules."""
    return validate_path(target + path[len(source) :], "to")


async def live_subtree(conn: AsyncConnection[Any], folder: Folder, root: str) -> list[Row]:
    cur = await conn.execute(
        f"SELECT * FROM ({LIVE_SUBTREE_SQL.format(columns='*')}) AS s ORDER BY path",
        subtree_params(folder.id, root),
    )
    return list(await cur.fetchall())


async def repath_rows(
    conn: AsyncConnection[Any], folder: Folder, moves: list[tuple[Row, str]], *, restore: bool
) -> list[Row]:
    """Give each row its new path and a fresh version (in new-path order).

    ``restore`` also takes the rows out of the trash.
    """
    moves = sorted(moves, key=lambda m: m[1])
    first = folder.counters.take(len(moves))
    revive = ", deleted_at = NULL, trash_root = NULL, updated_at = now()" if restore else ""
    cur = await conn.execute(
        "UPDATE files f SET path = t.np, parent = t.npar, version = t.v" + revive + ""
        " FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::bigint[]) AS t(id, np, npar, v)"
        " WHERE f.id = t.id RETURNING f.*",
        (
            [r["id"] for r, _ in moves],
            [p for _, p in moves],
            [parent_of(p) or "" for _, p in moves],
            [first + i for i in range(len(moves))],
        ),
    )
    return sorted(await cur.fetchall(), key=lambda r: r["path"])


async def bury_paths(conn: AsyncConnection[Any], folder: Folder, rows: list[Row]) -> None:
    """Record that ``rows`` left their paths (each gets a version of its own)."""
    first = folder.counters.take(len(rows))
    async with conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO path_tombstones (folder_id, path, parent, kind, digest, version)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            [
                (folder.id, r["path"], r["parent"], r["kind"], r["digest"], first + i)
                for i, r in enumerate(rows)
            ],
        )


async def move_subtree(conn: AsyncConnection[Any], folder: Folder, path: str, to: str) -> Row:
    """Move ``path`` (a file, or a directory with everything below it) to ``to``."""
    if to == path:
        raise MoveTargetExists(details=[{"path": to}])
    if is_within(to, path):
        raise MoveIntoItself(details=[{"path": path, "to": to}])
    rows = await live_subtree(conn, folder, path)
    if not rows:
        raise FileNotFound(details=[{"path": path}])
    if await live_row(conn, folder, to) is not None:
        raise MoveTargetExists(details=[{"path": to}])
    moves = [(r, moved_path(r["path"], path, to)) for r in rows]
    await ensure_parents(conn, folder, to)
    await bury_paths(conn, folder, rows)
    moved = await repath_rows(conn, folder, moves, restore=False)
    return {"applied": True, "files": [entry_json(r) for r in moved]}


async def move(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    path: str,
    to: str,
    operation_id: str | None,
    policy: WritePolicy,
    guard: Authority | None = None,
) -> dict[str, Any]:
    """A person's rename or move; the same Idempotency-Key replays the first
    answer. ``guard`` (the folder's own rules) runs under the folder lock first."""
    fp = fingerprint(action="move", path=path, to=to)
    async with committing(conn, folder, operation_id, fp, policy) as commit:
        if commit.replay is not None:
            return {**commit.replay, "applied": False}
        if guard is not None:
            await guard(conn)
        commit.result = await move_subtree(conn, folder, path, to)
    return commit.result


async def restore_as(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    file_id: str,
    to: str,
    operation_id: str | None,
    policy: WritePolicy,
) -> dict[str, Any]:
    """Restore a trash batch under another path: its top entry becomes ``to``.

    The way out of a restore collision: the batch's rows keep their ids and
    contents, re-rooted at ``to``; 409 ``restore_collision`` when one of the
    new paths is occupied too.
    """
    fp = fingerprint(action="restore", fileId=file_id, to=to)
    async with committing(conn, folder, operation_id, fp, policy) as commit:
        if commit.replay is not None:
            return {**commit.replay, "applied": False}
        batch = await trash_batch(conn, folder, file_id)
        root = batch[0]["path"]
        moves = [(r, moved_path(r["path"], root, to)) for r in batch]
        await check_restore_paths_free(conn, folder, [p for _, p in moves])
        await ensure_parents(conn, folder, to)
        rows = await repath_rows(conn, folder, moves, restore=True)
        count_revived(folder, rows)
        commit.result = {"applied": True, "files": [entry_json(r) for r in rows]}
    return commit.result
