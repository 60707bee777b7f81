"""Durable local state of one mounted collection: inodes, entries, journal, baseline.

Layout of a state dir (default ``$HOME/.local/state/fsagent/<scope>``)::

    fsagent-state.json   marker: format version; a dir without it is not ours
    lock                 flock()ed by the daemon that owns the state
    db/                  LMDB environment (named databases below)
    objects/<digest>     saved contents, read-only, filled by hydration
    upper/<inode>        copy-on-write contents of changed files over INLINE_MAX
    daemon.json          pid + mountpoint of the running daemon (for status)

LMDB databases:

``meta``     format, binding (company + the run's four owners), baseline
             (``highWater`` of the last manifest read), counters.
``inodes``   inode number -> record (kind, mode, size, times, parent+name,
             digest of saved content, upper flag, write generation).
``entries``  parent inode + name -> child inode (a name is one segment).
``base``     path -> what the controller had at the baseline (kind, digest,
             size, executable, version).  Never changed by local edits.
``journal``  path -> (sequence number, last operation).  A path is in the
             journal when anything happened at it since the baseline.
``orphans``  inodes unlinked while the kernel still knew them; freed on
             forget, or at the next start after a crash.
``inline``   inode -> contents of a changed file of at most ``INLINE_MAX``
             bytes.  Small files live here instead of in ``upper/``: creating,
             writing and removing one is a single LMDB commit, with no file
             created or deleted on the disk (on ext4 an inode allocation can
             take a millisecond).  A file that grows past the limit moves to
             ``upper/<inode>`` (:meth:`Store.drop_inline`); a file with the
             upper flag is inline exactly when it has a key here.

The journal is a set of *touched paths*, not a replay log: the change set
since the baseline is derived by comparing, for each touched path, the live
tree with ``base`` (:meth:`Store.changes_since_baseline`).  That gives the
coalescing rules for free: a file created and deleted between checkpoints
compares equal to "absent at baseline" and ships nothing; an unchanged file
renamed elsewhere has a digest but no upper copy, so it ships as a reference;
and the cost of listing grows with the number of touched paths, not with the
size of the collection.  Each touch takes a new sequence number, so a shipper
can tell whether a path was touched again while its checkpoint was in flight
(:meth:`Store.acknowledge`).

Durability: the environment is opened with ``sync=False``.  A commit still
hands the pages to the kernel, so it survives ``kill -9`` of this process;
only power loss can undo it, and :meth:`Store.sync` (called on fsync) closes
that gap where POSIX promises it.  Transactions are kept to one FUSE
operation each.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, NewType

import lmdb

from common.paths import ancestors
from common.types import Digest, FileVersion
from fsagent.errors import StateBindingMismatch, StateCorrupt, StateForeign, StateInUse

InodeNo = NewType("InodeNo", int)
JournalSeq = NewType("JournalSeq", int)
Kind = Literal["file", "directory"]

log = logging.getLogger(__name__)

ROOT_INODE: Final = InodeNo(1)
STATE_FORMAT: Final = 2
"""2 added the ``inline`` database; a format-1 dir is upgraded when opened for
writing (format 1 code must not open a format 2 dir: it would not see inline files)."""
_UPGRADABLE: Final = frozenset({1})
INLINE_MAX: Final = 64 * 1024
MARKER: Final = "fsagent-state.json"
EMPTY_DIGEST: Final = Digest("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")

_MAP_SIZE: Final = 16 << 30  # address space only; the file grows as needed
# (100,000 inline files of 64 KiB alone are 6.1 GiB, plus copy-on-write pages)
_U64 = struct.Struct(">Q")
# One encoder for all records: json.dumps with options builds a new encoder per call,
# which dominated the hydration of large manifests.
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _ikey(ino: int) -> bytes:
    return _U64.pack(ino)


def _ekey(parent: int, name: str) -> bytes:
    return _U64.pack(parent) + name.encode("utf-8")


@dataclass(slots=True)
class Inode:
    ino: InodeNo
    kind: Kind
    mode: int
    """Permission bits (0o777); only the owner exec bit is part of the saved signature."""
    size: int
    mtime_ns: int
    ctime_ns: int
    parent: InodeNo
    """0 once unlinked (an orphan kept alive by open handles or kernel lookups)."""
    name: str
    digest: Digest | None
    """Saved content this file still shows (in objects/); None once it has an upper copy."""
    upper: bool
    generation: int
    """Bumped on every content change; a shipper compares it before and after upload."""

    @property
    def executable(self) -> bool:
        return bool(self.mode & 0o100)

    def encode(self) -> bytes:
        return _encode(
            [
                self.kind,
                self.mode,
                self.size,
                self.mtime_ns,
                self.ctime_ns,
                self.parent,
                self.name,
                self.digest,
                self.upper,
                self.generation,
            ]
        ).encode()

    @classmethod
    def decode(cls, ino: int, raw: bytes) -> Inode:
        k, mode, size, mt, ct, parent, name, digest, upper, gen = json.loads(raw)
        return cls(InodeNo(ino), k, mode, size, mt, ct, InodeNo(parent), name, digest, upper, gen)


@dataclass(frozen=True, slots=True)
class BaseEntry:
    """What the controller held at a path when the baseline was taken."""

    kind: Kind
    digest: Digest | None
    size: int
    executable: bool
    version: FileVersion

    def encode(self) -> bytes:
        return _encode([self.kind, self.digest, self.size, self.executable, self.version]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> BaseEntry:
        kind, digest, size, exe, version = json.loads(raw)
        return cls(kind, digest, size, exe, FileVersion(version))


ChangeAction = Literal["upload", "reference", "mkdir", "delete"]


@dataclass(frozen=True, slots=True)
class Change:
    """One path whose live state differs from the baseline.

    ``upload``     new content in ``upper/<inode>`` (size, executable, generation)
    ``reference``  a file showing saved content ``digest`` (a renamed unchanged
                   file, or an exec-bit change): ships without bytes
    ``mkdir``      a directory that the baseline did not have as a directory
    ``delete``     the baseline had ``base.kind`` here; nothing is there now
    """

    path: str
    action: ChangeAction
    seq: JournalSeq
    base: BaseEntry | None
    inode: InodeNo | None = None
    digest: Digest | None = None
    size: int = 0
    executable: bool = False
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Binding:
    """Who the state belongs to. A run with any other binding cannot reuse it."""

    company_id: str
    scope: str
    owner_id: str | None
    owners: dict[str, str | None] = field(default_factory=dict)
    """The run's four bindings (task/agent/user/project -> owner id or None)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "companyId": self.company_id,
            "scope": self.scope,
            "ownerId": self.owner_id,
            "owners": dict(sorted(self.owners.items())),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Binding:
        return cls(data["companyId"], data["scope"], data["ownerId"], dict(data["owners"]))

    def describe(self) -> str:
        owners = ", ".join(f"{k}={v or '-'}" for k, v in sorted(self.owners.items()))
        return f"company {self.company_id}, {self.scope} owner {self.owner_id or '-'} ({owners})"


@dataclass(frozen=True, slots=True)
class Baseline:
    high_water: int
    hydrated: bool


_HEADROOM: Final = 2 << 20


class _WriteTxn:
    """A write transaction whose commit failing for lack of disk space is an ENOSPC."""

    def __init__(self, txn: Any) -> None:
        self._txn = txn

    def __enter__(self) -> Any:
        return self._txn.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._txn.__exit__(*exc)
        except (lmdb.DiskError, lmdb.MapFullError) as err:
            if isinstance(err, lmdb.MapFullError) or "No space" in str(err):
                raise OSError(errno.ENOSPC, f"state database: {err}") from err
            raise


class _GuardedEnv:
    """The LMDB environment, keeping disk space in reserve for metadata commits.

    When the sandbox disk fills up, the agent's writes must fail with ENOSPC
    but unlink, rename and the journal must keep working (that is how the
    agent makes room, and how a save still records what was written).  LMDB
    writes copy-on-write pages past the end of its file, so the file is kept
    fallocated a few MiB beyond its last used page: those blocks are ours
    before the disk fills.  The reserve is topped up every 256 commits.
    """

    def __init__(self, env: Any, data_file: Path) -> None:
        self._env = env
        self._data_file = data_file
        self._commits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, *, write: bool = False, **kwargs: Any) -> Any:
        if not write:
            return self._env.begin(**kwargs)
        self._commits += 1
        if self._commits % 256 == 0:
            self.reserve_headroom()
        return _WriteTxn(self._env.begin(write=True, **kwargs))

    def reserve_headroom(self) -> None:
        used = (int(self._env.info()["last_pgno"]) + 1) * int(self._env.stat()["psize"])
        try:
            fd = os.open(self._data_file, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.posix_fallocate(fd, 0, used + _HEADROOM)
        except OSError as exc:
            log.warning("cannot reserve %d bytes for %s: %s", _HEADROOM, self._data_file, exc)
        finally:
            os.close(fd)


def default_state_root() -> Path:
    return Path(os.path.expanduser("~")) / ".local" / "state" / "fsagent"


def now_ns() -> int:
    return time.time_ns()


class Store:
    """The LMDB environment plus the objects/ and upper/ directories.

    Every public method is synchronous and commits at most one short write
    transaction, so on the trio thread each one is atomic with respect to
    other FUSE handlers.  A small in-memory cache holds the inodes the kernel
    currently knows; records are written through on every change (a write()
    commits size and generation with its bytes, :meth:`persist`).  After a
    crash the size of an upper file is recovered from the file itself, which
    is always exactly as long as the logical file (see :meth:`recover`).
    """

    def __init__(self, root: Path, env: Any, lock_fd: int, readonly: bool) -> None:
        self.root = root
        self.objects = root / "objects"
        self.upper = root / "upper"
        self.readonly = readonly
        self._env = _GuardedEnv(env, root / "db" / "data.mdb")
        self._lock_fd = lock_fd
        self._meta = env.open_db(b"meta", create=not readonly)
        self._inodes = env.open_db(b"inodes", create=not readonly)
        self._entries = env.open_db(b"entries", create=not readonly)
        self._base = env.open_db(b"base", create=not readonly)
        self._journal = env.open_db(b"journal", create=not readonly)
        self._orphans = env.open_db(b"orphans", create=not readonly)
        try:
            self._inline: Any = env.open_db(b"inline", create=not readonly)
        except lmdb.NotFoundError:
            self._inline = None  # a format-1 dir opened read-only: nothing is inline
        self._cache: dict[InodeNo, Inode] = {}

    # --- opening ------------------------------------------------------------

    @classmethod
    def open(cls, root: Path, *, readonly: bool = False) -> Store:
        """Open (or create, when absent or empty) the state dir at ``root``.

        Raises StateForeign for a non-empty directory without our marker,
        StateCorrupt when the marker or database cannot be read, StateInUse
        when another daemon holds it.  Nothing is modified on failure.
        """
        root = root.absolute()
        marker = root / MARKER
        if not marker.exists():
            if readonly:
                raise StateForeign(f"{root} is not an fsagent state dir (no {MARKER})")
            if root.exists() and (not root.is_dir() or any(root.iterdir())):
                raise StateForeign(
                    f"{root} exists and is not an fsagent state dir (no {MARKER}); "
                    "refusing to use it"
                )
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            for sub in ("objects", "upper", "db"):
                (root / sub).mkdir(mode=0o700, exist_ok=True)
            tmp = root / (MARKER + ".tmp")
            tmp.write_text(json.dumps({"kind": "fsagent-state", "format": STATE_FORMAT}) + "\n")
            os.replace(tmp, marker)
        try:
            info = json.loads(marker.read_text())
            fmt = info["format"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateCorrupt(f"{marker} is unreadable: {exc}") from exc
        if info.get("kind") != "fsagent-state" or (fmt != STATE_FORMAT and fmt not in _UPGRADABLE):
            raise StateCorrupt(f"{marker}: unsupported state format {fmt!r}")
        lock_fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if not readonly:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                raise StateInUse(f"{root} is in use by another fsagent process") from None
        try:
            env = lmdb.open(
                str(root / "db"),
                map_size=_MAP_SIZE,
                max_dbs=8,
                subdir=True,
                sync=False,
                metasync=False,
                readahead=False,
                readonly=readonly,
                create=False,
                lock=True,
            )
            store = cls(root, env, lock_fd, readonly)
            store._check_format(create=not readonly)
            if fmt != STATE_FORMAT and not readonly:
                tmp = root / (MARKER + ".tmp")
                tmp.write_text(json.dumps({"kind": "fsagent-state", "format": STATE_FORMAT}) + "\n")
                os.replace(tmp, marker)
        except lmdb.Error as exc:
            os.close(lock_fd)
            raise StateCorrupt(f"{root}/db is not a readable fsagent database: {exc}") from exc
        except StateCorrupt:
            os.close(lock_fd)
            raise
        return store

    def _check_format(self, *, create: bool) -> None:
        with self._env.begin(write=create) as txn:
            raw = txn.get(b"format", db=self._meta)
            if raw is None:
                if not create:
                    raise StateCorrupt(f"{self.root}/db has no format record")
                txn.put(b"format", str(STATE_FORMAT).encode(), db=self._meta)
                txn.put(b"next_ino", str(int(ROOT_INODE) + 1).encode(), db=self._meta)
                txn.put(b"seq", b"0", db=self._meta)
                t = now_ns()
                root = Inode(
                    ROOT_INODE, "directory", 0o755, 0, t, t, ROOT_INODE, "", None, False, 0
                )
                txn.put(_ikey(ROOT_INODE), root.encode(), db=self._inodes)
            elif raw != str(STATE_FORMAT).encode() and not (
                raw.isdigit() and int(raw) in _UPGRADABLE
            ):
                raise StateCorrupt(f"{self.root}/db has format {raw!r}, expected {STATE_FORMAT}")
            elif txn.get(_ikey(ROOT_INODE), db=self._inodes) is None:
                raise StateCorrupt(f"{self.root}/db has no root directory")
            elif create and raw != str(STATE_FORMAT).encode():
                txn.put(b"format", str(STATE_FORMAT).encode(), db=self._meta)

    def close(self) -> None:
        if not self.readonly:
            self._env.sync(True)
        self._env.close()
        os.close(self._lock_fd)

    def sync(self) -> None:
        """Make every committed transaction durable against power loss (slow: run in a thread)."""
        self._env.sync(True)

    # --- binding and baseline ----------------------------------------------

    def binding(self) -> Binding | None:
        with self._env.begin() as txn:
            raw = txn.get(b"binding", db=self._meta)
        return None if raw is None else Binding.from_json(json.loads(raw))

    def bind(self, binding: Binding) -> None:
        """Record the binding on first use, or refuse a different one."""
        current = self.binding()
        if current is None:
            with self._env.begin(write=True) as txn:
                txn.put(b"binding", json.dumps(binding.to_json()).encode(), db=self._meta)
            self._env.reserve_headroom()
            return
        if current == binding:
            # Only now is the state known to be ours to grow: a refused state
            # dir is left byte for byte as it was.
            self._env.reserve_headroom()
        else:
            raise StateBindingMismatch(
                f"state dir {self.root} belongs to {current.describe()}; this run is "
                f"{binding.describe()}. The state is kept; use another --state-dir "
                "or save and remove it first"
            )

    def baseline(self) -> Baseline:
        with self._env.begin() as txn:
            raw = txn.get(b"baseline", db=self._meta)
        if raw is None:
            return Baseline(0, False)
        data = json.loads(raw)
        return Baseline(int(data["highWater"]), bool(data["hydrated"]))

    # --- inodes -------------------------------------------------------------

    def get(self, ino: int) -> Inode:
        """The inode's live record; KeyError when it does not exist."""
        cached = self._cache.get(InodeNo(ino))
        if cached is not None:
            return cached
        with self._env.begin() as txn:
            raw = txn.get(_ikey(ino), db=self._inodes)
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

    def lookup(self, parent: InodeNo, name: str) -> InodeNo | None:
        with self._env.begin() as txn:
            raw = txn.get(_ekey(parent, name), db=self._entries)
        return None if raw is None else InodeNo(_U64.unpack(raw)[0])

    def children(self, parent: InodeNo) -> list[tuple[str, InodeNo]]:
        """All entries of a directory, sorted by name bytes (a stable readdir order)."""
        prefix = _U64.pack(parent)
        out: list[tuple[str, InodeNo]] = []
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._entries)
            if cur.set_range(prefix):
                for key, val in cur:
                    if not key.startswith(prefix):
                        break
                    out.append((key[8:].decode("utf-8"), InodeNo(_U64.unpack(val)[0])))
        return out

    def has_children(self, parent: InodeNo) -> bool:
        prefix = _U64.pack(parent)
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
                txn.put(_ikey(inode.ino), inline, db=self._inline)
            self._put_inode(txn, inode)
            if touch is not None and inode.parent != 0:
                path = self._path_in(txn, inode.ino)
                if path:
                    self._touch(txn, [path], touch)

    def inline_data(self, ino: InodeNo) -> bytes | None:
        """The contents of an inline file; None when the file is not inline."""
        if self._inline is None:
            return None
        with self._env.begin() as txn:
            raw = txn.get(_ikey(ino), db=self._inline)
        return None if raw is None else bytes(raw)

    def drop_inline(self, inode: Inode) -> None:
        """The file's contents are now complete in ``upper/<inode>``: forget the inline copy."""
        with self._env.begin(write=True) as txn:
            txn.delete(_ikey(inode.ino), db=self._inline)
            self._put_inode(txn, inode)

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of inline contents leave the metadata reserve intact.

        Inline contents go into the database, whose reserve must stay for the
        commits that make room (unlink, rename, the journal): when the disk is
        that full, writes get ENOSPC as they would on the disk itself.
        """
        vfs = os.statvfs(self.root)
        return vfs.f_bavail * vfs.f_frsize >= nbytes + 2 * _HEADROOM

    def _put_inode(self, txn: Any, inode: Inode) -> None:
        self._cache[inode.ino] = inode
        txn.put(_ikey(inode.ino), inode.encode(), db=self._inodes)

    def _path_in(self, txn: Any, ino: InodeNo) -> str | None:
        parts: list[str] = []
        while ino != ROOT_INODE:
            inode = self._cache.get(ino)
            if inode is None:
                raw = txn.get(_ikey(ino), db=self._inodes)
                if raw is None:
                    return None
                inode = Inode.decode(ino, raw)
            if inode.parent == 0:
                return None
            parts.append(inode.name)
            ino = inode.parent
        return "/".join(reversed(parts))

    def _next_ino(self, txn: Any) -> InodeNo:
        ino = int(txn.get(b"next_ino", db=self._meta))
        txn.put(b"next_ino", str(ino + 1).encode(), db=self._meta)
        return InodeNo(ino)

    def _subtree_paths(self, txn: Any, ino: InodeNo, prefix: str) -> Iterator[str]:
        """``prefix`` and every path below directory ``ino`` (depth first)."""
        yield prefix
        stack = [(ino, prefix)]
        while stack:
            dino, dpath = stack.pop()
            key = _U64.pack(dino)
            cur = txn.cursor(db=self._entries)
            if not cur.set_range(key):
                continue
            for k, v in cur:
                if not k.startswith(key):
                    break
                child = InodeNo(_U64.unpack(v)[0])
                cpath = f"{dpath}/{k[8:].decode('utf-8')}"
                yield cpath
                craw = txn.get(_ikey(child), db=self._inodes)
                if craw is not None and json.loads(craw)[0] == "directory":
                    stack.append((child, cpath))

    # --- mutations (each one commit; each touches the journal) --------------

    def create(self, parent: InodeNo, name: str, kind: Kind, mode: int) -> Inode:
        """Link a new empty file or directory; the caller checked the name is free."""
        t = now_ns()
        with self._env.begin(write=True) as txn:
            ino = self._next_ino(txn)
            inode = Inode(ino, kind, mode & 0o777, 0, t, t, parent, name, None, kind == "file", 0)
            self._put_inode(txn, inode)
            if kind == "file":
                txn.put(_ikey(ino), b"", db=self._inline)
            txn.put(_ekey(parent, name), _U64.pack(ino), db=self._entries)
            path = self._path_in(txn, ino)
            assert path is not None
            self._touch(txn, [path], "mkdir" if kind == "directory" else "create")
            self._touch_parent_mtime(txn, parent, t)
        return inode

    def _touch_parent_mtime(self, txn: Any, parent: InodeNo, t: int) -> None:
        pinode = self._cache.get(parent)
        if pinode is None:
            raw = txn.get(_ikey(parent), db=self._inodes)
            if raw is None:
                return
            pinode = Inode.decode(parent, raw)
        pinode.mtime_ns = pinode.ctime_ns = t
        self._put_inode(txn, pinode)

    def unlink(self, parent: InodeNo, name: str, *, keep: bool) -> Inode:
        """Remove the entry; ``keep`` makes the inode an orphan instead of freeing it."""
        t = now_ns()
        with self._env.begin(write=True) as txn:
            raw = txn.get(_ekey(parent, name), db=self._entries)
            if raw is None:
                raise KeyError(name)
            ino = InodeNo(_U64.unpack(raw)[0])
            path = self._path_in(txn, ino)
            inode = self._cache.get(ino) or Inode.decode(ino, txn.get(_ikey(ino), db=self._inodes))
            if path is not None:
                self._touch(txn, [path], "rmdir" if inode.kind == "directory" else "unlink")
            txn.delete(_ekey(parent, name), db=self._entries)
            self._detach(txn, inode, keep=keep, t=t)
            self._touch_parent_mtime(txn, parent, t)
        return inode

    def _detach(self, txn: Any, inode: Inode, *, keep: bool, t: int) -> None:
        inode.parent = InodeNo(0)
        inode.ctime_ns = t
        if keep:
            self._put_inode(txn, inode)
            txn.put(_ikey(inode.ino), b"", db=self._orphans)
        else:
            self._free(txn, inode)

    def _free(self, txn: Any, inode: Inode) -> None:
        txn.delete(_ikey(inode.ino), db=self._inodes)
        txn.delete(_ikey(inode.ino), db=self._orphans)
        self._cache.pop(inode.ino, None)
        if inode.upper and not txn.delete(_ikey(inode.ino), db=self._inline):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.upper / str(inode.ino))

    def free_orphan(self, ino: InodeNo) -> None:
        """Release an unlinked inode nobody references any more (forget / recovery)."""
        with self._env.begin(write=True) as txn:
            if txn.get(_ikey(ino), db=self._orphans) is None:
                return
            raw = txn.get(_ikey(ino), db=self._inodes)
            inode = self._cache.get(ino) or (Inode.decode(ino, raw) if raw else None)
            if inode is None:
                txn.delete(_ikey(ino), db=self._orphans)
                return
            self._free(txn, inode)

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
        with self._env.begin(write=True) as txn:
            raw = txn.get(_ekey(old_parent, old_name), db=self._entries)
            if raw is None:
                raise KeyError(old_name)
            ino = InodeNo(_U64.unpack(raw)[0])
            moved = self._cache.get(ino) or Inode.decode(ino, txn.get(_ikey(ino), db=self._inodes))
            old_path = self._path_in(txn, ino)
            replaced: Inode | None = None
            traw = txn.get(_ekey(new_parent, new_name), db=self._entries)
            if traw is not None:
                tino = InodeNo(_U64.unpack(traw)[0])
                replaced = self._cache.get(tino) or Inode.decode(
                    tino, txn.get(_ikey(tino), db=self._inodes)
                )
            if old_path is not None:
                self._touch(txn, list(self._subtree_paths(txn, ino, old_path)), "rename-from")
            txn.delete(_ekey(old_parent, old_name), db=self._entries)
            txn.put(_ekey(new_parent, new_name), _U64.pack(ino), db=self._entries)
            moved.parent, moved.name, moved.ctime_ns = new_parent, new_name, t
            self._put_inode(txn, moved)
            if replaced is not None:
                self._detach(txn, replaced, keep=keep_replaced(replaced.ino), t=t)
            new_path = self._path_in(txn, ino)
            if new_path is not None:
                self._touch(txn, list(self._subtree_paths(txn, ino, new_path)), "rename-to")
            self._touch_parent_mtime(txn, old_parent, t)
            if new_parent != old_parent:
                self._touch_parent_mtime(txn, new_parent, t)
        return replaced

    def exchange(self, p1: InodeNo, n1: str, p2: InodeNo, n2: str) -> None:
        """RENAME_EXCHANGE: swap two existing entries atomically."""
        t = now_ns()
        with self._env.begin(write=True) as txn:
            r1 = txn.get(_ekey(p1, n1), db=self._entries)
            r2 = txn.get(_ekey(p2, n2), db=self._entries)
            if r1 is None or r2 is None:
                raise KeyError(n1 if r1 is None else n2)
            i1, i2 = InodeNo(_U64.unpack(r1)[0]), InodeNo(_U64.unpack(r2)[0])
            a = self._cache.get(i1) or Inode.decode(i1, txn.get(_ikey(i1), db=self._inodes))
            b = self._cache.get(i2) or Inode.decode(i2, txn.get(_ikey(i2), db=self._inodes))
            for inode in (a, b):
                path = self._path_in(txn, inode.ino)
                if path is not None:
                    self._touch(txn, list(self._subtree_paths(txn, inode.ino, path)), "exchange")
            txn.put(_ekey(p1, n1), _U64.pack(i2), db=self._entries)
            txn.put(_ekey(p2, n2), _U64.pack(i1), db=self._entries)
            a.parent, a.name, a.ctime_ns = p2, n2, t
            b.parent, b.name, b.ctime_ns = p1, n1, t
            self._put_inode(txn, a)
            self._put_inode(txn, b)
            for inode in (a, b):
                path = self._path_in(txn, inode.ino)
                if path is not None:
                    self._touch(txn, list(self._subtree_paths(txn, inode.ino, path)), "exchange")

    # --- journal ------------------------------------------------------------

    def _touch(self, txn: Any, paths: Iterable[str], op: str) -> None:
        seq = int(txn.get(b"seq", db=self._meta))
        for path in paths:
            if not path:
                continue  # the root itself is never a work path
            seq += 1
            txn.put(path.encode("utf-8"), json.dumps([seq, op]).encode(), db=self._journal)
        txn.put(b"seq", str(seq).encode(), db=self._meta)

    def touch(self, paths: Iterable[str], op: str) -> None:
        with self._env.begin(write=True) as txn:
            self._touch(txn, paths, op)

    def journal(self) -> list[tuple[str, JournalSeq, str]]:
        """Raw journal: every path touched since the baseline, with its last operation."""
        out: list[tuple[str, JournalSeq, str]] = []
        with self._env.begin() as txn:
            for key, val in txn.cursor(db=self._journal):
                seq, op = json.loads(val)
                out.append((bytes(key).decode("utf-8"), JournalSeq(seq), op))
        return out

    def _resolve(self, txn: Any, path: str) -> Inode | None:
        ino = ROOT_INODE
        for name in path.split("/"):
            raw = txn.get(_ekey(ino, name), db=self._entries)
            if raw is None:
                return None
            ino = InodeNo(_U64.unpack(raw)[0])
        cached = self._cache.get(ino)
        if cached is not None:
            return cached
        raw = txn.get(_ikey(ino), db=self._inodes)
        return None if raw is None else Inode.decode(ino, raw)

    def changes_since_baseline(self) -> list[Change]:
        """The exact, coalesced change set since the baseline, parents before children.

        Sizes and generations come from the live (in-memory) inodes, so a file
        still open for writing shows its current state; the shipper must use
        :meth:`acknowledge` to clear what it has shipped.
        """
        out: list[Change] = []
        with self._env.begin() as txn:
            for key, val in txn.cursor(db=self._journal):
                path = bytes(key).decode("utf-8")
                seq = JournalSeq(json.loads(val)[0])
                braw = txn.get(key, db=self._base)
                base = BaseEntry.decode(braw) if braw is not None else None
                cur = self._resolve(txn, path)
                change = _compare(path, seq, base, cur)
                if change is not None:
                    out.append(change)
        return out

    def acknowledge(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], high_water: int
    ) -> int:
        """Fold what a checkpoint saved into the baseline; returns paths cleared.

        For each shipped change, ``base`` becomes what was saved (with the
        server's version, and the digest the server computed for uploads).  The
        journal entry is removed only when nothing touched the path since the
        change was listed (same sequence number) and, for uploads, the file's
        generation is unchanged: otherwise the path stays dirty for the next
        checkpoint and torn content is never taken as saved.
        """
        cleared = 0
        with self._env.begin(write=True) as txn:
            for change, digest, version in shipped:
                key = change.path.encode("utf-8")
                if change.action == "delete":
                    txn.delete(key, db=self._base)
                elif change.action == "mkdir":
                    txn.put(
                        key, BaseEntry("directory", None, 0, False, version).encode(), db=self._base
                    )
                else:
                    entry = BaseEntry(
                        "file", digest or change.digest, change.size, change.executable, version
                    )
                    txn.put(key, entry.encode(), db=self._base)
                raw = txn.get(key, db=self._journal)
                if raw is None or json.loads(raw)[0] != change.seq:
                    continue
                if change.action == "upload" and change.inode is not None:
                    live = self._cache.get(change.inode)
                    if live is None:
                        lraw = txn.get(_ikey(change.inode), db=self._inodes)
                        live = Inode.decode(change.inode, lraw) if lraw else None
                    if live is None or live.generation != change.generation:
                        continue
                txn.delete(key, db=self._journal)
                cleared += 1
            data = {"highWater": high_water, "hydrated": True}
            txn.put(b"baseline", json.dumps(data).encode(), db=self._meta)
        return cleared

    # --- checkpoints ----------------------------------------------------------

    def base_entry(self, path: str) -> BaseEntry | None:
        """What the controller held at ``path`` as of the baseline."""
        with self._env.begin() as txn:
            raw = txn.get(path.encode("utf-8"), db=self._base)
        return None if raw is None else BaseEntry.decode(raw)

    def pending_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint in flight: its operation id, and once committing, its exact body."""
        with self._env.begin() as txn:
            raw = txn.get(b"pending_checkpoint", db=self._meta)
        return None if raw is None else dict(json.loads(raw))

    def set_pending_checkpoint(self, record: dict[str, Any] | None) -> None:
        """Persist (or clear) the pending checkpoint, durable before any byte is sent."""
        with self._env.begin(write=True) as txn:
            if record is None:
                txn.delete(b"pending_checkpoint", db=self._meta)
            else:
                txn.put(b"pending_checkpoint", _encode(record).encode(), db=self._meta)
        # The whole point is surviving power loss between here and the request.
        self._env.sync(True)

    def finish_checkpoint(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], receipt: dict[str, Any]
    ) -> int:
        """Fold a saved checkpoint into the baseline and clear the pending record.

        The baseline's high-water mark stays where the last manifest put it:
        other writers' changes after it are fetched at the next warm start.
        A crash between the two steps leaves the pending record, whose replay
        answers with the same receipt and acknowledges again (idempotent).
        """
        cleared = self.acknowledge(shipped, self.baseline().high_water)
        status = self.save_status()
        status["lastSave"] = {
            "at": time.time(),
            "operationId": receipt.get("operationId"),
            "entries": receipt.get("entries"),
            "savedAt": receipt.get("savedAt"),
        }
        status.pop("lastError", None)
        with self._env.begin(write=True) as txn:
            txn.delete(b"pending_checkpoint", db=self._meta)
            txn.put(b"save_status", _encode(status).encode(), db=self._meta)
        self._env.sync(True)
        return cleared

    def record_save_error(self, message: str) -> None:
        status = self.save_status()
        status["lastError"] = {"at": time.time(), "message": message[:2000]}
        with self._env.begin(write=True) as txn:
            txn.put(b"save_status", _encode(status).encode(), db=self._meta)

    def save_status(self) -> dict[str, Any]:
        """``{"lastSave": {...}, "lastError": {...}}`` (either may be missing)."""
        with self._env.begin() as txn:
            raw = txn.get(b"save_status", db=self._meta)
        return {} if raw is None else dict(json.loads(raw))

    def apply_incoming(self, entries: Iterable[ManifestRow | tuple[str, bool]]) -> int:
        """Apply the server's changes since the baseline to paths not changed locally.

        Only for a warm start before mounting (no FUSE handles exist yet).
        ``entries`` are manifest rows, or (path, True) for a deletion, in
        version order. A path in the journal keeps the local version: local
        changes were shipped first and win. Returns the paths updated.
        """
        journal = {p for p, _, _ in self.journal()}
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
            cur = self._resolve(txn, path)
            key = path.encode("utf-8")
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
                txn.put(key, BaseEntry(*row_fields(row)).encode(), db=self._base)
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
                raw = txn.get(_ekey(parent, name), db=self._entries)
                if raw is None:
                    ino = self._next_ino(txn)
                    node = Inode(ino, "directory", 0o755, 0, t, t, parent, name, None, False, 0)
                    self._put_inode(txn, node)
                    txn.put(_ekey(parent, name), _U64.pack(ino), db=self._entries)
                    parent = ino
                else:
                    parent = InodeNo(_U64.unpack(raw)[0])
            if cur is not None and (cur.kind != row.kind or row.kind == "file"):
                self._remove_tree(txn, cur, path, t)
                cur = None
            if cur is None:
                ino = self._next_ino(txn)
                mode = 0o755 if row.kind == "directory" or row.executable else 0o644
                node = Inode(ino, row.kind, mode, row.byte_size, t, t, parent, parts[-1],
                             row.digest, False, 0)  # fmt: skip
                self._put_inode(txn, node)
                txn.put(_ekey(parent, parts[-1]), _U64.pack(ino), db=self._entries)
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
                    raw = txn.get(_ikey(child), db=self._inodes)
                    if raw is not None:
                        stack.append((Inode.decode(child, raw), f"{ipath}/{name}"))
            txn.delete(_ekey(inode.parent, inode.name), db=self._entries)
            txn.delete(ipath.encode("utf-8"), db=self._base)
            self._detach(txn, inode, keep=False, t=t)

    def _children_in(self, txn: Any, parent: InodeNo) -> list[tuple[str, InodeNo]]:
        key = _U64.pack(parent)
        out: list[tuple[str, InodeNo]] = []
        cur = txn.cursor(db=self._entries)
        if cur.set_range(key):
            for k, v in cur:
                if not bytes(k).startswith(key):
                    break
                out.append((bytes(k)[len(key) :].decode("utf-8"), InodeNo(_U64.unpack(v)[0])))
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
        dirs: dict[str, InodeNo] = {"": ROOT_INODE}
        created = 0
        with self._env.begin(write=True) as txn:
            if txn.stat(self._entries)["entries"] or txn.stat(self._journal)["entries"]:
                raise StateCorrupt(f"{self.root}: refusing to hydrate over existing entries")
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
                    _ikey(ino),
                    Inode(ino, "directory", 0o755, 0, t, t, parent, name, None, False, 0).encode(),
                    db=self._inodes,
                )
                put(_ekey(parent, name), _U64.pack(ino), db=self._entries)
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
                        row.path.encode(),
                        BaseEntry("directory", None, 0, False, row.version).encode(),
                        db=self._base,
                    )
                    continue
                ino = InodeNo(next_ino)
                next_ino += 1
                created += 1
                mode = 0o755 if row.executable else 0o644
                inode = Inode(
                    ino, "file", mode, row.byte_size, t, t, parent, name, row.digest, False, 0
                )
                put(_ikey(ino), inode.encode(), db=self._inodes)
                put(_ekey(parent, name), _U64.pack(ino), db=self._entries)
                put(
                    row.path.encode(),
                    BaseEntry(
                        "file", row.digest, row.byte_size, row.executable, row.version
                    ).encode(),
                    db=self._base,
                )
                files.add(row.path)
            put(b"next_ino", str(next_ino).encode(), db=self._meta)
            data = {"highWater": high_water, "hydrated": True}
            put(b"baseline", json.dumps(data).encode(), db=self._meta)
        return created

    def missing_digests(self) -> list[tuple[Digest, int]]:
        """Saved contents the tree shows that are not in objects/ yet (safe off-thread)."""
        have = set(os.listdir(self.objects))
        seen: set[str] = set()
        out: list[tuple[Digest, int]] = []
        with self._env.begin() as txn:
            for _key, raw in txn.cursor(db=self._inodes):
                rec = json.loads(raw)
                digest = rec[7]
                if digest and not rec[8] and digest not in have and digest not in seen:
                    seen.add(digest)
                    out.append((Digest(digest), int(rec[2])))
        return out

    # --- recovery -----------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Repair what a crash can leave behind; returns (orphans freed, sizes fixed).

        Orphans were kept only for handles that died with the old process.
        An upper file's length is the truth for the file's size: the bytes
        reach the upper file before write() commits the size, so a crash in
        between leaves the file longer than the record.  An inline file's
        contents and size are one commit.  Files in ``upper/`` that no inode
        uses are removed: a temp copy cut short, or an upper file left beside
        inline contents by a crash while they moved out of line.
        """
        freed = fixed = 0
        on_disk = set(os.listdir(self.upper))
        with self._env.begin(write=True) as txn:
            for key, _ in list(txn.cursor(db=self._orphans)):
                ino = InodeNo(_U64.unpack(key)[0])
                raw = txn.get(key, db=self._inodes)
                if raw is not None:
                    self._free(txn, Inode.decode(ino, raw))
                else:
                    txn.delete(key, db=self._orphans)
                freed += 1
            for key, raw in list(txn.cursor(db=self._inodes)):
                rec = json.loads(raw)
                if rec[0] != "file" or not rec[8]:
                    continue
                ino = _U64.unpack(key)[0]
                upath = self.upper / str(ino)
                inline = txn.get(key, db=self._inline)
                if inline is not None:
                    size = len(inline)
                elif str(ino) in on_disk:
                    size = upath.stat().st_size
                    on_disk.discard(str(ino))
                else:
                    # The upper file never reached the disk: an empty file.
                    txn.put(key, b"", db=self._inline)
                    size = 0
                if size != rec[2]:
                    inode = Inode.decode(ino, raw)
                    inode.size = size
                    inode.generation += 1
                    txn.put(key, inode.encode(), db=self._inodes)
                    fixed += 1
            for name in on_disk:  # what is left is used by no inode
                with contextlib.suppress(FileNotFoundError):  # freed above
                    os.unlink(self.upper / name)
            for name in os.listdir(self.objects):
                if name.startswith(".tmp-"):
                    os.unlink(self.objects / name)
        return freed, fixed


def row_fields(row: ManifestRow) -> tuple[Kind, Digest | None, int, bool, FileVersion]:
    return row.kind, row.digest, row.byte_size, row.executable, row.version


@dataclass(frozen=True, slots=True)
class ManifestRow:
    """One live manifest entry, as hydration needs it."""

    path: str
    kind: Kind
    digest: Digest | None
    byte_size: int
    executable: bool
    version: FileVersion


def _compare(
    path: str, seq: JournalSeq, base: BaseEntry | None, cur: Inode | None
) -> Change | None:
    if cur is None:
        return None if base is None else Change(path, "delete", seq, base)
    if cur.kind == "directory":
        if base is not None and base.kind == "directory":
            return None
        return Change(path, "mkdir", seq, base, inode=cur.ino)
    exe = cur.executable
    if cur.upper:
        return Change(
            path,
            "upload",
            seq,
            base,
            inode=cur.ino,
            size=cur.size,
            executable=exe,
            generation=cur.generation,
        )
    if (
        base is not None
        and base.kind == "file"
        and base.digest == cur.digest
        and base.executable == exe
    ):
        return None
    return Change(
        path,
        "reference",
        seq,
        base,
        inode=cur.ino,
        digest=cur.digest,
        size=cur.size,
        executable=exe,
    )
