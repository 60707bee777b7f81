"""Repository bindings and checkpoints in the database.

A task's binding of a workspace (``task_repos``) points at its current
repository checkpoint; ``repo_refs`` holds every digest that checkpoint
references (its file objects and its manifest objects: the manifest's own
and, for a manifest stored as a delta, the chain it is read from; see
:mod:`controller.repomanifest`). What the sandbox may
reference is what the task already references (any of its bindings' current
checkpoints) plus what this run uploaded and still pins, the same rule as
folder checkpoints (``checkpoint.claim_contents``), with the task in place
of the folder.

A commit (:func:`commit`) is one transaction:

1. the task's repository lock (two-key advisory lock), so commits of one
   task serialize and the task's references cannot change under a claim;
2. the binding row, and its current checkpoint: the plan was made against
   it, else the plan is stale (``base_mismatch`` for a delta);
3. the run's lease, locked (``checkpoint.check_lease``): a superseded or ended
   run is refused here, inside the transaction that would advance the pointer;
4. the receipt: a replay answers the stored receipt, another body under the
   same operation id is ``idempotency_conflict``;
5. the claim of the digests the binding did not reference yet (one query;
   uploads marked committed, which row-locks them against the sweeper), and
   their sizes against the declared ones;
6. the manifest object registered (its object lock, its row, its bytes
   re-stored if a sweep removed them);
7. the checkpoint row, ``repo_refs`` changed by the difference of the old and
   the new digest sets, computed from the plan's delta (rows for the changes
   only), the dropped digests and manifest objects journaled for GC (an old
   chain once a manifest is stored whole), the binding pointed at the new
   checkpoint.

The manifest object and every file object are durable before step 1 starts.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection

from common.errors import (
    BaseMismatch,
    IdempotencyConflict,
    NotFound,
    UnknownContent,
    UnsafeRepoMember,
)
from controller import foldercore
from controller.auth import RunBinding
from controller.checkpoint import check_lease
from controller.foldercore import EnsureObject
from controller.quotas import UNEXPIRED
from controller.repomanifest import CheckpointRequest, Plan, member_with
from controller.rowjson import iso

REPO_LOCK_CLASS = 0x726570
"""First key of the two-key advisory lock on a task's repositories (see
``foldercore.OBJECT_LOCK_CLASS`` for the other classes)."""

MAX_ERROR_CHARS = 2000
STATES = ("unsaved", "saving", "saved", "failed")


@dataclass(frozen=True)
class Bound:
    """One binding of a workspace to a task, as read (not locked)."""

    task_id: str
    workspace_id: str
    company_id: str
    name: str
    current_id: str | None
    manifest_digest: str | None
    saved_at: Any
    removed: bool


_BOUND_SQL = (
    "SELECT b.task_id, b.workspace_id, b.company_id, b.name, b.current_id,"
    " c.manifest_digest, c.created_at AS saved_at, w.removed_at IS NOT NULL AS removed"
    " FROM task_repos b JOIN workspaces w ON w.id = b.workspace_id"
    " LEFT JOIN repo_checkpoints c ON c.id = b.current_id"
)


def _bound(row: dict[str, Any]) -> Bound:
    return Bound(
        str(row["task_id"]),
        str(row["workspace_id"]),
        str(row["company_id"]),
        str(row["name"]),
        None if row["current_id"] is None else str(row["current_id"]),
        row["manifest_digest"],
        row["saved_at"],
        bool(row["removed"]),
    )


async def binding(
    conn: AsyncConnection[Any], company_id: str, task_id: str | None, workspace_id: str
) -> Bound:
    """The task's binding of the workspace; NotFound when there is none (or
    the ids are not UUIDs: nothing is bound under them)."""
    try:
        ids = (str(uuid.UUID(task_id or "")), str(uuid.UUID(workspace_id)))
    except ValueError:
        raise NotFound("Repository not found") from None
    if ids[1] != workspace_id.lower():
        raise NotFound("Repository not found")
    cur = await conn.execute(
        _BOUND_SQL + " WHERE b.task_id = %s AND b.workspace_id = %s AND b.company_id = %s",
        (*ids, company_id),
    )
    row = await cur.fetchone()
    if row is None:
        raise NotFound("Repository not found")
    return _bound(row)


async def binding_for_run(conn: AsyncConnection[Any], run: RunBinding, workspace_id: str) -> Bound:
    """A workspace bound to the run's task; NotFound otherwise (a run without
    a task has no repositories)."""
    if run.task_id is None:
        raise NotFound("Repository not found")
    return await binding(conn, run.company_id, run.task_id, workspace_id)


async def list_for_run(conn: AsyncConnection[Any], run: RunBinding) -> list[dict[str, Any]]:
    """The run's task's bindings of workspaces that are not removed, with what
    a sandbox needs to prepare them; oldest workspace first."""
    if run.task_id is None:
        return []
    cur = await conn.execute(
        "SELECT b.workspace_id, b.name, w.repo_url, w.ref, w.is_primary, w.setup_command,"
        " t.branch, c.id AS checkpoint_id, c.entries, c.byte_size, c.created_at"
        " FROM task_repos b JOIN workspaces w ON w.id = b.workspace_id"
        " JOIN tasks t ON t.id = b.task_id"
        " LEFT JOIN repo_checkpoints c ON c.id = b.current_id"
        " WHERE b.task_id = %s AND b.company_id = %s AND w.removed_at IS NULL"
        " ORDER BY w.created_at, w.id",
        (run.task_id, run.company_id),
    )
    return list(await cur.fetchall())


async def list_for_task(
    conn: AsyncConnection[Any], company_id: str, task_id: str
) -> list[dict[str, Any]]:
    """Every binding of the task, removed workspaces' included, with its save
    state and current checkpoint; oldest workspace first."""
    cur = await conn.execute(
        "SELECT b.workspace_id, b.name, w.repo_url, w.removed_at IS NOT NULL AS removed,"
        " b.state, b.error, b.last_saved_at, c.id AS checkpoint_id, c.entries, c.files,"
        " c.byte_size"
        " FROM task_repos b JOIN workspaces w ON w.id = b.workspace_id"
        " LEFT JOIN repo_checkpoints c ON c.id = b.current_id"
        " WHERE b.task_id = %s AND b.company_id = %s ORDER BY w.created_at, w.id",
        (task_id, company_id),
    )
    return list(await cur.fetchall())


async def missing(
    conn: AsyncConnection[Any], run: RunBinding, bound: Bound, digests: list[str]
) -> list[str]:
    """The digests (in request order) the run's commit could not reference:
    in no current checkpoint of the task and not uploaded by this run (or
    that upload has expired uncommitted)."""
    cur = await conn.execute(
        "SELECT d FROM unnest(%(d)s::text[]) WITH ORDINALITY AS u(d, n)"
        " WHERE NOT EXISTS (SELECT 1 FROM repo_refs r"
        "   WHERE r.task_id = %(task)s AND r.digest = u.d)"
        " AND NOT EXISTS (SELECT 1 FROM run_uploads p"
        "   WHERE p.run_id = %(run)s AND p.digest = u.d"
        "   AND (p.committed_at IS NOT NULL OR p." + UNEXPIRED + "))"
        " ORDER BY n",
        {"d": digests, "task": bound.task_id, "run": run.run_id},
    )
    return [r["d"] for r in await cur.fetchall()]


async def current_objects(
    conn: AsyncConnection[Any], bound: Bound, digests: list[str]
) -> dict[str, int]:
    """Sizes of those of ``digests`` the binding's current checkpoint references."""
    cur = await conn.execute(
        "SELECT digest, byte_size FROM repo_refs"
        " WHERE task_id = %s AND workspace_id = %s AND digest = ANY(%s)",
        (bound.task_id, bound.workspace_id, sorted(set(digests))),
    )
    return {r["digest"]: int(r["byte_size"]) for r in await cur.fetchall()}


async def set_state(
    conn: AsyncConnection[Any], bound: Bound, state: str, error: str | None
) -> None:
    """The binding's visible save state (``saving`` or ``failed``); an empty
    error is stored as none."""
    assert state in STATES
    await conn.execute(
        "UPDATE task_repos SET state = %s, error = %s WHERE task_id = %s AND workspace_id = %s",
        (state, error[:MAX_ERROR_CHARS] if error else None, bound.task_id, bound.workspace_id),
    )


async def mark_saving(conn: AsyncConnection[Any], bound: Bound) -> None:
    await conn.execute(
        "UPDATE task_repos SET state = 'saving'"
        " WHERE task_id = %s AND workspace_id = %s AND state <> 'saving'",
        (bound.task_id, bound.workspace_id),
    )


async def has_receipt(conn: AsyncConnection[Any], bound: Bound, operation_id: str) -> bool:
    cur = await conn.execute(
        "SELECT 1 FROM repo_checkpoints"
        " WHERE task_id = %s AND workspace_id = %s AND operation_id = %s",
        (bound.task_id, bound.workspace_id, operation_id),
    )
    return await cur.fetchone() is not None


class PlanOutdated(Exception):
    """The binding's current checkpoint is no longer the one the plan was made
    against (another commit landed first): plan again."""


@dataclass(frozen=True)
class StoredManifest:
    digest: str
    byte_size: int
    ensure: EnsureObject
    """Brings the bytes back inside the commit if a GC sweep removed them."""


_CLAIM_SQL = (
    "WITH claimed AS (UPDATE run_uploads SET committed_at = now()"
    "  WHERE run_id = %(rid)s AND digest = ANY(%(d)s) AND committed_at IS NULL AND "
    + UNEXPIRED
    + "  RETURNING digest, byte_size)"
    " SELECT digest, byte_size FROM claimed"
    " UNION SELECT digest, byte_size FROM run_uploads"
    "  WHERE run_id = %(rid)s AND digest = ANY(%(d)s) AND committed_at IS NOT NULL"
    " UNION SELECT digest, byte_size FROM repo_refs WHERE task_id = %(tid)s AND digest = ANY(%(d)s)"
)


async def _claim(
    conn: AsyncConnection[Any], run: RunBinding, task_id: str, digests: frozenset[str]
) -> dict[str, int]:
    """Sizes of ``digests`` when the task references them or this run's
    uploads pin them (marking uncommitted uploads committed); UnknownContent
    naming the others. The caller holds the task's repository lock, so the
    task's references cannot go away before this transaction commits."""
    if not digests:
        return {}
    cur = await conn.execute(_CLAIM_SQL, {"rid": run.run_id, "tid": task_id, "d": sorted(digests)})
    sizes = {r["digest"]: int(r["byte_size"]) for r in await cur.fetchall()}
    unknown = sorted(digests - sizes.keys())
    if unknown:
        raise UnknownContent(
            "Repository checkpoint references content this task cannot see and this run did"
            " not upload (or whose upload expired: upload it again)",
            details=[{"digest": d} for d in unknown[:20]],
        )
    return sizes


async def _receipt(
    conn: AsyncConnection[Any], task_id: str, workspace_id: str, req: CheckpointRequest
) -> dict[str, Any] | None:
    cur = await conn.execute(
        "SELECT fingerprint, result FROM repo_checkpoints"
        " WHERE task_id = %s AND workspace_id = %s AND operation_id = %s",
        (task_id, workspace_id, req.operation_id),
    )
    row = await cur.fetchone()
    if row is None:
        return None
    if row["fingerprint"] != req.fingerprint:
        raise IdempotencyConflict()
    return {**row["result"], "replayed": True}


async def commit(
    conn: AsyncConnection[Any],
    run: RunBinding,
    bound: Bound,
    req: CheckpointRequest,
    plan: Plan | None,
    manifest: StoredManifest | None,
    *,
    gc_delay: timedelta,
) -> dict[str, Any]:
    """Advance the binding's pointer to the planned checkpoint, or answer the
    receipt of a replay (``plan`` may be None when a receipt was seen before).
    PlanOutdated when the plan no longer fits; see the module docstring."""
    task_id, workspace_id = bound.task_id, bound.workspace_id
    await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (REPO_LOCK_CLASS, task_id))
    cur = await conn.execute(
        "SELECT b.current_id, c.manifest_digest FROM task_repos b"
        " LEFT JOIN repo_checkpoints c ON c.id = b.current_id"
        " WHERE b.task_id = %s AND b.workspace_id = %s FOR UPDATE OF b",
        (task_id, workspace_id),
    )
    row = await cur.fetchone()
    if row is None:
        raise NotFound("Repository not found")
    current_id = None if row["current_id"] is None else str(row["current_id"])
    await check_lease(conn, run, req.lease_epoch)
    replay = await _receipt(conn, task_id, workspace_id, req)
    if replay is not None:
        return replay
    if plan is None or manifest is None or plan.current_id != current_id:
        if req.base is not None and req.base != current_id:
            raise BaseMismatch(details=[{"base": req.base, "current": current_id}])
        raise PlanOutdated()
    new = plan.added_digests
    claimed = await _claim(conn, run, task_id, new)
    declared = plan.manifest.sizes
    for digest, size in claimed.items():
        if declared[digest] != size:
            raise UnsafeRepoMember(member_with(plan.manifest, digest), "size_mismatch")
    await foldercore.register_object(
        conn, bound.company_id, manifest.digest, manifest.byte_size, manifest.ensure
    )
    checkpoint_id = str(uuid.uuid4())
    cur = await conn.execute("SELECT now() AS t")
    now = await cur.fetchone()
    assert now is not None
    result = {
        "operationId": req.operation_id,
        "checkpointId": checkpoint_id,
        "entries": plan.entries,
        "byteSize": plan.byte_size,
        "savedAt": iso(now["t"]),
    }
    await conn.execute(
        "INSERT INTO repo_checkpoints (id, task_id, workspace_id, company_id, run_id,"
        " operation_id, fingerprint, base_id, manifest_digest, entries, files, byte_size, result)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            checkpoint_id,
            task_id,
            workspace_id,
            bound.company_id,
            run.run_id,
            req.operation_id,
            req.fingerprint,
            current_id,
            manifest.digest,
            plan.entries,
            plan.files,
            plan.byte_size,
            json.dumps(result),
        ),
    )
    # The references change by the delta: file digests taken or let go, and
    # the manifest objects (the new one; the old chain when it is stored whole).
    old_objects = set(plan.current_objects)
    if row["manifest_digest"] is not None:
        old_objects.add(row["manifest_digest"])
    new_objects = {*plan.manifest.chain, manifest.digest}
    old_files, new_files = plan.current.counts, plan.manifest.counts
    added = sorted(
        d
        for d in plan.added_digests | (new_objects - old_objects)
        if d not in old_files and d not in old_objects
    )
    dropped = sorted(
        d
        for d in plan.dropped_digests | (old_objects - new_objects)
        if d not in new_files and d not in new_objects
    )
    if dropped:
        await conn.execute(
            "DELETE FROM repo_refs WHERE task_id = %s AND workspace_id = %s AND digest = ANY(%s)",
            (task_id, workspace_id, dropped),
        )
        await foldercore.journal_deletion(
            conn, bound.company_id, dropped, "superseded repository checkpoint", gc_delay
        )
    if added:
        await conn.execute(
            "INSERT INTO repo_refs (task_id, workspace_id, company_id, digest, byte_size)"
            " SELECT %s, %s, %s, d, s FROM unnest(%s::text[], %s::bigint[]) AS u(d, s)",
            (
                task_id,
                workspace_id,
                bound.company_id,
                added,
                [manifest.byte_size if d == manifest.digest else declared[d] for d in added],
            ),
        )
    await conn.execute(
        "UPDATE task_repos SET current_id = %s, state = 'saved', error = NULL,"
        " last_saved_at = %s WHERE task_id = %s AND workspace_id = %s",
        (checkpoint_id, now["t"], task_id, workspace_id),
    )
    return result
