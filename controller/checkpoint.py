"""Validate and apply a checkpoint from a sandbox: all entries or none.

The sandbox is untrusted, so everything is checked here before anything is
written: path rules, entry shapes, limits, and that every referenced digest is
already visible to this folder (its live files or trash) or was uploaded by
this very run. Without that last rule a sandbox could claim another tenant's
object by naming its hash.

Apply order inside one transaction (``foldercore.committing``): lock the folder,
re-check the run's lease (and its user's write right for the user folder, its
user's configure permission for the agent folder), check the receipt, claim
the referenced digests (one query), leave out the entries the folder refuses
one by one (the agent's instruction entry: :mod:`controller.agentfiles`),
apply the rest in order with last-writer-wins as one change set
(:mod:`controller.changeset`; a conflicting server entry of the other kind
goes to trash), check the agent folder's storage limits and the entry limit,
store the counters and the receipt, advance the run's baseline, record the
save on the run and its save receipt (:mod:`controller.receipts`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection

from common.bridge import (
    LOCAL_REFUSAL_CODES,
    MAX_CHECKPOINT_ENTRIES,
    MAX_LOCAL_REFUSAL_PATH,
    MAX_LOCAL_REFUSALS,
)
from common.errors import StaleLease, UnknownContent, ValidationError
from common.paths import validate_path
from common.text import operation_id_problem
from controller import agentfiles, foldercore, receipts
from controller.auth import (
    RunBinding,
    confirm_member_writes,
    confirm_run_agent_writes,
    locked_lease,
)
from controller.changeset import Entry, apply_changes
from controller.config import Quotas
from controller.quotas import UNEXPIRED, checkpoint_row_bound, raise_row_limit
from controller.rowjson import iso

Screen = Callable[
    [AsyncConnection[Any], Sequence[Entry], dict[str, int]],
    Awaitable[tuple[list[Entry], list[dict[str, Any]]]],
]
"""Leaves out the entries a folder refuses one by one (the agent's instruction
entry: :func:`controller.agentfiles.screen_checkpoint`) and lists them."""

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_OP_FIELDS = {
    "put": {"op", "path", "digest", "executable"},
    "mkdir": {"op", "path"},
    "delete": {"op", "path"},
}


@dataclass(frozen=True)
class Checkpoint:
    operation_id: str
    lease_epoch: int
    final: bool
    entries: list[Entry]
    local_refusals: list[dict[str, str]] = field(default_factory=list)
    """Paths the sandbox refused itself (``{"path", "code"}``): receipt only."""
    local_refused_more: int = 0

    def fingerprint(self) -> str:
        extra: dict[str, Any] = {}
        if self.local_refusals or self.local_refused_more:
            # Only when present: fingerprints of bodies without them stay as they were.
            extra["localRefusals"] = [[r["path"], r["code"]] for r in self.local_refusals]
            extra["localRefusedMore"] = self.local_refused_more
        return foldercore.fingerprint(
            action="checkpoint",
            final=self.final,
            entries=[[e.op, e.path, e.digest, e.executable] for e in self.entries],
            **extra,
        )

    def sandbox_refused(self) -> list[dict[str, Any]]:
        """The sandbox's refusals as receipt entries; the message is the
        controller's own text for the code, never the sandbox's."""
        return [
            {**r, "message": LOCAL_REFUSAL_MESSAGES[r["code"]], "by": "sandbox"}
            for r in self.local_refusals
        ]


LOCAL_REFUSAL_MESSAGES = {
    "symlink": "a symbolic link is not saved",
    "hard_link": "a file with more than one link is not saved",
    "special_file": "a FIFO, socket or device is not saved",
    "invalid_name": "the name breaks the path rules",
    "file_too_large": "the file is over the per-file limit",
    "entry_limit": "the folder is at its entry limit",
    "unreadable": "the sandbox could not read it",
}
assert set(LOCAL_REFUSAL_MESSAGES) == LOCAL_REFUSAL_CODES


def parse_local_refusals(
    raw: object, more: object, bad: Callable[[str, str, str], None]
) -> tuple[list[dict[str, str]], int]:
    """The body's ``localRefusals`` and ``localRefusedMore`` (common/bridge.py),
    untrusted: every problem goes to ``bad``."""
    if not isinstance(more, int) or isinstance(more, bool) or not 0 <= more <= 1 << 31:
        bad("localRefusedMore", "invalid", "localRefusedMore must be a count (0 to 2^31)")
        more = 0
    if not isinstance(raw, list):
        bad("localRefusals", "invalid", "localRefusals must be a list")
        return [], 0
    if len(raw) > MAX_LOCAL_REFUSALS:
        bad("localRefusals", "too_many", f"at most {MAX_LOCAL_REFUSALS} local refusals listed")
        return [], 0
    out: list[dict[str, str]] = []
    for i, r in enumerate(raw):
        where = f"localRefusals[{i}]"
        if not isinstance(r, dict) or set(r) != {"path", "code"}:
            bad(where, "invalid_fields", "a local refusal is exactly {path, code}")
            continue
        code, path = r["code"], r["path"]
        if not isinstance(code, str) or code not in LOCAL_REFUSAL_CODES:
            bad(
                f"{where}.code",
                "invalid_code",
                f"code must be one of {sorted(LOCAL_REFUSAL_CODES)}",
            )
            continue
        if code != "invalid_name":
            try:
                validate_path(path, f"{where}.path")
            except ValidationError as exc:
                for d in exc.details or []:
                    bad(d.get("field", where), d.get("code", "invalid"), d.get("message", ""))
                continue
        elif (
            not isinstance(path, str)
            or not 1 <= len(path) <= MAX_LOCAL_REFUSAL_PATH
            or not path.isprintable()
        ):
            # A name the path rules refuse, shown escaped by the sandbox: any
            # printable text, never a control character or a lone surrogate.
            bad(
                f"{where}.path",
                "invalid",
                f"path must be 1-{MAX_LOCAL_REFUSAL_PATH} printable characters",
            )
            continue
        assert isinstance(path, str)
        out.append({"path": path, "code": code})
    return out, int(more)


def parse_checkpoint(
    body: dict[str, Any],
    max_rows: int | None = None,
    *,
    max_entries: int = MAX_CHECKPOINT_ENTRIES,
    agent_max_entries: int | None = None,
) -> Checkpoint:
    """Shape and path validation; raises ValidationError listing every problem.

    A checkpoint naming more than ``max_entries`` entries is refused
    (``too_many``); with ``max_rows``, also one that could create more rows
    than that, counting every parent directory (CheckpointRowLimit). Both
    bound the work of one request, before any database work.

    ``agent_max_entries``: the folder is an agent's, with that entry limit.
    Both bounds are then at least twice that limit, so that one checkpoint
    can replace every entry the folder may hold (a deletion for each old
    path, a put for each new one): a stopped run's agent-folder changes are
    saved whole or not at all, so fsagent never splits
    an agent folder's save by entries. A checkpoint over either bound is
    then parsed in full (the body's size bounds that) and, when its own
    entries leave the folder past the limit,
    refused as the limit the agent can act on (AgentFilesLimitExceeded,
    :func:`controller.agentfiles.check_checkpoint_entries`): an agent that
    wrote more than 100,000 files in one interval is over its folder's limit,
    which is a warning of its run, not a malformed request.
    """
    if agent_max_entries is not None:
        max_entries = max(max_entries, 2 * agent_max_entries)
        if max_rows is not None:
            max_rows = max(max_rows, 2 * agent_max_entries)
    problems: list[dict[str, Any]] = []

    def bad(field: str, code: str, message: str) -> None:
        problems.append({"field": field, "code": code, "message": message})

    extra = set(body) - {
        "operationId",
        "leaseEpoch",
        "final",
        "finalSave",
        "entries",
        "localRefusals",
        "localRefusedMore",
    }
    for f in sorted(extra):
        bad(f, "unexpected_field", f"{f} is not allowed")
    op_id = body.get("operationId")
    if (problem := operation_id_problem(op_id)) is not None:
        bad("operationId", problem[0], "operationId must be 1-256 printable characters")
    epoch = body.get("leaseEpoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
        bad("leaseEpoch", "invalid", "leaseEpoch must be a positive integer")
    final = body.get("final", False)
    if not isinstance(final, bool):
        bad("final", "invalid", "final must be a boolean")
    if not isinstance(body.get("finalSave", False), bool):
        bad("finalSave", "invalid", "finalSave must be a boolean")
    raw_entries = body.get("entries")
    entries: list[Entry] = []
    if not isinstance(raw_entries, list):
        bad("entries", "invalid", "entries must be a list")
        raw_entries = []
    too_many = len(raw_entries) > max_entries
    if too_many and agent_max_entries is None:
        bad("entries", "too_many", f"at most {max_entries} entries per checkpoint")
        raw_entries = []
    local_refusals, local_more = parse_local_refusals(
        body.get("localRefusals", []), body.get("localRefusedMore", 0), bad
    )
    for i, raw in enumerate(raw_entries):
        where = f"entries[{i}]"
        op = raw.get("op") if isinstance(raw, dict) else None
        if not isinstance(op, str) or op not in _OP_FIELDS:
            bad(where, "invalid_op", "op must be put, mkdir or delete (no links or special files)")
            continue
        if set(raw) != _OP_FIELDS[raw["op"]]:
            bad(
                where,
                "invalid_fields",
                f"{raw['op']} takes exactly {sorted(_OP_FIELDS[raw['op']])}",
            )
            continue
        try:
            path = validate_path(raw["path"], f"{where}.path")
        except ValidationError as exc:
            problems.extend(exc.details or [])
            continue
        if raw["op"] == "put":
            digest, executable = raw["digest"], raw["executable"]
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                bad(f"{where}.digest", "invalid_digest", "digest must be lower-case hex SHA-256")
                continue
            if not isinstance(executable, bool):
                bad(f"{where}.executable", "invalid", "executable must be a boolean")
                continue
            entries.append(Entry("put", path, digest, executable))
        else:
            entries.append(Entry(raw["op"], path))
    if problems:
        raise ValidationError(problems[:100])
    assert isinstance(op_id, str) and isinstance(epoch, int)
    rows = 0 if max_rows is None else checkpoint_row_bound(e.path for e in entries)
    too_many_rows = max_rows is not None and rows > max_rows
    if agent_max_entries is not None and (too_many or too_many_rows):
        agentfiles.check_checkpoint_entries(entries, agent_max_entries)
    if too_many:
        raise ValidationError.single(
            "entries", "too_many", f"at most {max_entries} entries per checkpoint"
        )
    if too_many_rows:
        assert max_rows is not None
        raise_row_limit(rows, max_rows)
    return Checkpoint(op_id, epoch, bool(final), entries, local_refusals, local_more)


async def check_lease(conn: AsyncConnection[Any], run: RunBinding, epoch: int) -> None:
    """Fencing: only the newest lease of a sandbox may save.

    The run row stays locked (exclusively: the commit updates it at the end)
    until the commit, so one run's checkpoints of its four folders commit one
    after another; a shared lock here would let two of them deadlock on that
    final update.
    """
    row = await locked_lease(conn, run.run_id, "update")
    if row is None or epoch != row["lease_epoch"] or row["newest"] != row["lease_epoch"]:
        raise StaleLease(details=[{"leaseEpoch": epoch}])
    if not row["active"]:
        raise StaleLease("Run has ended; its lease is retired")


CLAIM_SQL = (
    "WITH claimed AS (UPDATE run_uploads SET committed_at = now()"
    "  WHERE run_id = %(rid)s AND digest = ANY(%(d)s) AND committed_at IS NULL AND "
    + UNEXPIRED
    + "  RETURNING digest, byte_size)"
    " SELECT digest, byte_size FROM claimed"
    " UNION SELECT digest, byte_size FROM run_uploads"
    "  WHERE run_id = %(rid)s AND digest = ANY(%(d)s) AND committed_at IS NOT NULL"
    " UNION SELECT u.digest, f.byte_size FROM unnest(%(d)s::text[]) AS u(digest)"
    "  CROSS JOIN LATERAL (SELECT byte_size FROM files"
    "   WHERE folder_id = %(fid)s AND digest = u.digest LIMIT 1) AS f"
)
"""One row per digest the run may reference. The folder's files are asked
once per digest (``files_folder_digest``, the first row will do): a digest
many of the folder's files share, such as an empty file's, is not read once
per file."""


async def claim_contents(
    conn: AsyncConnection[Any], folder: foldercore.Folder, run_id: str, digests: set[str]
) -> dict[str, int]:
    """Sizes of the digests this checkpoint may reference; UnknownContent otherwise.

    One query checks every pin: a digest is usable when this folder's files
    (live or trash) reference it, or this run uploaded it and the upload is
    committed or not yet expired. Uncommitted uploads are marked committed
    here, which row-locks them: the sweeper locks a digest's upload rows
    before it decides, so it either waits for this transaction (and then sees
    its files) or decides first, and then this claim re-reads the row at a
    later clock and finds it expired too. An expired upload no longer counts
    against the run's quota, so it may not be used either.
    """
    if not digests:
        return {}
    cur = await conn.execute(CLAIM_SQL, {"fid": folder.id, "rid": run_id, "d": sorted(digests)})
    sizes = {r["digest"]: int(r["byte_size"]) for r in await cur.fetchall()}
    missing = sorted(digests - set(sizes))
    if missing:
        raise UnknownContent(details=[{"digest": d} for d in missing[:20]])
    return sizes


async def apply_checkpoint(
    conn: AsyncConnection[Any],
    folder: foldercore.Folder,
    run: RunBinding,
    cp: Checkpoint,
    *,
    gc_delay: timedelta,
    quotas: Quotas,
    screen: Screen | None = None,
) -> dict[str, Any]:
    """Apply ``cp`` and record its save receipt (not for a replay: the
    operation already has one). An agent folder's storage limits are checked
    at commit; its receipt carries the folder's limit warnings."""

    async def confirm(c: AsyncConnection[Any]) -> None:
        await check_lease(c, run, cp.lease_epoch)
        if folder.scope == "user":
            assert run.user_id is not None
            await confirm_member_writes(c, run.company_id, run.user_id)
        if folder.scope == "agent":
            await confirm_run_agent_writes(c, run)

    agent_limits = quotas.agent if folder.scope == "agent" else None
    policy = foldercore.WritePolicy(confirm, quotas.max_folder_entries, agent_limits)
    fp = cp.fingerprint()
    async with foldercore.committing(
        conn, folder, cp.operation_id, fp, policy, touch=False
    ) as commit:
        if commit.replay is not None:
            return {**commit.replay, "replayed": True}
        commit.result = await _apply_entries(conn, folder, run, cp, gc_delay, screen)
    await conn.execute(
        "INSERT INTO sync_baselines (run_id, folder_id, version) VALUES (%s, %s, %s)"
        " ON CONFLICT (run_id, folder_id)"
        " DO UPDATE SET version = EXCLUDED.version, updated_at = now()",
        (run.run_id, folder.id, commit.result["highWater"]),
    )
    await conn.execute(
        "UPDATE runs SET state = 'saved', last_saved_at = now(), error = NULL,"
        " final_checkpoint_at = CASE WHEN %s THEN now() ELSE final_checkpoint_at END"
        " WHERE id = %s",
        (cp.final, run.run_id),
    )
    refused: list[dict[str, Any]] = commit.result.get("refusedEntries", [])
    warnings = [{**r, "message": f"{r['path']} was not saved: {r['message']}"} for r in refused]
    sandbox_refused = cp.sandbox_refused()
    if sandbox_refused or cp.local_refused_more:
        count = len(sandbox_refused) + cp.local_refused_more
        warnings.append(
            {
                "code": "SANDBOX_REFUSED",
                "count": count,
                "message": f"{count} path(s) refused in the sandbox were not saved"
                + (
                    f"; the first {len(sandbox_refused)} are listed"
                    if cp.local_refused_more
                    else ""
                ),
            }
        )
    if agent_limits is not None:
        usage = await agentfiles.folder_usage(conn, folder, agent_limits)
        warnings += agentfiles.limit_warnings(usage, agent_limits)
    await receipts.record(
        conn,
        run_id=run.run_id,
        company_id=run.company_id,
        scope=folder.scope,
        owner_id=folder.owner_id,
        operation_id=cp.operation_id,
        outcome="saved",
        warnings=warnings,
        refused_entries=refused + sandbox_refused,
        files_changed=len(cp.entries) - len(refused),
        final=cp.final,
    )
    return commit.result


async def _apply_entries(
    conn: AsyncConnection[Any],
    folder: foldercore.Folder,
    run: RunBinding,
    cp: Checkpoint,
    gc_delay: timedelta,
    screen: Screen | None,
) -> dict[str, Any]:
    digests = {e.digest for e in cp.entries if e.digest}
    sizes = await claim_contents(conn, folder, run.run_id, digests)
    entries, refused = (
        await screen(conn, cp.entries, sizes) if screen is not None else (cp.entries, [])
    )
    outcome = await apply_changes(conn, folder, entries, sizes, gc_delay)
    folder.counters.count(outcome.entries_delta, outcome.bytes_delta)
    if outcome.largest_written is not None:
        folder.counters.wrote(outcome.largest_written[1], outcome.largest_written[0])
    # The folder's counter (under its lock): every change of the folder,
    # this checkpoint's included, has a version at or below it, as the
    # manifest's highWater.
    cur = await conn.execute("SELECT now() AS t")
    row = await cur.fetchone()
    assert row is not None
    result: dict[str, Any] = {
        "operationId": cp.operation_id,
        "applied": True,
        "entries": len(cp.entries),
        "byteSize": sum(sizes[e.digest] for e in entries if e.op == "put" and e.digest),
        "highWater": folder.counters.base(),
        "savedAt": iso(row["t"]),
    }
    if refused:
        # fsagent keeps these paths unsaved (dirty) rather than taking them as saved.
        result["refusedEntries"] = refused
    return result
