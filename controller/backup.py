"""`controller admin backup --to DIR` and `controller admin restore --from DIR`.

A backup directory holds ``db.dump`` (``pg_dump --format=custom`` of the
controller's database), for ``local_disk`` storage ``objects/`` (a copy of the
object directory) and ``backup.json`` (what was taken, written last: a
directory without it is an unfinished backup and restore refuses it).

Order: the dump first, then the objects. ``pg_dump`` reads one consistent
snapshot. Objects are immutable and named by company and SHA-256, so every
object the snapshot references is already in the directory when the copy
starts, and GC deletes an object only after it has been unreferenced for
``--gc-delay`` (default 24 h): an object referenced in the snapshot can only
disappear during the copy if the copy takes longer than that delay. Objects
written after the snapshot are copied too or not; either way they are
unreferenced in the dump and the restored controller's GC removes them.
Copying first would miss objects uploaded and committed between the copy and
the dump, which the dump would then reference.

With S3 storage only the database is dumped: back the bucket up with the
bucket's own versioning or replication (objects are never rewritten in place).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from controller.admin import AdminError

DUMP = "db.dump"
OBJECTS = "objects"
MANIFEST = "backup.json"
FORMAT = 1
_SKIP = shutil.ignore_patterns("tmp", ".probe-*")


def _run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise AdminError(f"{argv[0]} is not installed (PostgreSQL client tools)") from None
    if proc.returncode != 0:
        reason = " ".join(proc.stderr.split())[:500] or f"exit {proc.returncode}"
        raise AdminError(f"{what} failed: {reason}")


def _tree_size(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def backup(database_url: str, storage: str, data_dir: Path, to: Path) -> dict[str, Any]:
    if to.exists() and any(to.iterdir()):
        raise AdminError(f"{to} is not empty; back up into a new directory")
    to.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _run(["pg_dump", "--format=custom", "--no-owner", f"--file={to / DUMP}", database_url],
         "pg_dump")  # fmt: skip
    objects = {"files": 0, "bytes": 0}
    if storage == "local_disk":
        source = data_dir / OBJECTS
        if source.is_dir():
            shutil.copytree(source, to / OBJECTS, ignore=_SKIP)
        n, size = _tree_size(to / OBJECTS)
        objects = {"files": n, "bytes": size}
    manifest = {
        "format": FORMAT,
        "storage": storage,
        "startedAt": started,
        "finishedAt": time.time(),
        "databaseBytes": (to / DUMP).stat().st_size,
        "objects": objects if storage == "local_disk" else None,
    }
    (to / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {"backup": str(to), **manifest}


def restore(database_url: str, data_dir: Path, source: Path) -> dict[str, Any]:
    """Load a backup into an empty (or disposable) database; objects merge into
    the data dir. The controller must be stopped."""
    try:
        manifest = json.loads((source / MANIFEST).read_text())
    except (OSError, ValueError):
        raise AdminError(f"{source} is not a finished backup (no readable {MANIFEST})") from None
    if manifest.get("format") != FORMAT:
        raise AdminError(f"{source}: unknown backup format {manifest.get('format')!r}")
    _run(["pg_restore", "--clean", "--if-exists", "--no-owner", "--single-transaction",
          f"--dbname={database_url}", str(source / DUMP)], "pg_restore")  # fmt: skip
    restored = 0
    if manifest.get("storage") == "local_disk" and (source / OBJECTS).is_dir():
        shutil.copytree(source / OBJECTS, data_dir / OBJECTS, dirs_exist_ok=True)
        restored, _ = _tree_size(source / OBJECTS)
    return {"restored": str(source), "storage": manifest.get("storage"), "objects": restored}
