"""Controller-side quotas: what one tenant or run may cost, checked at commit.

fsagent keeps its own limits, but the sandbox is untrusted: each rule here is
enforced by the controller inside the transaction (or, for bytes, before the
upload is accepted), so a modified agent gains nothing by skipping them.
Defaults live in :class:`controller.config.Quotas`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from psycopg import AsyncConnection

from common.errors import (
    CheckpointRowLimit,
    FolderEntryLimit,
    StorageQuotaExceeded,
    UploadQuotaExceeded,
)
from common.paths import ancestors
from controller.config import Quotas


async def check_folder_entries(conn: AsyncConnection[Any], folder_id: int, limit: int) -> None:
    """After a write that may add rows, under the folder lock: at most ``limit``
    live entries. Counting stops at ``limit + 1`` rows, so the cost is bounded."""
    cur = await conn.execute(
        "SELECT count(*) AS n FROM (SELECT 1 FROM files"
        " WHERE folder_id = %s AND deleted_at IS NULL LIMIT %s) AS live",
        (folder_id, limit + 1),
    )
    row = await cur.fetchone()
    assert row is not None
    if int(row["n"]) > limit:
        raise FolderEntryLimit(
            f"A folder holds at most {limit} entries", details=[{"limit": limit}]
        )


def checkpoint_row_bound(paths: Iterable[str]) -> int:
    """How many rows a checkpoint naming ``paths`` can create at most: each
    path and each of its ancestors once (a deep path makes one row per level)."""
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        seen.update(ancestors(path))
    return len(seen)


def check_checkpoint_rows(paths: Iterable[str], limit: int) -> None:
    """Refuse, before any database work, a checkpoint that could write too many rows."""
    bound = checkpoint_row_bound(paths)
    if bound > limit:
        raise CheckpointRowLimit(
            f"A checkpoint may create at most {limit} rows; this one could create {bound}",
            details=[{"limit": limit, "rows": bound}],
        )


PENDING_UPLOADS_SQL = """
SELECT coalesce(sum(u.byte_size), 0) AS pending FROM run_uploads u
WHERE u.run_id = %(run)s AND u.committed_at IS NULL
  AND u.created_at > now() - make_interval(secs => %(ttl)s)
"""


async def check_pending_uploads(
    conn: AsyncConnection[Any], run_id: str, size: int, *, limit: int, ttl: float
) -> None:
    """A run may keep at most ``limit`` uploaded bytes that no checkpoint has
    committed yet; older uploads expire after ``ttl`` seconds and stop counting."""
    cur = await conn.execute(PENDING_UPLOADS_SQL, {"run": run_id, "ttl": ttl})
    row = await cur.fetchone()
    pending = int(row["pending"]) if row else 0
    if pending + size > limit:
        raise UploadQuotaExceeded(
            f"At most {limit} uploaded bytes may wait for a checkpoint",
            details=[{"limit": limit, "pending": pending}],
        )


async def check_company_storage(
    conn: AsyncConnection[Any], company_id: str, digest: str, size: int, *, limit: int
) -> None:
    """The optional per-company storage quota (``limit`` 0 = off). Bytes the
    company already stores under ``digest`` cost nothing again."""
    if limit <= 0:
        return
    cur = await conn.execute(
        "SELECT coalesce(sum(byte_size), 0) AS used,"
        " bool_or(digest = %s) AS present FROM objects WHERE company_id = %s",
        (digest, company_id),
    )
    row = await cur.fetchone()
    assert row is not None
    if row["present"]:
        return
    if int(row["used"]) + size > limit:
        raise StorageQuotaExceeded(details=[{"limit": limit, "used": int(row["used"])}])


async def mark_uploads_committed(
    conn: AsyncConnection[Any], run_id: str, digests: Iterable[str]
) -> None:
    """A checkpoint referenced these uploads: they no longer count as pending."""
    wanted = sorted(set(digests))
    if wanted:
        await conn.execute(
            "UPDATE run_uploads SET committed_at = now()"
            " WHERE run_id = %s AND digest = ANY(%s) AND committed_at IS NULL",
            (run_id, wanted),
        )


async def check_upload(
    conn: AsyncConnection[Any],
    company_id: str,
    run_id: str | None,
    digest: str,
    size: int,
    quotas: Quotas,
) -> None:
    """Before an upload's bytes are stored: the company's storage quota and,
    for a run's bridge upload, its allowance of uncommitted bytes."""
    if run_id is not None:
        await check_pending_uploads(
            conn,
            run_id,
            size,
            limit=quotas.max_pending_upload_bytes,
            ttl=quotas.pending_upload_ttl,
        )
    await check_company_storage(conn, company_id, digest, size, limit=quotas.company_storage_bytes)
