"""The core of every write to a work folder: the folder's lock and the one
``committing`` sequence, the ``files`` rows, and the objects they reference.

People's single writes (:mod:`controller.restwrites`), moves, checkpoints,
attachments, the agent folder's entry and the one-time import all write
through these functions, one transaction per operation.

Ordering rule: every write to a folder first takes that folder's advisory
transaction lock, so writes to one folder are serialized and the version each
accepted write draws from the folder's own counter (``controller.versions``)
grows in commit order. That is
what makes "last accepted write wins" well defined, and it also settles the
parent-file/child-file race (one of the two sees the other's row).

Objects: a single write here may reference a digest only after the object's
advisory lock (:func:`lock_object`) was taken and its ``objects`` row upserted
in the same transaction. The GC sweeper holds the same lock while it checks
for references and deletes an object, so the two never interleave, even when
no row exists yet. (A checkpoint references pinned digests instead; see
:mod:`controller.gc`.)

Bytes are stored before the transaction that references them, so a sweep
can delete them in between. A writer that took a :func:`take_store_mark`
before storing asks storage again only for the objects a sweep may have
deleted since (:func:`upsert_objects`, one query); without a mark it asks for
each object.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NewType

from psycopg import AsyncConnection, AsyncCursor

from common.errors import (
    FileNotFound,
    IdempotencyConflict,
    KindConflict,
    ParentIsFile,
    RestoreCollision,
)
from common.paths import ancestors, parent_of
from controller.config import AgentLimits
from controller.storage.base import object_key
from controller.versions import FolderCounters

Row = dict[str, Any]
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
"""Empty content has no stored object: nothing reads storage for a 0-byte file
(``api.objects.object_response`` answers it without a read; fsagent makes it
locally), so a file of it can be created where no storage is at hand."""
EnsureObject = Callable[[str], Awaitable[None]]
"""Called with the object key inside the transaction, after the objects row
is locked: must make sure the bytes are in storage (re-upload if a sweep
removed them in between)."""
StoreMark = NewType("StoreMark", int)
"""Drawn before a writer stores bytes (:func:`take_store_mark`); a deletion
stamped later than it may have removed them."""
Query = tuple[str, tuple[Any, ...]]
"""A statement and its parameters."""
Authority = Callable[[AsyncConnection[Any]], Awaitable[None]]
"""Raises unless the caller may still write; run inside the committing
transaction, after the folder lock (see :func:`committing`)."""


@dataclass(frozen=True)
class WritePolicy:
    """What every write to a folder re-checks at commit."""

    confirm: Authority
    max_folder_entries: int
    agent_limits: AgentLimits | None = None
    """An agent folder's storage limits (None for the other scopes)."""


def fingerprint(**fields: Any) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Folder:
    id: int
    company_id: str
    scope: str
    owner_id: str
    counters: FolderCounters = field(default_factory=FolderCounters, compare=False, repr=False)


async def get_folder(
    conn: AsyncConnection[Any], company_id: str, scope: str, owner_id: str, *, create: bool
) -> Folder | None:
    sql = "SELECT id FROM folders WHERE company_id = %s AND scope = %s AND owner_id = %s"
    cur = await conn.execute(sql, (company_id, scope, owner_id))
    row = await cur.fetchone()
    if row is None and create:
        await conn.execute(
            "INSERT INTO folders (company_id, scope, owner_id) VALUES (%s, %s, %s)"
            " ON CONFLICT (company_id, scope, owner_id) DO NOTHING",
            (company_id, scope, owner_id),
        )
        cur = await conn.execute(sql, (company_id, scope, owner_id))
        row = await cur.fetchone()
    if row is None:
        return None
    return Folder(int(row["id"]), company_id, scope, owner_id)


async def lock_folder(conn: AsyncConnection[Any], folder: Folder) -> None:
    """Serialize writes to the folder; only then may versions be drawn."""
    await folder.counters.read(await _send_lock(conn, folder))


async def _send_lock(conn: AsyncConnection[Any], folder: Folder) -> AsyncCursor[Any]:
    """Take the folder lock, then read its counters in a statement of its own
    (whose snapshot is taken once the lock is held, so it sees the previous
    holder's commit); returns the cursor of the counters, for
    :meth:`FolderCounters.read`. In pipeline mode nothing waits here: both
    statements go to the server with the next round trip."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s)", (folder.id,))
    return await folder.counters.request(conn, folder.id)


async def live_row(conn: AsyncConnection[Any], folder: Folder, path: str) -> Row | None:
    cur = await conn.execute(*live_rows_query(folder.id, [path]))
    return await cur.fetchone()


async def stored_result(
    conn: AsyncConnection[Any], folder: Folder, operation_id: str, fp: str
) -> dict[str, Any] | None:
    """The result stored for the folder's operation id (the caller holds the
    folder lock, so a retry of the same key waits for the first to commit);
    IdempotencyConflict when the id was used for a different request."""
    return await _stored_answer(await _send_receipt_lookup(conn, folder, operation_id), fp)


async def _send_receipt_lookup(
    conn: AsyncConnection[Any], folder: Folder, operation_id: str
) -> AsyncCursor[Any]:
    return await conn.execute(
        "SELECT fingerprint, result FROM receipts WHERE folder_id = %s AND operation_id = %s",
        (folder.id, operation_id),
    )


async def _stored_answer(cur: AsyncCursor[Any], fp: str) -> dict[str, Any] | None:
    """:func:`stored_result` from the answer of :func:`_send_receipt_lookup`."""
    row = await cur.fetchone()
    if row is None:
        return None
    if row["fingerprint"] != fp:
        raise IdempotencyConflict()
    result: dict[str, Any] = dict(row["result"])
    return result


async def store_receipt(
    conn: AsyncConnection[Any], folder: Folder, operation_id: str, fp: str, result: dict[str, Any]
) -> None:
    """Keep the answer to an operation id, in the transaction that applied it."""
    await conn.execute(
        "INSERT INTO receipts (folder_id, operation_id, fingerprint, result)"
        " VALUES (%s, %s, %s, %s)",
        (folder.id, operation_id, fp, json.dumps(result)),
    )


@dataclass
class Commit:
    """One write in progress: ``replay`` is a stored result for this operation
    id (the block must return it unchanged); otherwise the block sets ``result``."""

    replay: dict[str, Any] | None
    result: dict[str, Any] | None = None
    touch: bool = True
    ahead: AsyncCursor[Any] | None = None
    """The answer to the ``ahead`` query given to :func:`committing`."""
    registered: Registration | None = None
    """The ``register`` object given to :func:`committing`, locked and upserted
    (None where it was not sent ahead: see there)."""


@asynccontextmanager
async def committing(
    conn: AsyncConnection[Any],
    folder: Folder,
    operation_id: str | None,
    fp: str,
    policy: WritePolicy,
    *,
    touch: bool = True,
    ahead: Query | None = None,
    register: PendingObject | None = None,
) -> AsyncIterator[Commit]:
    """Lock the folder, re-check authority, look up the receipt; on success
    check an agent folder's storage limits and the folder's entry limit (only
    a write that adds entries or bytes can fail them), store the counters and
    the receipt and touch the folder.

    Authority is checked again here, inside the transaction that commits, and
    not only when the request arrived: a token may be ended, its lease
    superseded or its member removed or made a viewer while a body was still
    arriving, and revocation must be final for anything committed after it.
    It is confirmed before the receipt is read (the lookup goes to the server
    in the same round trip), so a replay cannot outlive revocation.

    A write without an operation id (a request without ``Idempotency-Key``)
    cannot be replayed, so it neither looks up nor stores a receipt.

    ``ahead``: a read the block needs (under the folder lock), sent with the
    lock so that in pipeline mode its answer comes in the same round trip
    as the authority's (:attr:`Commit.ahead`); it is only read, so sending
    it before the authority is confirmed changes nothing.

    ``register``: the object a file write will reference, locked and
    upserted (:func:`send_registration`) in that same round trip, so that
    the write's rows need no answer before the ``COMMIT``
    (:attr:`Commit.registered`, for :func:`write_file`). Only a write
    without an operation id does so: a replay commits without writing, and
    must not register an object nothing references. The upsert is undone
    with the rest if the write is refused.
    """
    counters = await _send_lock(conn, folder)
    early = None if ahead is None else await conn.execute(*ahead)
    # The receipt is looked up in the same round trip, and read only once
    # the authority is confirmed: a replay cannot outlive revocation.
    receipt = (
        None if operation_id is None else await _send_receipt_lookup(conn, folder, operation_id)
    )
    registered = None
    if register is not None and operation_id is None:
        registered = await send_registration(conn, folder.company_id, register)
    await policy.confirm(conn)
    await folder.counters.read(counters)
    replay = None if receipt is None else await _stored_answer(receipt, fp)
    commit = Commit(replay, touch=touch, ahead=early, registered=registered)
    yield commit
    if commit.replay is not None:
        return
    assert commit.result is not None
    if policy.agent_limits is not None:
        limits = policy.agent_limits
        folder.counters.check_agent_limits(
            limits.max_entries, limits.max_file_bytes, limits.max_total_bytes
        )
    folder.counters.check_entries(policy.max_folder_entries)
    await folder.counters.store(conn, folder.id, touch=commit.touch)
    if operation_id is not None:
        await store_receipt(conn, folder, operation_id, fp, commit.result)


def live_rows_query(folder_id: int, paths: Iterable[str], columns: str = "*") -> Query:
    """The live rows at ``paths`` (``columns`` of each), each found by its full key.

    Each path is looked up on its own by (folder, parent, path), in a
    ``LATERAL`` subquery its ``LIMIT`` keeps on the inner side of the loop, so
    both indexes that start with the folder (``files_live_path`` and
    ``files_children``) find it exactly. ``path = ANY(...)`` let a planner
    that misjudged the folder's size (a table never analyzed, or a folder
    larger than the average) scan the whole folder on ``folder_id`` alone, and
    each lookup grew with the folder.
    """
    wanted = list(paths)
    return (
        "SELECT f.* FROM unnest(%s::text[], %s::text[]) AS p(path, parent)"
        f" CROSS JOIN LATERAL (SELECT {columns} FROM files"
        "  WHERE folder_id = %s AND parent = p.parent AND path = p.path AND deleted_at IS NULL"
        "  LIMIT 1) AS f",
        (wanted, [parent_of(p) or "" for p in wanted], folder_id),
    )


LIVE_SUBTREE_SQL = (
    "SELECT {columns} FROM files WHERE folder_id = %(fid)s AND deleted_at IS NULL"
    " AND parent = %(root_parent)s AND path = %(root)s"
    " UNION ALL"
    " SELECT {columns} FROM files WHERE folder_id = %(fid)s AND deleted_at IS NULL"
    " AND path > (%(root)s || '/') COLLATE \"C\" AND path < (%(root)s || '0') COLLATE \"C\""
    ' AND parent >= %(root)s COLLATE "C" AND parent < (%(root)s || \'0\') COLLATE "C"'
)
"""The live rows at ``%(root)s`` and below it, as ranges of both folder indexes.

In byte order (``COLLATE "C"``) everything below ``root`` sorts between
``root/`` and ``root0`` ('/' is 0x2f, '0' is 0x30), and so do the parents of
everything below it, ``root`` itself first: ``files_live_path`` reads the
range of paths and ``files_children`` the range of parents, and neither
reads the rest of the folder (as ``left(path, n) = root || '/'`` did).
Parameters: ``fid``, ``root`` and ``root_parent`` (:func:`subtree_params`).
"""


def subtree_params(folder_id: int, root: str) -> dict[str, Any]:
    """The parameters of :data:`LIVE_SUBTREE_SQL`."""
    return {"fid": folder_id, "root": root, "root_parent": parent_of(root) or ""}


def path_rows_query(folder: Folder, path: str) -> Query:
    """The query of :func:`path_rows` (its answer: :func:`rows_by_path`)."""
    return live_rows_query(folder.id, [*ancestors(path), path])


async def rows_by_path(cur: AsyncCursor[Any]) -> dict[str, Row]:
    return {r["path"]: r for r in await cur.fetchall()}


async def path_rows(conn: AsyncConnection[Any], folder: Folder, path: str) -> dict[str, Row]:
    """The live rows at ``path`` and at each of its ancestors, in one query."""
    return await rows_by_path(await conn.execute(*path_rows_query(folder, path)))


async def ensure_parents(
    conn: AsyncConnection[Any], folder: Folder, path: str, found: dict[str, Row] | None = None
) -> None:
    """Create missing ancestor directories; a file in the way is a 409
    (ParentIsFile). ``found``: :func:`path_rows` of ``path``, when the caller
    has them already. (A checkpoint sends such a file to trash instead:
    :mod:`controller.changeset`.)"""
    wanted = list(ancestors(path))
    if not wanted:
        return
    existing = found if found is not None else await path_rows(conn, folder, path)
    for anc in wanted:
        row = existing.get(anc)
        if row is not None and row["kind"] != "directory":
            raise ParentIsFile(details=[{"path": anc}])
        if row is None:
            await _insert_row(conn, folder, anc, "directory", read=False)


async def _insert_row(
    conn: AsyncConnection[Any],
    folder: Folder,
    path: str,
    kind: str,
    *,
    digest: str | None = None,
    byte_size: int = 0,
    executable: bool = False,
    content_type: str | None = None,
    read: bool = True,
) -> Row:
    """Insert a live row. ``read``: return the row as the database answers it
    (``RETURNING *``); without, the statement's answer is not waited for (in
    pipeline mode it comes with the next round trip, its error too) and the
    row returned is the one the statement writes (:func:`_write_row`)."""
    values: Row = {
        "id": uuid.uuid4(),
        "folder_id": folder.id,
        "path": path,
        "parent": parent_of(path) or "",
        "kind": kind,
        "digest": digest,
        "byte_size": byte_size,
        "executable": executable,
        "content_type": content_type,
        "version": folder.counters.take(),
    }
    row = await _write_row(
        conn,
        folder,
        "INSERT INTO files (id, folder_id, path, parent, kind, digest, byte_size, executable,"
        " content_type, version)"
        " VALUES (%(id)s, %(folder_id)s, %(path)s, %(parent)s, %(kind)s, %(digest)s,"
        " %(byte_size)s, %(executable)s, %(content_type)s, %(version)s)",
        values,
        {**values, "deleted_at": None, "trash_root": None},
        read=read,
    )
    folder.counters.count(1, byte_size)
    if kind == "file":
        folder.counters.wrote(path, byte_size)
    return row


async def _write_row(
    conn: AsyncConnection[Any],
    folder: Folder,
    sql: str,
    values: Row,
    written: Row,
    *,
    read: bool,
) -> Row:
    """Run ``sql``, an ``INSERT`` or ``UPDATE`` of one ``files`` row. ``read``:
    return the row as the database answers it (``RETURNING *``); without,
    do not wait for the answer and return ``written``, every column of the
    row as the statement writes it but ``updated_at``, which the statement
    sets (or leaves by default) to ``now()``: the transaction's time, read
    with the folder's counters."""
    cur = await conn.execute(sql + (" RETURNING *" if read else ""), values)
    if not read:
        assert folder.counters.now is not None
        return {**written, "updated_at": folder.counters.now}
    row: Row | None = await cur.fetchone()
    assert row is not None
    return row


async def create_empty_file(conn: AsyncConnection[Any], folder: Folder, path: str) -> Row:
    """An empty file at a free ``path`` under the folder lock (missing parents
    created); it references no stored object (:data:`EMPTY_DIGEST`)."""
    await ensure_parents(conn, folder, path)
    return await _insert_row(conn, folder, path, "file", digest=EMPTY_DIGEST)


async def register_object(
    conn: AsyncConnection[Any],
    company_id: str,
    digest: str,
    byte_size: int,
    ensure_object: EnsureObject,
    stored_after: StoreMark | None = None,
) -> None:
    """Lock the object, upsert its row, then make sure the bytes exist: with
    ``ensure_object`` when a sweep may have deleted them since ``stored_after``
    (always, without a mark)."""
    pending = PendingObject(digest, byte_size, stored_after)
    if await (await send_registration(conn, company_id, pending)).swept():
        await ensure_object(object_key(company_id, digest))


UPSERT_OBJECTS_SQL = (
    "INSERT INTO objects (company_id, digest, byte_size)"
    " SELECT %(company)s, d, s FROM unnest(%(digests)s::text[], %(sizes)s::bigint[]) AS u(d, s)"
    " ON CONFLICT (company_id, digest) DO UPDATE SET byte_size = EXCLUDED.byte_size"
)


async def upsert_objects(
    conn: AsyncConnection[Any], company_id: str, sizes: dict[str, int], mark: StoreMark | None
) -> list[str]:
    """Upsert the ``objects`` rows of ``sizes`` (digest to byte size), whose
    object locks the caller holds (:func:`lock_object`, so no sweep of them
    is in flight), in one statement that also answers which of them a GC
    sweep may have deleted since ``mark`` was taken (all of them without a
    mark): the digests whose bytes the caller must check.

    A sweep deletes the bytes under the object lock, then stamps the entries
    it settles with a mark drawn after the delete (:mod:`controller.gc`). So
    a delete after this writer stored the bytes carries a later mark, and a
    sweep that deleted them but could not commit leaves its entry due and
    unsettled, which counts too. Neither kind exists in the common case: a
    write's own entries are not due for ``gc_delay``."""
    return await (await _send_upsert_objects(conn, company_id, sizes, mark)).swept()


@dataclass(frozen=True)
class Registration:
    """The answer to :func:`upsert_objects`, still to be read; for one object,
    :func:`send_registration`'s."""

    digests: list[str]
    cur: AsyncCursor[Any] | None

    async def swept(self) -> list[str]:
        if self.cur is None:
            return self.digests
        return sorted(row["digest"] for row in await self.cur.fetchall())


async def _send_upsert_objects(
    conn: AsyncConnection[Any], company_id: str, sizes: dict[str, int], mark: StoreMark | None
) -> Registration:
    digests = sorted(sizes)
    params = {
        "company": company_id,
        "digests": digests,
        "sizes": [sizes[d] for d in digests],
        "mark": mark,
    }
    if mark is None:
        await conn.execute(UPSERT_OBJECTS_SQL, params)
        return Registration(digests, None)
    cur = await conn.execute(f"WITH up AS ({UPSERT_OBJECTS_SQL}) {SWEPT_SINCE_SQL}", params)
    return Registration(digests, cur)


STORE_MARK_SQL = "nextval('object_deletion_marks')"
"""The expression that draws a store mark (a statement may draw one along
with other work: :func:`controller.auth.token_write_access`)."""


async def take_store_mark(conn: AsyncConnection[Any]) -> StoreMark:
    """A mark to take before storing bytes that a later transaction registers
    (:func:`upsert_objects`)."""
    cur = await conn.execute(f"SELECT {STORE_MARK_SQL} AS mark")
    row = await cur.fetchone()
    assert row is not None
    return StoreMark(int(row["mark"]))


SWEPT_SINCE_SQL = (
    "SELECT DISTINCT digest FROM deletion_journal"
    " WHERE company_id = %(company)s AND digest = ANY(%(digests)s)"
    " AND ((done_at IS NULL AND not_before <= clock_timestamp())"
    "  OR (outcome = 'deleted' AND (deleted_mark IS NULL OR deleted_mark > %(mark)s)))"
)


OBJECT_LOCK_CLASS = 0x6F626A
"""First key of the two-key advisory locks on objects; two-key locks never
collide with the one-key folder locks."""


async def lock_object(conn: AsyncConnection[Any], company_id: str, digest: str) -> None:
    """Serialize a writer and the GC sweeper on one object, row or no row.

    A row lock is not enough: when the ``objects`` row does not exist yet (or
    was just swept), ``FOR UPDATE`` locks nothing and a sweep could delete
    the bytes a first writer is about to reference.
    """
    await conn.execute(
        "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
        (OBJECT_LOCK_CLASS, f"{company_id}:{digest}"),
    )


@dataclass(frozen=True)
class PendingObject:
    """An object a write is about to reference: its digest and size, and the
    store mark taken before its bytes were stored (:func:`register_object`)."""

    digest: str
    byte_size: int
    stored_after: StoreMark | None


async def send_registration(
    conn: AsyncConnection[Any], company_id: str, pending: PendingObject
) -> Registration:
    """Lock the object and upsert its row, without waiting for the answer:
    :meth:`Registration.swept` reads it (:func:`register_object`'s steps)."""
    await lock_object(conn, company_id, pending.digest)
    return await _send_upsert_objects(
        conn, company_id, {pending.digest: pending.byte_size}, pending.stored_after
    )


async def journal_deletion(
    conn: AsyncConnection[Any], company_id: str, digests: list[str], reason: str, delay: timedelta
) -> None:
    if not digests:
        return
    await conn.execute(
        "INSERT INTO deletion_journal (company_id, digest, reason, not_before)"
        " SELECT %s, d, %s, now() + %s FROM unnest(%s::text[]) AS d",
        (company_id, reason, delay, sorted(set(digests))),
    )


async def write_file(
    conn: AsyncConnection[Any],
    folder: Folder,
    *,
    path: str,
    digest: str,
    byte_size: int,
    executable: bool,
    content_type: str | None,
    ensure_object: EnsureObject,
    gc_delay: timedelta,
    found: dict[str, Row] | None = None,
    stored_after: StoreMark | None = None,
    registered: Registration | None = None,
) -> tuple[Row, bool]:
    """Write one file under the folder lock; returns (row, created).
    A directory at ``path`` is a KindConflict. ``found``: :func:`path_rows`
    of ``path``, when the caller has them already; ``stored_after``: see
    :func:`register_object`.

    ``registered``: the object, already locked and upserted in this
    transaction (:attr:`Commit.registered`) and its answer read with the
    folder's. Its bytes are then checked first, and the rows are written
    without waiting for their answers: the row returned is the one written
    (in pipeline mode the statements go with the ``COMMIT``, and an error
    of theirs is raised there)."""
    if found is None:
        found = await path_rows(conn, folder, path)
    await ensure_parents(conn, folder, path, found)
    existing = found.get(path)
    if existing is not None and existing["kind"] != "file":
        raise KindConflict(details=[{"path": path, "kind": existing["kind"]}])
    if registered is not None:
        # Under the object lock since it was sent: no sweep can come between.
        if await registered.swept():
            await ensure_object(object_key(folder.company_id, digest))
        return await _write_file_row(
            conn, folder, existing, path, digest, byte_size, executable, content_type, gc_delay,
            read=False,
        )  # fmt: skip
    # register_object, with the bytes checked once the row referencing them
    # is written too (in pipeline mode its statement goes with the upsert's):
    # both happen under the object lock, in this transaction, before it commits.
    upserted = await send_registration(
        conn, folder.company_id, PendingObject(digest, byte_size, stored_after)
    )
    row, created = await _write_file_row(
        conn, folder, existing, path, digest, byte_size, executable, content_type, gc_delay
    )
    if await upserted.swept():
        await ensure_object(object_key(folder.company_id, digest))
    return row, created


async def _write_file_row(
    conn: AsyncConnection[Any],
    folder: Folder,
    existing: Row | None,
    path: str,
    digest: str,
    byte_size: int,
    executable: bool,
    content_type: str | None,
    gc_delay: timedelta,
    *,
    read: bool = True,
) -> tuple[Row, bool]:
    """``read``: as for :func:`_insert_row`."""
    if existing is None:
        row = await _insert_row(
            conn,
            folder,
            path,
            "file",
            digest=digest,
            byte_size=byte_size,
            executable=executable,
            content_type=content_type,
            read=read,
        )
        return row, True
    values = {
        "digest": digest,
        "byte_size": byte_size,
        "executable": executable,
        "content_type": content_type,
        "version": folder.counters.take(),
        "id": existing["id"],
    }
    updated = await _write_row(
        conn,
        folder,
        "UPDATE files SET digest = %(digest)s, byte_size = %(byte_size)s,"
        " executable = %(executable)s, content_type = %(content_type)s,"
        " version = %(version)s, updated_at = now() WHERE id = %(id)s",
        values,
        {**existing, **values},
        read=read,
    )
    folder.counters.count(0, byte_size - int(existing["byte_size"]))
    folder.counters.wrote(path, byte_size)
    if existing["digest"] != digest:
        await journal_deletion(
            conn, folder.company_id, [existing["digest"]], "superseded", gc_delay
        )
    return updated, False


async def make_directory(conn: AsyncConnection[Any], folder: Folder, path: str) -> tuple[Row, bool]:
    """Create a directory under the folder lock; returns (row, created)."""
    found = await path_rows(conn, folder, path)
    await ensure_parents(conn, folder, path, found)
    existing = found.get(path)
    if existing is not None and existing["kind"] != "directory":
        raise KindConflict(details=[{"path": path, "kind": existing["kind"]}])
    if existing is not None:
        return existing, False
    return await _insert_row(conn, folder, path, "directory"), True


def _subtree_clause(column: str = "path") -> str:
    # Not LIKE: '%' and '_' are legal in names and would act as wildcards.
    return f"({column} = %(root)s OR left({column}, length(%(root)s) + 1) = %(root)s || '/')"


async def _trash_subtree(conn: AsyncConnection[Any], folder: Folder, target: Row) -> list[Row]:
    """Move ``target`` and everything below it to trash with one shared deletedAt."""
    subtree = LIVE_SUBTREE_SQL.format(columns="id, path")
    cur = await conn.execute(
        "UPDATE files f SET deleted_at = now(), trash_root = %(tid)s, version = %(base)s + t.n"
        " FROM (SELECT id, row_number() OVER (ORDER BY path) AS n"
        f"  FROM ({subtree}) AS s) AS t"
        " WHERE f.id = t.id RETURNING f.*",
        {"tid": target["id"], "base": folder.counters.base(),
         **subtree_params(folder.id, target["path"])},
    )  # fmt: skip
    rows = await cur.fetchall()
    folder.counters.take(len(rows))
    folder.counters.count(-len(rows), -sum(int(r["byte_size"]) for r in rows))
    return sorted(rows, key=lambda r: r["path"])


async def trash_path(conn: AsyncConnection[Any], folder: Folder, path: str) -> list[Row] | None:
    """Trash ``path``'s subtree under the folder lock; None when nothing lives there."""
    target = await live_row(conn, folder, path)
    if target is None:
        return None
    return await _trash_subtree(conn, folder, target)


async def trash_batch(conn: AsyncConnection[Any], folder: Folder, file_id: str) -> list[Row]:
    """The trashed entry ``file_id`` and its descendants from the same delete."""
    try:
        key = uuid.UUID(file_id)
    except ValueError:
        raise FileNotFound(details=[{"fileId": file_id}]) from None
    cur = await conn.execute(
        "SELECT * FROM files WHERE id = %s AND folder_id = %s AND deleted_at IS NOT NULL",
        (key, folder.id),
    )
    top = await cur.fetchone()
    if top is None:
        raise FileNotFound(details=[{"fileId": file_id}])
    cur = await conn.execute(
        "SELECT * FROM files WHERE folder_id = %(fid)s AND trash_root = %(tr)s"
        " AND deleted_at = %(da)s AND " + _subtree_clause() + " ORDER BY path",
        {"fid": folder.id, "tr": top["trash_root"], "da": top["deleted_at"], "root": top["path"]},
    )
    return list(await cur.fetchall())


async def check_restore_paths_free(
    conn: AsyncConnection[Any], folder: Folder, paths: list[str]
) -> None:
    """RestoreCollision (naming every occupied path) unless all ``paths`` are free."""
    cur = await conn.execute(*live_rows_query(folder.id, set(paths), "path"))
    occupied = sorted(r["path"] for r in await cur.fetchall())
    if occupied:
        raise RestoreCollision(details=[{"path": p} for p in occupied])


def count_revived(folder: Folder, rows: list[Row]) -> None:
    """Rows taken out of the trash count again, as entries, bytes and written files."""
    folder.counters.count(len(rows), sum(int(r["byte_size"]) for r in rows))
    for r in rows:
        if r["kind"] == "file":
            folder.counters.wrote(r["path"], int(r["byte_size"]))
