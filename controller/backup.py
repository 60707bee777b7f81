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

A backup directory is data, not trusted code or configuration: restore
reads it without following a single symbolic link (every name is opened
relative to its directory's descriptor with ``O_NOFOLLOW``), and refuses,
before it changes anything, a directory that is not a backup this command
wrote: ``backup.json`` and ``db.dump`` regular files, the dump of the size
(and, since the manifest records it, the SHA-256) the manifest says, and
under ``objects/`` only directories and regular files at object keys'
names (``<company>/<xx>/<digest>``), as many and as large as the manifest
says. So a link planted in a backup directory cannot pull a host file into
the object store or the database. The backup side copies the object
directory the same way (it never follows a link out of the data dir).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from controller.admin import AdminError
from controller.storage.base import validate_key

DUMP = "db.dump"
OBJECTS = "objects"
MANIFEST = "backup.json"
FORMAT = 1
_SKIP = ("tmp",)
_SKIP_PREFIX = ".probe-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MANIFEST_MAX = 1 << 20
_CHUNK = 1 << 20
_KEY_DEPTH = 3
"""Slashes in a storage key (``objects/<company>/<xx>/<digest>``)."""


def _run(argv: list[str], what: str, stdin: IO[bytes] | None = None) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, stdin=stdin)
    except FileNotFoundError:
        raise AdminError(f"{argv[0]} is not installed (PostgreSQL client tools)") from None
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace")
        reason = " ".join(err.split())[:500] or f"exit {proc.returncode}"
        raise AdminError(f"{what} failed: {reason}")


@dataclass(frozen=True)
class ObjectFile:
    rel: str
    """Its path under the object directory: its storage key,
    ``objects/<company>/<xx>/<digest>``."""
    size: int


def _open_file(name: str, dir_fd: int) -> int:
    """A regular file in ``dir_fd``, opened without following a link."""
    fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{name} is not a regular file")
    return fd


def _walk_objects(dir_fd: int, prefix: str, *, strict: bool) -> Iterator[ObjectFile]:
    """The object files below ``dir_fd``, sorted, no link followed. ``strict``
    (a backup being restored): anything but a directory or a regular file at
    an object key's name is refused; otherwise (the controller's own data
    dir being backed up) its temporary files are skipped and so is anything
    that is no object."""
    for name in sorted(os.listdir(dir_fd)):
        rel = prefix + name
        if not strict and not prefix and (name in _SKIP or name.startswith(_SKIP_PREFIX)):
            continue
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        depth = rel.count("/")
        if stat.S_ISDIR(st.st_mode) and depth < _KEY_DEPTH:
            sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                yield from _walk_objects(sub, rel + "/", strict=strict)
            finally:
                os.close(sub)
            continue
        is_object = stat.S_ISREG(st.st_mode) and depth == _KEY_DEPTH and _is_object_key(rel)
        if is_object:
            yield ObjectFile(rel, st.st_size)
        elif strict:
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not an object"
            raise AdminError(f"objects/{rel} is {kind}: not a backup this command wrote")


def _is_object_key(rel: str) -> bool:
    try:
        validate_key(rel)
    except ValueError:
        return False
    return True


def _copy_objects(src_fd: int, dst: Path, files: list[ObjectFile]) -> int:
    """Copy ``files`` from below ``src_fd`` to below ``dst``, each name opened
    without following a link, each written to a temporary name and renamed
    into place; an object already there is kept (objects never change)."""
    copied = 0
    for f in files:
        target = dst / f.rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        *dirs, name = f.rel.split("/")
        with contextlib.ExitStack() as stack:
            fd = src_fd
            for d in dirs:
                fd = os.open(d, _DIR_FLAGS, dir_fd=fd)
                stack.callback(os.close, fd)
            src = os.fdopen(_open_file(name, fd), "rb")
            stack.enter_context(src)
            if os.fstat(src.fileno()).st_size != f.size:
                raise AdminError(f"objects/{f.rel} changed while it was copied")
            tmp = target.with_name(f".restore-{name}")
            with open(tmp, "wb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        copied += 1
    return copied


def _sha256(fh: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := fh.read(_CHUNK):
        h.update(chunk)
    fh.seek(0)
    return h.hexdigest()


def backup(database_url: str, storage: str, data_dir: Path, to: Path) -> dict[str, Any]:
    if to.exists() and any(to.iterdir()):
        raise AdminError(f"{to} is not empty; back up into a new directory")
    to.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _run(["pg_dump", "--format=custom", "--no-owner", f"--file={to / DUMP}", database_url],
         "pg_dump")  # fmt: skip
    objects = {"files": 0, "bytes": 0}
    if storage == "local_disk":
        (to / OBJECTS).mkdir()
        source = data_dir / OBJECTS
        if source.is_dir():
            src_fd = os.open(source, _DIR_FLAGS)
            try:
                files = list(_walk_objects(src_fd, "", strict=False))
                _copy_objects(src_fd, to / OBJECTS, files)
            finally:
                os.close(src_fd)
            objects = {"files": len(files), "bytes": sum(f.size for f in files)}
    with (to / DUMP).open("rb") as dump:
        dump_sha256 = _sha256(dump)
    manifest = {
        "format": FORMAT,
        "storage": storage,
        "startedAt": started,
        "finishedAt": time.time(),
        "databaseBytes": (to / DUMP).stat().st_size,
        "dumpSha256": dump_sha256,
        "objects": objects if storage == "local_disk" else None,
    }
    (to / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {"backup": str(to), **manifest}


def _read_manifest(root_fd: int, source: Path) -> dict[str, Any]:
    try:
        fd = _open_file(MANIFEST, root_fd)
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(_MANIFEST_MAX + 1)
        manifest = json.loads(raw) if len(raw) <= _MANIFEST_MAX else None
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        raise AdminError(f"{source} is not a finished backup (no readable {MANIFEST} file in it)")
    if manifest.get("format") != FORMAT:
        raise AdminError(f"{source}: unknown backup format {manifest.get('format')!r}")
    if manifest.get("storage") not in ("local_disk", "s3"):
        raise AdminError(f"{source}: {MANIFEST} names no storage this command writes")
    return manifest


def restore(database_url: str, data_dir: Path, source: Path) -> dict[str, Any]:
    """Load a backup into an empty (or disposable) database; objects merge into
    the data dir. The controller must be stopped. Everything is checked
    before anything is changed (module docstring)."""
    try:
        root_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise AdminError(f"{source} is not a directory: {exc.strerror}") from None
    with contextlib.ExitStack() as stack:
        stack.callback(os.close, root_fd)
        manifest = _read_manifest(root_fd, source)
        try:
            dump = stack.enter_context(os.fdopen(_open_file(DUMP, root_fd), "rb"))
        except OSError:
            raise AdminError(f"{source}: {DUMP} is missing or not a regular file") from None
        size = os.fstat(dump.fileno()).st_size
        if size != manifest.get("databaseBytes"):
            raise AdminError(f"{source}: {DUMP} is not the dump {MANIFEST} describes (size)")
        expected = manifest.get("dumpSha256")  # absent from backups made before it was kept
        if expected is not None and _sha256(dump) != expected:
            raise AdminError(f"{source}: {DUMP} is not the dump {MANIFEST} describes (SHA-256)")
        files: list[ObjectFile] = []
        objects_fd: int | None = None
        if manifest["storage"] == "local_disk":
            try:
                objects_fd = os.open(OBJECTS, _DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError:
                objects_fd = None
            except OSError:
                raise AdminError(f"{source}: {OBJECTS} is not a directory") from None
            if objects_fd is not None:
                stack.callback(os.close, objects_fd)
                files = list(_walk_objects(objects_fd, "", strict=True))
            found = {"files": len(files), "bytes": sum(f.size for f in files)}
            if manifest.get("objects") != found:
                raise AdminError(
                    f"{source}: {OBJECTS}/ holds {found['files']} files of {found['bytes']}"
                    f" bytes; {MANIFEST} says {manifest.get('objects')}"
                )
        _run(["pg_restore", "--clean", "--if-exists", "--no-owner", "--single-transaction",
              f"--dbname={database_url}"], "pg_restore", stdin=dump)  # fmt: skip
        if objects_fd is not None:
            _copy_objects(objects_fd, data_dir / OBJECTS, files)
    return {"restored": str(source), "storage": manifest.get("storage"), "objects": len(files)}
