"""Reading work folders: listing pages, the last operation time, the bridge's
manifest pages and which objects a folder references."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection

from common.errors import ResyncRequired
from controller.apply import Folder, Row


@dataclass(frozen=True)
class EntryPage:
    rows: list[Row]
    more: bool
    """True when rows past the last one exist (the caller hands out a cursor)."""
    last_operation_at: datetime | None


@dataclass(frozen=True)
class ManifestPage:
    entries_json: str
    """The page's entries as a JSON array, in version order (wire format of
    :mod:`common.bridge`)."""
    last_version: int | None
    """The version of the page's last entry (None for an empty page)."""
    more: bool
    """True when entries past the last one exist (the caller hands out ``nextSince``)."""
    high_water: int
    """The folder's version counter before the page was read."""


async def last_operation_at(conn: AsyncConnection[Any], folder: Folder | None) -> datetime | None:
    if folder is None:
        return None
    cur = await conn.execute("SELECT last_operation_at FROM folders WHERE id = %s", (folder.id,))
    row = await cur.fetchone()
    return row["last_operation_at"] if row else None


async def list_entries(
    conn: AsyncConnection[Any],
    folder: Folder | None,
    *,
    parent: str | None,
    trash: bool,
    limit: int,
    after: dict[str, Any] | None,
) -> EntryPage:
    """One page of live entries by path, or of trash entries newest first.

    ``after`` is the last entry of the previous page: ``{"p": path}`` for live
    entries, ``{"d": deleted_at, "p": path}`` for the trash.
    """
    rows: list[Row] = []
    if folder is not None:
        params: dict[str, Any] = {"fid": folder.id, "limit": limit + 1}
        where = ["folder_id = %(fid)s"]
        if parent is not None:
            where.append("parent = %(parent)s")
            params["parent"] = parent
        if trash:
            where.append("deleted_at IS NOT NULL")
            order = "deleted_at DESC, path"
            if after is not None:
                where.append(
                    "(deleted_at < %(cd)s::timestamptz OR"
                    " (deleted_at = %(cd)s::timestamptz AND path > %(cp)s))"
                )
                params.update(cd=after["d"], cp=after["p"])
        else:
            where.append("deleted_at IS NULL")
            order = "path"
            if after is not None:
                where.append("path > %(cp)s")
                params["cp"] = after["p"]
        cur = await conn.execute(
            f"SELECT * FROM files WHERE {' AND '.join(where)} ORDER BY {order} LIMIT %(limit)s",
            params,
        )
        rows = list(await cur.fetchall())
    return EntryPage(rows[:limit], len(rows) > limit, await last_operation_at(conn, folder))


_MANIFEST_SQL = """
SELECT coalesce(json_agg(json_build_object(
           'path', path, 'kind', kind, 'digest', digest, 'byteSize', byte_size,
           'executable', executable, 'version', version, 'deleted', deleted)
       ORDER BY version) FILTER (WHERE n <= %(limit)s), '[]')::text AS entries,
       max(version) FILTER (WHERE n <= %(limit)s) AS last,
       count(*) > %(limit)s AS more
FROM (SELECT path, kind, digest, byte_size, executable, version,
             deleted_at IS NOT NULL AS deleted, row_number() OVER (ORDER BY version) AS n
      FROM (SELECT * FROM files WHERE folder_id = %(fid)s AND version > %(since)s {live}
            ORDER BY version LIMIT %(limit)s + 1) AS page) AS numbered
"""


async def manifest_page(
    conn: AsyncConnection[Any], folder: Folder | None, *, since: int, limit: int
) -> ManifestPage:
    """Entries changed after version ``since`` in version order (a full listing
    of live entries when ``since`` is 0). ResyncRequired when a purge removed
    versions past ``since``.

    Keyset paging on ``(folder_id, version)`` (index ``files_folder_version``):
    each page starts where the last one ended, whatever its depth. PostgreSQL
    builds the page's JSON itself, so a 5,000-entry page costs the controller
    no Python work per entry.
    """
    if folder is None:
        return ManifestPage("[]", None, False, 0)
    # The page must walk files_folder_version in order and stop at the limit.
    # Right after a large checkpoint, before autovacuum's ANALYZE, the planner
    # guesses a handful of rows and would rather read every row of the folder
    # with a bitmap scan and sort them, once per page; these settings (for
    # this transaction only) leave it the ordered index scan.
    cur = await conn.execute(
        "SELECT version_counter, purge_floor, set_config('enable_bitmapscan', 'off', true),"
        " set_config('enable_sort', 'off', true) FROM folders WHERE id = %s",
        (folder.id,),
    )
    head = await cur.fetchone()
    assert head is not None
    high_water = int(head["version_counter"])
    if since > 0 and since < int(head["purge_floor"]):
        raise ResyncRequired()
    sql = _MANIFEST_SQL.format(live="" if since > 0 else "AND deleted_at IS NULL")
    cur = await conn.execute(sql, {"fid": folder.id, "since": since, "limit": limit})
    row = await cur.fetchone()
    assert row is not None
    last = None if row["last"] is None else int(row["last"])
    return ManifestPage(row["entries"], last, bool(row["more"]), high_water)


async def referenced_object_size(
    conn: AsyncConnection[Any], folder: Folder, digest: str
) -> int | None:
    """The size of ``digest`` when one of this folder's files (live or trashed)
    references it; None otherwise."""
    cur = await conn.execute(
        "SELECT byte_size FROM files WHERE folder_id = %s AND digest = %s LIMIT 1",
        (folder.id, digest),
    )
    row = await cur.fetchone()
    return None if row is None else int(row["byte_size"])
