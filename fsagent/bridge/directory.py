"""The bridge client over a local directory: a run, manifests and objects
served read-only from files, for tests and benchmarks (layout in
:class:`DirectoryBridgeClient`'s docstring).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from common.bridge import MANIFEST_PAGE_MAX
from common.types import Digest
from fsagent.bridge.base import (
    CHUNK,
    BridgeClient,
    DestFor,
    Frames,
    ManifestEntry,
    ManifestPage,
    RepoList,
    RepoManifest,
    RunInfo,
    copy_hashing,
    manifest_pages,
)
from fsagent.errors import (
    ControllerRefused,
    ObjectUnavailable,
)


class DirectoryBridgeClient(BridgeClient):
    """Serves a run from a directory, for tests and benchmarks (read-only).

    Layout::

        run.json                      GET /run body
        <scope>/manifest.json         {"entries": [ManifestEntry...], "highWater": n}
        <scope>/objects/<digest>      object bytes
        config.json (optional)        {"fetchDelay": seconds per object}
    """

    writable = False

    def __init__(self, root: Path) -> None:
        self.root = root
        cfg = root / "config.json"
        self._config: dict[str, Any] = json.loads(cfg.read_text()) if cfg.exists() else {}

    async def get_run(self) -> RunInfo:
        try:
            data = json.loads((self.root / "run.json").read_text())
        except FileNotFoundError:
            raise ControllerRefused(f"{self.root}/run.json not found", 404) from None
        return RunInfo.from_json(data)

    async def iter_manifest(self, scope: str, since: int = 0) -> AsyncIterator[ManifestPage]:
        path = self.root / scope / "manifest.json"
        if not path.exists():
            raise ControllerRefused(f"{path} not found: scope {scope} is not bound", 404)
        data = await trio.to_thread.run_sync(lambda: json.loads(path.read_text()))
        entries = [ManifestEntry.from_json(e) for e in data["entries"]]
        high = int(data.get("highWater", max((e.version for e in entries), default=0)))
        for page in manifest_pages(entries, since, high, MANIFEST_PAGE_MAX):
            yield page

    async def fetch_object(self, scope: str, digest: Digest, dest: Path) -> tuple[str, int]:
        delay = float(self._config.get("fetchDelay", 0))
        if delay:
            await trio.sleep(delay)
        src = self.root / scope / "objects" / digest
        try:
            fh = await trio.to_thread.run_sync(lambda: open(src, "rb"))  # noqa: SIM115
        except FileNotFoundError:
            raise ObjectUnavailable(f"object {digest[:12]} not in {src.parent}") from None

        async def chunks() -> AsyncIterator[bytes]:
            with fh:
                while chunk := await trio.to_thread.run_sync(fh.read, CHUNK):
                    yield chunk

        return await copy_hashing(chunks(), dest)

    async def refresh_requested(self) -> bool:
        return False

    def _read_only(self) -> ControllerRefused:
        return ControllerRefused(f"{self.root} is a read-only source", 405, "read_only_source")

    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        raise self._read_only()

    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        raise self._read_only()

    async def commit_checkpoint(self, scope: str, body: dict[str, Any]) -> dict[str, Any]:
        raise self._read_only()

    async def report_state(
        self,
        state: str,
        error: str | None = None,
        *,
        scope: str | None = None,
        operation_id: str | None = None,
        final: bool = False,
    ) -> None:
        raise self._read_only()

    async def refresh_applied(self) -> None:
        raise self._read_only()

    async def list_repos(self) -> RepoList:
        return RepoList("repos", [])  # a local source binds no repositories

    async def repo_missing(self, workspace_id: str, digests: list[str]) -> set[str]:
        raise self._read_only()

    async def upload_repo_object(self, workspace_id: str, frames: Frames) -> tuple[str, int]:
        raise self._read_only()

    async def upload_repo_batch(
        self, workspace_id: str, members: list[bytes]
    ) -> list[tuple[str, int]]:
        raise self._read_only()

    async def commit_repo_checkpoint(
        self, workspace_id: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        raise self._read_only()

    async def repo_manifest(
        self, workspace_id: str, checkpoint_id: str = "current"
    ) -> RepoManifest:
        raise ControllerRefused(f"{self.root}: no repository {workspace_id}", 404, "not_found")

    async def fetch_repo_objects(
        self, workspace_id: str, digests: list[str], dest_for: DestFor
    ) -> list[tuple[str, int]]:
        raise ControllerRefused(f"{self.root}: no repository {workspace_id}", 404, "not_found")

    async def report_repo_state(
        self, workspace_id: str, state: str, error: str | None = None
    ) -> None:
        raise self._read_only()
