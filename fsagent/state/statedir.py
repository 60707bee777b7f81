"""The life cycle of a state dir: marker, lock, LMDB environment, format upgrade.

:class:`StateDir` is the part every other one is built on: the locked
directory, the environment (``env``) and its named tables (``meta_db``,
``inodes_db``, ...), binding, mode, disk room and the durability epoch.
:class:`fsagent.state.store.Store` holds it as ``dir``, and so does a
plain-directory collection's :class:`fsagent.dirmode.store.DirStore`.

Layout of a state dir (default ``$HOME/.local/state/fsagent/<scope>``)::

    fsagent-state.json   marker: format version; a dir without it is not ours
    lock                 flock()ed by the daemon that owns the state
    db/                  LMDB environment (tables: fsagent.state.store)
    objects/<digest>     saved contents, read-only, filled by hydration
    upper/<inode>        copy-on-write contents over INLINE_MAX (fsagent.state.content)
    daemon.json          pid + mountpoint of the running daemon (for status)

A collection is served in one mode for the life of its state dir
(:meth:`StateDir.claim_mode`): ``fuse`` (the tree and journal below) or
``dir`` (a plain directory, fsagent.dirmode.store: ``base`` plus the ``dirstat``
table of what the last scan saw).

Durability: the environment is opened with ``sync=False``.  A commit still
hands the pages to the kernel, so it survives ``kill -9`` of this process;
only power loss can undo it, and :meth:`StateDir.sync` (called on fsync)
closes that gap where POSIX promises it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Final, Self

import lmdb

from fsagent.errors import (
    StateBindingMismatch,
    StateCorrupt,
    StateError,
    StateForeign,
    StateInUse,
    StateModeMismatch,
)
from fsagent.state.records import (
    Baseline,
    Binding,
    Inode,
    InodeNo,
    encode_json,
    ikey,
    now_ns,
    upgrade_record,
)

log = logging.getLogger("fsagent.statedir")

ROOT_INODE: Final = InodeNo(1)
STATE_FORMAT: Final = 5
"""2 added the ``inline`` table; 3 versioned every record and keys paths longer
than LMDB's key limit by their hash (fsagent.state.records); 4 gives inodes an owner
(uid, gid) and an atime (inode records of version 2; older ones are read as
owned by the daemon's user, atime = mtime, which is what they reported); 5
adds plain-directory collections (the ``dirstat`` table and the ``mode``
record: format 4 code would serve such a dir as an empty FUSE tree).  An
older dir is upgraded in place when opened for writing; older code refuses a
newer dir (format 2 code would misread versioned records, format 3 code would
refuse version-2 inode records)."""
_UPGRADABLE: Final = frozenset({1, 2, 3, 4})
MARKER: Final = "fsagent-state.json"
_MAP_SIZE: Final = 16 << 30  # address space only; the file grows as needed
# (100,000 inline files of 64 KiB alone are 6.1 GiB, plus copy-on-write pages)
HEADROOM: Final = 2 << 20
ROOM_SLACK: Final = 64 << 20
"""Free space above the reserve below which every inline write reads it again."""
ROOM_RECHECK_S: Final = 1.0
_TABLES: Final = (
    "meta", "inodes", "entries", "base", "journal", "orphans", "inline", "dirstat",
)  # fmt: skip
_VERSIONED: Final = ("inodes", "base", "journal")
"""Tables whose values are versioned records (rewritten by the format-3 and -4 upgrades)."""


def default_state_root() -> Path:
    return Path(os.path.expanduser("~")) / ".local" / "state" / "fsagent"


def runtime_dir(state_root: Path | None = None) -> Path:
    """The agent's runtime directory: ``<state root>/run``."""
    return (state_root or default_state_root()) / "run"


def default_socket(state_root: Path | None = None) -> Path:
    """Where ``fsagent bridge``, the local API endpoint, listens by default."""
    return runtime_dir(state_root) / "api.sock"


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


_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
_SYNC_FILE_RANGE_WRITE: Final = 2


def start_writeback(fd: int) -> None:
    """Start writing the dirty pages of the file open as ``fd`` to disk,
    without waiting for them (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` over
    the whole file). It promises nothing: a later fsync still waits for every
    page, and finds less left to do. It can block while the disk's queue is
    full: call it from a worker thread."""
    if _libc.sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class GuardedEnv:
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

    @property
    def commits(self) -> int:
        """Write transactions begun so far (a counter that only grows)."""
        return self._commits

    def start_writeback(self) -> None:
        """Start writing the data file's dirty pages to disk, without waiting
        for them (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; it can block while
        the disk's queue is full: call it from a worker thread).

        Commits are ``sync=False``: their pages stay dirty in the page cache
        until the kernel writes them back or the next :meth:`StateDir.sync`
        does. A burst of metadata (creating and removing thousands of small
        inline files) leaves tens of MiB that way, and the next fsync of any
        file paid for all of it (about 40 ms after 3,000 files). Written back
        in the background as they come, they are mostly on disk by then.
        Durability is unchanged: nothing is promised until a sync."""
        fd = os.open(self._data_file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            start_writeback(fd)
        finally:
            os.close(fd)

    def reserve_headroom(self) -> None:
        used = (int(self._env.info()["last_pgno"]) + 1) * int(self._env.stat()["psize"])
        try:
            fd = os.open(self._data_file, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.posix_fallocate(fd, 0, used + HEADROOM)
        except OSError as exc:
            log.warning("cannot reserve %d bytes for %s: %s", HEADROOM, self._data_file, exc)
        finally:
            os.close(fd)


def discard_state_dir(root: Path, *, fresh: bool = False) -> None:
    """Empty the state dir ``root`` (closed) so that no interruption leaves
    half of one behind: its contents leave in one rename, into a sibling
    ``.NAME.discarded`` that is then removed (one an interrupted discard left
    goes first), and ``root`` is made again, empty. A daemon killed meanwhile
    (systemd's SIGTERM right after the final save answered) leaves the whole
    state dir, an empty one or none (the next start makes one), never one
    without its marker that the next start refuses as foreign. The old one
    is removed before ``root`` is made again: on a disk without a free inode
    that is where the new directory's comes from.

    With ``fresh`` (the agent folder's discard at the stop boundary), ``root``
    becomes a new state dir holding nothing: marker, empty database and its
    reserve, made in the room the old one just freed (:func:`_make_fresh`).
    A sandbox started again on a disk filled meanwhile could not make one:
    a new state dir needs inodes and blocks, an existing one writes into the
    room its database keeps in reserve."""
    trash = root.with_name(f".{root.name}.discarded")
    shutil.rmtree(trash, ignore_errors=True)
    shutil.rmtree(_fresh_name(root), ignore_errors=True)
    try:
        os.rename(root, trash)
    except FileNotFoundError:
        pass
    except OSError:  # the parent is not ours to change: in place, the marker last
        for child in sorted(root.iterdir(), key=lambda c: c.name == MARKER):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink(missing_ok=True)
        return
    shutil.rmtree(trash, ignore_errors=True)
    if fresh and _make_fresh(root):
        return
    try:
        root.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        log.warning("%s is gone and cannot be made again now (%s); the next start makes it",
                    root, exc)  # fmt: skip


def _fresh_name(root: Path) -> Path:
    return root.with_name(f".{root.name}.fresh")


def _make_fresh(root: Path) -> bool:
    """Make ``root`` (absent) a new state dir: built whole beside it and
    renamed into place, so a kill leaves none or a whole one, never one
    without its marker. False where it cannot be made (the disk full
    already): the caller makes ``root`` an empty directory, and the next
    start a state dir, as it always did."""
    building = _fresh_name(root)
    try:
        state = StateDir.open(building)
        try:
            state.env.reserve_headroom()  # for its first commits: the binding, the hydration
        finally:
            state.close()
        os.rename(building, root)
        return True
    except (OSError, StateError) as exc:
        log.warning("%s is left empty: a new state dir cannot be made there now (%s)", root, exc)
        shutil.rmtree(building, ignore_errors=True)
        return False


def _write_marker(root: Path) -> None:
    tmp = root / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"kind": "fsagent-state", "format": STATE_FORMAT}) + "\n")
    os.replace(tmp, root / MARKER)


class StateDir:
    """An open state dir: the locked directory and its LMDB tables."""

    def __init__(
        self, root: Path, env: Any, lock_fd: int, readonly: bool, *, dirstat: bool = False
    ) -> None:
        self.root = root
        self.objects = root / "objects"
        self.readonly = readonly
        self.env = GuardedEnv(env, root / "db" / "data.mdb")
        self._lock_fd = lock_fd
        self._durable: set[InodeNo] = set()
        self._room = 0
        self._room_at = -ROOM_RECHECK_S
        self._durable_epoch = 0
        self.meta_db = env.open_db(b"meta", create=not readonly)
        self.inodes_db = env.open_db(b"inodes", create=not readonly)
        self.entries_db = env.open_db(b"entries", create=not readonly)
        self.base_db = env.open_db(b"base", create=not readonly)
        self.journal_db = env.open_db(b"journal", create=not readonly)
        self.orphans_db = env.open_db(b"orphans", create=not readonly)
        try:
            self.inline_db: Any = env.open_db(b"inline", create=not readonly)
        except lmdb.NotFoundError:
            self.inline_db = None  # a format-1 dir opened read-only: nothing is inline
        self.dirstat_db: Any = None
        if dirstat:
            try:
                self.dirstat_db = env.open_db(b"dirstat", create=not readonly)
            except lmdb.NotFoundError:
                self.dirstat_db = None  # a FUSE state dir opened read-only

    @classmethod
    def open(cls, root: Path, *, readonly: bool = False, dirstat: bool = False) -> Self:
        """Open (or create, when absent or empty) the state dir at ``root``;
        ``dirstat`` also opens (when writable, creates) the ``dirstat`` table
        of a plain-directory collection (fsagent.dirmode.store).

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
            _write_marker(root)
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
                max_dbs=len(_TABLES) + 1,
                subdir=True,
                sync=False,
                metasync=False,
                readahead=False,
                readonly=readonly,
                create=False,
                lock=True,
            )
            state = cls(root, env, lock_fd, readonly, dirstat=dirstat)
            state._check_format(create=not readonly)
            if fmt != STATE_FORMAT and not readonly:
                _write_marker(root)
        except lmdb.Error as exc:
            os.close(lock_fd)
            raise StateCorrupt(f"{root}/db is not a readable fsagent database: {exc}") from exc
        except StateCorrupt:
            os.close(lock_fd)
            raise
        return state

    def _check_format(self, *, create: bool) -> None:
        """Initialise a new database, or check (and when writable, upgrade) an existing one.

        The upgrade is one commit: the records and the format record change
        together.  The marker is rewritten after it; a crash in between leaves
        an old marker over a current database, which the next open accepts.
        """
        current = str(STATE_FORMAT).encode()
        with self.env.begin(write=create) as txn:
            raw = txn.get(b"format", db=self.meta_db)
            if raw is None:
                if not create:
                    raise StateCorrupt(f"{self.root}/db has no format record")
                txn.put(b"format", current, db=self.meta_db)
                txn.put(b"next_ino", str(int(ROOT_INODE) + 1).encode(), db=self.meta_db)
                txn.put(b"seq", b"0", db=self.meta_db)
                t = now_ns()
                root = Inode(
                    ROOT_INODE, "directory", 0o755, 0, t, t, ROOT_INODE, "", None, False, 0
                )
                txn.put(ikey(ROOT_INODE), root.encode(), db=self.inodes_db)
            elif raw != current and not (raw.isdigit() and int(raw) in _UPGRADABLE):
                raise StateCorrupt(f"{self.root}/db has format {raw!r}, expected {STATE_FORMAT}")
            elif txn.get(ikey(ROOT_INODE), db=self.inodes_db) is None:
                raise StateCorrupt(f"{self.root}/db has no root directory")
            elif create and raw != current:
                self._upgrade_records(txn)
                txn.put(b"format", current, db=self.meta_db)
                log.info("state dir %s upgraded from format %s to %d", self.root, raw, STATE_FORMAT)

    def _upgrade_records(self, txn: Any) -> None:
        """Rewrite every record of an older format in the current encoding.

        Older formats could not hold a key over LMDB's limit, so every key
        stays as it is; only the values change.
        """
        for table in _VERSIONED:
            db = getattr(self, f"{table}_db")
            for key, raw in list(txn.cursor(db=db)):
                new = upgrade_record(table, bytes(key), bytes(raw))
                if new is not None:
                    txn.put(key, new, db=db)

    # --- binding ------------------------------------------------------------

    def binding(self) -> Binding | None:
        with self.env.begin() as txn:
            raw = txn.get(b"binding", db=self.meta_db)
        return None if raw is None else Binding.from_json(json.loads(raw))

    def bind(self, binding: Binding) -> None:
        """Record the binding on first use, or refuse a different one."""
        current = self.binding()
        if current is None:
            with self.env.begin(write=True) as txn:
                txn.put(b"binding", encode_json(binding.to_json()), db=self.meta_db)
            self.env.reserve_headroom()
            return
        if current == binding:
            # Only now is the state known to be ours to grow: a refused state
            # dir is left byte for byte as it was.
            self.env.reserve_headroom()
        else:
            raise StateBindingMismatch(
                f"state dir {self.root} belongs to {current.describe()}; this run is "
                f"{binding.describe()}. The state is kept; use another --state-dir "
                "or save and remove it first"
            )

    # --- mode -------------------------------------------------------------

    def mode_record(self) -> dict[str, Any] | None:
        """``{"mode": "fuse"|"dir", "reason", "path"}`` as last claimed; None
        for a dir no daemon of format 5 has served yet (those were FUSE)."""
        with self.env.begin() as txn:
            raw = txn.get(b"mode", db=self.meta_db)
        return None if raw is None else dict(json.loads(raw))

    def claim_mode(self, mode: str, reason: str, path: str) -> None:
        """Record that this state dir is served in ``mode`` (and why), or refuse
        the other mode: a FUSE collection's unsaved changes live in this state
        dir, a plain directory's in the directory, and neither mode can serve
        the other's."""
        current = self.mode_record()
        with self.env.begin() as txn:
            hydrated = Baseline.decode(txn.get(b"baseline", db=self.meta_db)).hydrated
        was = current["mode"] if current else ("fuse" if hydrated else None)
        if was is not None and was != mode:
            raise StateModeMismatch(
                f"state dir {self.root} holds a collection served in {was} mode; it cannot be "
                f"served in {mode} mode ({reason}). The state is kept; use --mode {was}, "
                "or another --state-dir"
            )
        record = {"mode": mode, "reason": reason, "path": path}
        if current != record:
            with self.env.begin(write=True) as txn:
                txn.put(b"mode", encode_json(record), db=self.meta_db)

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of inline contents leave the metadata reserve intact.

        Inline contents go into the database, whose reserve must stay for the
        commits that make room (unlink, rename, the journal): when the disk is
        that full, writes get ENOSPC as they would on the disk itself.

        The free space is read again (``statvfs``) once the bytes granted since
        the last reading come within ``ROOM_SLACK`` of the reserve, or after
        ``ROOM_RECHECK_S``: a disk with room to spare costs no system call per
        write.
        """
        now = time.monotonic()
        need = nbytes + 2 * HEADROOM
        if now - self._room_at > ROOM_RECHECK_S or self._room - need < ROOM_SLACK:
            vfs = os.statvfs(self.root)
            self._room, self._room_at = vfs.f_bavail * vfs.f_frsize, now
            if self._room < need:
                return False
        self._room -= nbytes
        return True

    def close(self) -> None:
        if not self.readonly:
            self.env.sync(True)
        self.env.close()
        os.close(self._lock_fd)

    def sync(self) -> None:
        """Make every committed transaction durable against power loss (slow: run in a thread)."""
        self.env.sync(True)

    # --- what an fsync of an upper file still needs ----------------------------
    #
    # An upper file's length is the truth for its size after a crash
    # (fsagent.state.tree, ``recover``), so once its inode record (with the upper
    # flag) and its journal entry are durable, an fsync of it only needs the
    # file's own data: ``fdatasync``, without syncing the whole environment.
    # Anything that could make those records stale again (a rename moving the
    # path, an acknowledged checkpoint clearing the journal entry, a file
    # moving out of line, a mode or owner change) forgets every such inode.

    def durable_epoch(self) -> int:
        """Read before a :meth:`sync`, handed to :meth:`mark_durable` after it."""
        return self._durable_epoch

    def mark_durable(self, ino: InodeNo, epoch: int) -> None:
        """``ino``'s records were committed before a sync that began at ``epoch``."""
        if epoch == self._durable_epoch:
            self._durable.add(ino)

    def is_durable(self, ino: InodeNo) -> bool:
        return ino in self._durable

    def forget_durable(self) -> None:
        self._durable.clear()
        self._durable_epoch += 1
