"""Runs as the controller records them: which runs use a folder, their save
state, refresh requests and the objects they uploaded."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg import AsyncConnection

from common.errors import RunNotActive, RunNotFound
from controller import apply, folders
from controller.apply import EnsureObject, Folder, Row
from controller.storage.base import object_key

MAX_ERROR_CHARS = 2000

_OWNER_COLUMN = {"task": "task_id", "agent": "agent_id", "project": "project_id", "user": "user_id"}


@dataclass(frozen=True)
class SyncStatus:
    runs: list[Row]
    """Runs bound to the folder's owner, newest first."""
    last_operation_at: datetime | None


async def bound_runs(
    conn: AsyncConnection[Any], company_id: str, scope: str, owner_id: str
) -> list[Row]:
    cur = await conn.execute(
        f"SELECT * FROM runs WHERE company_id = %s AND {_OWNER_COLUMN[scope]}::text = %s"
        " ORDER BY started_at DESC, id",
        (company_id, owner_id),
    )
    return list(await cur.fetchall())


async def sync_status(
    conn: AsyncConnection[Any],
    folder: Folder | None,
    company_id: str,
    scope: str,
    owner_id: str,
) -> SyncStatus:
    runs = await bound_runs(conn, company_id, scope, owner_id)
    return SyncStatus(runs, await folders.last_operation_at(conn, folder))


async def request_refresh(
    conn: AsyncConnection[Any], company_id: str, scope: str, owner_id: str, run_id: str
) -> None:
    """Ask a run bound to this owner to take the server's changes."""
    runs = {str(r["id"]): r for r in await bound_runs(conn, company_id, scope, owner_id)}
    run = runs.get(run_id)
    if run is None:
        raise RunNotFound()
    if not run["active"]:
        raise RunNotActive()
    await conn.execute("UPDATE runs SET refresh_requested = true WHERE id = %s", (run_id,))


async def refresh_requested(conn: AsyncConnection[Any], run_id: str) -> bool:
    cur = await conn.execute("SELECT refresh_requested FROM runs WHERE id = %s", (run_id,))
    row = await cur.fetchone()
    return bool(row and row["refresh_requested"])


async def clear_refresh(conn: AsyncConnection[Any], run_id: str) -> None:
    await conn.execute("UPDATE runs SET refresh_requested = false WHERE id = %s", (run_id,))


async def set_state(conn: AsyncConnection[Any], run_id: str, state: str, error: str | None) -> None:
    """Record the run's save state; an empty error is stored as none."""
    await conn.execute(
        "UPDATE runs SET state = %s, error = %s WHERE id = %s",
        (state, error[:MAX_ERROR_CHARS] if error else None, run_id),
    )


async def settle_saving(conn: AsyncConnection[Any], run_id: str) -> None:
    """A save that was refused without failing the run (a storage limit, which
    is a warning): the run's state goes back to what it was before the save."""
    await conn.execute(
        "UPDATE runs SET state = CASE WHEN last_saved_at IS NULL THEN 'starting' ELSE 'saved' END"
        " WHERE id = %s AND state = 'saving'",
        (run_id,),
    )


async def mark_saving(conn: AsyncConnection[Any], run_id: str) -> None:
    await conn.execute(
        "UPDATE runs SET state = 'saving' WHERE id = %s AND state <> 'saving'", (run_id,)
    )


async def record_uploads(
    conn: AsyncConnection[Any],
    run_id: str,
    company_id: str,
    sizes: dict[str, int],
    ensure_objects: Callable[[list[str]], Awaitable[None]],
    gc_delay: timedelta,
    ttl: float,
) -> None:
    """Register objects a run uploaded, with a few multi-row statements: the
    objects' locks in digest order (the order every writer takes them), their
    rows, the bytes re-checked (``ensure_objects`` with every key, as
    ``EnsureObject`` for one), the run's uploads and the GC journal.

    Each upload row pins its object for ``ttl`` seconds or, once a checkpoint
    commits it, while the run is running (the pin rule is in
    :mod:`controller.gc`); after that the object is collected unless a file
    references it."""
    digests = sorted(sizes)
    sizes_list = [sizes[d] for d in digests]
    await conn.execute(
        "SELECT pg_advisory_xact_lock(%s, hashtext(%s || ':' || d)) FROM"
        ' (SELECT d FROM unnest(%s::text[]) AS d ORDER BY d COLLATE "C") AS ordered',
        (apply.OBJECT_LOCK_CLASS, company_id, digests),
    )
    await conn.execute(
        "INSERT INTO objects (company_id, digest, byte_size)"
        " SELECT %s, d, s FROM unnest(%s::text[], %s::bigint[]) AS u(d, s)"
        " ON CONFLICT (company_id, digest) DO UPDATE SET byte_size = EXCLUDED.byte_size",
        (company_id, digests, sizes_list),
    )
    await ensure_objects([object_key(company_id, d) for d in digests])
    await conn.execute(
        "INSERT INTO run_uploads (run_id, company_id, digest, byte_size, expires_at)"
        " SELECT %s, %s, d, s, now() + make_interval(secs => %s)"
        " FROM unnest(%s::text[], %s::bigint[]) AS u(d, s)"
        " ON CONFLICT (run_id, digest) DO UPDATE"
        # Uploading an expired upload again makes it usable again.
        " SET created_at = now(), expires_at = EXCLUDED.expires_at"
        " WHERE run_uploads.committed_at IS NULL",
        (run_id, company_id, ttl, digests, sizes_list),
    )
    await apply.journal_deletion(conn, company_id, digests, "bridge upload", gc_delay)


async def record_upload(
    conn: AsyncConnection[Any],
    run_id: str,
    company_id: str,
    digest: str,
    byte_size: int,
    ensure_object: EnsureObject,
    gc_delay: timedelta,
    ttl: float,
) -> None:
    """:func:`record_uploads` for one object."""

    async def ensure(keys: list[str]) -> None:
        for key in keys:
            await ensure_object(key)

    await record_uploads(conn, run_id, company_id, {digest: byte_size}, ensure, gc_delay, ttl)
