"""The agent folder contract (docs/internals/invariants.md): the instruction entry and
the storage limits' warnings.

**The entry.** Each agent has one instruction entry in its folder
(``agents.entry_path``, ``AGENTS.md`` by default). It is valid UTF-8 of at most
1 MiB and cannot be deleted: a person's delete or move of it (or of a
directory holding it) is 409 ``entry_protected``; a checkpoint entry that
would delete it, replace it by a directory or write invalid content is left
out of that checkpoint and reported in its receipt (``refusedEntries``),
while the checkpoint's other entries are applied. A new agent's folder
starts with an empty entry, which needs no stored object
(:data:`controller.foldercore.EMPTY_DIGEST`).

**The limits** (``controller.config.AgentLimits``) are sync-validation limits:
checked when a save commits (``foldercore.committing``, through
``FolderCounters.check_agent_limits``), never while the agent writes. A
folder at or over one is reported as a warning of each run
(:func:`limit_warnings`) until it is back under.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from common.errors import (
    AgentFilesLimitExceeded,
    AgentNotFound,
    EntryNotUtf8,
    EntryProtected,
    EntryTooLarge,
    KindConflict,
    NotFound,
    WorkFolderError,
)
from common.limits import DEFAULT_AGENT_ENTRY, ENTRY_MAX_BYTES
from common.paths import is_within, validate_path
from controller import foldercore, receipts
from controller.changeset import Entry, live_on_their_own
from controller.config import AgentLimits

ReadSmall = Callable[[str], Awaitable[bytes]]
"""The bytes of a stored object of at most :data:`ENTRY_MAX_BYTES` (by digest)."""


# --- the entry -----------------------------------------------------------------


async def agent_entry(
    conn: AsyncConnection[Any], company_id: str, agent_id: str, *, lock: bool = False
) -> str | None:
    """The agent's entry path; None when the company has no such agent. With
    ``lock`` (after the folder lock: that order everywhere) the agent row is
    share-locked, so ``set-agent-entry`` waits for the write."""
    cur = await conn.execute(
        "SELECT entry_path FROM agents WHERE company_id = %s AND id::text = %s"
        + (" FOR SHARE" if lock else ""),
        (company_id, agent_id),
    )
    row = await cur.fetchone()
    return None if row is None else str(row["entry_path"])


def text_problem(data: bytes | None, size: int) -> WorkFolderError | None:
    """Why content of ``size`` bytes (``data``: those bytes, when small enough
    to have been read) cannot be an entry; None when it can."""
    if size > ENTRY_MAX_BYTES:
        return EntryTooLarge(
            f"The agent's instruction entry is limited to {ENTRY_MAX_BYTES} bytes; this is {size}",
            details=[{"limit": ENTRY_MAX_BYTES, "byteSize": size}],
        )
    assert data is not None and len(data) == size
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return EntryNotUtf8(
            f"The agent's instruction entry must be valid UTF-8 (invalid byte at {exc.start})",
            details=[{"offset": exc.start}],
        )
    return None


async def _ensure_empty_entry(
    conn: AsyncConnection[Any], folder: foldercore.Folder, path: str
) -> bool:
    """An empty entry at ``path`` unless something is there (under the folder lock)."""
    found = await foldercore.path_rows(conn, folder, path)
    if path in found or any(r["kind"] != "directory" for r in found.values()):
        return False
    await foldercore.create_empty_file(conn, folder, path)
    return True


async def create_agent(conn: AsyncConnection[Any], company_id: str, name: str) -> dict[str, Any]:
    """A new agent whose folder starts with an empty :data:`DEFAULT_AGENT_ENTRY`."""
    cur = await conn.execute(
        "INSERT INTO agents (id, company_id, name, entry_path)"
        " VALUES (gen_random_uuid(), %s, %s, %s) RETURNING id",
        (company_id, name, DEFAULT_AGENT_ENTRY),
    )
    row = await cur.fetchone()
    assert row is not None
    agent_id = str(row["id"])
    await ensure_entry(conn, company_id, agent_id)
    return {"id": agent_id, "entry_path": DEFAULT_AGENT_ENTRY}


async def ensure_entry(conn: AsyncConnection[Any], company_id: str, agent_id: str) -> bool:
    """Create the agent's empty entry when its folder has nothing at that path
    (a new agent, or one from before entries existed); True when created.
    A directory (or a file in place of a parent) at the path is left alone."""
    if await agent_entry(conn, company_id, agent_id) is None:
        raise NotFound(f"no agent {agent_id} in company {company_id}")
    folder = await foldercore.get_folder(conn, company_id, "agent", agent_id, create=True)
    assert folder is not None
    await foldercore.lock_folder(conn, folder)
    entry = await agent_entry(conn, company_id, agent_id, lock=True)
    assert entry is not None
    created = await _ensure_empty_entry(conn, folder, entry)
    await folder.counters.store(conn, folder.id, touch=created)
    return created


async def set_entry(
    conn: AsyncConnection[Any], agent_id: str, path: str, company_id: str | None = None
) -> dict[str, Any]:
    """Make ``path`` the agent's entry, creating it empty when nothing is there
    (``company_id``: the agent must be that company's, as a route asks).

    A directory there, or an existing file over 1 MiB, is refused; an existing
    file's encoding is checked at its next save (this runs without storage).
    """
    path = validate_path(path)
    cur = await conn.execute("SELECT company_id FROM agents WHERE id::text = %s", (agent_id,))
    row = await cur.fetchone()
    if row is None or (company_id is not None and str(row["company_id"]) != company_id):
        raise AgentNotFound(f"no such agent: {agent_id}")
    company_id = str(row["company_id"])
    folder = await foldercore.get_folder(conn, company_id, "agent", agent_id, create=True)
    assert folder is not None
    # Lock order, as every write: the folder, then the agent row.
    await foldercore.lock_folder(conn, folder)
    await conn.execute("SELECT 1 FROM agents WHERE id = %s FOR UPDATE", (agent_id,))
    existing = await foldercore.live_row(conn, folder, path)
    if existing is not None and existing["kind"] != "file":
        raise KindConflict(f"{path} is a directory", details=[{"path": path, "kind": "directory"}])
    if existing is not None and int(existing["byte_size"]) > ENTRY_MAX_BYTES:
        raise EntryTooLarge(
            f"{path} is {existing['byte_size']} bytes; an entry is limited to {ENTRY_MAX_BYTES}",
            details=[{"path": path, "byteSize": int(existing["byte_size"])}],
        )
    created = False
    if existing is None:
        await foldercore.create_empty_file(conn, folder, path)
        created = True
    await folder.counters.store(conn, folder.id, touch=created)
    await conn.execute("UPDATE agents SET entry_path = %s WHERE id = %s", (path, agent_id))
    return {"agent_id": agent_id, "entry_path": path, "created": created}


async def guard_entry_removal(
    conn: AsyncConnection[Any], company_id: str, agent_id: str, path: str
) -> None:
    """A person's delete or move of ``path``: 409 when it is the entry or holds it."""
    entry = await agent_entry(conn, company_id, agent_id, lock=True)
    if entry is not None and is_within(entry, path):
        raise EntryProtected(
            f"{entry} is the agent's instruction entry; it cannot be deleted or moved",
            details=[{"path": path, "entry": entry}],
        )


async def guard_entry_write(
    conn: AsyncConnection[Any],
    company_id: str,
    agent_id: str,
    path: str,
    problem: WorkFolderError | None,
) -> None:
    """A person's upload to ``path``: refused when it is the entry and the
    content (checked before, as ``problem``) cannot be one."""
    entry = await agent_entry(conn, company_id, agent_id, lock=True)
    if entry == path and problem is not None:
        details = [{"path": path, **d} for d in problem.details or [{}]]
        raise type(problem)(problem.text, details=details)


def _refusal(path: str, exc: WorkFolderError) -> dict[str, Any]:
    return {"path": path, "code": exc.code.upper(), "message": exc.text}


def _removes_entry(e: Entry, entry: str) -> bool:
    """Whether applying ``e`` would take the entry away: deleting it or a
    directory holding it, a directory at it or below it (the file in the way
    goes to the trash), or a file in place of a directory holding it."""
    if e.op == "delete":
        return is_within(entry, e.path)
    if e.op == "mkdir":
        return is_within(e.path, entry)
    return e.path != entry and (is_within(entry, e.path) or is_within(e.path, entry))


async def screen_checkpoint(
    conn: AsyncConnection[Any],
    company_id: str,
    agent_id: str,
    entries: Sequence[Entry],
    sizes: dict[str, int],
    read_small: ReadSmall,
) -> tuple[list[Entry], list[dict[str, Any]]]:
    """A checkpoint's entries without those that break the entry's rules, and
    those refused (``{"path", "code", "message"}``, for the receipt).

    Refused: deleting the entry or a directory holding it; a directory at the
    entry or below it (which would send the entry to the trash); a file in
    place of a directory holding it; a put of the entry that is over 1 MiB
    or not UTF-8 (its bytes are read from storage: at most 1 MiB).
    """
    entry = await agent_entry(conn, company_id, agent_id, lock=True)
    if entry is None:
        return list(entries), []
    kept: list[Entry] = []
    refused: list[dict[str, Any]] = []
    protected = EntryProtected(f"{entry} is the agent's instruction entry")
    for e in entries:
        problem: WorkFolderError | None = None
        if _removes_entry(e, entry):
            problem = protected
        elif e.op == "put" and e.path == entry:
            assert e.digest is not None
            size = sizes[e.digest]
            data = await read_small(e.digest) if 0 < size <= ENTRY_MAX_BYTES else b""
            problem = text_problem(data, size)
        if problem is None:
            kept.append(e)
        else:
            refused.append(_refusal(e.path, problem))
    return kept, refused


# --- limits and their warnings ------------------------------------------------------

LIMIT_NAMES = {"entries": "files and folders", "fileBytes": "bytes per file", "totalBytes": "bytes"}


@dataclass(frozen=True)
class Usage:
    entries: int
    total_bytes: int
    largest: tuple[int, str] | None
    """The largest file at or over the per-file limit: (size, path)."""

    def to_json(self) -> dict[str, Any]:
        return {"entries": self.entries, "totalBytes": self.total_bytes}


async def folder_usage(
    conn: AsyncConnection[Any], folder: foldercore.Folder | None, limits: AgentLimits
) -> Usage:
    """The agent folder's counters, and its largest file when at or over the limit."""
    if folder is None:
        return Usage(0, 0, None)
    cur = await conn.execute(
        "SELECT live_entries, live_bytes FROM folders WHERE id = %s", (folder.id,)
    )
    row = await cur.fetchone()
    assert row is not None
    total = int(row["live_bytes"])
    largest = None
    # No file can reach the per-file limit while all of them together do not:
    # the common case skips the scan of the folder's rows.
    if total >= limits.max_file_bytes:
        cur = await conn.execute(
            "SELECT path, byte_size FROM files WHERE folder_id = %s AND deleted_at IS NULL"
            " AND kind = 'file' AND byte_size >= %s ORDER BY byte_size DESC, path LIMIT 1",
            (folder.id, limits.max_file_bytes),
        )
        big = await cur.fetchone()
        largest = None if big is None else (int(big["byte_size"]), str(big["path"]))
    return Usage(int(row["live_entries"]), total, largest)


def limit_warnings(usage: Usage, limits: AgentLimits) -> list[dict[str, Any]]:
    """``AGENT_FILES_AT_LIMIT`` for each limit the folder is at or over."""
    found: list[dict[str, Any]] = []
    if usage.largest is not None:
        size, path = usage.largest
        found.append(
            {"code": "AGENT_FILES_AT_LIMIT", "limit": "fileBytes", "max": limits.max_file_bytes,
             "value": size, "path": path,
             "message": f"{path} ({size} bytes) is at or over the {limits.max_file_bytes}-byte"
                        " limit per file of the agent folder"}
        )  # fmt: skip
    for name, value, top in (
        ("entries", usage.entries, limits.max_entries),
        ("totalBytes", usage.total_bytes, limits.max_total_bytes),
    ):
        if value >= top:
            found.append(
                {"code": "AGENT_FILES_AT_LIMIT", "limit": name, "max": top, "value": value,
                 "message": f"The agent folder holds {value} {LIMIT_NAMES[name]};"
                            f" its limit is {top}"}
            )  # fmt: skip
    return found


def check_checkpoint_entries(entries: Sequence[Entry], max_entries: int) -> None:
    """A checkpoint too large to apply (more entries than one may name, or
    rows than one may write: refused before any database work) whose own
    entries leave the agent folder past its entry limit is refused as that
    limit, 422 ``agent_files_limit_exceeded`` naming ``entries``: what the
    agent did (too many files and folders in one interval) and can undo by
    removing some, and a warning of the run rather than a malformed request
    that fails it. ``value`` is what the entries leave on their own
    (:func:`controller.changeset.live_on_their_own`): the folder would hold
    at least that many."""
    live = live_on_their_own(entries)
    if live > max_entries:
        raise AgentFilesLimitExceeded(
            f"An agent folder holds at most {max_entries} files and folders;"
            f" this save alone would leave {live}",
            details=[{"limit": "entries", "max": max_entries, "value": live}],
        )


def refusal_warning(exc: AgentFilesLimitExceeded) -> dict[str, Any]:
    """The run's warning for a save refused over a limit (details of the error)."""
    detail = dict((exc.details or [{}])[0])
    return {
        "code": "AGENT_FILES_LIMIT_EXCEEDED",
        **detail,
        "message": f"None of this save's agent-folder changes were saved: {exc.text}",
    }


async def record_api_save(
    conn: AsyncConnection[Any],
    folder: foldercore.Folder | None,
    *,
    run_id: str,
    company_id: str,
    agent_id: str,
    operation_id: str | None,
    limits: AgentLimits,
    files_changed: int = 0,
    refusal: WorkFolderError | None = None,
) -> None:
    """The save receipt of a run's write to its own agent folder through the
    API bridge (a ``PUT /content`` or an operation by sandbox code): ``saved``
    in the write's own transaction, else ``refused`` (``failed`` for an error
    on the controller's side) in a transaction of its own. Its warnings are the
    folder's limit warnings as it now is, after a limit refusal's own warning:
    a refusal of another kind does not clear a warning the folder still earns.
    The operation id is the request's ``Idempotency-Key``, when it has one."""
    warnings = limit_warnings(await folder_usage(conn, folder, limits), limits)
    if isinstance(refusal, AgentFilesLimitExceeded):
        warnings = [refusal_warning(refusal), *warnings]
    outcome = "saved" if refusal is None else "failed" if refusal.status >= 500 else "refused"
    await receipts.record(
        conn,
        run_id=run_id,
        company_id=company_id,
        scope="agent",
        owner_id=agent_id,
        operation_id=operation_id,
        outcome=outcome,
        code=None if refusal is None else refusal.code.upper(),
        error=None if refusal is None else refusal.text,
        details=None if refusal is None else refusal.details,
        warnings=warnings,
        files_changed=files_changed,
    )


async def describe_agent(
    conn: AsyncConnection[Any], company_id: str, agent_id: str, limits: AgentLimits
) -> dict[str, Any] | None:
    """The agent's name, entry, limits and usage (for the Instructions editor)."""
    cur = await conn.execute(
        "SELECT id, name, entry_path FROM agents WHERE company_id = %s AND id::text = %s",
        (company_id, agent_id),
    )
    row = await cur.fetchone()
    if row is None:
        return None
    folder = await foldercore.get_folder(conn, company_id, "agent", agent_id, create=False)
    usage = await folder_usage(conn, folder, limits)
    return {
        "id": str(row["id"]),
        "name": row["name"],
        "entryPath": row["entry_path"],
        "limits": {
            "entries": limits.max_entries,
            "fileBytes": limits.max_file_bytes,
            "totalBytes": limits.max_total_bytes,
            "entryBytes": ENTRY_MAX_BYTES,
        },
        "usage": usage.to_json(),
        "warnings": limit_warnings(usage, limits),
    }
