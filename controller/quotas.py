"""Controller-side quotas: what one tenant or run may cost, checked at commit.

fsagent keeps its own limits, but the sandbox is untrusted: each rule here is
enforced by the controller inside the transaction (or, for bytes, before the
upload is accepted), so a modified agent gains nothing by skipping them.
Defaults live in :class:`controller.config.Quotas`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from psycopg import AsyncConnection

from common.errors import (
    CheckpointRowLimit,
    StorageQuotaExceeded,
    UploadOverAllowance,
    UploadQuotaExceeded,
)
from common.paths import ancestors
from controller.config import Quotas


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


def raise_row_limit(bound: int, limit: int) -> NoReturn:
    """Refuse, before any database work, a checkpoint that could write ``bound``
    rows (:func:`checkpoint_row_bound`), over ``limit``."""
    raise CheckpointRowLimit(
        f"A checkpoint may create at most {limit} rows; this one could create {bound}",
        details=[{"limit": limit, "rows": bound}],
    )


UNEXPIRED = "expires_at > clock_timestamp()"
"""An uncommitted run upload still pins its object, counts against the run's
quota and may be committed (``expires_at`` is set when it is recorded). The
clock, not the transaction's start, so a commit that waited for the sweeper
sees the same expiry the sweeper saw or a later one."""

PENDING_UPLOADS_SQL = (
    "SELECT (SELECT coalesce(sum(byte_size), 0) FROM run_uploads"
    "  WHERE run_id = %(run)s AND committed_at IS NULL AND " + UNEXPIRED + ") AS pending,"
    " (SELECT coalesce(array_agg(digest), '{}') FROM run_uploads"
    "  WHERE run_id = %(run)s AND digest = ANY(%(d)s)"
    "  AND (committed_at IS NOT NULL OR " + UNEXPIRED + ")) AS held"
)
"""The run's uncommitted, unexpired upload bytes, and which of the digests
about to be uploaded the run holds already (committed, or uncommitted and
unexpired): two index lookups (the pending rows' partial index, the key)."""


async def check_pending_uploads(
    conn: AsyncConnection[Any], run_id: str, sizes: dict[str, int], *, limit: int
) -> None:
    """A run may keep at most ``limit`` uploaded bytes that no checkpoint has
    committed yet; an upload stops counting when it expires.

    Only new bytes count: an upload of content the run already holds
    (committed, or uploaded and not yet expired) adds no row (its upload row
    is renewed, :func:`controller.runs.record_uploads`), so it costs nothing
    again. A sandbox that retries a save after a crash or a refused commit
    sends the same files again; were they counted twice, the run's own
    earlier attempt would exhaust its allowance for the uploads' lifetime.

    A request whose new bytes alone exceed ``limit`` can never fit, whatever
    is committed meanwhile: :class:`UploadOverAllowance` (413), not the
    429 of an allowance that commits free again."""
    if not sizes:
        return
    cur = await conn.execute(PENDING_UPLOADS_SQL, {"run": run_id, "d": sorted(sizes)})
    row = await cur.fetchone()
    pending = int(row["pending"]) if row else 0
    held = set(row["held"]) if row else set()
    size = sum(n for digest, n in sizes.items() if digest not in held)
    if size > limit:
        raise UploadOverAllowance(
            f"This upload of {size} new bytes is larger than the run's allowance"
            f" of {limit} uncommitted bytes",
            details=[{"limit": limit, "size": size}],
        )
    if size and pending + size > limit:
        raise UploadQuotaExceeded(
            f"At most {limit} uploaded bytes may wait for a checkpoint",
            details=[{"limit": limit, "pending": pending, "size": size}],
        )


async def check_company_storage(
    conn: AsyncConnection[Any], company_id: str, sizes: dict[str, int], *, limit: int
) -> None:
    """The optional per-company storage quota (``limit`` 0 = off) for new
    objects of ``sizes`` (digest -> bytes), in one query. Bytes the company
    already stores under a digest cost nothing again."""
    if limit <= 0 or not sizes:
        return
    cur = await conn.execute(
        "SELECT coalesce(sum(byte_size), 0) AS used,"
        " coalesce(array_agg(digest) FILTER (WHERE digest = ANY(%s)), '{}') AS present"
        " FROM objects WHERE company_id = %s",
        (sorted(sizes), company_id),
    )
    row = await cur.fetchone()
    assert row is not None
    present = set(row["present"])
    new = sum(size for digest, size in sizes.items() if digest not in present)
    if new and int(row["used"]) + new > limit:
        raise StorageQuotaExceeded(details=[{"limit": limit, "used": int(row["used"])}])


def upload_checks_apply(run_id: str | None, quotas: Quotas) -> bool:
    """Whether :func:`check_uploads` has anything to check: a person's upload
    with the storage quota off has not, and needs no transaction for it."""
    return run_id is not None or quotas.company_storage_bytes > 0


async def check_uploads(
    conn: AsyncConnection[Any],
    company_id: str,
    run_id: str | None,
    sizes: dict[str, int],
    quotas: Quotas,
) -> None:
    """Before uploaded bytes are stored (``sizes``: digest -> bytes, any
    number of objects, two queries): the company's storage quota and, for a
    run's bridge upload, its allowance of uncommitted bytes."""
    if run_id is not None:
        await check_pending_uploads(conn, run_id, sizes, limit=quotas.max_pending_upload_bytes)
    await check_company_storage(conn, company_id, sizes, limit=quotas.company_storage_bytes)


async def check_upload(
    conn: AsyncConnection[Any],
    company_id: str,
    run_id: str | None,
    digest: str,
    size: int,
    quotas: Quotas,
) -> None:
    """:func:`check_uploads` for one object."""
    await check_uploads(conn, company_id, run_id, {digest: size}, quotas)
