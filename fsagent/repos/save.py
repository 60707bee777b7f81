"""Repository checkpoints of one checkout: scan, upload what the controller
lacks, commit a delta against the current checkpoint.

One checkpoint (:meth:`RepoSaver.checkpoint`):

1. Refuse at once while a Git lock is held (:func:`fsagent.repos.capture.held_locks`):
   Git is changing the repository. The cadence tries again later.
2. Scan the members (:mod:`fsagent.scan.engine`: stable reads, the metadata cache,
   fingerprints before and after of ``.git``, of the files read and of the
   directories above them; a working-tree file not read that changes after
   its lstat is the next checkpoint's change). A tree that changed during
   the scan is scanned again, up to :data:`SCAN_RETRIES` more times, then the save fails
   visibly (:class:`fsagent.errors.TreeUnstable`). The lock check is
   repeated after the scan.
3. Compare with the base (the current checkpoint, read once from the
   controller and then kept in memory): only added or changed members and
   removed paths travel. Nothing changed: nothing is sent.
4. Ask which digests the task cannot reference yet (``/missing``), and
   upload only those, streamed from the checkout (no archive, no temporary
   copy): small files in batches, large ones in frames. Each file is opened
   again with the scan's rules and must still be the scanned inode with the
   scanned metadata, and the controller's digest must equal the scanned one;
   otherwise the file changed after the scan and the whole checkpoint starts
   over (counted as an unstable attempt). Torn content is never committed.
5. Commit. The operation id is derived from (run, workspace, body, the base
   last refused), so nothing is written before the transfer (the disk may be
   full) and a retry after a lost answer replays the same request. A
   ``base_mismatch`` (another writer advanced the pointer) sends the whole
   checkpoint instead.

The saver writes only two things, both optional: the metadata cache and a
status file (``status.json``), each replaced whole and each given up
quietly when the disk is full. A failed save changes nothing in the checkout.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import trio
import zstandard

from common.bridge import BATCH_MEMBER_MAX
from common.errors import BaseMismatch
from common.repos import GIT_DIR, MAX_REPO_ENTRIES
from fsagent.bridge.base import BridgeClient, RepoBinding, RunInfo
from fsagent.checkpoint.ship import (
    OVER_ALLOWANCE,
    UPLOAD_CONCURRENCY,
    batches,
    file_frames,
    raise_first_failure,
)
from fsagent.errors import (
    CheckoutUnsupported,
    ControllerRefused,
    ControllerUnavailable,
    FsagentError,
    GitCommandFailed,
    GitLockHeld,
    MemberChanged,
    ObjectUnavailable,
    RepoSaveFailed,
    TreeUnstable,
)
from fsagent.repos.capture import (
    GIT_OBJECTS,
    MAX_MEMBER_BYTES,
    MemberNames,
    WorktreeLister,
    check_layout,
    checkpoint_members,
    git_dir_members,
    git_immutable,
    held_locks,
    link_problem,
    portable_config_pairs,
)
from fsagent.scan.engine import (
    HASH_THREADS,
    Member,
    MetadataCache,
    Problem,
    ReadHook,
    ScanResult,
    ScanStats,
    StatKey,
    TreeScan,
    member_path,
    open_member,
)

log = logging.getLogger("fsagent.reposave")

SCAN_RETRIES: Final = 3
"""Scans after the first when the tree changed during one."""
RETRY_PAUSES: Final = (0.2, 0.5, 1.0)
PROBLEMS_SHOWN: Final = 50

WireKey = tuple[str, str | None, int, bool, str | None]


def wire_key(member: dict[str, Any]) -> WireKey:
    """What makes two wire members save the same."""
    kind = str(member["kind"])
    if kind == "file":
        return (kind, member["digest"], int(member["byteSize"]), bool(member["executable"]), None)
    if kind == "symlink":
        return (kind, None, 0, False, str(member["target"]))
    return (kind, None, 0, False, None)


def member_key(member: Member) -> WireKey:
    """:func:`wire_key` of a scanned member, without building its wire form."""
    if member.kind == "file":
        return ("file", member.digest, member.size, member.executable, None)
    if member.kind == "symlink":
        return ("symlink", None, 0, False, member.target)
    return (member.kind, None, 0, False, None)


@dataclass
class _Base:
    checkpoint_id: str
    members: dict[str, WireKey]
    config: list[tuple[str, str]]
    scanned: list[Member] | None = None
    """The scanned members (sorted by path) this process committed as the
    base: a member of the next scan equal to one of them (the scan reuses
    unchanged ones, so mostly the same object) saves the same."""

    def changed(self, members: list[Member]) -> list[Member]:
        """The members (sorted by path) that do not save as the base's."""
        keys = self.members
        last = self.scanned
        if not last:
            return [m for m in members if keys.get(m.path) != member_key(m)]
        # Runs equal to the same run of the last scan's are unchanged: one
        # comparison each (by identity first, in C); others member by member.
        out: list[Member] = []
        count = len(members)
        for lo in range(0, count, COMPARE_RUN):
            hi = min(lo + COMPARE_RUN, count)
            at = bisect.bisect_left(last, members[lo].path, key=member_path)
            if last[at : at + hi - lo] != members[lo:hi]:
                out.extend(m for m in members[lo:hi] if keys.get(m.path) != member_key(m))
        return out

    def removed(self, members: list[Member], changed: list[Member]) -> list[str]:
        """The base's paths that ``members`` (unique paths) no longer hold."""
        keys = self.members
        added = sum(1 for m in changed if m.path not in keys)
        if len(members) - added == len(keys):
            return []  # every path of the base is still there
        present = {m.path for m in members}
        return sorted(p for p in keys if p not in present)


COMPARE_RUN: Final = 128


@dataclass
class _Plan:
    """A checkpoint ready to commit: the delta against ``base`` and its uploads."""

    base: _Base | None
    changed: list[Member]
    removed: list[str]
    refused: str | None
    """The base last refused with ``base_mismatch`` (part of the operation id)."""
    unchanged: bool = False
    uploaded: int = 0
    uploaded_bytes: int = 0
    upload_seconds: float = 0.0


@dataclass
class RepoSaveOutcome:
    """What one checkpoint did."""

    checkpoint_id: str | None
    committed: bool
    entries: int
    changed: int = 0
    removed: int = 0
    uploaded: int = 0
    uploaded_bytes: int = 0
    full: bool = False
    attempts: int = 1
    seconds: float = 0.0
    upload_seconds: float = 0.0
    """Asking which contents are missing, and uploading them."""
    commit_seconds: float = 0.0
    scan: ScanStats = field(default_factory=ScanStats)
    problems: list[Problem] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpointId": self.checkpoint_id,
            "committed": self.committed,
            "entries": self.entries,
            "changed": self.changed,
            "removed": self.removed,
            "uploaded": self.uploaded,
            "uploadedBytes": self.uploaded_bytes,
            "full": self.full,
            "attempts": self.attempts,
            "seconds": round(self.seconds, 3),
            "uploadSeconds": round(self.upload_seconds, 3),
            "commitSeconds": round(self.commit_seconds, 3),
            "scan": self.scan.to_json(),
            "problems": len(self.problems),
        }


def operation_id(run_id: str, workspace_id: str, body: dict[str, Any], refused: str | None) -> str:
    """A checkpoint's operation id, derived from what it sends: the same
    request gets the same id (a replay), another request another id. The base
    last refused with ``base_mismatch`` is part of it, so a whole checkpoint
    sent after a refusal never replays an earlier identical one."""
    digest = hashlib.sha256()
    digest.update(json.dumps([run_id, workspace_id, refused], separators=(",", ":")).encode())
    digest.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return "rcp-" + digest.hexdigest()[:40]


_LOCAL_CODES: Final[tuple[tuple[type[BaseException], str], ...]] = (
    (ControllerUnavailable, "controller_unavailable"),
    (ObjectUnavailable, "object_unavailable"),
    (GitLockHeld, "git_lock_held"),
    (TreeUnstable, "tree_unstable"),
    (CheckoutUnsupported, "checkout_unsupported"),
    (GitCommandFailed, "git_command_failed"),
    (OSError, "os_error"),
)


def failure_code(exc: BaseException) -> str:
    """The stable code of a failed save, as status files show it: the
    controller's own code for a refusal (``stale_lease``, ``unknown_content``,
    ``unauthenticated``: the README's error table), else fsagent's name for
    what failed here (``controller_unavailable``, ``git_lock_held``,
    ``tree_unstable``, ``checkout_unsupported``, ``git_command_failed``,
    ``object_unavailable``, ``os_error``; ``save_failed`` for anything else)."""
    if isinstance(exc, ControllerRefused):
        if exc.code:
            return exc.code
        return "unauthenticated" if exc.status == 401 else f"http_{exc.status}"
    for kind, code in _LOCAL_CODES:
        if isinstance(exc, kind):
            return code
    return "save_failed"


def failure_record(message: str, code: str) -> dict[str, Any]:
    """A status file's ``lastError``."""
    return {"at": now_iso(), "code": code, "message": message}


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_json_quietly(path: Path, data: dict[str, Any]) -> bool:
    """Replace ``path`` with ``data``; False (logged at INFO) when the disk
    refuses. Status files are conveniences, never worth failing a save for."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("%s not written: %s", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RepoSaver:
    """Checkpoints of one checkout of a workspace bound to the run's task.

    Keeps the base (the current checkpoint's members) and the metadata cache
    in memory between checkpoints, so a checkpoint costs one metadata walk
    plus the changes. One checkpoint at a time per saver (a trio lock); the
    caller keeps several savers from overlapping (:mod:`fsagent.repos.checkouts`).
    """

    def __init__(
        self,
        client: BridgeClient,
        run: RunInfo,
        binding: RepoBinding,
        checkout: Path,
        state_dir: Path | None,
        *,
        threads: int = HASH_THREADS,
        after_read: ReadHook | None = None,
    ) -> None:
        self.client = client
        self.run = run
        self.binding = binding
        self.checkout = checkout
        self.state_dir = state_dir
        self.threads = threads
        self.after_read = after_read
        self.cache = MetadataCache.load(state_dir / "metacache" if state_dir else None)
        self._base: _Base | None = None
        self._known_current = binding.current.checkpoint_id if binding.current else None
        self._lock = trio.Lock()
        self._listing_problems: list[Problem] = []
        self._names = MemberNames()
        self._worktree = WorktreeLister(checkout)
        self._last_paths: list[str] | None = None
        self._last_scan: TreeScan | None = None
        self._config: tuple[StatKey | None, list[tuple[str, str]]] | None = None
        self.fenced: str | None = None
        self.fenced_code = "stale_lease"
        self.status: dict[str, Any] = (read_json(self.status_file) if state_dir else None) or {}
        self.status.update(
            workspaceId=binding.workspace_id, name=binding.name, checkout=str(checkout)
        )

    @property
    def workspace_id(self) -> str:
        return self.binding.workspace_id

    @property
    def status_file(self) -> Path:
        assert self.state_dir is not None
        return self.state_dir / "status.json"

    # --- one checkpoint --------------------------------------------------------

    async def checkpoint(self, *, lock_wait: float = 0.0) -> RepoSaveOutcome:
        """Save the checkout now; raises RepoSaveFailed (recorded and reported)."""
        async with self._lock:
            started = time.monotonic()
            try:
                if self.fenced is not None:
                    raise RepoSaveFailed(
                        f"{self.binding.name}: not saved, the run ended or a newer run "
                        f"holds the lease: {self.fenced}"
                    )
                outcome = await self._checkpoint(lock_wait)
            except (FsagentError, OSError) as exc:
                await self._failed(exc)
                if isinstance(exc, RepoSaveFailed):
                    raise
                raise RepoSaveFailed(f"{self.binding.name}: {exc}") from exc
            outcome.seconds = time.monotonic() - started
            self._saved(outcome)
            return outcome

    async def _checkpoint(self, lock_wait: float) -> RepoSaveOutcome:
        await trio.to_thread.run_sync(check_layout, self.checkout)
        unstable: list[str] = []
        for attempt in range(1 + SCAN_RETRIES):
            if attempt:
                await trio.sleep(RETRY_PAUSES[min(attempt, len(RETRY_PAUSES)) - 1])
            await self._wait_for_locks(lock_wait)
            scan = self._new_scan()
            first = await trio.to_thread.run_sync(scan.read)
            result = first
            plan: _Plan | None = None
            if first.stable:
                members, problems = checkpoint_members(first, self._listing_problems)
                if len(members) > MAX_REPO_ENTRIES:
                    raise CheckoutUnsupported(
                        f"{self.binding.name}: {len(members)} members, at most {MAX_REPO_ENTRIES}"
                    )
                config = await trio.to_thread.run_sync(self._portable_config)
                try:
                    # Contents travel while the tree is checked again: an upload
                    # commits nothing, so only the commit waits for the check.
                    plan, result = await self._plan_while_verifying(scan, members, config)
                except MemberChanged as exc:
                    unstable = [exc.path]
                    log.info("%s: %s; scanning again", self.binding.name, exc)
                    continue
            self._last_paths = result.paths
            locks = await trio.to_thread.run_sync(held_locks, self.checkout)
            if locks:
                raise GitLockHeld(f"{self.binding.name}: Git is busy ({', '.join(locks)})")
            if not result.stable or plan is None:
                unstable = result.unstable
                log.info(
                    "%s changed during the scan (%s); scanning again",
                    self.binding.name,
                    ", ".join(unstable[:5]),
                )
                continue
            try:
                outcome = await self._commit_saving_cache(plan, members, config)
            except MemberChanged as exc:
                unstable = [exc.path]
                log.info("%s: %s; scanning again", self.binding.name, exc)
                continue
            outcome.attempts = attempt + 1
            outcome.scan = result.stats
            outcome.problems = problems
            return outcome
        shown = ", ".join(unstable[:10]) + (" ..." if len(unstable) > 10 else "")
        raise TreeUnstable(
            f"{self.binding.name}: the checkout kept changing during "
            f"{1 + SCAN_RETRIES} scans ({shown}); not saved"
        )

    async def _plan_while_verifying(
        self, scan: TreeScan, members: list[Member], config: list[tuple[str, str]]
    ) -> tuple[_Plan, ScanResult]:
        verified: list[ScanResult] = []

        async def verify() -> None:
            verified.append(await trio.to_thread.run_sync(scan.verify))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(verify)
                plan = await self._plan(members, config, await self._load_base(), None)
        except BaseExceptionGroup as group:
            raise_first_failure(group)
        return plan, verified[0]

    async def _commit_saving_cache(
        self, plan: _Plan, members: list[Member], config: list[tuple[str, str]]
    ) -> RepoSaveOutcome:
        """Commit while the metadata cache is written in a thread: the file
        holds digests of contents, right whatever the commit's answer, and
        its write (the whole cache) then costs the checkpoint nothing."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, self.cache.save)
                return await self._commit(plan, members, config)
        except BaseExceptionGroup as group:
            raise_first_failure(group)

    async def _wait_for_locks(self, lock_wait: float) -> None:
        deadline = time.monotonic() + lock_wait
        while True:
            locks = await trio.to_thread.run_sync(held_locks, self.checkout)
            if not locks:
                return
            if time.monotonic() >= deadline:
                raise GitLockHeld(f"{self.binding.name}: Git is busy ({', '.join(locks)})")
            await trio.sleep(0.25)

    def _new_scan(self) -> TreeScan:
        def lister() -> list[str]:
            paths, self._listing_problems = self._worktree()
            return paths + git_dir_members(self.checkout)

        scan = TreeScan(
            self.checkout,
            lister,
            self.cache,
            path_rule=self._names,
            link_rule=link_problem,
            max_file_bytes=MAX_MEMBER_BYTES,
            threads=self.threads,
            after_read=self.after_read,
            guess=self._last_paths,
            immutable=git_immutable,
            immutable_prefix=GIT_OBJECTS,
            # The verify rechecks .git (whose members must agree with each
            # other) and the files read; the working tree's other files are
            # whole as scanned, and a change to one is the next checkpoint's.
            recheck=GIT_DIR,
            relist=lambda: git_dir_members(self.checkout),
            previous=self._last_scan,
        )
        self._last_scan = scan
        return scan

    def _portable_config(self) -> list[tuple[str, str]]:
        """The carried configuration, read again only when ``.git/config`` changed."""
        try:
            key: StatKey | None = StatKey.of(os.lstat(self.checkout / ".git" / "config"))
        except OSError:
            key = None
        if self._config is None or self._config[0] != key or key is None:
            self._config = (key, portable_config_pairs(self.checkout))
        return self._config[1]

    async def _load_base(self) -> _Base | None:
        if self._base is None and self._known_current is not None:
            try:
                manifest = await self.client.repo_manifest(self.workspace_id, "current")
            except ControllerRefused as exc:
                if exc.status != 404:
                    raise
                self._known_current = None  # nothing saved after all: a whole checkpoint
                return None
            self._base = _Base(
                manifest.checkpoint_id,
                {str(m["path"]): wire_key(m) for m in manifest.members},
                manifest.config,
            )
        return self._base

    async def _plan(
        self,
        members: list[Member],
        config: list[tuple[str, str]],
        base: _Base | None,
        refused: str | None,
    ) -> _Plan:
        """The delta against ``base`` (everything without one), its contents
        the controller lacks uploaded."""
        if base is not None:
            changed = base.changed(members)
            removed = base.removed(members, changed)
            if not changed and not removed and config == base.config:
                return _Plan(base, [], [], refused, unchanged=True)
        else:
            changed, removed = list(members), []
        started = time.monotonic()
        uploaded, uploaded_bytes = await self._upload_missing(changed)
        return _Plan(
            base,
            changed,
            removed,
            refused,
            uploaded=uploaded,
            uploaded_bytes=uploaded_bytes,
            upload_seconds=time.monotonic() - started,
        )

    async def _commit(
        self, plan: _Plan, members: list[Member], config: list[tuple[str, str]]
    ) -> RepoSaveOutcome:
        """Commit a plan; after a ``base_mismatch``, plan and commit the whole checkpoint."""
        for _ in range(2):
            if plan.unchanged:
                assert plan.base is not None
                plan.base.scanned = members  # each saves as its base's
                return RepoSaveOutcome(plan.base.checkpoint_id, False, len(members))
            body: dict[str, Any] = {
                "leaseEpoch": self.run.lease_epoch,
                "base": plan.base.checkpoint_id if plan.base else None,
                "members": [m.to_json() for m in plan.changed],
                "removed": plan.removed,
                "config": [[k, v] for k, v in config],
            }
            body = {
                "operationId": operation_id(self.run.run_id, self.workspace_id, body, plan.refused),
                **body,
            }
            commit_started = time.monotonic()
            try:
                receipt = await self.client.commit_repo_checkpoint(self.workspace_id, body)
            except ControllerRefused as exc:
                if not exc.means(BaseMismatch) or plan.base is None:
                    raise
                log.info("%s: the base moved on; sending the whole checkpoint", self.binding.name)
                self._base = None
                plan = await self._plan(members, config, None, plan.base.checkpoint_id)
                continue
            checkpoint_id = str(receipt["checkpointId"])
            if plan.base is not None and body["base"] is not None:
                # The delta applied to the base's table in place (it is this
                # saver's own, and the old base is done with): no copy.
                keys = plan.base.members
                for path in plan.removed:
                    del keys[path]
                keys.update((m.path, member_key(m)) for m in plan.changed)
            else:
                keys = {m.path: member_key(m) for m in members}
            self._base = _Base(checkpoint_id, keys, config, members)
            self._known_current = checkpoint_id
            return RepoSaveOutcome(
                checkpoint_id,
                True,
                len(members),
                changed=len(plan.changed),
                removed=len(plan.removed),
                uploaded=plan.uploaded,
                uploaded_bytes=plan.uploaded_bytes,
                full=body["base"] is None,
                upload_seconds=plan.upload_seconds,
                commit_seconds=time.monotonic() - commit_started,
            )
        raise RepoSaveFailed(f"{self.binding.name}: the base kept moving; not saved")

    # --- uploads ---------------------------------------------------------------

    async def _upload_missing(self, changed: Iterable[Member]) -> tuple[int, int]:
        """Upload the contents of ``changed`` that the task cannot reference yet."""
        by_digest: dict[str, Member] = {}
        for m in changed:
            if m.kind == "file" and m.digest is not None:
                by_digest.setdefault(m.digest, m)
        if not by_digest:
            return 0, 0
        missing = await self.client.repo_missing(self.workspace_id, sorted(by_digest))
        todo = [by_digest[d] for d in sorted(missing) if d in by_digest]
        self._check_allowance(todo)
        small = [m for m in todo if m.size <= BATCH_MEMBER_MAX]
        large = [m for m in todo if m.size > BATCH_MEMBER_MAX]
        limiter = trio.CapacityLimiter(UPLOAD_CONCURRENCY)

        async def batch(group: list[Member]) -> None:
            async with limiter:
                await self._upload_batch(group)

        async def one(member: Member) -> None:
            async with limiter:
                await self._upload_one(member)

        try:
            async with trio.open_nursery() as nursery:
                for group in batches(small, lambda m: m.size):
                    if len(group) == 1:
                        nursery.start_soon(one, group[0])
                    else:
                        nursery.start_soon(batch, group)
                for member in large:
                    nursery.start_soon(one, member)
        except BaseExceptionGroup as group:
            raise_first_failure(group)
        return len(todo), sum(m.size for m in todo)

    def _check_allowance(self, todo: list[Member]) -> None:
        """Refuse, before a byte is sent, a checkpoint whose new contents
        are more than the run's whole upload allowance.

        A repository is committed whole, never in parts as folders are. Such
        a checkpoint used to upload until the allowance refused it (429),
        and what it had uploaded then held the allowance until it expired
        (``--repo-upload-ttl``, an hour by default): the run's other saves
        found no room either, even after the agent had removed what was too
        big. Refused here, nothing is
        held, and the next checkpoint saves once the new contents fit."""
        limit = self.run.upload_allowance
        new_bytes = sum(m.size for m in todo)
        if limit is None or new_bytes <= limit:
            return
        largest = sorted(todo, key=lambda m: m.size, reverse=True)[:3]
        shown = ", ".join(f"{m.path} ({m.size} bytes)" for m in largest)
        raise ControllerRefused(
            f"{OVER_ALLOWANCE}: {self.binding.name} has {new_bytes} bytes of new contents in"
            f" {len(todo)} file(s), more than the run's upload allowance of {limit} bytes"
            f" (--max-pending-upload-bytes), and a repository is saved whole; nothing was"
            f" uploaded. The largest: {shown}",
            413,
            OVER_ALLOWANCE,
        )

    def _read_small(self, member: Member) -> bytes:
        fd = open_member(self.checkout, member)
        try:
            parts = []
            left = member.size + 1  # one more byte shows growth
            while left > 0:
                chunk = os.read(fd, left)
                if not chunk:
                    break
                parts.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(parts)
        if len(data) != member.size or hashlib.sha256(data).hexdigest() != member.digest:
            raise MemberChanged(member.path, "changed since the scan")
        return data

    async def _upload_batch(self, group: list[Member]) -> None:
        datas = await trio.to_thread.run_sync(lambda: [self._read_small(m) for m in group])
        answers = await self.client.upload_repo_batch(self.workspace_id, datas)
        for member, (digest, size) in zip(group, answers, strict=True):
            if digest != member.digest or size != member.size:
                raise MemberChanged(member.path, "the controller read other bytes")

    async def _upload_one(self, member: Member) -> None:
        fd = await trio.to_thread.run_sync(open_member, self.checkout, member)
        fh = os.fdopen(fd, "rb")
        try:
            compressor = zstandard.ZstdCompressor(level=3)

            def frames() -> Any:
                fh.seek(0)  # called again for each attempt
                return file_frames(fh, compressor, lambda n: None)

            digest, size = await self.client.upload_repo_object(self.workspace_id, frames)
        finally:
            fh.close()
        if digest != member.digest or size != member.size:
            raise MemberChanged(member.path, "changed while it was uploaded")

    # --- status ----------------------------------------------------------------

    def _saved(self, outcome: RepoSaveOutcome) -> None:
        problems = [{"path": p.path, "reason": p.reason} for p in outcome.problems]
        self.status.update(
            state="saved",  # committed now, or nothing changed since the last save
            lastAttempt=now_iso(),
            lastError=None,
            problems=problems[:PROBLEMS_SHOWN],
            problemCount=len(problems),
        )
        last = self.status.get("lastSave") or {}
        if outcome.committed or last.get("checkpointId") != outcome.checkpoint_id:
            # Unchanged: the last save is still the one named, unless this
            # status file names another (it came with the state root, the
            # checkout was restored since).
            self.status["lastSave"] = {"at": now_iso(), **outcome.to_json()}
        saved = self.cache.save()  # written during the commit; again only if that failed
        self.status["cache"] = {"entries": len(self.cache), "degraded": self.cache.degraded}
        if not saved:
            log.info("%s: metadata cache kept in memory only", self.binding.name)
        if outcome.committed:
            log.info(
                "repository %s saved as %s: %d members, %d changed, %d removed, "
                "%d uploaded in %.2fs",
                self.binding.name,
                outcome.checkpoint_id,
                outcome.entries,
                outcome.changed,
                outcome.removed,
                outcome.uploaded,
                outcome.seconds,
            )
        self._write_status()

    def fence(self, message: str, code: str = "stale_lease") -> None:
        """Stop saving for good: the run ended or a newer run holds the lease
        (:attr:`fsagent.errors.ControllerRefused.fences_the_run`; ``code`` is
        the refusal's, ``stale_lease`` or ``unauthenticated``). Every later
        checkpoint fails at once without a request; ``fsagent repos status``
        shows ``fenced``, why and the code."""
        if self.fenced is None:
            self.fenced = message
            self.fenced_code = code
        self.record_failure(self.fenced, self.fenced_code, state="fenced")

    def record_failure(self, message: str, code: str, *, state: str = "failed") -> None:
        """Show a save that did not happen in the status file (``failed``,
        ``waiting`` or ``fenced``, with ``lastError``) until a later one
        succeeds: also one that failed before this saver was reached (the
        listing of the task's repositories, :mod:`fsagent.repos.checkouts`)."""
        self.status.update(state=state, lastAttempt=now_iso())
        self.status["lastError"] = failure_record(message, code)
        self._write_status()

    async def _failed(self, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ControllerRefused) and exc.fences_the_run:
            self.fence(message, failure_code(exc))
        if self.fenced is not None:
            log.warning("repository %s not saved: %s", self.binding.name, message)
            return  # the controller refuses this run's reports too
        state = "waiting" if isinstance(exc, GitLockHeld) else "failed"
        self.record_failure(message, failure_code(exc), state=state)
        log.warning("repository %s not saved: %s", self.binding.name, message)
        with trio.move_on_after(10):
            try:
                await self.client.report_repo_state(self.workspace_id, "failed", message)
            except FsagentError as report_exc:
                log.warning("could not report the failed save: %s", report_exc)

    def _write_status(self) -> None:
        if self.state_dir is not None:
            write_json_quietly(self.status_file, self.status)
