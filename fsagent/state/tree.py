"""The tree: inodes and directory entries, bulk loads from a manifest, crash recovery.

Tables (fsagent.state.records has their encodings):

``inodes``   inode number -> record (kind, mode, size, times, parent+name,
             digest of saved content, upper flag, write generation).
``entries``  parent inode + name -> child inode (a name is one segment).
``orphans``  inodes unlinked while the kernel still knew them; freed on
             forget, or at the next start after a crash.
``inline``   inode -> contents of a changed file of at most ``INLINE_MAX``
             bytes (fsagent.state.content); a file with the upper flag is inline
             exactly when it has a key here.

Every public method is synchronous and commits at most one short write
transaction, so on the trio thread each one is atomic with respect to other
FUSE handlers.  A small in-memory cache holds the inodes the kernel currently
knows; records are written through on every change (a write() commits size
and generation with its bytes, :meth:`Tree.persist`).  Every mutation journals
the paths it touched in the same commit (fsagent.state.journal).

:class:`Tree` is built on the :class:`fsagent.state.statedir.StateDir` (its
tables) and the :class:`fsagent.state.journal.Journal` (``journal``, for the
paths each mutation touches); the store holds it as ``tree``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from common.paths import ancestors
from common.types import Digest
from fsagent.errors import StateCorrupt
from fsagent.state.content import UpperFiles
from fsagent.state.journal import Journal
from fsagent.state.records import (
    BaseEntry,
    Baseline,
    Inode,
    InodeNo,
    Kind,
    ManifestRow,
    ekey,
    entry_name,
    ikey,
    ino_of,
    now_ns,
    path_key,
    process_owner,
)
from fsagent.state.statedir import ROOT_INODE, StateDir


class Tree:
    """The inode tree of an open state dir; every mutation journals the paths
    it touched through ``journal`` in its own commit; ``upper`` holds the
    large upper copies."""

    def __init__(self, state: StateDir, journal: Journal) -> None:
        self._state = state
        self.journal = journal
        self._env = state.env
        self._meta = state.meta_db
        self._inodes = state.inodes_db
        self._entries = state.entries_db
        self._base = state.base_db
        self._journal_db = state.journal_db
        self._orphans = state.orphans_db
        self._inline = state.inline_db
        self.upper = UpperFiles(state.root / "upper")
        self._cache: dict[InodeNo, Inode] = {}
        self._subdirs: dict[InodeNo, int] = {}

    def live_inode(self, txn: Any, ino: InodeNo) -> Inode | None:
        cached = self._cache.get(ino)
        if cached is not None:
            return cached
        raw = txn.get(ikey(ino), db=self._inodes)
        return None if raw is None else Inode.decode(ino, raw)

    # --- inodes -------------------------------------------------------------

    def get(self, ino: int) -> Inode:
        """The inode's live record; KeyError when it does not exist."""
        cached = self._cache.get(InodeNo(ino))
        if cached is not None:
            return cached
        with self._env.begin() as txn:
            raw = txn.get(ikey(ino), db=self._inodes)
        if raw is None:
            raise KeyError(ino)
        inode = Inode.decode(ino, raw)
        self._cache[inode.ino] = inode
        return inode

    def evict(self, ino: InodeNo) -> None:
        """Drop an inode from the cache once the kernel has forgotten it
        (every change to it is already committed)."""
        if ino != ROOT_INODE:
            self._cache.pop(ino, None)

    def nlink(self, inode: Inode) -> int:
        """The link count: 1 for a file, 2 + its subdirectories for a directory
        (its entry, its ``.`` and each subdirectory's ``..``), 0 once unlinked."""
        if inode.parent == 0 and inode.ino != ROOT_INODE:
            return 0
        if inode.kind != "directory":
            return 1
        count = self._subdirs.get(inode.ino)
        if count is None:
            # Counted once, then kept exact by every change below (in memory
            # only: nothing to store, upgrade or repair).
            with self._env.begin() as txn:
                count = sum(
                    1
                    for _, child in self._children_in(txn, inode.ino)
                    if (node := self.live_inode(txn, child)) is not None
                    and node.kind == "directory"
                )
            self._subdirs[inode.ino] = count
        return 2 + count

    def _count_subdir(self, parent: InodeNo, delta: int) -> None:
        count = self._subdirs.get(parent)
        if count is not None:
            self._subdirs[parent] = count + delta

    def lookup(self, parent: InodeNo, name: str) -> InodeNo | None:
        with self._env.begin() as txn:
            raw = txn.get(ekey(parent, name), db=self._entries)
        return None if raw is None else ino_of(raw)

    def children(self, parent: InodeNo) -> list[tuple[str, InodeNo]]:
        """All entries of a directory, sorted by name bytes (a stable readdir order)."""
        with self._env.begin() as txn:
            return self._children_in(txn, parent)

    def has_children(self, parent: InodeNo) -> bool:
        prefix = ikey(parent)
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._entries)
            return bool(cur.set_range(prefix)) and bytes(cur.key()).startswith(prefix)

    def path_of(self, ino: InodeNo) -> str | None:
        """Work path of a linked inode ("" for the root), None for an orphan."""
        parts: list[str] = []
        while ino != ROOT_INODE:
            inode = self.get(ino)
            if inode.parent == 0:
                return None
            parts.append(inode.name)
            ino = inode.parent
        return "/".join(reversed(parts))

    def is_ancestor(self, ancestor: InodeNo, ino: InodeNo) -> bool:
        """Whether directory ``ancestor`` is ``ino`` or above it (False for an orphan)."""
        while ino != ancestor:
            if ino == ROOT_INODE:
                return False
            ino = self.get(ino).parent
            if ino == 0:
                return False
        return True

    def count_entries(self) -> int:
        """Linked names in the tree: what the controller's entry limit counts."""
        with self._env.begin() as txn:
            return int(txn.stat(self._entries)["entries"])

    def count_inodes(self) -> int:
        with self._env.begin() as txn:
            return int(txn.stat(self._inodes)["entries"])

    def persist(
        self, inode: Inode, *, touch: str | None = None, inline: bytes | None = None
    ) -> None:
        """Write the inode record (and optionally touch its path) in one commit;
        ``inline`` also replaces the file's inline contents."""
        with self._env.begin(write=True) as txn:
            if inline is not None:
                txn.put(ikey(inode.ino), inline, db=self._inline)
            self._put_inode(txn, inode)
            if touch is not None and inode.parent != 0:
                path = self._path_in(txn, inode.ino)
                if path:
                    self.journal.touch_in(txn, [path], touch)

    def inline_data(self, ino: InodeNo) -> bytes | None:
        """The contents of an inline file; None when the file is not inline."""
        if self._inline is None:
            return None
        with self._env.begin() as txn:
            raw = txn.get(ikey(ino), db=self._inline)
        return None if raw is None else bytes(raw)

    def committed_contents(self, inos: list[InodeNo]) -> list[tuple[int, bytes | None] | None]:
        """Each inode's write generation and inline contents (None: not inline) as
        last committed, from one snapshot; None for an inode that is gone.

        Reads no in-memory state, so a thread other than the mount's may call
        it: a write commits its generation together with its inline bytes, so
        the pair is consistent.
        """
        out: list[tuple[int, bytes | None] | None] = []
        with self._env.begin() as txn:
            for ino in inos:
                raw = txn.get(ikey(ino), db=self._inodes)
                if raw is None:
                    out.append(None)
                    continue
                data = None if self._inline is None else txn.get(ikey(ino), db=self._inline)
                out.append(
                    (Inode.decode(ino, raw).generation, None if data is None else bytes(data))
                )
        return out

    def drop_inline(self, inode: Inode) -> None:
        """The file's contents are now complete in ``upper/<inode>``: forget the inline copy."""
        self._state.forget_durable()
        with self._env.begin(write=True) as txn:
            txn.delete(ikey(inode.ino), db=self._inline)
            self._put_inode(txn, inode)

    def _put_inode(self, txn: Any, inode: Inode) -> None:
        self._cache[inode.ino] = inode
        txn.put(ikey(inode.ino), inode.encode(), db=self._inodes)

    def _path_in(self, txn: Any, ino: InodeNo) -> str | None:
        parts: list[str] = []
        while ino != ROOT_INODE:
            inode = self.live_inode(txn, ino)
            if inode is None or inode.parent == 0:
                return None
            parts.append(inode.name)
            ino = inode.parent
        return "/".join(reversed(parts))

    def _next_ino(self, txn: Any) -> InodeNo:
        ino = int(txn.get(b"next_ino", db=self._meta))
        txn.put(b"next_ino", str(ino + 1).encode(), db=self._meta)
        return InodeNo(ino)

    def _moved_paths(self, txn: Any, inode: Inode, path: str) -> list[str]:
        """``path`` and, for a directory, every path below it."""
        if inode.kind != "directory":
            return [path]
        return list(self._subtree_paths(txn, inode.ino, path))

    def _subtree_paths(self, txn: Any, ino: InodeNo, prefix: str) -> Iterator[str]:
        """``prefix`` and every path below directory ``ino`` (depth first)."""
        yield prefix
        stack = [(ino, prefix)]
        while stack:
            dino, dpath = stack.pop()
            key = ikey(dino)
            cur = txn.cursor(db=self._entries)
            if not cur.set_range(key):
                continue
            for k, v in cur:
                if not k.startswith(key):
                    break
                child = ino_of(v)
                cpath = f"{dpath}/{entry_name(k)}"
                yield cpath
                craw = txn.get(ikey(child), db=self._inodes)
                if craw is not None and Inode.decode(child, craw).kind == "directory":
                    stack.append((child, cpath))

    # --- mutations (each one commit; each touches the journal) --------------

    def create(
        self, parent: InodeNo, name: str, kind: Kind, mode: int, uid: int = -1, gid: int = -1
    ) -> Inode:
        """Link a new empty file or directory owned by ``uid``:``gid`` (-1: the
        daemon's user); the caller checked the name is free."""
        t = now_ns()
        with self._env.begin(write=True) as txn:
            ino = self._next_ino(txn)
            inode = Inode(
                ino, kind, mode & 0o7777, 0, t, t, parent, name, None, kind == "file", 0, uid, gid
            )
            self._put_inode(txn, inode)
            if kind == "file":
                txn.put(ikey(ino), b"", db=self._inline)
            txn.put(ekey(parent, name), ikey(ino), db=self._entries)
            path = self._path_in(txn, ino)
            assert path is not None
            self.journal.touch_in(txn, [path], "mkdir" if kind == "directory" else "create")
            self._touch_parent_mtime(txn, parent, t)
        if kind == "directory":
            self._subdirs[ino] = 0
            self._count_subdir(parent, 1)
        return inode

    def _touch_parent_mtime(self, txn: Any, parent: InodeNo, t: int) -> None:
        pinode = self.live_inode(txn, parent)
        if pinode is None:
            return
        pinode.mtime_ns = pinode.ctime_ns = t
        self._put_inode(txn, pinode)

    def _entry_inode(self, txn: Any, parent: InodeNo, name: str) -> Inode:
        """The live inode linked at ``parent``/``name``; KeyError when there is none."""
        raw = txn.get(ekey(parent, name), db=self._entries)
        inode = None if raw is None else self.live_inode(txn, ino_of(raw))
        if inode is None:
            raise KeyError(name)
        return inode

    def unlink(self, parent: InodeNo, name: str, *, keep: bool) -> Inode:
        """Remove the entry; ``keep`` makes the inode an orphan instead of freeing it."""
        t = now_ns()
        with self._env.begin(write=True) as txn:
            inode = self._entry_inode(txn, parent, name)
            path = self._path_in(txn, inode.ino)
            if path is not None:
                self.journal.touch_in(
                    txn, [path], "rmdir" if inode.kind == "directory" else "unlink"
                )
            txn.delete(ekey(parent, name), db=self._entries)
            self._detach(txn, inode, keep=keep, t=t)
            self._touch_parent_mtime(txn, parent, t)
        if inode.kind == "directory":
            self._subdirs.pop(inode.ino, None)
            self._count_subdir(parent, -1)
        return inode

    def _detach(self, txn: Any, inode: Inode, *, keep: bool, t: int) -> None:
        inode.parent = InodeNo(0)
        inode.ctime_ns = t
        if keep:
            self._put_inode(txn, inode)
            txn.put(ikey(inode.ino), b"", db=self._orphans)
        else:
            self._free(txn, inode)

    def _free(self, txn: Any, inode: Inode) -> None:
        txn.delete(ikey(inode.ino), db=self._inodes)
        txn.delete(ikey(inode.ino), db=self._orphans)
        self._cache.pop(inode.ino, None)
        if inode.upper and not txn.delete(ikey(inode.ino), db=self._inline):
            self.upper.remove(inode.ino)

    def _free_orphans_in(self, txn: Any, inos: Iterable[InodeNo]) -> None:
        """Release unlinked inodes nobody references any more."""
        for ino in inos:
            if txn.get(ikey(ino), db=self._orphans) is None:
                continue
            raw = txn.get(ikey(ino), db=self._inodes)
            inode = self._cache.get(ino) or (Inode.decode(ino, raw) if raw else None)
            if inode is None:
                txn.delete(ikey(ino), db=self._orphans)
                continue
            self._free(txn, inode)

    def write_behind(self, times: Iterable[InodeNo], orphans: Iterable[InodeNo]) -> None:
        """One commit: the cached records of ``times`` (inodes whose times
        changed; one freed meanwhile is not written back), and the orphans
        nobody references freed."""
        with self._env.begin(write=True) as txn:
            for ino in times:
                inode = self._cache.get(ino)
                if inode is not None and txn.get(ikey(ino), db=self._inodes) is not None:
                    txn.put(ikey(ino), inode.encode(), db=self._inodes)
            self._free_orphans_in(txn, orphans)

    def drop_orphan_copy(self, ino: InodeNo) -> None:
        """Remove the upper copy of an orphan nobody can reach any more now (the
        disk space comes back at once); its records go with :meth:`write_behind`.
        A crash in between leaves an orphan that recovery frees."""
        inode = self._cache.get(ino)
        if inode is not None and inode.parent == 0 and inode.upper:
            self.upper.remove(ino)

    def rename(
        self,
        old_parent: InodeNo,
        old_name: str,
        new_parent: InodeNo,
        new_name: str,
        *,
        keep_replaced: Callable[[InodeNo], bool],
    ) -> Inode | None:
        """Move an entry, replacing whatever is at the target; returns the replaced inode.

        The caller has already checked kinds and emptiness.  Both the old and
        the new path of the moved subtree enter the journal, so the change set
        shows a delete at every old path and a reference (or upload) at every
        new one.
        """
        t = now_ns()
        self._state.forget_durable()
        with self._env.begin(write=True) as txn:
            moved = self._entry_inode(txn, old_parent, old_name)
            ino = moved.ino
            old_path = self._path_in(txn, ino)
            replaced: Inode | None = None
            traw = txn.get(ekey(new_parent, new_name), db=self._entries)
            if traw is not None:
                tino = ino_of(traw)
                replaced = self._cache.get(tino) or Inode.decode(
                    tino, txn.get(ikey(tino), db=self._inodes)
                )
            touched: list[tuple[list[str], str]] = []
            if old_path is not None:
                touched.append((self._moved_paths(txn, moved, old_path), "rename-from"))
            txn.delete(ekey(old_parent, old_name), db=self._entries)
            txn.put(ekey(new_parent, new_name), ikey(ino), db=self._entries)
            moved.parent, moved.name, moved.ctime_ns = new_parent, new_name, t
            self._put_inode(txn, moved)
            if replaced is not None:
                self._detach(txn, replaced, keep=keep_replaced(replaced.ino), t=t)
            new_path = self._path_in(txn, ino)
            if new_path is not None:
                touched.append((self._moved_paths(txn, moved, new_path), "rename-to"))
            self.journal.touch_all_in(txn, touched)
            self._touch_parent_mtime(txn, old_parent, t)
            if new_parent != old_parent:
                self._touch_parent_mtime(txn, new_parent, t)
        if moved.kind == "directory":
            self._count_subdir(old_parent, -1)
            self._count_subdir(new_parent, 1)
        if replaced is not None and replaced.kind == "directory":
            self._subdirs.pop(replaced.ino, None)
            self._count_subdir(new_parent, -1)
        return replaced

    def exchange(self, p1: InodeNo, n1: str, p2: InodeNo, n2: str) -> None:
        """RENAME_EXCHANGE: swap two existing entries atomically."""
        t = now_ns()
        self._state.forget_durable()
        with self._env.begin(write=True) as txn:
            r1 = txn.get(ekey(p1, n1), db=self._entries)
            r2 = txn.get(ekey(p2, n2), db=self._entries)
            if r1 is None or r2 is None:
                raise KeyError(n1 if r1 is None else n2)
            i1, i2 = ino_of(r1), ino_of(r2)
            a = self._cache.get(i1) or Inode.decode(i1, txn.get(ikey(i1), db=self._inodes))
            b = self._cache.get(i2) or Inode.decode(i2, txn.get(ikey(i2), db=self._inodes))
            for inode in (a, b):
                path = self._path_in(txn, inode.ino)
                if path is not None:
                    self.journal.touch_in(
                        txn, list(self._subtree_paths(txn, inode.ino, path)), "exchange"
                    )
            txn.put(ekey(p1, n1), ikey(i2), db=self._entries)
            txn.put(ekey(p2, n2), ikey(i1), db=self._entries)
            a.parent, a.name, a.ctime_ns = p2, n2, t
            b.parent, b.name, b.ctime_ns = p1, n1, t
            self._put_inode(txn, a)
            self._put_inode(txn, b)
            for inode in (a, b):
                path = self._path_in(txn, inode.ino)
                if path is not None:
                    self.journal.touch_in(
                        txn, list(self._subtree_paths(txn, inode.ino, path)), "exchange"
                    )
        for inode, left, joined in ((a, p1, p2), (b, p2, p1)):
            if inode.kind == "directory":
                self._count_subdir(left, -1)
                self._count_subdir(joined, 1)

    def resolve(self, txn: Any, path: str, *, committed: bool = False) -> Inode | None:
        ino = ROOT_INODE
        for name in path.split("/"):
            raw = txn.get(ekey(ino, name), db=self._entries)
            if raw is None:
                return None
            ino = ino_of(raw)
        cached = None if committed else self._cache.get(ino)
        if cached is not None:
            return cached
        raw = txn.get(ikey(ino), db=self._inodes)
        return None if raw is None else Inode.decode(ino, raw)

    def apply_incoming(self, entries: Iterable[ManifestRow | tuple[str, bool]]) -> int:
        """Apply the server's changes since the baseline to paths not changed locally.

        Only for a warm start before mounting (no FUSE handles exist yet).
        ``entries`` are manifest rows, or (path, True) for a deletion, in
        version order. A path in the journal keeps the local version: local
        changes were shipped first and win. Returns the paths updated.
        """
        journal = {p for p, _, _ in self.journal.entries()}
        self._subdirs.clear()  # counted again on demand
        applied = 0
        for item in entries:
            if isinstance(item, tuple):
                path, _deleted = item
                row: ManifestRow | None = None
            else:
                path, row = item.path, item
            # A path changed locally, or below one that was (e.g. a directory
            # deleted here), keeps the local version: O(depth), not O(journal).
            if path in journal or any(a in journal for a in ancestors(path)):
                continue
            if self._apply_incoming_one(path, row):
                applied += 1
        return applied

    def _apply_incoming_one(self, path: str, row: ManifestRow | None) -> bool:
        t = now_ns()
        with self._env.begin(write=True) as txn:
            cur = self.resolve(txn, path)
            key = path_key(path)
            braw = txn.get(key, db=self._base)
            base = BaseEntry.decode(braw) if braw is not None else None
            if (
                row is not None
                and base is not None
                and (base.kind, base.digest, base.executable)
                == (row.kind, row.digest, row.executable)
            ):
                # Our own saved state coming back (or no real change): keep the
                # local inode (and its upper copy), only note the new version.
                txn.put(key, row.base_entry().encode(), db=self._base)
                return False
            if row is None:
                if cur is None:
                    txn.delete(key, db=self._base)
                    return False
                self._remove_tree(txn, cur, path, t)
                return True
            parent = ROOT_INODE
            parts = path.split("/")
            for name in parts[:-1]:
                raw = txn.get(ekey(parent, name), db=self._entries)
                if raw is None:
                    ino = self._next_ino(txn)
                    node = Inode(ino, "directory", 0o755, 0, t, t, parent, name, None, False, 0)
                    self._put_inode(txn, node)
                    txn.put(ekey(parent, name), ikey(ino), db=self._entries)
                    parent = ino
                else:
                    parent = ino_of(raw)
            if cur is not None and (cur.kind != row.kind or row.kind == "file"):
                self._remove_tree(txn, cur, path, t)
                cur = None
            if cur is None:
                ino = self._next_ino(txn)
                mode = 0o755 if row.kind == "directory" or row.executable else 0o644
                node = Inode(ino, row.kind, mode, row.byte_size, t, t, parent, parts[-1],
                             row.digest, False, 0)  # fmt: skip
                self._put_inode(txn, node)
                txn.put(ekey(parent, parts[-1]), ikey(ino), db=self._entries)
            entry = BaseEntry(row.kind, row.digest, row.byte_size, row.executable, row.version)
            txn.put(key, entry.encode(), db=self._base)
        return True

    def _remove_tree(self, txn: Any, top: Inode, path: str, t: int) -> None:
        """Drop ``top`` (and, for a directory, everything below it) from tree and base."""
        stack = [(top, path)]
        while stack:
            inode, ipath = stack.pop()
            if inode.kind == "directory":
                for name, child in self._children_in(txn, inode.ino):
                    raw = txn.get(ikey(child), db=self._inodes)
                    if raw is not None:
                        stack.append((Inode.decode(child, raw), f"{ipath}/{name}"))
            txn.delete(ekey(inode.parent, inode.name), db=self._entries)
            txn.delete(path_key(ipath), db=self._base)
            self._detach(txn, inode, keep=False, t=t)

    def _children_in(self, txn: Any, parent: InodeNo) -> list[tuple[str, InodeNo]]:
        key = ikey(parent)
        out: list[tuple[str, InodeNo]] = []
        cur = txn.cursor(db=self._entries)
        if cur.set_range(key):
            for k, v in cur:
                if not bytes(k).startswith(key):
                    break
                out.append((entry_name(k), ino_of(v)))
        return out

    # --- hydration ----------------------------------------------------------

    def hydrate(self, entries: Iterable[ManifestRow], high_water: int) -> int:
        """Build the tree and the baseline from a full manifest in one commit.

        Either the whole manifest lands (and ``hydrated`` is set) or nothing
        does, so a crash mid-hydration just hydrates again.  Ancestors that the
        manifest does not list are created as directories.  Returns the number
        of inodes created.
        """
        t = now_ns()
        uid, gid = process_owner()  # hydrated entries are the daemon's, as Inode's default
        self._subdirs.clear()
        dirs: dict[str, InodeNo] = {"": ROOT_INODE}
        created = 0
        with self._env.begin(write=True) as txn:
            if txn.stat(self._entries)["entries"] or txn.stat(self._journal_db)["entries"]:
                raise StateCorrupt(f"{self._state.root}: refusing to hydrate over existing entries")
            next_ino = int(txn.get(b"next_ino", db=self._meta))
            put = txn.put

            def ensure_dir(path: str) -> InodeNo | None:
                nonlocal next_ino, created
                found = dirs.get(path)
                if found is not None:
                    return found
                head, _, name = path.rpartition("/")
                parent = ensure_dir(head)
                if parent is None or path in files:
                    return None
                ino = InodeNo(next_ino)
                next_ino += 1
                created += 1
                put(
                    ikey(ino),
                    Inode(
                        ino, "directory", 0o755, 0, t, t, parent, name, None, False, 0, uid, gid, t
                    ).encode(),
                    db=self._inodes,
                )
                put(ekey(parent, name), ikey(ino), db=self._entries)
                dirs[path] = ino
                return ino

            files: set[str] = set()
            for row in sorted(entries, key=lambda r: (r.kind != "directory", r.path)):
                head, _, name = row.path.rpartition("/")
                if row.path in dirs or row.path in files:
                    continue
                parent = ensure_dir(head)
                if parent is None:
                    continue  # a file sits where a directory should be: keep the file
                if row.kind == "directory":
                    ensure_dir(row.path)
                    put(
                        path_key(row.path),
                        BaseEntry("directory", None, 0, False, row.version).encode(),
                        db=self._base,
                    )
                    continue
                ino = InodeNo(next_ino)
                next_ino += 1
                created += 1
                mode = 0o755 if row.executable else 0o644
                inode = Inode(
                    ino, "file", mode, row.byte_size, t, t, parent, name, row.digest, False, 0,
                    uid, gid, t,
                )  # fmt: skip
                put(ikey(ino), inode.encode(), db=self._inodes)
                put(ekey(parent, name), ikey(ino), db=self._entries)
                put(
                    path_key(row.path),
                    BaseEntry(
                        "file", row.digest, row.byte_size, row.executable, row.version
                    ).encode(),
                    db=self._base,
                )
                files.add(row.path)
            put(b"next_ino", str(next_ino).encode(), db=self._meta)
            put(b"baseline", Baseline(high_water, True).encode(), db=self._meta)
        return created

    def missing_digests(self) -> list[tuple[Digest, int]]:
        """Saved contents the tree shows that are not in objects/ yet (safe off-thread)."""
        have = set(os.listdir(self._state.objects))
        seen: set[str] = set()
        out: list[tuple[Digest, int]] = []
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._inodes):
                inode = Inode.decode(ino_of(key), raw)
                digest = inode.digest
                if digest and not inode.upper and digest not in have and digest not in seen:
                    seen.add(digest)
                    out.append((Digest(digest), inode.size))
        return out

    # --- recovery -----------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Repair what a crash can leave behind; returns (orphans freed, sizes fixed).

        Orphans were kept only for handles that died with the old process.
        An upper file's length is the truth for the file's size: the bytes
        reach it before write() commits the size (an inline file's contents
        and size are one commit).  Files in ``upper/`` that no inode uses are
        removed: a temp copy cut short, or one left beside inline contents by
        a crash while they moved out of line.
        """
        freed = fixed = 0
        on_disk = self.upper.sizes()
        used: set[InodeNo] = set()
        with self._env.begin(write=True) as txn:
            for key, _ in list(txn.cursor(db=self._orphans)):
                ino = ino_of(key)
                raw = txn.get(key, db=self._inodes)
                if raw is not None:
                    self._free(txn, Inode.decode(ino, raw))
                else:
                    txn.delete(key, db=self._orphans)
                freed += 1
            for key, raw in list(txn.cursor(db=self._inodes)):
                inode = Inode.decode(ino_of(key), raw)
                if inode.kind != "file" or not inode.upper:
                    continue
                inline = txn.get(key, db=self._inline)
                if inline is not None:
                    size = len(inline)
                elif inode.ino in on_disk:
                    size = on_disk[inode.ino]
                    used.add(inode.ino)
                else:
                    # The upper file never reached the disk: an empty file.
                    txn.put(key, b"", db=self._inline)
                    size = 0
                if size != inode.size:
                    inode.size = size
                    inode.generation += 1
                    txn.put(key, inode.encode(), db=self._inodes)
                    fixed += 1
            self.upper.remove_all_but(used)  # what is left is used by no inode
            for name in os.listdir(self._state.objects):
                if name.startswith(".tmp-"):
                    os.unlink(self._state.objects / name)
        return freed, fixed
