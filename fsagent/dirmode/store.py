"""The state of a plain-directory collection (dir mode), in the same LMDB state
dir a FUSE collection uses.

Tables (beside ``meta``): ``base`` is what the controller held at each path
as of the baseline (fsagent.state.journal, the same records as in FUSE mode);
``dirstat`` is what the last scan saw at each path: kind, ``lstat`` key
(device, inode, size, mode, mtime, ctime) and, for a file, its digest
(fsagent.state.records.LocalEntry). Both are mirrored in memory: a checkpoint
compares the scan with them without reading a table.

A checkpoint is a scan (:meth:`DirStore.rescan`, fsagent.dirmode.scan) followed by
the same shipper as in FUSE mode (fsagent.checkpoint.ship): :meth:`changes_since_baseline`
compares the scan with ``base``, and the shipper reads a changed file through
:attr:`DirStore.upper` (:class:`ScannedFiles`), which opens it only while it
is still the file the scan hashed. Its before/after check is
:meth:`DirStore.get`: a file's *generation* is 0 while its ``lstat`` key is the
scanned one. What was saved folds into ``base`` (:meth:`acknowledge`), exactly
as in FUSE mode, so receipts, operation ids, fencing and warm start are
shared.

``dirstat`` keeps a record for every path ``base`` holds (it is dropped only
once the path is gone both here and there): ``base`` keys a long path by its
hash, and these records are how the mirror of ``base`` knows such a path's
name.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, Self

from common.limits import AGENT_LOCAL_MAX_ENTRIES
from common.paths import ancestors
from common.types import Digest, FileVersion
from fsagent.dirmode.fs import lstat_at, open_scanned
from fsagent.dirmode.scan import DirScan, entry_limit, report, scan_directory
from fsagent.errors import StateCorrupt
from fsagent.scan.engine import ReadHook, StatKey
from fsagent.state.journal import Change, Journal
from fsagent.state.records import (
    MAX_KEY_BYTES,
    BaseEntry,
    Baseline,
    Inode,
    InodeNo,
    JournalSeq,
    LocalEntry,
    ManifestRow,
    encode_json,
    path_key,
)
from fsagent.state.statedir import StateDir

NO_SEQ: Final = JournalSeq(0)
"""Dir mode has no journal: every change is derived from a scan."""


@dataclass(frozen=True, slots=True)
class ScannedGeneration:
    """:meth:`DirStore.get`'s answer: 0 while the file is still the scanned one."""

    generation: int


class ScannedFiles:
    """The shipper's reader of changed files (the role of ``upper/`` in FUSE
    mode): a file opens only while its ``lstat`` key is the one its digest
    was computed under; otherwise FileNotFoundError, and the file waits for
    the next checkpoint."""

    def __init__(self, store: DirStore) -> None:
        self._store = store

    def open_read(self, ino: int) -> BinaryIO:
        path, entry = self._store.shipping(ino)
        return open_scanned(self._store.directory(), path, StatKey(*entry[1:7]))


class _NoTree:
    """The live tree of a plain directory: none. :meth:`Journal.acknowledge`
    never asks it (dir mode writes no journal entry)."""

    def resolve(self, txn: Any, path: str, *, committed: bool = False) -> Inode | None:
        return None

    def live_inode(self, txn: Any, ino: InodeNo) -> Inode | None:
        return None


class DirStore:
    """An open state dir of a plain-directory collection: ``DirStore.open(root)``;
    its parts are ``dir`` (with the ``dirstat`` table) and ``journal`` (the
    baseline, pending checkpoint and save status, as in FUSE mode)."""

    def __init__(self, state: StateDir) -> None:
        self.dir = state
        self.journal = Journal(state)
        self.root = state.root
        self.objects = state.objects
        self.readonly = state.readonly
        self._env = state.env
        self._meta = state.meta_db
        self._base = state.base_db
        self._dirstat = state.dirstat_db
        self.upper = ScannedFiles(self)
        self.last_scan: DirScan | None = None
        self.after_read: ReadHook | None = None
        """Called after each file is hashed (tests change files there)."""
        self.protected: str | None = None
        """The agent's instruction entry under the agent folder contract: a save
        never deletes it, nor a directory holding it (the mount refuses the
        unlink; here the scan reports it)."""
        self._directory_fd: int | None = None
        self._seen: dict[str, LocalEntry] = {}
        self._saved: dict[str, BaseEntry] = {}
        self._loaded = False
        self._shipping: dict[int, tuple[str, LocalEntry]] = {}

    @classmethod
    def open(cls, root: Path, *, readonly: bool = False) -> Self:
        """Open (or create) the state dir at ``root`` with its ``dirstat`` table."""
        return cls(StateDir.open(root, readonly=readonly, dirstat=True))

    def close(self) -> None:
        self.dir.close()

    # --- the directory ----------------------------------------------------------

    def attach(self, directory_fd: int) -> None:
        """Serve the directory open as ``directory_fd`` (pinned; the caller keeps
        it open until :meth:`close`)."""
        self._directory_fd = directory_fd

    def directory(self) -> int:
        if self._directory_fd is None:
            raise RuntimeError("no directory attached")
        return self._directory_fd

    def directory_record(self) -> dict[str, Any] | None:
        """``{"path", "dev", "ino"}`` of the directory this state belongs to."""
        with self._env.begin() as txn:
            raw = txn.get(b"dir_root", db=self._meta)
        return None if raw is None else dict(json.loads(raw))

    def record_directory(self, path: Path, st: os.stat_result) -> None:
        record = {"path": str(path), "dev": st.st_dev, "ino": st.st_ino}
        with self._env.begin(write=True) as txn:
            txn.put(b"dir_root", encode_json(record), db=self._meta)

    # --- the mirrors ----------------------------------------------------------

    def load(self) -> None:
        """Read ``dirstat`` and ``base`` into memory (once per daemon)."""
        seen: dict[str, LocalEntry] = {}
        saved: dict[str, BaseEntry] = {}
        decode_local, decode_base = LocalEntry.decode, BaseEntry.decode_current
        with self._env.begin() as txn:
            if self._dirstat is not None:
                for raw in txn.cursor(db=self._dirstat).iternext(keys=False):
                    path, entry = decode_local(raw)
                    seen[path] = entry
            long_paths = {path_key(p): p for p in seen if len(p) > MAX_KEY_BYTES // 4}
            for key, raw in txn.cursor(db=self._base):
                if key[:1] == b"\x00":
                    found = long_paths.get(bytes(key))
                    if found is None:
                        raise StateCorrupt(f"{self.root}: a saved long path has no dirstat record")
                    path = found
                else:
                    path = bytes(key).decode("utf-8")
                saved[path] = decode_base(raw)
        self._seen, self._saved, self._loaded = seen, saved, True

    def saved(self) -> Mapping[str, BaseEntry]:
        """What the controller held at each path as of the baseline."""
        return self._saved

    def seen(self) -> Mapping[str, LocalEntry]:
        """What the last recorded scan (or hydration) saw at each path."""
        return self._seen

    # --- scanning ---------------------------------------------------------------

    def rescan(self, *, record: bool = True) -> DirScan:
        """Scan the directory now; with ``record`` (and a writable store) keep what
        it saw for the next scan and its report for ``fsagent status``.

        Blocking: run it in a worker thread.
        """
        if not self._loaded:
            self.load()
        # The agent folder's entry limit is checked when a save commits (the
        # agent may write past it); other collections
        # refuse entries past MAX_ENTRIES by name, as the mount does.
        scan = scan_directory(
            self.directory(),
            self._seen,
            saved=self._saved,
            after_read=self.after_read,
            max_entries=entry_limit() if self.protected is None else AGENT_LOCAL_MAX_ENTRIES,
        )
        entry = self.protected
        if entry is not None and entry in self._saved:
            here = scan.entries.get(entry)
            if (here is None or here.kind != "file") and not scan.withheld(entry):
                scan.problems[entry] = (
                    "entry_protected: the agent's instruction entry cannot be deleted or "
                    "replaced by a directory; the saved one stays"
                )
                below = entry + "/"
                for path in [p for p in scan.entries if p == entry or p.startswith(below)]:
                    del scan.entries[path]  # a directory in its place is not saved either
        self.last_scan = scan
        if record and not self.readonly:
            self._record_scan(scan)
        return scan

    def _record_scan(self, scan: DirScan) -> None:
        seen = self._seen
        puts = [(p, e) for p, e in scan.entries.items() if seen.get(p) is not e]
        drops: list[str] = []
        if scan.stable:
            drops = [
                p
                for p in seen
                if p not in scan.entries and p not in self._saved and not scan.withheld(p)
            ]
        shown = {"at": time.time(), **report(scan)}
        with self._env.begin(write=True) as txn:
            for p, e in puts:
                txn.put(path_key(p), e.encode(p), db=self._dirstat)
            for p in drops:
                txn.delete(path_key(p), db=self._dirstat)
            txn.put(b"dir_scan", encode_json(shown), db=self._meta)
        for p, e in puts:
            seen[p] = e
        for p in drops:
            del seen[p]

    def scan_report(self) -> dict[str, Any] | None:
        """The last recorded scan's refusals and retries (:func:`fsagent.dirmode.scan.report`)."""
        with self._env.begin() as txn:
            raw = txn.get(b"dir_scan", db=self._meta)
        return None if raw is None else dict(json.loads(raw))

    # --- the change set -----------------------------------------------------------

    def changes_since_baseline(self, *, committed: bool = False) -> list[Change]:
        """The last scan against ``base``, parents before children (``committed``
        changes nothing: a scan reads no in-memory state of a mount).

        Files whose contents or exec bit differ upload, unless their digest is
        the saved content of a path this change set deletes or replaces (a
        rename: shipped as a reference, without bytes, as in FUSE mode).
        Deletions come only from a stable scan, and never for a path the scan
        refused or could not read steadily (it keeps its saved version).
        """
        scan = self.last_scan
        if scan is None:
            return []
        saved = self._saved
        files: list[tuple[str, LocalEntry, BaseEntry | None]] = []
        out: list[Change] = []
        new_dirs: list[tuple[str, BaseEntry | None]] = []
        get = saved.get
        # Once per entry of the collection at every checkpoint: kept to a few
        # comparisons for the common case, an entry as saved.
        for path, cur in scan.entries.items():
            base = get(path)
            if cur[0] == "directory":
                if base is None or base.kind != "directory":
                    new_dirs.append((path, base))
                continue
            if (
                base is None
                or base.digest != cur[7]
                or base.executable != bool(cur[4] & stat.S_IXUSR)
                or base.kind != "file"
            ):
                files.append((path, cur, base))
        if new_dirs:
            # A manifest may leave parents implicit; a parent of saved paths is
            # not new (the controller holds it as such).
            implied = {a for p in saved for a in ancestors(p)}
            out.extend(
                Change(path, "mkdir", NO_SEQ, base)
                for path, base in new_dirs
                if base is not None or path not in implied
            )
        if scan.stable:
            holds_entry = set(ancestors(self.protected)) if self.protected else set()
            for path, base in saved.items():
                if path not in scan.entries and not scan.withheld(path):
                    if path in holds_entry:
                        continue  # the entry's own problem is reported; it stays saved
                    out.append(Change(path, "delete", NO_SEQ, base))
        referable = {c.base.digest for c in out if c.base is not None and c.base.kind == "file"}
        referable.update(b.digest for _, _, b in files if b is not None and b.kind == "file")
        self._shipping = {}
        for path, cur, base in files:
            exe = bool(cur.mode & stat.S_IXUSR)
            if cur.digest in referable:
                out.append(
                    Change(path, "reference", NO_SEQ, base, digest=cur.digest, size=cur.size,
                           executable=exe)
                )  # fmt: skip
                continue
            ino = InodeNo(len(self._shipping) + 1)
            self._shipping[ino] = (path, cur)
            out.append(
                Change(path, "upload", NO_SEQ, base, inode=ino, size=cur.size, executable=exe)
            )
        return sorted(out, key=lambda c: c.path.encode("utf-8"))

    def shipping(self, ino: int) -> tuple[str, LocalEntry]:
        """The path and scanned entry behind an upload's id; KeyError if unknown."""
        return self._shipping[ino]

    def get(self, ino: int) -> ScannedGeneration:
        """The shipper's before/after check of an upload: generation 0 while the
        file's ``lstat`` key is still the scanned one; KeyError once it is gone."""
        path, entry = self._shipping[ino]
        try:
            st = lstat_at(self.directory(), path)
        except FileNotFoundError:
            raise KeyError(ino) from None
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns)
        return ScannedGeneration(0 if now == tuple(entry[1:7]) else 1)

    def inline_data(self, ino: int) -> bytes | None:
        """Never inline: every upload is read from the directory."""
        return None

    def acknowledge(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], high_water: int
    ) -> int:
        """:meth:`Journal.acknowledge`, and the mirror of ``base`` follows it."""
        shipped = list(shipped)
        cleared = self.journal.acknowledge(shipped, high_water, _NoTree())
        with self._env.begin() as txn:
            for change, _, _ in shipped:
                raw = txn.get(path_key(change.path), db=self._base)
                if raw is None:
                    self._saved.pop(change.path, None)
                else:
                    self._saved[change.path] = BaseEntry.decode(bytes(raw))
        return cleared

    def finish_checkpoint(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], receipt: dict[str, Any]
    ) -> int:
        """Fold a saved checkpoint into the baseline (:meth:`acknowledge`) and
        clear the pending record, as :meth:`fsagent.state.store.Store.finish_checkpoint`."""
        cleared = self.acknowledge(shipped, self.journal.baseline().high_water)
        self.journal.close_checkpoint(receipt)
        return cleared

    # --- hydration and the server's changes ----------------------------------------

    def hydrating(self) -> bool:
        """Whether a hydration began and never finished (its files may be half there)."""
        with self._env.begin() as txn:
            return txn.get(b"dir_hydrating", db=self._meta) is not None

    def begin_hydration(self) -> None:
        """Durable before the first file is placed: a crash then hydrates again."""
        with self._env.begin(write=True) as txn:
            txn.put(b"dir_hydrating", b"1", db=self._meta)
        self._env.sync(True)

    def finish_hydration(
        self, rows: Iterable[ManifestRow], placed: Mapping[str, LocalEntry], high_water: int
    ) -> None:
        """The manifest as the baseline and what was placed as the last scan, in
        one commit (the files were made durable before it)."""
        saved = {row.path: row.base_entry() for row in rows}
        with self._env.begin(write=True) as txn:
            txn.drop(self._base, delete=False)
            txn.drop(self._dirstat, delete=False)
            for path, entry in saved.items():
                txn.put(path_key(path), entry.encode(), db=self._base)
            for path, seen in placed.items():
                txn.put(path_key(path), seen.encode(path), db=self._dirstat)
            txn.put(b"baseline", Baseline(high_water, True).encode(), db=self._meta)
            txn.delete(b"dir_hydrating", db=self._meta)
        self._env.sync(True)
        self._saved, self._seen, self._loaded = saved, dict(placed), True

    def record_applied(
        self,
        saved: Mapping[str, BaseEntry | None],
        seen: Mapping[str, LocalEntry | None],
        high_water: int,
    ) -> None:
        """The server's changes applied to the directory (None: the path is gone),
        and the new baseline high-water mark, in one commit."""
        with self._env.begin(write=True) as txn:
            for path, base in saved.items():
                if base is None:
                    txn.delete(path_key(path), db=self._base)
                else:
                    txn.put(path_key(path), base.encode(), db=self._base)
            for path, entry in seen.items():
                if entry is None:
                    txn.delete(path_key(path), db=self._dirstat)
                else:
                    txn.put(path_key(path), entry.encode(path), db=self._dirstat)
            txn.put(b"baseline", Baseline(high_water, True).encode(), db=self._meta)
        self._env.sync(True)
        for path, base in saved.items():
            if base is None:
                self._saved.pop(path, None)
            else:
                self._saved[path] = base
        for path, entry in seen.items():
            if entry is None:
                self._seen.pop(path, None)
            else:
                self._seen[path] = entry
