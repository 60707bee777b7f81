"""Controller-side quotas: what one tenant or run may cost, checked at commit.

fsagent keeps its own limits, but the sandbox is untrusted: each rule here is
enforced by the controller inside the transaction (or, for bytes, reserved
atomically before the upload is stored, :func:`reserved`), so a modified agent
gains nothing by skipping them.
Defaults live in :class:`controller.config.Quotas`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
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
from controller.runs import Transact

log = logging.getLogger(__name__)


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

QUOTA_LOCK_CLASS = 0x71756F
"""First key of the two-key advisory locks that serialize quota checks: one
per run (its allowance) and one per company (its storage quota), taken in that
order. Another class than the object and folder locks, so they never collide."""

RESERVATION_TTL = timedelta(minutes=15)
"""How long a reservation counts if its upload never settles or releases it
(the process died between the check and the registration). Longer than any
store of a checked upload takes (its bytes are already spooled on this host);
a store that takes longer only lets one more upload through, never an
unbounded number."""

RESERVE_SQL = (
    "SELECT (SELECT coalesce(sum(byte_size), 0) FROM run_uploads"
    "  WHERE run_id = %(run)s AND committed_at IS NULL AND " + UNEXPIRED + ")"
    " + (SELECT coalesce(sum(run_bytes), 0) FROM quota_reservations"
    "  WHERE run_id = %(run)s AND " + UNEXPIRED + ") AS pending,"
    " (SELECT coalesce(array_agg(digest), '{}') FROM run_uploads"
    "  WHERE run_id = %(run)s AND digest = ANY(%(d)s)"
    "  AND (committed_at IS NOT NULL OR " + UNEXPIRED + ")) AS held,"
    " (SELECT coalesce(sum(byte_size), 0) FROM objects WHERE company_id = %(company)s)"
    " + (SELECT coalesce(sum(company_bytes), 0) FROM quota_reservations"
    "  WHERE company_id = %(company)s AND " + UNEXPIRED + ") AS used,"
    " (SELECT coalesce(array_agg(digest), '{}') FROM objects"
    "  WHERE company_id = %(company)s AND digest = ANY(%(d)s)) AS present"
)
"""In one statement, so one snapshot: the run's uncommitted, unexpired upload
bytes plus what its uploads in flight reserved, and which of the digests about
to be uploaded the run holds already (committed, or uncommitted and
unexpired); the company's stored bytes plus its reservations, and which of
the digests it stores already. A registration swaps a reservation for its
rows in one transaction, so a snapshot sees the bytes once."""


@dataclass
class Reservation:
    """Bytes one upload holds between :func:`reserve_uploads` and the
    transaction that registers it (:func:`settle`)."""

    id: int | None
    """The ``quota_reservations`` row; None when the upload reserved nothing
    (no new bytes, or no quota applies)."""
    settled: bool = False


def upload_checks_apply(run_id: str | None, quotas: Quotas) -> bool:
    """Whether an upload has a quota to reserve against: a person's upload
    with the storage quota off has not, and needs no transaction for it."""
    return run_id is not None or quotas.company_storage_bytes > 0


async def reserve_uploads(
    conn: AsyncConnection[Any],
    company_id: str,
    run_id: str | None,
    sizes: dict[str, int],
    quotas: Quotas,
) -> Reservation:
    """Check and reserve, before uploaded bytes are stored (``sizes``: digest
    -> bytes, any number of objects), the company's storage quota and, for a
    run's bridge upload, its allowance of uncommitted bytes.

    The check and the reservation are one atomic step across replicas: under
    the run's and the company's advisory locks (held to the end of this
    transaction) the totals count every reservation not yet settled, so two
    uploads checked at once on two replicas cannot both fit in room for one.

    Run allowance: only new bytes count. An upload of content the run already
    holds (committed, or uploaded and not yet expired) costs nothing again (its
    upload row is renewed, :func:`controller.runs.record_uploads`). A sandbox
    that retries a save after a crash or a refused commit sends the same files
    again; were they counted twice, the run's own earlier attempt would exhaust
    its allowance for the uploads' lifetime. A request whose new bytes alone
    exceed the allowance can never fit, whatever is committed meanwhile:
    :class:`UploadOverAllowance` (413), not the 429 of an allowance that
    commits free again.

    Company quota (``company_storage_bytes``, 0 = off): bytes the company
    already stores under a digest cost nothing again."""
    limit = quotas.max_pending_upload_bytes
    company_limit = quotas.company_storage_bytes
    if not sizes or not upload_checks_apply(run_id, quotas):
        return Reservation(None)
    if run_id is not None:
        await conn.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (QUOTA_LOCK_CLASS, f"run:{run_id}")
        )
    if company_limit > 0:
        await conn.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            (QUOTA_LOCK_CLASS, f"company:{company_id}"),
        )
    # Rows of uploads whose process died; they count no more (UNEXPIRED).
    await conn.execute(
        "DELETE FROM quota_reservations WHERE company_id = %s AND expires_at <= clock_timestamp()",
        (company_id,),
    )
    cur = await conn.execute(
        RESERVE_SQL, {"run": run_id, "company": company_id, "d": sorted(sizes)}
    )
    row = await cur.fetchone()
    assert row is not None
    run_bytes = 0
    if run_id is not None:
        pending = int(row["pending"])
        held = set(row["held"])
        run_bytes = sum(n for digest, n in sizes.items() if digest not in held)
        if run_bytes > limit:
            raise UploadOverAllowance(
                f"This upload of {run_bytes} new bytes is larger than the run's allowance"
                f" of {limit} uncommitted bytes",
                details=[{"limit": limit, "size": run_bytes}],
            )
        if run_bytes and pending + run_bytes > limit:
            raise UploadQuotaExceeded(
                f"At most {limit} uploaded bytes may wait for a checkpoint",
                details=[{"limit": limit, "pending": pending, "size": run_bytes}],
            )
    company_bytes = 0
    if company_limit > 0:
        used = int(row["used"])
        present = set(row["present"])
        company_bytes = sum(n for digest, n in sizes.items() if digest not in present)
        if company_bytes and used + company_bytes > company_limit:
            raise StorageQuotaExceeded(details=[{"limit": company_limit, "used": used}])
    if not run_bytes and not company_bytes:
        return Reservation(None)
    cur = await conn.execute(
        "INSERT INTO quota_reservations (company_id, run_id, run_bytes, company_bytes, expires_at)"
        " VALUES (%s, %s, %s, %s, clock_timestamp() + %s) RETURNING id",
        (company_id, run_id, run_bytes, company_bytes, RESERVATION_TTL),
    )
    inserted = await cur.fetchone()
    assert inserted is not None
    return Reservation(int(inserted["id"]))


async def settle(conn: AsyncConnection[Any], reservation: Reservation) -> None:
    """Drop the reservation inside the transaction that registers its upload:
    from its commit the registered rows count the bytes instead."""
    if reservation.id is not None:
        await conn.execute("DELETE FROM quota_reservations WHERE id = %s", (reservation.id,))
        reservation.settled = True


async def release(conn: AsyncConnection[Any], reservation: Reservation) -> None:
    """Give back the bytes of an upload that failed or was refused after
    :func:`reserve_uploads` (a no-op once its registration committed)."""
    if reservation.id is not None:
        await conn.execute("DELETE FROM quota_reservations WHERE id = %s", (reservation.id,))


@asynccontextmanager
async def reserved(
    transact: Transact,
    company_id: str,
    run_id: str | None,
    sizes: dict[str, int],
    quotas: Quotas,
) -> AsyncIterator[Reservation]:
    """:func:`reserve_uploads` in a transaction of its own; the block stores
    the bytes and registers them, calling :func:`settle` in the registering
    transaction. However the block ends without a committed registration
    (an error, a refusal at commit, cancellation), the reservation is released
    at once; if even that fails (the database is gone), it expires after
    :data:`RESERVATION_TTL`."""
    if not upload_checks_apply(run_id, quotas):
        yield Reservation(None)
        return
    reservation = await transact(
        lambda conn: reserve_uploads(conn, company_id, run_id, sizes, quotas)
    )
    try:
        yield reservation
    except BaseException:
        reservation.settled = False  # a settle in a transaction that rolled back
        raise
    finally:
        if reservation.id is not None and not reservation.settled:
            try:
                await transact(lambda conn: release(conn, reservation))
            except Exception:
                log.warning(
                    "releasing quota reservation %s failed; it expires in %s",
                    reservation.id,
                    RESERVATION_TTL,
                    exc_info=True,
                )
