"""DirectoryBridgeClient sources: a run, per-scope manifests and objects on disk.

fsagent mounted with ``--controller dir:PATH`` reads these instead of talking
to a controller, so filesystem behaviour can be tested (and measured) without
controller round trips.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

from tests.support.constants import SCOPES


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_source(
    root: Path,
    folders: Mapping[str, Mapping[str, bytes | None]] | None = None,
    *,
    bindings: dict[str, str | None] | None = None,
    executable: set[str] = frozenset(),  # type: ignore[assignment]
    fetch_delay: float = 0.0,
    company_id: str | None = None,
    keep_order: bool = False,
) -> Path:
    """Write a source: ``folders[scope][path] = bytes`` (None = a directory).

    Scopes missing from ``bindings`` are bound to a fresh owner when they
    appear in ``folders``; ``bindings`` can unbind (None) or pin owners.
    Entries get versions in path order, or in the mapping's own order with
    ``keep_order``. Identical contents are stored once, as the controller would.
    """
    folders = folders or {"agent": {}}
    root.mkdir(parents=True, exist_ok=True)
    owners: dict[str, str | None] = {s: None for s in SCOPES}
    owners["agent"] = str(uuid.uuid4())  # a run always has an agent folder
    for scope in folders:
        owners[scope] = owners[scope] or str(uuid.uuid4())
    owners.update(bindings or {})
    run = {
        "runId": str(uuid.uuid4()),
        "companyId": company_id or str(uuid.uuid4()),
        "agentId": owners["agent"],
        "leaseEpoch": 1,
        "active": True,
        "bindings": owners,
    }
    (root / "run.json").write_text(json.dumps(run))
    if fetch_delay:
        (root / "config.json").write_text(json.dumps({"fetchDelay": fetch_delay}))
    for scope, files in folders.items():
        items = files.items() if keep_order else sorted(files.items())
        write_manifest(root / scope, items, executable)
    return root


def write_manifest(
    folder: Path,
    items: Iterable[tuple[str, bytes | None]],
    executable: set[str] = frozenset(),  # type: ignore[assignment]
) -> None:
    """``folder/manifest.json`` and ``folder/objects/<digest>`` for (path, bytes | None) items."""
    objects = folder / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, object]] = []
    written: set[str] = set()
    for path, data in items:
        entry: dict[str, object] = {
            "path": path,
            "kind": "directory",
            "digest": None,
            "byteSize": 0,
            "executable": False,
            "version": len(entries) + 1,
            "deleted": False,
        }
        if data is not None:
            digest = sha256(data)
            if digest not in written and not (objects / digest).exists():
                (objects / digest).write_bytes(data)
            written.add(digest)
            entry.update(
                kind="file", digest=digest, byteSize=len(data), executable=path in executable
            )
        entries.append(entry)
    (folder / "manifest.json").write_text(
        json.dumps({"entries": entries, "highWater": len(entries)})
    )
