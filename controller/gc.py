"""Object garbage collection driven by the deletion journal.

A journal entry becomes due at ``not_before``. The sweeper then takes the
object's advisory lock (``foldercore.lock_object``), locks the digest's run-upload
rows, and deletes the bytes only if no live file, trash entry or task
attachment (an original upload, ``controller.attachments``) of the company
references the digest, no current repository checkpoint of the company
references it (``repo_refs``: its objects and its manifest, kept while the
task's binding exists, also after its workspace is removed) and no upload
pins it. A run upload pins its
object while its run is active and the upload is either committed or not yet
expired (:data:`PINNED`).

Two kinds of writer reference a digest, and each is ordered against the
sweeper:

- a single write (REST PUT, a bridge upload's registration, a task
  attachment and its working copy) takes the same
  object lock and upserts the ``objects`` row before it references the
  digest, and re-uploads the bytes when they are gone
  (``foldercore.register_object``). It asks storage only when a sweep may have
  deleted them since it stored them (``foldercore.upsert_objects``): each deletion
  is stamped with a mark drawn after the bytes are gone, and a writer
  draws its own before it stores;
- a checkpoint references only pinned digests and claims them in one query
  (``checkpoint.claim_contents``), holding the run's row lock, so no HEAD
  per file is needed: the sweeper either waits on the claimed upload rows
  and then sees the checkpoint's files, or decides first, and then the claim
  sees the upload expired as well. A repository checkpoint claims the same
  way (``repos.commit``), and the references it may also rely on, its task's
  ``repo_refs``, change only under the task's repository lock, which it
  holds; its manifest object is registered like a single write.

Each sweep also removes the leftovers of puts that never finished (an S3
multipart upload of a killed process, a local temp file) once they are older
than ``--gc-upload-grace`` (:func:`sweep_abandoned_writes`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from common.limits import GC_UPLOAD_GRACE_SECONDS
from controller.foldercore import lock_object
from controller.quotas import UNEXPIRED
from controller.storage.base import StorageProvider, object_key

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    examined: int = 0
    deleted: int = 0
    kept: int = 0
    failed: int = 0

    def as_json(self) -> dict[str, int]:
        return {
            "examined": self.examined,
            "deleted": self.deleted,
            "kept": self.kept,
            "failed": self.failed,
        }


PINNED = "r.active AND (u.committed_at IS NOT NULL OR u." + UNEXPIRED + ")"
"""A run upload ``u`` of run ``r`` keeps its object."""

LOCK_UPLOADS_SQL = (
    "SELECT 1 FROM run_uploads WHERE company_id = %(company)s AND digest = %(digest)s FOR SHARE"
)

REFERENCED_SQL = (
    # A task attachment's original and a current repository checkpoint
    # reference an object as a file does.
    "SELECT EXISTS (SELECT 1 FROM files f JOIN folders d ON d.id = f.folder_id"
    "  WHERE d.company_id = %(company)s AND f.digest = %(digest)s)"
    " OR EXISTS (SELECT 1 FROM task_attachments a"
    "  WHERE a.company_id = %(company)s AND a.digest = %(digest)s)"
    " OR EXISTS (SELECT 1 FROM repo_refs WHERE company_id = %(company)s"
    "  AND digest = %(digest)s) AS referenced,"
    " EXISTS (SELECT 1 FROM run_uploads u JOIN runs r ON r.id = u.run_id"
    "  WHERE u.company_id = %(company)s AND u.digest = %(digest)s AND " + PINNED + ") AS pinned"
)


async def sweep_once(
    pool: AsyncConnectionPool[AsyncConnection[Any]], storage: StorageProvider, *, batch: int = 500
) -> SweepReport:
    report = SweepReport()
    after_id = 0
    while True:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT id, company_id, digest FROM deletion_journal"
                " WHERE done_at IS NULL AND not_before <= now() AND id > %s"
                " ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
                (after_id, batch),
            )
            entries = list(await cur.fetchall())
        if not entries:
            return report
        after_id = int(entries[-1]["id"])
        for entry in entries:
            report.examined += 1
            try:
                outcome = await _collect(pool, storage, entry)
            except Exception:
                log.exception(
                    "GC of %s/%s failed; will retry", entry["company_id"], entry["digest"]
                )
                report.failed += 1
                continue
            if outcome == "deleted":
                report.deleted += 1
            else:
                report.kept += 1
        if len(entries) < batch:
            return report


async def _collect(
    pool: AsyncConnectionPool[AsyncConnection[Any]], storage: StorageProvider, entry: dict[str, Any]
) -> str:
    company, digest = str(entry["company_id"]), entry["digest"]
    async with pool.connection() as conn, conn.transaction():
        await lock_object(conn, company, digest)
        # Another sweeper may have settled this entry since it was read. Then
        # there is nothing to decide, and deciding again could delete bytes a
        # writer stored since with no entry left to carry the deletion's mark.
        cur = await conn.execute(
            "SELECT 1 FROM deletion_journal WHERE id = %s AND done_at IS NULL FOR UPDATE",
            (entry["id"],),
        )
        if await cur.fetchone() is None:
            return "settled"
        key = {"company": company, "digest": digest}
        # Waits for a checkpoint that claimed one of these uploads; the next
        # statement's snapshot then shows its files.
        await conn.execute(LOCK_UPLOADS_SQL, key)
        cur = await conn.execute(REFERENCED_SQL, key)
        row = await cur.fetchone()
        assert row is not None
        if row["pinned"] and not row["referenced"]:
            # A running run may still commit a checkpoint that references
            # its upload: decide again on a later sweep, after the pin ends.
            return "pending"
        if row["referenced"]:
            outcome = "referenced"
        else:
            await asyncio.to_thread(storage.delete, object_key(company, digest))
            await conn.execute(
                "DELETE FROM objects WHERE company_id = %s AND digest = %s", (company, digest)
            )
            outcome = "deleted"
        # Every due entry for this object is settled by this decision. A
        # deletion's mark is drawn now, after the bytes are gone, so it is
        # later than the mark of any writer that stored them before the
        # delete (``foldercore.upsert_objects``).
        await conn.execute(
            "UPDATE deletion_journal SET done_at = now(), outcome = %s,"
            " deleted_mark = CASE WHEN %s = 'deleted'"
            "  THEN nextval('object_deletion_marks') END"
            " WHERE company_id = %s AND digest = %s AND done_at IS NULL AND not_before <= now()",
            (outcome, outcome, company, digest),
        )
    if outcome == "deleted":
        log.info("GC deleted object %s/%s", company, digest)
    return outcome


async def sweep_abandoned_writes(storage: StorageProvider, grace: timedelta) -> int:
    """Remove the leftovers of puts that never finished and started more than
    ``grace`` ago (S3: incomplete multipart uploads; local disk: temp files);
    how many. A failed put removes its own; these are what a killed process
    or a failed abort left. No database work: nothing references them."""
    started_before = time.time() - grace.total_seconds()
    return await asyncio.to_thread(storage.sweep_abandoned_writes, started_before)


async def run_sweeper(
    pool: AsyncConnectionPool[AsyncConnection[Any]],
    storage: StorageProvider,
    interval: float,
    on_sweep: Callable[[dict[str, int] | None], None] | None = None,
    *,
    upload_grace: timedelta = timedelta(seconds=GC_UPLOAD_GRACE_SECONDS),
) -> None:
    """Sweep every ``interval`` seconds until cancelled; a failed sweep is retried next time.

    Each sweep settles the due deletions, then removes abandoned writes
    older than ``upload_grace``. ``on_sweep`` gets each sweep's report, or
    None for a failed sweep (metrics).
    """
    while True:
        outcome: dict[str, int] | None = None
        try:
            report = await sweep_once(pool, storage)
            outcome = report.as_json()
            if report.examined:
                log.info("GC sweep: %s", outcome)
        except Exception:
            log.exception("GC sweep failed")
        try:
            abandoned = await sweep_abandoned_writes(storage, upload_grace)
        except Exception:
            # Its own step: a bucket policy that forbids listing uploads must
            # not stop the deletions, and the failure is worth a line each time.
            log.exception("GC could not sweep abandoned uploads")
        else:
            if abandoned:
                log.info("GC removed %d abandoned uploads", abandoned)
        if on_sweep is not None:
            on_sweep(outcome)
        await asyncio.sleep(interval)
