"""Reading work folders: listing pages, the last operation time, the bridge's
manifest pages and which objects a folder references."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection

from common.errors import ResyncRequired
from controller.foldercore import Folder, Row
from controller.versions import folder_high_water


@dataclass(frozen=True)
class EntryPage:
    rows: list[Row]
    more: bool
    """True when rows past the last one exist (the caller hands out a cursor)."""
    last_operation_at: datetime | None
    total: int
    """Entries matching the same filters on every page together."""
    version: int
    """The folder's version read before the rows: a ``since`` for :func:`changes_since`."""


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


# An entry whose last segment contains %(name)s, case-insensitively; strpos,
# not LIKE: '%' and '_' are ordinary characters in names.
_NAME_MATCH = (
    "strpos(lower(substr(path, length(parent) + CASE WHEN parent = '' THEN 1"
    " ELSE 2 END)), lower(%(name)s)) > 0"
)


async def list_entries(
    conn: AsyncConnection[Any],
    folder: Folder | None,
    *,
    parent: str | None,
    trash: bool,
    limit: int,
    after: dict[str, Any] | None,
    name: str | None = None,
) -> EntryPage:
    """One page of live entries by path, or of trash entries newest first.

    ``after`` is the last entry of the previous page: ``{"p": path}`` for live
    entries, ``{"d": deleted_at, "p": path}`` for the trash. ``name`` keeps
    the entries whose last segment contains it (case-insensitive); it only
    narrows the scan, so the keyset order and cursors stay the same.

    A page reads its own rows, not the folder's, whatever the planner knows
    of the table (``test_folder_lookups``). The whole folder's live total
    is the folder's own counter (``live_entries``, kept by every write), and
    a page of the whole folder or of the trash is read with planner settings
    (:data:`_OWN_ROWS`) that leave no plan reading every row of the folder,
    or of the table: before the table's first ``ANALYZE`` the planner takes
    nearly every row for trash (``deleted_at IS NOT NULL``) and very few for
    a folder, and scanned the table for a page of the trash, counted it
    with a bitmap scan of the whole folder, and sorted the whole folder for
    a page of the listing. A directory's live page is left to the planner:
    its index (``files_children``) gives the order, and in a small folder a
    scan of the table is the cheaper plan.
    """
    rows: list[Row] = []
    total = 0
    if folder is None:
        version = await folder_high_water(conn, None)
    else:
        own_rows = _OWN_ROWS if trash or parent is None else ""
        cur = await conn.execute(
            f"SELECT version_counter, live_entries{own_rows} FROM folders WHERE id = %s",
            (folder.id,),
        )
        head = await cur.fetchone()
        if head is None:  # the folder was removed meanwhile: nothing to list
            return EntryPage([], False, None, 0, 0)
        version, live = int(head["version_counter"]), int(head["live_entries"])
        params: dict[str, Any] = {"fid": folder.id, "limit": limit + 1}
        where = ["folder_id = %(fid)s"]
        if parent is not None:
            where.append("parent = %(parent)s")
            params["parent"] = parent
        if name:
            where.append(_NAME_MATCH)
            params["name"] = name
        where.append("deleted_at IS NOT NULL" if trash else "deleted_at IS NULL")
        if parent is None and not name and not trash:
            total = live
        else:
            cur = await conn.execute(
                f"SELECT count(*) AS n FROM files WHERE {' AND '.join(where)}", params
            )
            counted = await cur.fetchone()
            total = 0 if counted is None else int(counted["n"])
        if trash:
            order = "deleted_at DESC, path"
            if after is not None:
                where.append(
                    "(deleted_at < %(cd)s::timestamptz OR"
                    " (deleted_at = %(cd)s::timestamptz AND path > %(cp)s))"
                )
                params.update(cd=after["d"], cp=after["p"])
        else:
            order = "path"
            if after is not None:
                where.append("path > %(cp)s")
                params["cp"] = after["p"]
        cur = await conn.execute(
            f"SELECT * FROM files WHERE {' AND '.join(where)} ORDER BY {order} LIMIT %(limit)s",
            params,
        )
        rows = list(await cur.fetchall())
    last_op = await last_operation_at(conn, folder)
    return EntryPage(rows[:limit], len(rows) > limit, last_op, total, version)


_OWN_ROWS = (
    ", set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),"
    " set_config('enable_sort', 'off', true), set_config('jit', 'off', true)"
)
"""Planner settings for the rest of a listing's transaction, read with the
folder's counters: no scan of the table and no bitmap scan (every index of
``files`` starts with the folder, and ``files_trash`` holds the trash
alone), no sort where an index gives the order (the live listing's, by
path, whose ``LIMIT`` then stops the scan; the trash's order has no index
and is sorted all the same, after a scan of the trash alone). A step the
planner is told to avoid is costed at 10^10, far past ``jit_above_cost``:
JIT stays off (as :func:`manifest_page` does)."""


@dataclass(frozen=True)
class Changes:
    version: int
    """The folder's newest version: pass it as ``since`` next time."""
    changed: bool


async def changes_since(
    conn: AsyncConnection[Any], folder: Folder | None, *, since: int, parent: str | None
) -> Changes:
    """Whether anything changed after version ``since`` (in directory ``parent`` only,
    when given: an entry there written, trashed, restored, moved in or moved out).

    Cheap enough to poll: an index range over the versions after ``since``.
    """
    high_water = await folder_high_water(conn, None if folder is None else folder.id)
    if folder is None or high_water <= since:
        return Changes(high_water, False)
    if parent is None:
        return Changes(high_water, True)
    cur = await conn.execute(
        "SELECT EXISTS (SELECT 1 FROM files WHERE folder_id = %(fid)s AND version > %(v)s"
        "  AND parent = %(p)s)"
        " OR EXISTS (SELECT 1 FROM path_tombstones WHERE folder_id = %(fid)s"
        "  AND version > %(v)s AND parent = %(p)s) AS changed",
        {"fid": folder.id, "v": since, "p": parent},
    )
    row = await cur.fetchone()
    return Changes(high_water, bool(row and row["changed"]))


@dataclass(frozen=True)
class DirChanges:
    """What changed in one directory after a version, for a listing on screen."""

    rows: list[Row]
    """Its entries written, trashed, restored or moved in after the version, in
    version order (trashed ones have ``deleted_at``), name-filtered like the listing."""
    gone: list[str]
    """Paths a move took out of it after the version."""
    complete: bool
    """False when more than the limit changed: the caller lists the directory again."""
    total: int
    """Its live entries matching the name filter, as a listing counts them."""


async def dir_changes(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    since: int,
    parent: str,
    name: str | None,
    limit: int,
) -> DirChanges:
    """The changes of directory ``parent`` after ``since`` (at most ``limit``
    rows and ``limit`` moved-out paths), so a listing on screen patches only
    what changed instead of fetching its pages again."""
    params: dict[str, Any] = {"fid": folder.id, "v": since, "p": parent, "limit": limit + 1}
    named = ""
    if name:
        named = " AND " + _NAME_MATCH
        params["name"] = name
    cur = await conn.execute(
        "SELECT * FROM files WHERE folder_id = %(fid)s AND version > %(v)s AND parent = %(p)s"
        f"{named} ORDER BY version LIMIT %(limit)s",
        params,
    )
    rows = list(await cur.fetchall())
    cur = await conn.execute(
        "SELECT path FROM path_tombstones WHERE folder_id = %(fid)s AND version > %(v)s"
        " AND parent = %(p)s ORDER BY version LIMIT %(limit)s",
        params,
    )
    gone = [str(r["path"]) for r in await cur.fetchall()]
    cur = await conn.execute(
        "SELECT count(*) AS n FROM files WHERE folder_id = %(fid)s AND parent = %(p)s"
        f" AND deleted_at IS NULL{named}",
        params,
    )
    counted = await cur.fetchone()
    complete = len(rows) <= limit and len(gone) <= limit
    total = 0 if counted is None else int(counted["n"])
    return DirChanges(rows[:limit], gone[:limit], complete, total)


async def folder_saves(conn: AsyncConnection[Any], folder: Folder | None) -> dict[str, datetime]:
    """When each run last saved a checkpoint of this folder (its sync baseline's time)."""
    if folder is None:
        return {}
    cur = await conn.execute(
        "SELECT run_id, updated_at FROM sync_baselines WHERE folder_id = %s", (folder.id,)
    )
    return {str(r["run_id"]): r["updated_at"] for r in await cur.fetchall()}


_MANIFEST_SQL = """
SELECT coalesce(json_agg(json_build_object(
           'path', path, 'kind', kind, 'digest', digest, 'byteSize', byte_size,
           'executable', executable, 'version', version, 'deleted', deleted)
       ORDER BY version) FILTER (WHERE n <= %(limit)s), '[]')::text AS entries,
       max(version) FILTER (WHERE n <= %(limit)s) AS last,
       count(*) > %(limit)s AS more
FROM (SELECT path, kind, digest, byte_size, executable, version,
             deleted_at IS NOT NULL AS deleted, row_number() OVER (ORDER BY version) AS n
      FROM ({page}) AS page) AS numbered
"""

_LIVE_PAGE = (
    "SELECT path, kind, digest, byte_size, executable, version, deleted_at FROM files"
    " WHERE folder_id = %(fid)s AND version > %(since)s AND deleted_at IS NULL"
    " ORDER BY version LIMIT %(limit)s + 1"
)
"""A full listing (``since`` 0): live rows only."""

_CHANGES_PAGE = (
    "(SELECT path, kind, digest, byte_size, executable, version, deleted_at FROM files"
    "  WHERE folder_id = %(fid)s AND version > %(since)s ORDER BY version LIMIT %(limit)s + 1)"
    " UNION ALL"
    " (SELECT path, kind, digest, 0, false, version, moved_at FROM path_tombstones"
    "  WHERE folder_id = %(fid)s AND version > %(since)s ORDER BY version LIMIT %(limit)s + 1)"
    " ORDER BY version LIMIT %(limit)s + 1"
)
"""Changes after ``since``: rows (trashed ones read as deletions) and the paths a
move took rows off (``path_tombstones``, controller/moves.py), also deletions."""


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
    # this transaction only) leave it the ordered index scan. A step it was
    # told to avoid is costed at 10^10, far past jit_above_cost: JIT stays off
    # (as on every pooled connection, controller.db.connection_options), or
    # each page is compiled for about 250 ms.
    cur = await conn.execute(
        "SELECT version_counter, purge_floor, set_config('enable_bitmapscan', 'off', true),"
        " set_config('enable_sort', 'off', true), set_config('jit', 'off', true)"
        " FROM folders WHERE id = %s",
        (folder.id,),
    )
    head = await cur.fetchone()
    assert head is not None
    high_water = int(head["version_counter"])
    if since > 0 and since < int(head["purge_floor"]):
        raise ResyncRequired()
    sql = _MANIFEST_SQL.format(page=_CHANGES_PAGE if since > 0 else _LIVE_PAGE)
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
