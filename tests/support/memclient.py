"""A bridge client that keeps a run in memory: the controller's contract
without a controller, for fast in-process tests of the shipper and warm start.

It validates what matters like the controller does (:mod:`common.bridge`):
upload frames are decoded and checked by the controller's own reader
(:mod:`common.wire`: xxh64, declared sizes, end frame), the digest and
size of an upload are computed from its bytes, a put may reference only
content the folder holds or this run uploaded (422 ``unknown_content``), an
old lease epoch is 409 ``stale_lease`` (checked first: a replay from a
superseded lease gets no receipt), and an operation id replayed with the
same body (the lease epoch aside) returns the first receipt (``"replayed":
true``) while another body is 409 ``idempotency_conflict``.

Repositories (:mod:`common.repos`): workspaces are added with
:meth:`MemoryBridgeClient.add_repo`; a repository checkpoint is validated
like the controller validates it (paths, kinds, link confinement, the
``.git`` shape and refused administrative paths, entry and size limits,
referenceable digests, ``base_mismatch``, lease, replay), and objects are
fetched in the batch format, read back by the client's own reader.

With ``upload_allowance``, folder uploads are held to the run's allowance of
uncommitted bytes as the controller holds them (:mod:`controller.quotas`):
content the run holds already costs nothing again, a request whose new bytes
alone exceed it is 413 ``upload_over_allowance``, one that would take the
uncommitted bytes past it 429 ``upload_quota_exceeded`` (both
:class:`fsagent.bridge.base.UploadAllowanceRefused`), and a commit that references
an upload commits it. ``announce_allowance`` (default True): the run info
names the allowance, as the controller's does.

Fault injection: :meth:`MemoryBridgeClient.fail_next` makes the next calls
raise (before doing anything); :meth:`MemoryBridgeClient.lose_next` applies
the next calls and then raises, as when the answer is lost on the way back.
``calls`` records every call by method name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.bridge import MANIFEST_PAGE_MAX, encode_batch
from common.errors import BadFrame, ResyncRequired, WorkFolderError
from common.limits import ENTRY_MAX_BYTES, SCOPES
from common.paths import is_within
from common.repos import FETCH_BATCH_MAX, MISSING_MAX, checkout_name, member_problem
from common.types import Digest, FileVersion
from common.wire import BatchSplitter, Frame, FrameSplitter, Member, decode_frame
from fsagent.bridge.base import (
    CHUNK,
    BridgeClient,
    DestFor,
    Frames,
    ManifestEntry,
    ManifestPage,
    RepoBinding,
    RepoCurrent,
    RepoList,
    RepoManifest,
    RunInfo,
    UploadAllowanceRefused,
    copy_hashing,
    manifest_pages,
)
from fsagent.bridge.http import read_batch
from fsagent.errors import (
    ControllerRefused,
    ControllerUnavailable,
    ObjectUnavailable,
)
from fsagent.repos.capture import checkpoint_problem, portable_pairs


@dataclass
class _Fault:
    remaining: int
    exc: Exception | None
    after: bool
    """True: apply the call, then raise (a lost response)."""


@dataclass
class MemoryFolder:
    """One folder: entries by path (deleted ones kept as tombstones) and its versions."""

    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    high_water: int = 0
    purge_floor: int = 0

    def bump(self) -> FileVersion:
        self.high_water += 1
        return FileVersion(self.high_water)


@dataclass
class MemoryRepo:
    """One workspace bound to the task, and its repository checkpoints."""

    binding: RepoBinding
    checkpoints: dict[str, tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]] = field(
        default_factory=dict
    )
    """checkpoint id → (members by path, config pairs)."""
    current: str | None = None
    saved: list[dict[str, Any]] = field(default_factory=list)
    """Receipts of the checkpoints that advanced the pointer, in order."""
    reports: list[tuple[str, str | None]] = field(default_factory=list)

    def members(self, checkpoint_id: str | None = None) -> dict[str, dict[str, Any]]:
        key = checkpoint_id or self.current
        return {} if key is None else self.checkpoints[key][0]


def new_run(
    lease_epoch: int = 1,
    bindings: dict[str, str | None] | None = None,
    agent_entry: str | None = None,
) -> RunInfo:
    """A run bound to fresh task and agent owners (or to ``bindings``); with
    ``agent_entry``, under the agent folder contract (as a controller's run)."""
    owners: dict[str, str | None] = {s: None for s in SCOPES}
    owners.update(task=str(uuid.uuid4()), agent=str(uuid.uuid4()))
    owners.update(bindings or {})
    agent = owners["agent"] or str(uuid.uuid4())
    return RunInfo(
        str(uuid.uuid4()), str(uuid.uuid4()), agent, lease_epoch, True, owners, agent_entry
    )


class MemoryBridgeClient(BridgeClient):
    """A run, its folders and objects in memory; accepts uploads and checkpoints."""

    def __init__(
        self,
        run: RunInfo | None = None,
        *,
        page_size: int = MANIFEST_PAGE_MAX,
        upload_allowance: int | None = None,
        checkpoint_entries: int | None = None,
    ) -> None:
        self.run = run or new_run()
        self.checkpoint_entries = checkpoint_entries
        """Entries one checkpoint may name (the controller's 400 ``too_many``
        past it), announced by :meth:`get_run`; None: no bound."""
        self.page_size = page_size
        self.upload_allowance = upload_allowance
        self.announce_allowance = True
        self.pending_uploads: dict[str, int] = {}
        """Uncommitted folder uploads of the run: digest → bytes."""
        self.committed_uploads: set[str] = set()
        self.folders: dict[str, MemoryFolder] = {
            s: MemoryFolder() for s, owner in self.run.bindings.items() if owner is not None
        }
        self.objects: dict[str, bytes] = {}
        self.uploaded: set[str] = set()
        self.receipts: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        self.reports: list[tuple[str, str | None]] = []
        self.failure_receipts: list[tuple[str, str | None, bool, str | None]] = []
        """(scope, operation id, final, error) of each save fsagent gave up on."""
        self.refresh = False
        self.calls: list[str] = []
        self._faults: dict[str, list[_Fault]] = {}
        self.repos: dict[str, MemoryRepo] = {}
        self.repo_uploaded: set[str] = set()
        """Digests this run uploaded for the task's repository checkpoints."""

    # --- fault injection ---

    def fail_next(self, method: str, n: int = 1, exc: Exception | None = None) -> None:
        """The next ``n`` calls of ``method`` raise ``exc`` (default: unavailable)."""
        self._faults.setdefault(method, []).append(_Fault(n, exc, after=False))

    def lose_next(self, method: str, n: int = 1) -> None:
        """The next ``n`` calls of ``method`` take effect, then their answer is lost."""
        self._faults.setdefault(method, []).append(_Fault(n, None, after=True))

    def _fault(self, method: str, *, after: bool) -> None:
        for fault in self._faults.get(method, []):
            if fault.after == after and fault.remaining > 0:
                fault.remaining -= 1
                what = "lost the response" if after else "failed"
                raise fault.exc or ControllerUnavailable(f"{method}: injected: {what}")

    def _call(self, method: str) -> None:
        self.calls.append(method)
        self._fault(method, after=False)

    # --- setup helpers ---

    def folder(self, scope: str) -> MemoryFolder:
        try:
            return self.folders[scope]
        except KeyError:
            raise ControllerRefused(f"scope {scope} is not bound", 404, "not_found") from None

    def put_file(self, scope: str, path: str, data: bytes, executable: bool = False) -> Digest:
        """A server-side write (another writer), as the REST API would make it."""
        digest = Digest(hashlib.sha256(data).hexdigest())
        self.objects[digest] = data
        folder = self.folder(scope)
        folder.entries[path] = ManifestEntry(
            path, "file", digest, len(data), executable, folder.bump(), False
        )
        return digest

    def files(self, scope: str) -> dict[str, bytes]:
        """The folder's live files and their bytes."""
        return {
            e.path: self.objects[e.digest]
            for e in self.folder(scope).entries.values()
            if not e.deleted and e.kind == "file" and e.digest is not None
        }

    def add_repo(
        self,
        repo_url: str,
        name: str | None = None,
        *,
        ref: str | None = None,
        primary: bool = False,
        branch: str | None = None,
        setup_command: str | None = None,
    ) -> str:
        """Bind a workspace to the task (as ``add-workspace`` and a run start
        would); returns its workspace id."""
        workspace_id = str(uuid.uuid4())
        binding = RepoBinding(
            workspace_id,
            name or checkout_name(repo_url),
            repo_url,
            ref,
            primary,
            branch,
            setup_command,
            None,
        )
        self.repos[workspace_id] = MemoryRepo(binding)
        return workspace_id

    def repo(self, workspace_id: str) -> MemoryRepo:
        try:
            return self.repos[workspace_id]
        except KeyError:
            raise ControllerRefused(
                f"workspace {workspace_id} is not bound", 404, "not_found"
            ) from None

    def repo_files(self, workspace_id: str) -> dict[str, bytes]:
        """The current checkpoint's files and their bytes."""
        return {
            path: self.objects[m["digest"]]
            for path, m in self.repo(workspace_id).members().items()
            if m["kind"] == "file"
        }

    # --- read side ---

    async def get_run(self) -> RunInfo:
        self._call("get_run")
        run = replace(self.run, checkpoint_entries=self.checkpoint_entries)
        if self.announce_allowance and self.upload_allowance is not None:
            return replace(run, upload_allowance=self.upload_allowance)
        return run

    async def iter_manifest(self, scope: str, since: int = 0) -> AsyncIterator[ManifestPage]:
        self._call("iter_manifest")
        folder = self.folder(scope)
        if since and since < folder.purge_floor:
            raise ControllerRefused(
                f"since {since} is below the purge floor", 410, ResyncRequired.code
            )
        for page in manifest_pages(
            folder.entries.values(), since, folder.high_water, self.page_size
        ):
            yield page

    def _visible(self, scope: str, digest: str) -> bool:
        folder = self.folder(scope)
        return digest in self.uploaded or any(e.digest == digest for e in folder.entries.values())

    async def fetch_object(self, scope: str, digest: Digest, dest: Path) -> tuple[str, int]:
        self._call("fetch_object")
        if not self._visible(scope, digest) or digest not in self.objects:
            raise ObjectUnavailable(f"object {digest[:12]} not served (404)")
        data = self.objects[digest]

        async def chunks() -> AsyncGenerator[bytes, None]:
            for i in range(0, len(data), CHUNK):
                yield data[i : i + CHUNK]

        # Closed here even when the copy is cancelled part way (a sibling
        # download failed): an async generator left to the garbage collector
        # is a ResourceWarning.
        async with contextlib.aclosing(chunks()) as stream:
            return await copy_hashing(stream, dest)

    async def refresh_requested(self) -> bool:
        self._call("refresh_requested")
        return self.refresh

    # --- write side ---

    async def _receive_frames(self, frames: Frames) -> tuple[str, int]:
        """An upload body read by the controller's own reader: (digest, size)."""
        splitter = FrameSplitter()
        data = bytearray()
        try:
            body = frames()
            try:
                async for chunk in body:
                    for frame in splitter.feed(chunk):
                        data += decode_frame(frame)
            finally:
                aclose = getattr(body, "aclose", None)  # an async generator: close it now
                if aclose is not None:
                    await aclose()
            splitter.finish()
        except BadFrame as exc:
            raise ControllerRefused(f"upload: {exc.text}", 400, "bad_frame") from None
        digest = hashlib.sha256(data).hexdigest()
        self.objects[digest] = bytes(data)
        return digest, len(data)

    def _receive_batch(self, members: list[bytes]) -> list[tuple[str, int]]:
        """A batch body (the wire format, the controller's reader): member
        digests verified, all or nothing, as on the controller."""
        splitter = BatchSplitter()
        got: list[tuple[str, bytes]] = []
        current: tuple[Member, bytearray] | None = None
        try:
            for item in splitter.feed(encode_batch(members)):
                if isinstance(item, Member):
                    current = (item, bytearray())
                elif isinstance(item, Frame):
                    assert current is not None
                    current[1].extend(decode_frame(item))
                else:
                    assert current is not None
                    digest = hashlib.sha256(current[1]).hexdigest()
                    if digest != current[0].sha256.hex():
                        raise ControllerRefused("batch: digest mismatch", 422, "digest_mismatch")
                    got.append((digest, bytes(current[1])))
            splitter.finish()
        except WorkFolderError as exc:
            raise ControllerRefused(f"batch: {exc.text}", exc.status, exc.code) from None
        for digest, data in got:
            self.objects[digest] = data
        return [(digest, len(data)) for digest, data in got]

    def _admit(self, sizes: dict[str, int]) -> None:
        """The run's upload allowance, as :func:`controller.quotas.reserve_uploads`
        checks it; then the uploads are the run's, uncommitted."""
        limit = self.upload_allowance
        held = self.committed_uploads | set(self.pending_uploads)
        new = {d: n for d, n in sizes.items() if d not in held}
        size = sum(new.values())
        if limit is not None and size > limit:
            raise UploadAllowanceRefused(
                f"upload: {size} new bytes over the allowance of {limit}",
                413,
                "upload_over_allowance",
                limit=limit,
                size=size,
            )
        pending = sum(self.pending_uploads.values())
        if limit is not None and size and pending + size > limit:
            raise UploadAllowanceRefused(
                f"upload: {pending} bytes wait for a checkpoint, {size} more is over {limit}",
                429,
                "upload_quota_exceeded",
                limit=limit,
                pending=pending,
                size=size,
            )
        self.pending_uploads.update(new)
        self.uploaded.update(sizes)

    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        self._call("upload_object")
        self.folder(scope)
        digest, size = await self._receive_frames(frames)
        self._admit({digest: size})
        self._fault("upload_object", after=True)
        return digest, size

    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        self._call("upload_batch")
        self.folder(scope)
        got = self._receive_batch(members)
        self._admit(dict(got))
        self._fault("upload_batch", after=True)
        return got

    def _check_body(self, scope: str, body: dict[str, Any]) -> None:
        if body.get("leaseEpoch") != self.run.lease_epoch or not self.run.active:
            raise ControllerRefused("checkpoint: stale lease", 409, "stale_lease")
        bound = self.checkpoint_entries
        if bound is not None and len(body.get("entries", [])) > bound:
            raise ControllerRefused(
                f"at most {bound} entries per checkpoint", 400, "validation_error"
            )
        for entry in body.get("entries", []):
            op = entry.get("op")
            if op not in ("put", "mkdir", "delete") or not isinstance(entry.get("path"), str):
                raise ControllerRefused(f"checkpoint: bad entry {entry}", 400, "validation_error")
            if op == "put" and not self._visible(scope, str(entry.get("digest"))):
                raise ControllerRefused(
                    f"checkpoint: unknown content {entry.get('digest')}", 422, "unknown_content"
                )

    def _entry_problem(self, scope: str, entry: dict[str, Any]) -> str | None:
        """The controller's rules for the agent's instruction entry
        (``controller.agentfiles.screen_checkpoint``): the code refusing this
        entry, or None."""
        main = self.run.agent_entry
        if scope != "agent" or main is None:
            return None
        path, op = entry["path"], entry["op"]
        if op == "delete" and is_within(main, path):
            return "ENTRY_PROTECTED"
        if op == "mkdir" and is_within(path, main):
            return "ENTRY_PROTECTED"
        if op == "put" and path != main and (is_within(main, path) or is_within(path, main)):
            return "ENTRY_PROTECTED"
        if op == "put" and path == main:
            data = self.objects[entry["digest"]]
            if len(data) > ENTRY_MAX_BYTES:
                return "ENTRY_TOO_LARGE"
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                return "ENTRY_NOT_UTF8"
        return None

    def _apply(self, folder: MemoryFolder, entry: dict[str, Any]) -> None:
        path = entry["path"]
        if entry["op"] == "delete":
            for p, e in list(folder.entries.items()):
                if (p == path or p.startswith(path + "/")) and not e.deleted:
                    folder.entries[p] = replace(e, deleted=True, version=folder.bump())
            return
        if entry["op"] == "mkdir":
            existing = folder.entries.get(path)
            if existing is not None and existing.kind == "directory" and not existing.deleted:
                return  # as the controller: an mkdir of a directory there does nothing
            folder.entries[path] = ManifestEntry(
                path, "directory", None, 0, False, folder.bump(), False
            )
            return
        digest = Digest(entry["digest"])
        folder.entries[path] = ManifestEntry(
            path,
            "file",
            digest,
            len(self.objects[digest]),
            bool(entry.get("executable")),
            folder.bump(),
            False,
        )

    async def commit_checkpoint(self, scope: str, body: dict[str, Any]) -> dict[str, Any]:
        self._call("commit_checkpoint")
        folder = self.folder(scope)
        if body.get("leaseEpoch") != self.run.lease_epoch or not self.run.active:
            raise ControllerRefused("checkpoint: stale lease", 409, "stale_lease")
        # The controller's fingerprint leaves the lease epoch out, as here.
        fingerprint = json.dumps({**body, "leaseEpoch": None}, sort_keys=True)
        key = (scope, str(body.get("operationId")))
        if key in self.receipts:
            seen, stored = self.receipts[key]
            if seen != fingerprint:
                raise ControllerRefused(
                    "checkpoint: operation id reused", 409, "idempotency_conflict"
                )
            return {**stored, "replayed": True}
        self._check_body(scope, body)
        refused = []
        for entry in body.get("entries", []):
            problem = self._entry_problem(scope, entry)
            if problem is not None:
                refused.append({"path": entry["path"], "code": problem, "message": problem})
                continue
            self._apply(folder, entry)
        for entry in body.get("entries", []):
            if entry["op"] == "put" and entry["digest"] in self.pending_uploads:
                del self.pending_uploads[entry["digest"]]  # committed: it counts no more
                self.committed_uploads.add(entry["digest"])
        receipt: dict[str, Any] = {
            "operationId": body.get("operationId"),
            "applied": True,
            "entries": len(body.get("entries", [])),
            "highWater": folder.high_water,
            "savedAt": datetime.now(UTC).isoformat(),
        }
        if refused:
            receipt["refusedEntries"] = refused
        self.receipts[key] = (fingerprint, receipt)
        self._fault("commit_checkpoint", after=True)
        return dict(receipt)

    async def report_state(
        self,
        state: str,
        error: str | None = None,
        *,
        scope: str | None = None,
        operation_id: str | None = None,
        final: bool = False,
    ) -> None:
        self._call("report_state")
        self.reports.append((state, error))
        if scope is not None:
            self.failure_receipts.append((scope, operation_id, final, error))

    async def refresh_applied(self) -> None:
        self._call("refresh_applied")
        self.refresh = False

    # --- repositories ---

    def _task_references(self) -> set[str]:
        return {
            m["digest"]
            for repo in self.repos.values()
            for m in repo.members().values()
            if m["kind"] == "file"
        } | self.repo_uploaded

    async def list_repos(self) -> RepoList:
        self._call("list_repos")
        out = []
        for repo in self.repos.values():
            current = None
            if repo.current is not None:
                receipt = repo.saved[-1]
                current = RepoCurrent(
                    repo.current, receipt["entries"], receipt["byteSize"], receipt["savedAt"]
                )
            out.append(replace(repo.binding, current=current))
        return RepoList("repos", out)

    async def repo_missing(self, workspace_id: str, digests: list[str]) -> set[str]:
        self._call("repo_missing")
        self.repo(workspace_id)
        known = self._task_references()
        missing: set[str] = set()
        for i in range(0, len(digests), MISSING_MAX):
            missing.update(d for d in digests[i : i + MISSING_MAX] if d not in known)
        return missing

    async def upload_repo_object(self, workspace_id: str, frames: Frames) -> tuple[str, int]:
        self.repo(workspace_id)
        self._call("upload_repo_object")
        digest, size = await self._receive_frames(frames)
        self.repo_uploaded.add(digest)
        self._fault("upload_repo_object", after=True)
        return digest, size

    async def upload_repo_batch(
        self, workspace_id: str, members: list[bytes]
    ) -> list[tuple[str, int]]:
        self.repo(workspace_id)
        self._call("upload_repo_batch")
        got = self._receive_batch(members)
        self.repo_uploaded.update(d for d, _ in got)
        self._fault("upload_repo_batch", after=True)
        return got

    def _refuse_member(self, path: str | None, rule: str) -> ControllerRefused:
        return ControllerRefused(
            f"repository checkpoint: {path}: {rule}", 422, "unsafe_repo_member"
        )

    async def commit_repo_checkpoint(
        self, workspace_id: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        self._call("commit_repo_checkpoint")
        repo = self.repo(workspace_id)
        fingerprint = json.dumps(body, sort_keys=True)
        key = (f"repo:{workspace_id}", str(body.get("operationId")))
        if key in self.receipts:
            seen, receipt = self.receipts[key]
            if seen != fingerprint:
                raise ControllerRefused(
                    "checkpoint: operation id reused", 409, "idempotency_conflict"
                )
            return {**receipt, "replayed": True}
        if body.get("leaseEpoch") != self.run.lease_epoch or not self.run.active:
            raise ControllerRefused("repository checkpoint: stale lease", 409, "stale_lease")
        base = body.get("base")
        if base != repo.current:
            raise ControllerRefused(
                f"repository checkpoint: base {base} is not the current checkpoint",
                409,
                "base_mismatch",
            )
        removed = body.get("removed", [])
        if base is None and removed:
            raise ControllerRefused("a full checkpoint removes nothing", 400, "validation_error")
        members = dict(repo.members(base))
        for path in removed:
            if path not in members:
                raise ControllerRefused(f"{path} is not in the base", 400, "validation_error")
            del members[path]
        for member in body.get("members", []):
            rule = member_problem(member)
            if rule is not None:
                raise self._refuse_member(str(member.get("path")), rule)
            members[member["path"]] = member
        problem = checkpoint_problem(list(members.values()))
        if problem is not None:
            raise self._refuse_member(str(problem[0]), problem[1])
        known = self._task_references()
        for path, member in members.items():
            if member["kind"] == "file":
                if member["digest"] not in known or member["digest"] not in self.objects:
                    raise ControllerRefused(
                        f"repository checkpoint: unknown content at {path}", 422, "unknown_content"
                    )
                if len(self.objects[member["digest"]]) != member["byteSize"]:
                    raise self._refuse_member(path, "size_mismatch")
        checkpoint_id = str(uuid.uuid4())
        config = portable_pairs(  # what the controller keeps of config
            [(str(k), str(v)) for k, v in body.get("config", [])]
        )
        repo.checkpoints[checkpoint_id] = (dict(sorted(members.items())), config)
        repo.current = checkpoint_id
        receipt = {
            "operationId": body.get("operationId"),
            "checkpointId": checkpoint_id,
            "entries": len(members),
            "byteSize": sum(m.get("byteSize", 0) for m in members.values()),
            "savedAt": datetime.now(UTC).isoformat(),
        }
        repo.saved.append(receipt)
        self.receipts[key] = (fingerprint, receipt)
        self._fault("commit_repo_checkpoint", after=True)
        return dict(receipt)

    async def repo_manifest(
        self, workspace_id: str, checkpoint_id: str = "current"
    ) -> RepoManifest:
        self._call("repo_manifest")
        repo = self.repo(workspace_id)
        key = repo.current if checkpoint_id == "current" else checkpoint_id
        if key is None or key not in repo.checkpoints:
            raise ControllerRefused(f"no checkpoint {checkpoint_id}", 404, "not_found")
        members, config = repo.checkpoints[key]
        return RepoManifest(key, [dict(m) for m in members.values()], list(config))

    async def fetch_repo_objects(
        self, workspace_id: str, digests: list[str], dest_for: DestFor
    ) -> list[tuple[str, int]]:
        self._call("fetch_repo_objects")
        current = self.repo(workspace_id).members()
        if not 0 < len(digests) <= FETCH_BATCH_MAX:
            raise ControllerRefused("batch fetch size", 400, "validation_error")
        referenced = {m["digest"] for m in current.values() if m["kind"] == "file"}
        for digest in digests:
            if digest not in referenced:
                raise ControllerRefused(f"object {digest[:12]} not served", 404, "not_found")
        body = encode_batch([self.objects[d] for d in digests])

        async def chunks() -> AsyncGenerator[bytes, None]:
            for i in range(0, len(body), CHUNK):
                yield body[i : i + CHUNK]

        return await read_batch(chunks(), len(digests), dest_for)

    async def report_repo_state(
        self, workspace_id: str, state: str, error: str | None = None
    ) -> None:
        self._call("report_repo_state")
        self.repo(workspace_id).reports.append((state, error))
