"""The one-time import of an existing agent workspace into its agent folder
(``controller admin import-agent-files AGENT DIR [--dry-run]``).

The directory is scanned on the controller's host without following links:
symlinks, special files and files with more than one hard link (another
name of the same file may lie anywhere on the host's filesystem: an agent
that could write the directory could link ``/etc/shadow`` into it) are
reported, never followed or copied. Each file is then read through a
descriptor opened without following a link and checked to be the very file
the scan saw (device and inode), still with one link, so a name swapped for
a link or another file after the scan is refused, not read. Excluded
by name at any depth: CLI homes, caches, Git metadata, conventional
credential stores and reserved runtime names (:data:`EXCLUDED`,
:data:`EXCLUDED_PATHS`). Refused, each with its reason: names that break the
path rules, files over the agent folder's per-file limit, an instruction
entry that is not UTF-8 or over 1 MiB, and paths that collide with a file or
directory of the other kind already in the folder.

Bytes go to object storage first (each file hashed, then stored; a file that
changes meanwhile is refused), then one transaction writes every file under
the folder lock, checks the folder's storage limits (over one, nothing is
imported) and records the controller-side marker (``agent_imports``) that
refuses any later import of that agent. A replaced file's old content goes to
the trash, as with any upload. A dry run scans and reports, nothing more.
:func:`import_files` is the whole command over a ``runs.Transact``, so the
command line supplies only its transactions (``controller.admin``).

There is no REST route for it: DIR is a directory on the controller's host.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from common.errors import AgentNotFound, AppError, InvalidPath
from common.limits import ENTRY_MAX_BYTES
from common.paths import validate_path
from controller import foldercore
from controller.agentfiles import agent_entry, text_problem
from controller.config import AgentLimits
from controller.overwrite import keep_replaced
from controller.runs import Transact
from controller.storage.base import SourceMismatch, StorageProvider, object_key

_CLI_HOMES = (".codex", ".claude", ".gemini", ".cursor", ".opencode", ".pi", ".aider",
              ".continue", ".copilot", ".kimi", ".grok")  # fmt: skip
_CACHES = (".cache", "node_modules", "__pycache__", ".venv", ".npm", ".pnpm-store", ".yarn",
           ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", ".gradle", ".cargo")  # fmt: skip
_CREDENTIALS = (".ssh", ".aws", ".gnupg", ".netrc", ".docker", ".kube", ".azure",
                ".git-credentials", ".pypirc", ".npmrc", ".password-store")  # fmt: skip
EXCLUDED: dict[str, str] = {
    **dict.fromkeys(_CLI_HOMES, "CLI home"),
    **dict.fromkeys(_CACHES, "cache"),
    ".git": "Git metadata",
    **dict.fromkeys(_CREDENTIALS, "credentials"),
    ".paperclip-runtime": "reserved runtime directory",
}
"""Names excluded wherever they appear (file or directory), with the reason."""

EXCLUDED_PATHS: dict[str, str] = {
    ".config/gh": "credentials",
    ".config/gcloud": "credentials",
    ".config/git/credentials": "credentials",
}
"""Relative paths excluded (credential stores under ``.config``)."""


_HARD_LINKS = "{} hard links (the file has other names, perhaps outside the directory)"


class ImportRefused(AppError):
    """The import as a whole cannot run (imported before, no such directory):
    an operator's refusal, printed as one line by the CLI."""


@dataclass(frozen=True)
class SourceFile:
    path: str
    """Its work path in the agent folder."""
    src: Path
    size: int
    executable: bool
    identity: tuple[int, int]
    """(st_dev, st_ino) the scan saw: what is read must be that file."""


@dataclass
class Plan:
    """What a scan found: what to import, and what it leaves out and why."""

    files: list[SourceFile] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)
    excluded: list[dict[str, str]] = field(default_factory=list)
    refused: list[dict[str, str]] = field(default_factory=list)

    def refuse(self, path: str, reason: str) -> None:
        self.refused.append({"path": path, "reason": reason})

    def summary(self, agent_id: str, source: Path, dry_run: bool) -> dict[str, Any]:
        return {
            "agent_id": agent_id,
            "source": str(source),
            "dry_run": dry_run,
            "imported": [{"path": f.path, "bytes": f.size} for f in self.files],
            "directories": sorted(self.directories),
            "excluded": self.excluded,
            "refused": self.refused,
            "bytes": sum(f.size for f in self.files),
        }


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):  # fmt: skip
        if test(mode):
            return name
    return "special file"


def scan(source: Path, entry: str, limits: AgentLimits) -> Plan:
    """Walk ``source`` without following links (sorted, so reports are stable)."""
    if not source.is_dir():
        raise ImportRefused(f"{source} is not a directory")
    plan = Plan()

    def walk(directory: Path, prefix: str) -> None:
        with os.scandir(directory) as it:
            children = sorted(it, key=lambda e: os.fsencode(e.name))
        for child in children:
            name = os.fsdecode(child.name)
            rel = f"{prefix}{name}"
            shown = rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            reason = EXCLUDED.get(name) or EXCLUDED_PATHS.get(rel)
            if reason is not None:
                plan.excluded.append({"path": shown, "reason": reason})
                continue
            st = child.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                plan.refuse(shown, f"symlink to {os.readlink(child.path)!r}: not followed")
                continue
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                plan.refuse(shown, f"{_kind(st.st_mode)}: not imported")
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                plan.refuse(shown, f"{_HARD_LINKS.format(st.st_nlink)}: not imported")
                continue
            try:
                validate_path(rel)
            except InvalidPath as exc:
                detail = (exc.details or [{}])[0]
                plan.refuse(shown, f"breaks the path rules: {detail.get('message', exc.reason)}")
                continue
            if stat.S_ISDIR(st.st_mode):
                plan.directories.append(rel)
                walk(Path(child.path), rel + "/")
            elif st.st_size > limits.max_file_bytes:
                plan.refuse(
                    rel,
                    f"{st.st_size} bytes: over the agent folder's {limits.max_file_bytes}-byte"
                    " limit per file",
                )
            elif rel == entry and (problem := _entry_problem(Path(child.path), st.st_size)):
                plan.refuse(rel, f"the instruction entry: {problem}")
            else:
                executable = bool(st.st_mode & stat.S_IXUSR)
                plan.files.append(
                    SourceFile(
                        rel, Path(child.path), st.st_size, executable, (st.st_dev, st.st_ino)
                    )
                )

    walk(source, "")
    return plan


def _entry_problem(path: Path, size: int) -> str | None:
    data = path.read_bytes()[: ENTRY_MAX_BYTES + 1] if size <= ENTRY_MAX_BYTES else None
    problem = text_problem(data if data is not None and len(data) == size else None, size)
    return None if problem is None else problem.text


class NotTheScannedFile(OSError):
    """A planned file's name no longer leads to the file the scan saw, alone."""


def _hash(f: SourceFile) -> str:
    """The SHA-256 of the file the scan saw, read through a descriptor that
    followed no link at its last step and is checked to be that very file
    (an earlier step swapped for a link would lead to another inode). What
    storage then stores is compared with this digest, so the bytes stored
    are the bytes of that file, whatever its name leads to by then."""
    fd = os.open(f.src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != f.identity:
            raise NotTheScannedFile(f"{f.src} is no longer the file the scan saw")
        if st.st_nlink > 1:
            raise NotTheScannedFile(f"{f.src} now has {_HARD_LINKS.format(st.st_nlink)}")
        h = hashlib.sha256()
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def _agent(conn: AsyncConnection[Any], agent_id: str) -> tuple[str, str]:
    cur = await conn.execute("SELECT company_id FROM agents WHERE id = %s", (agent_id,))
    row = await cur.fetchone()
    if row is None:
        raise AgentNotFound(f"no such agent: {agent_id}")
    company_id = str(row["company_id"])
    entry = await agent_entry(conn, company_id, agent_id)
    assert entry is not None
    return company_id, entry


async def _refuse_replay(conn: AsyncConnection[Any], agent_id: str) -> None:
    cur = await conn.execute(
        "SELECT imported_at, source FROM agent_imports WHERE agent_id = %s", (agent_id,)
    )
    row = await cur.fetchone()
    if row is not None:
        raise ImportRefused(
            f"agent {agent_id} was already imported from {row['source']}"
            f" at {row['imported_at'].isoformat()}; an import runs once"
        )


async def plan_import(
    conn: AsyncConnection[Any], agent_id: str, source: Path, limits: AgentLimits
) -> tuple[str, Plan]:
    """Read side: the agent's company, and the scan (refused when imported before)."""
    company_id, entry = await _agent(conn, agent_id)
    await _refuse_replay(conn, agent_id)
    plan = await asyncio.to_thread(scan, source, entry, limits)
    return company_id, plan


async def store_objects(
    storage: StorageProvider, company_id: str, plan: Plan
) -> tuple[dict[str, tuple[str, int]], list[str]]:
    """Hash and store every planned file: {path: (digest, size)}, and the
    digests this call created (journaled as orphans if the import fails)."""
    stored: dict[str, tuple[str, int]] = {}
    created: list[str] = []
    kept: list[SourceFile] = []
    for f in plan.files:
        try:
            digest = await asyncio.to_thread(_hash, f)
            made = await asyncio.to_thread(
                storage.put_file, object_key(company_id, digest), f.src, f.size, digest
            )
        except (SourceMismatch, OSError) as exc:
            plan.refuse(f.path, f"could not be read whole (changed while imported?): {exc}")
            continue
        stored[f.path] = (digest, f.size)
        kept.append(f)
        if made:
            created.append(digest)
    plan.files = kept
    return stored, created


async def write_import(
    conn: AsyncConnection[Any],
    storage: StorageProvider,
    company_id: str,
    agent_id: str,
    source: Path,
    plan: Plan,
    stored: dict[str, tuple[str, int]],
    limits: AgentLimits,
    max_folder_entries: int,
    gc_delay: timedelta,
) -> dict[str, Any]:
    """Write side, one transaction: marker first (a concurrent import waits on
    it and then finds it), the folder's directories and files, its limits."""
    cur = await conn.execute(
        "INSERT INTO agent_imports (agent_id, source, summary) VALUES (%s, %s, '{}')"
        " ON CONFLICT (agent_id) DO NOTHING RETURNING agent_id",
        (agent_id, str(source)),
    )
    if await cur.fetchone() is None:
        await _refuse_replay(conn, agent_id)
    folder = await foldercore.get_folder(conn, company_id, "agent", agent_id, create=True)
    assert folder is not None
    await foldercore.lock_folder(conn, folder)
    for path in plan.directories:
        found = await foldercore.path_rows(conn, folder, path)
        if any(r["kind"] != "directory" for r in found.values()):
            plan.refuse(path, "a file of the folder is in the way")
            continue
        await foldercore.make_directory(conn, folder, path)
    imported: list[SourceFile] = []
    for f in plan.files:
        digest, _ = stored[f.path]
        found = await foldercore.path_rows(conn, folder, f.path)
        if any(r["kind"] != "directory" for p, r in found.items() if p != f.path) or (
            f.path in found and found[f.path]["kind"] != "file"
        ):
            plan.refuse(f.path, "collides with an entry of the other kind in the folder")
            continue
        existing = found.get(f.path)
        if existing is not None and int(existing["byte_size"]) > 0:
            await keep_replaced(conn, folder, existing, digest)

        async def ensure(key: str, f: SourceFile = f, digest: str = digest) -> None:
            if not await asyncio.to_thread(storage.exists, key):
                await asyncio.to_thread(storage.put_file, key, f.src, f.size, digest)

        await foldercore.write_file(
            conn, folder, path=f.path, digest=digest, byte_size=f.size,
            executable=f.executable, content_type=None, ensure_object=ensure, gc_delay=gc_delay,
        )  # fmt: skip
        imported.append(f)
    plan.files = imported
    folder.counters.check_agent_limits(
        limits.max_entries, limits.max_file_bytes, limits.max_total_bytes
    )
    folder.counters.check_entries(max_folder_entries)
    await folder.counters.store(conn, folder.id, touch=True)
    summary = plan.summary(agent_id, source, dry_run=False)
    await conn.execute(
        "UPDATE agent_imports SET summary = %s WHERE agent_id = %s", (Jsonb(summary), agent_id)
    )
    return summary


async def import_files(
    transact: Transact,
    storage: StorageProvider,
    agent_id: str,
    source: Path,
    *,
    dry_run: bool,
    limits: AgentLimits,
    max_folder_entries: int,
    gc_delay: timedelta,
) -> dict[str, Any]:
    """``import-agent-files``: the scan in one transaction, the bytes stored
    outside any, then the write in a second transaction (which finds the
    marker of an import that committed meanwhile and refuses). The summary.

    Bytes this call stored for an import that then fails are journaled as
    orphans, so GC collects them unless something references them."""
    company_id, plan = await transact(lambda c: plan_import(c, agent_id, source, limits))
    if dry_run:
        return plan.summary(agent_id, source, dry_run=True)
    stored, created = await store_objects(storage, company_id, plan)
    try:
        return await transact(
            lambda c: write_import(
                c, storage, company_id, agent_id, source, plan, stored, limits,
                max_folder_entries, gc_delay,
            )
        )  # fmt: skip
    except BaseException:
        if created:
            await transact(
                lambda c: foldercore.journal_deletion(
                    c, company_id, created, "orphaned import", gc_delay
                )
            )
        raise
