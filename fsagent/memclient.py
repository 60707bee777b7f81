"""A bridge client that keeps a run in memory: the controller's contract
without a controller, for fast in-process tests of the shipper and warm start.

It validates what matters like the controller does (:mod:`common.bridge`):
upload frames are decoded and checked by the controller's own reader
(:mod:`controller.frames`: xxh64, declared sizes, end frame), the digest and
size of an upload are computed from its bytes, a put may reference only
content the folder holds or this run uploaded (422 ``unknown_content``), an
old lease epoch is 409 ``stale_lease``, and an operation id replayed with the
same body returns the first receipt (``"replayed": true``) while another
body is 409 ``idempotency_conflict``.

Fault injection: :meth:`MemoryBridgeClient.fail_next` makes the next calls
raise (before doing anything); :meth:`MemoryBridgeClient.lose_next` applies
the next calls and then raises, as when the answer is lost on the way back.
``calls`` records every call by method name.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.bridge import MANIFEST_PAGE_MAX
from common.errors import ResyncRequired
from common.limits import ENTRY_MAX_BYTES, SCOPES
from common.paths import is_within
from common.types import Digest, FileVersion
from fsagent.client import (
    CHUNK,
    BridgeClient,
    Frames,
    ManifestEntry,
    ManifestPage,
    RunInfo,
    copy_hashing,
    manifest_pages,
)
from fsagent.errors import (
    ControllerRefused,
    ControllerUnavailable,
    ObjectUnavailable,
)


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

    def __init__(self, run: RunInfo | None = None, *, page_size: int = MANIFEST_PAGE_MAX) -> None:
        self.run = run or new_run()
        self.page_size = page_size
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

    # --- read side ---

    async def get_run(self) -> RunInfo:
        self._call("get_run")
        return self.run

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

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), CHUNK):
                yield data[i : i + CHUNK]

        return await copy_hashing(chunks(), dest)

    async def refresh_requested(self) -> bool:
        self._call("refresh_requested")
        return self.refresh

    # --- write side ---

    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        # The controller's own reader, so a frame it refuses is refused here too.
        from common.errors import BadFrame
        from controller.frames import FrameSplitter, decode_frame

        self._call("upload_object")
        self.folder(scope)
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
        self.uploaded.add(digest)
        self._fault("upload_object", after=True)
        return digest, len(data)

    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        # The wire format and the controller's reader: member digests verified,
        # all or nothing, as on the controller.
        from common.bridge import encode_batch
        from common.errors import WorkFolderError
        from controller.frames import BatchSplitter, Frame, Member, decode_frame

        self._call("upload_batch")
        self.folder(scope)
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
            self.uploaded.add(digest)
        self._fault("upload_batch", after=True)
        return [(digest, len(data)) for digest, data in got]

    def _check_body(self, scope: str, body: dict[str, Any]) -> None:
        if body.get("leaseEpoch") != self.run.lease_epoch or not self.run.active:
            raise ControllerRefused("checkpoint: stale lease", 409, "stale_lease")
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
        fingerprint = json.dumps(body, sort_keys=True)
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
