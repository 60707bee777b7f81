"""The bridge client's interface: how fsagent reads its run, manifests and
objects and saves checkpoints (:class:`BridgeClient`: the read side and the
write side), with what it answers and the errors every implementation raises.

The implementations, side by side like transports behind one client, so the
filesystem, the shipper and warm start can be tested and benchmarked without
a controller:

* :class:`fsagent.bridge.http.HttpBridgeClient` talks to the controller's
  ``/bridge/v1`` routes (:mod:`common.bridge`) with the run token, retrying
  transient failures.
* :class:`fsagent.bridge.directory.DirectoryBridgeClient` serves a run,
  manifests and objects from a local directory; it is read-only.
* :class:`tests.support.memclient.MemoryBridgeClient` keeps a run in memory and
  accepts checkpoints, validating them like the controller, with fault
  injection.

:func:`fsagent.bridge.client.open_client` picks one from the ``--controller``
option. Objects are streamed to a destination file while their SHA-256 is
computed; the caller compares it with the manifest digest before publishing
anything.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import trio

from common.limits import SCOPES
from common.types import Digest, FileVersion
from fsagent.errors import (
    ControllerRefused,
    ObjectUnavailable,
)

CHUNK = 256 * 1024

Frames = Callable[[], AsyncIterator[bytes]]
"""Upload frames of one object (:mod:`common.bridge`); called again per attempt."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    run_id: str
    company_id: str
    agent_id: str
    lease_epoch: int
    active: bool
    bindings: dict[str, str | None]
    agent_entry: str | None = None
    """The agent's instruction entry. A controller that names it holds the agent
    folder contract (docs/users/agent-folders.md): the entry cannot be unlinked or
    renamed away, and the local copy of the agent folder is discarded at stop."""
    warnings: tuple[dict[str, Any], ...] = ()
    """The run's current warnings (e.g. an agent folder at a storage limit)."""
    upload_allowance: int | None = None
    """The run's allowance of uploaded bytes no checkpoint has committed yet
    (``--max-pending-upload-bytes``); None from a controller that does not
    say. The shipper commits a larger change set in parts (fsagent.checkpoint.ship)."""
    checkpoint_entries: int | None = None
    """Entries one checkpoint may name (``--max-checkpoint-entries``); None
    from a controller that does not say (the shipper assumes the default)."""
    checkpoint_rows: int | None = None
    """Rows one checkpoint may create, ancestors counted (``--max-checkpoint-rows``)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunInfo:
        bindings = {scope: data["bindings"].get(scope) for scope in SCOPES}
        entry = data.get("agentEntry")
        warnings = data.get("warnings") or []
        return cls(
            str(data["runId"]),
            str(data["companyId"]),
            str(data["agentId"]),
            int(data["leaseEpoch"]),
            bool(data["active"]),
            bindings,
            None if entry is None else str(entry),
            tuple(w for w in warnings if isinstance(w, dict)),
            _positive_int(data.get("maxPendingUploadBytes")),
            _positive_int(data.get("maxCheckpointEntries")),
            _positive_int(data.get("maxCheckpointRows")),
        )


def _positive_int(value: object) -> int | None:
    """An untrusted JSON number that must be a positive integer, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


class UploadAllowanceRefused(ControllerRefused):
    """A folder upload the run's allowance of uncommitted upload bytes refused
    (``--max-pending-upload-bytes``): 429 ``upload_quota_exceeded`` while
    uploads wait for a checkpoint (committing frees them), 413
    ``upload_over_allowance`` for a request larger than the whole allowance.
    Never retried by the client: the shipper commits what it uploaded and
    goes on in parts (fsagent.checkpoint.ship). ``limit``, ``pending`` and ``size`` as
    the controller's ``details`` name them, when it does."""

    def __init__(
        self,
        message: str,
        status: int,
        code: str,
        *,
        limit: int | None = None,
        pending: int | None = None,
        size: int | None = None,
    ) -> None:
        super().__init__(message, status, code)
        self.limit = limit
        self.pending = pending
        self.size = size


ALLOWANCE_CODES = frozenset({"upload_quota_exceeded", "upload_over_allowance"})
"""Refusals of an upload by the run's allowance (common.errors.UploadQuotaExceeded,
UploadOverAllowance), raised as :class:`UploadAllowanceRefused`."""


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    path: str
    kind: str
    digest: Digest | None
    byte_size: int
    executable: bool
    version: FileVersion
    deleted: bool

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ManifestEntry:
        return cls(
            str(data["path"]),
            str(data["kind"]),
            data.get("digest"),
            int(data.get("byteSize", 0)),
            bool(data.get("executable", False)),
            FileVersion(int(data.get("version", 0))),
            bool(data.get("deleted", False)),
        )


@dataclass(frozen=True, slots=True)
class ManifestPage:
    entries: list[ManifestEntry]
    next_since: int | None
    high_water: int


def manifest_pages(
    entries: Iterable[ManifestEntry], since: int, high_water: int, page_size: int
) -> Iterator[ManifestPage]:
    """What the controller answers for ``since``, cut into pages (for local sources):
    entries newer than ``since`` in version order; deleted ones only when since > 0."""
    chosen = sorted(
        (e for e in entries if e.version > since and (since > 0 or not e.deleted)),
        key=lambda e: e.version,
    )
    for i in range(0, max(len(chosen), 1), page_size):
        page = chosen[i : i + page_size]
        more = i + page_size < len(chosen)
        yield ManifestPage(page, int(page[-1].version) if more else None, high_water)


@dataclass(frozen=True, slots=True)
class RepoCurrent:
    """A workspace's current checkpoint, as the controller lists it."""

    checkpoint_id: str
    entries: int
    byte_size: int
    saved_at: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RepoCurrent:
        return cls(
            str(data["checkpointId"]),
            int(data.get("entries", 0)),
            int(data.get("byteSize", 0)),
            str(data.get("savedAt", "")),
        )


@dataclass(frozen=True, slots=True)
class RepoBinding:
    """One workspace bound to the run's task (:mod:`common.repos`)."""

    workspace_id: str
    name: str
    repo_url: str
    ref: str | None
    primary: bool
    branch: str | None
    setup_command: str | None
    current: RepoCurrent | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RepoBinding:
        current = data.get("current")
        return cls(
            str(data["workspaceId"]),
            str(data["name"]),
            str(data["repoUrl"]),
            None if data.get("ref") is None else str(data["ref"]),
            bool(data.get("primary", False)),
            None if data.get("branch") is None else str(data["branch"]),
            None if data.get("setupCommand") is None else str(data["setupCommand"]),
            None if current is None else RepoCurrent.from_json(current),
        )


@dataclass(frozen=True, slots=True)
class RepoList:
    repos_dir: str
    """The checkouts' directory, relative to the sandbox home (``repos``)."""
    repos: list[RepoBinding]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RepoList:
        return cls(
            str(data.get("reposDir", "repos")),
            [RepoBinding.from_json(r) for r in data.get("repos", [])],
        )


@dataclass(frozen=True, slots=True)
class RepoManifest:
    """A complete repository checkpoint: members (wire form) sorted by path, and
    the portable configuration it carries."""

    checkpoint_id: str
    members: list[dict[str, Any]]
    config: list[tuple[str, str]]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RepoManifest:
        return cls(
            str(data["checkpointId"]),
            list(data.get("members", [])),
            [(str(k), str(v)) for k, v in data.get("config", [])],
        )


DestFor = Callable[[int], Path]
"""Where the ``i``-th object of a batch fetch is written."""


class BridgeClient(ABC):
    """What fsagent needs from the controller: the read side and the write side.

    ``writable`` is False for a source that cannot take checkpoints (a local
    directory): the mount then serves it without a shipper.
    """

    writable: ClassVar[bool] = True
    retry_deadline: float = 60.0
    """Seconds a call retries transient failures before it gives up; the
    shipper waits no longer for an upload allowance others hold."""

    # --- read side ---

    @abstractmethod
    async def get_run(self) -> RunInfo:
        """The run this client's token belongs to, with its four bindings."""

    @abstractmethod
    def iter_manifest(self, scope: str, since: int = 0) -> AsyncIterator[ManifestPage]:
        """Pages of the folder's manifest with ``version > since``, in version order.

        Raises ControllerRefused meaning common.errors.ResyncRequired when ``since`` is older than the purge floor.
        """

    @abstractmethod
    async def fetch_object(self, scope: str, digest: Digest, dest: Path) -> tuple[str, int]:
        """Write the object's bytes to ``dest``; return (sha256 hex of what was written, size).

        Raises ObjectUnavailable when the controller does not serve it.
        """

    @abstractmethod
    async def refresh_requested(self) -> bool:
        """Whether the run asks for the server's changes after its final save."""

    # --- write side ---

    @abstractmethod
    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        """Stream one object as upload frames; return the controller's (digest, size).

        ``frames`` is called again for each attempt, so a retry re-reads the file.
        """

    @abstractmethod
    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        """Upload several small objects in one request (all or nothing); return
        the controller's (digest, size) per member, in order."""

    @abstractmethod
    async def commit_checkpoint(self, scope: str, body: dict[str, Any]) -> dict[str, Any]:
        """Apply one checkpoint body (all or nothing); return its receipt.

        The same operation id and body again returns the same receipt.
        """

    @abstractmethod
    async def report_state(
        self,
        state: str,
        error: str | None = None,
        *,
        scope: str | None = None,
        operation_id: str | None = None,
        final: bool = False,
    ) -> None:
        """Tell the controller that a save started or failed (shown on /sync).
        With ``scope``, fsagent gave up on that folder's save: the controller
        records an explicit failure receipt for it (operation id, final)."""

    @abstractmethod
    async def refresh_applied(self) -> None:
        """Clear the run's refresh request once its changes are taken."""

    # --- repositories (common.repos) ---

    @abstractmethod
    async def list_repos(self) -> RepoList:
        """The workspaces bound to the run's task, with their current checkpoints."""

    @abstractmethod
    async def repo_missing(self, workspace_id: str, digests: list[str]) -> set[str]:
        """Those of ``digests`` the task cannot reference yet (they must be uploaded)."""

    @abstractmethod
    async def upload_repo_object(self, workspace_id: str, frames: Frames) -> tuple[str, int]:
        """:meth:`upload_object` for a repository checkpoint of the task."""

    @abstractmethod
    async def upload_repo_batch(
        self, workspace_id: str, members: list[bytes]
    ) -> list[tuple[str, int]]:
        """:meth:`upload_batch` for a repository checkpoint of the task."""

    @abstractmethod
    async def commit_repo_checkpoint(
        self, workspace_id: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Commit a repository checkpoint (full or delta); return its receipt."""

    @abstractmethod
    async def repo_manifest(
        self, workspace_id: str, checkpoint_id: str = "current"
    ) -> RepoManifest:
        """A complete checkpoint's members and carried configuration."""

    @abstractmethod
    async def fetch_repo_objects(
        self, workspace_id: str, digests: list[str], dest_for: DestFor
    ) -> list[tuple[str, int]]:
        """Write each object (at most :data:`FETCH_BATCH_MAX`) to ``dest_for(i)``;
        return (sha256 of what was written, size) per object, in order. The
        caller compares them with the digests it asked for."""

    @abstractmethod
    async def report_repo_state(
        self, workspace_id: str, state: str, error: str | None = None
    ) -> None:
        """Tell the controller that a repository save started or failed."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most clients hold nothing
        """Release connections."""

    def fork(self) -> BridgeClient | None:
        """A client with the same settings and connections of its own, for the
        event loop of another thread (:mod:`fsagent.checkpoint.thread`); None when this
        client cannot serve another thread, and checkpoints then stay on the
        mount's loop."""
        return None


def _flush_and_sync(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())


async def copy_hashing(chunks: AsyncIterator[bytes], dest: Path) -> tuple[str, int]:
    """Stream chunks into ``dest`` (file I/O in a worker thread), hashing as we go."""
    sha = hashlib.sha256()
    size = 0
    fh: BinaryIO = await trio.to_thread.run_sync(lambda: open(dest, "wb"))  # noqa: SIM115
    try:
        async for chunk in chunks:
            sha.update(chunk)
            size += len(chunk)
            await trio.to_thread.run_sync(fh.write, chunk)
        await trio.to_thread.run_sync(_flush_and_sync, fh)
    finally:
        fh.close()
    return sha.hexdigest(), size


class BadBatch(ObjectUnavailable):
    """A batch answer that does not follow :func:`common.bridge.encode_batch`.
    ``digest``: the object whose bytes did not match it, when one did not."""

    def __init__(self, message: str, digest: str | None = None) -> None:
        super().__init__(message)
        self.digest = digest
