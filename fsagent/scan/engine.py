"""The scan engine: the members of a tree on the sandbox's own disk, with
content digests, read stably, at a cost that follows the changes.

Two users: repository checkpoints (:mod:`fsagent.repos.capture` lists a
checkout's members with Git) and plain-directory collections where FUSE is
unavailable (:mod:`fsagent.dirmode.scan` walks the whole directory through pinned
descriptors and reads changed files with :func:`hash_stable`). Nothing here
knows about Git.

One scan (:func:`scan_tree`):

1. **List and lstat** every path the caller names (``list_paths()``), and
   every directory above them. A parent that is not a real directory (a
   symbolic link, say) hides what is below it: those paths are reported, not
   followed.
2. **Read** each regular file whose metadata the cache does not know: open it
   with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO swapped in cannot block us, a
   symbolic link swapped in cannot redirect us), ``fstat`` must show the
   same device and inode as the ``lstat`` and a regular file, hash it
   (SHA-256), then ``fstat`` and ``lstat`` again: any difference (size,
   mtime, ctime, inode) marks the file *unstable*. A small thread pool reads
   several files at once (hashlib releases the GIL on large buffers).
3. **List and lstat again**: a fingerprint of every (path, kind, device,
   inode, size, mode, mtime, ctime) before and after must be equal, else the
   tree changed during the scan (a file added, removed, replaced or
   rewritten) and the result is unstable. A caller may narrow this pass to
   what can tear its result (:class:`TreeScan`'s ``recheck``): one
   directory, the files read and the directories above them.

An unstable result must not be committed: the caller retries (a checkout
being written to settles) and reports a failure after a few attempts. Torn
content (half old, half new) can therefore never be saved.

**The metadata cache** (:class:`MetadataCache`) maps a path to the
``lstat`` key it was hashed under (device, inode, size, mode, mtime_ns,
ctime_ns) and the digest. A file whose key is unchanged is neither read nor
hashed. ``ctime`` changes on every write and cannot be set by a user, so a
``touch -d`` back to the old mtime still misses. A digest is remembered only
when the file's mtime and ctime are at least :data:`RACY_MARGIN_NS` older
than the scan's start: a write in the same timestamp tick right after the
read could otherwise leave the key unchanged (Git's "racily clean" problem).
The cache is kept in memory and saved to one compact file in the state dir;
when that write fails (ENOSPC, EDQUOT, EROFS...) the cache carries on in
memory only and the scan still succeeds: **a scan never needs free disk
space**.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import gc
import hashlib
import logging
import operator
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple, Protocol

import xxhash

from fsagent.errors import MemberChanged

log = logging.getLogger("fsagent.scan")

Kind = Literal["file", "symlink", "dir"]

READ_CHUNK: Final = 1 << 20
HASH_THREADS: Final = 4
"""Files read at once: enough to overlap I/O waits with hashing on a small VM."""
WORK_GROUP: Final = 64
"""Files per task handed to the pool: one future per file costs more than a small file's read."""
RACY_MARGIN_NS: Final = 1_000_000_000
"""A digest is cached only for files last changed this long before the scan
started. File timestamps come from the kernel's coarse clock (a tick of at
most 10 ms); a second leaves room for clock steps and coarse filesystems."""

OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StatKey(NamedTuple):
    """What identifies one version of a file's contents, as ``lstat`` shows it.

    A tuple, so the cache can keep and compare plain tuples (loading 100,000
    entries builds no objects beyond them)."""

    dev: int
    ino: int
    size: int
    mode: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> StatKey:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns)


Key = tuple[int, int, int, int, int, int]
"""What a :class:`StatKey` holds, as a plain tuple (equal to the StatKey of the
same values): the scan's hot loops build these, a third cheaper."""


class Member(NamedTuple):
    """One entry of a scanned tree: a regular file, a symbolic link or a directory.

    A named tuple rather than a frozen dataclass: a scan builds one per
    member, and a frozen dataclass costs several times as much to build (its
    ``__init__`` goes through ``object.__setattr__`` field by field)."""

    path: str
    kind: Kind
    digest: str | None = None
    size: int = 0
    executable: bool = False
    target: str | None = None
    key: Key | None = None
    """For a file: the metadata its digest was computed under (to re-open it
    for upload and check that it is still that file)."""

    def to_json(self) -> dict[str, Any]:
        """The wire form (:mod:`common.repos` Member)."""
        if self.kind == "file":
            return {
                "path": self.path,
                "kind": "file",
                "digest": self.digest,
                "byteSize": self.size,
                "executable": self.executable,
            }
        if self.kind == "symlink":
            return {"path": self.path, "kind": "symlink", "target": self.target}
        return {"path": self.path, "kind": "dir"}

    def same_content(self, other: Member) -> bool:
        """Whether ``other`` saves as the same member (metadata keys aside)."""
        return (
            self.kind == other.kind
            and self.digest == other.digest
            and self.executable == other.executable
            and self.target == other.target
        )


@dataclass(frozen=True, slots=True)
class Problem:
    """A listed path that is not part of the result, and why (shown to the user)."""

    path: str
    reason: str


@dataclass
class ScanStats:
    listed: int = 0
    hashed: int = 0
    """Files read and hashed (cache misses)."""
    hashed_bytes: int = 0
    cache_hits: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "listed": self.listed,
            "hashed": self.hashed,
            "hashedBytes": self.hashed_bytes,
            "cacheHits": self.cache_hits,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class ScanResult:
    members: list[Member]
    """Sorted by path."""
    problems: list[Problem]
    unstable: list[str]
    """Paths that changed while the scan looked at them; empty when stable."""
    stats: ScanStats = field(default_factory=ScanStats)
    paths: list[str] = field(default_factory=list)
    """What the last listing named: the ``guess`` for the next scan."""

    @property
    def stable(self) -> bool:
        return not self.unstable


PathRule = Callable[[str], str | None]
"""Why a listed path cannot be a member (a name the controller refuses), or None."""
LinkRule = Callable[[str, str], str | None]
"""Why a symbolic link at a path with a target cannot be a member, or None."""
ReadHook = Callable[[str], None]
"""Called after a file is hashed and before it is checked again (tests inject changes here)."""


# --- the metadata cache ----------------------------------------------------------

_CACHE_MAGIC_V1: Final = b"FSAMC1\n"
"""A whole file of records (read, never written)."""
_CACHE_MAGIC: Final = b"FSAMC2\n"
_CACHE_RECORD: Final = struct.Struct(">QQQIqq32sH")
"""dev, ino, size, mode, mtime_ns, ctime_ns, sha256, path length; then the path (UTF-8)."""
_CACHE_FRAME: Final = struct.Struct(">4sIQ")
"""b"MCF1", the records' length, their xxh64; then the records."""
_FRAME_TAG: Final = b"MCF1"
CACHE_SLACK: Final = 1 << 20
"""Bytes of appended frames a cache file may carry beyond twice its size
when last written whole; past that the next save writes it whole again."""


class MetadataCache:
    """path → (StatKey, digest), in memory, saved to ``file`` when it can be.

    Loading a missing or unreadable file gives an empty cache (a cache is
    never needed for correctness, only for speed). The file is a magic line
    and frames of records, each frame with its length and checksum; a later
    record of a path replaces an earlier one. :meth:`save` appends one frame
    with the entries put since the last save (a few records after a small
    checkpoint, where writing the whole file cost megabytes each time), and
    writes the whole file beside the old one and renames it over when
    entries were dropped, the file grew to twice its size, or the last
    write failed. Nothing is synced: a frame torn by a crash fails its
    checksum and it and what follows are ignored (the entries before it are
    right for the files they name: a key that no longer matches is a miss).
    """

    def __init__(self, file: Path | None = None) -> None:
        self.file = file
        self._entries: dict[str, tuple[tuple[int, ...], str]] = {}
        self._records: dict[str, bytes] = {}
        """Each entry's record in the file, kept so a save encodes only what changed."""
        self._unencoded: set[str] = set()
        """Entries whose record is not in :attr:`_records` yet."""
        self._pending: set[str] = set()
        """Entries put since the last save: the next frame."""
        self._appendable = False
        """Whether the file holds exactly the entries as of the last save, so
        a frame of the pending ones brings it up to date."""
        self._file_bytes = 0
        self._whole_bytes = 0
        """The file's size, and its size when last written whole."""
        self._dirty = False
        self.degraded: str | None = None
        """Why the last save failed (the cache then lives in memory only); None when saved."""

    @classmethod
    def load(cls, file: Path | None) -> MetadataCache:
        cache = cls(file)
        if file is None:
            return cache
        try:
            data = file.read_bytes()
        except FileNotFoundError:
            return cache
        except OSError as exc:
            log.warning("metadata cache %s unreadable (%s); starting empty", file, exc)
            return cache
        try:
            cache._entries, whole = _decode_cache(data)
            cache._unencoded = set(cache._entries)
            cache._appendable = whole
            cache._file_bytes = cache._whole_bytes = len(data)
            if not whole and not data.startswith(_CACHE_MAGIC_V1):
                log.warning("metadata cache %s is damaged at its end; kept what precedes", file)
        except ValueError as exc:
            log.warning("metadata cache %s is damaged (%s); starting empty", file, exc)
        return cache

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, path: str, key: Key) -> str | None:
        hit = self._entries.get(path)
        if hit is None or hit[0] != key:
            return None
        return hit[1]

    def key_of(self, path: str) -> StatKey | None:
        """The key ``path`` was cached under, if any."""
        hit = self._entries.get(path)
        return None if hit is None else StatKey(*hit[0])

    def put(self, path: str, key: Key, digest: str) -> None:
        entry = (tuple(key), digest)
        if self._entries.get(path) != entry:
            self._entries[path] = entry
            self._unencoded.add(path)
            self._pending.add(path)
            self._dirty = True

    def retain(self, paths: set[str]) -> None:
        """Forget every path not in ``paths`` (gone from the tree)."""
        gone = [p for p in self._entries if p not in paths]
        for p in gone:
            del self._entries[p]
            self._records.pop(p, None)
            self._unencoded.discard(p)
            self._pending.discard(p)
        if gone:
            self._dirty = True
            self._appendable = False  # a frame cannot drop entries

    def save(self) -> bool:
        """Bring the cache file up to date if anything changed; False (and
        :attr:`degraded` set) when the write failed. Never raises for lack
        of space."""
        if self.file is None or not self._dirty:
            return True
        tmp = self.file.with_name(self.file.name + ".tmp")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            frame = _frame([self._record(p) for p in self._pending]) if self._appendable else b""
            if self._appendable and (
                self._file_bytes + len(frame) <= 2 * self._whole_bytes + CACHE_SLACK
            ):
                self._appendable = False  # until the frame is wholly written
                fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                try:
                    _write_all(fd, frame)
                finally:
                    os.close(fd)
                self._file_bytes += len(frame)
            else:
                data = _CACHE_MAGIC + _frame(list(self._encode_records().values()))
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _write_all(fd, data)
                finally:
                    os.close(fd)
                os.replace(tmp, self.file)
                self._file_bytes = self._whole_bytes = len(data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            reason = f"{errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror or exc}"
            if self.degraded is None:
                log.warning("metadata cache not saved (%s); using it in memory only", reason)
            self.degraded = reason
            return False
        self._appendable = True
        self._pending.clear()
        self._dirty = False
        self.degraded = None
        return True

    def _record(self, path: str) -> bytes:
        if path in self._unencoded:
            key, digest = self._entries[path]
            self._records[path] = _encode_record(path, key, digest)
            self._unencoded.discard(path)
        return self._records[path]

    def _encode_records(self) -> dict[str, bytes]:
        """Every entry's record: the new and changed ones encoded, the others kept."""
        records, entries = self._records, self._entries
        for path in self._unencoded:
            key, digest = entries[path]
            records[path] = _encode_record(path, key, digest)
        self._unencoded.clear()
        return records


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _frame(records: list[bytes]) -> bytes:
    body = b"".join(records)
    return _CACHE_FRAME.pack(_FRAME_TAG, len(body), xxhash.xxh64_intdigest(body)) + body


def _encode_record(path: str, key: tuple[int, ...], digest: str) -> bytes:
    raw = path.encode("utf-8", "surrogateescape")
    return _CACHE_RECORD.pack(*key, bytes.fromhex(digest), len(raw)) + raw


def _decode_records(
    data: bytes | memoryview, entries: dict[str, tuple[tuple[int, ...], str]]
) -> None:
    pos, end = 0, len(data)
    size = _CACHE_RECORD.size
    unpack = _CACHE_RECORD.unpack_from
    while pos < end:
        if pos + size > end:
            raise ValueError("truncated record")
        record = unpack(data, pos)
        pos += size
        plen = record[7]
        if pos + plen > end:
            raise ValueError("truncated path")
        entries[bytes(data[pos : pos + plen]).decode("utf-8", "surrogateescape")] = (
            record[:6],
            record[6].hex(),
        )
        pos += plen


def _decode_cache(data: bytes) -> tuple[dict[str, tuple[tuple[int, ...], str]], bool]:
    """The entries of a cache file, and whether every frame was whole (a
    damaged frame ends the file: what follows it is not read)."""
    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    if data.startswith(_CACHE_MAGIC_V1):
        _decode_records(memoryview(data)[len(_CACHE_MAGIC_V1) :], entries)
        return entries, False  # written whole next time, in frames
    if not data.startswith(_CACHE_MAGIC):
        raise ValueError("not a metadata cache file")
    view = memoryview(data)
    pos, end = len(_CACHE_MAGIC), len(data)
    head = _CACHE_FRAME.size
    while pos < end:
        if pos + head > end:
            break
        tag, length, checksum = _CACHE_FRAME.unpack_from(data, pos)
        body = view[pos + head : pos + head + length]
        if tag != _FRAME_TAG or len(body) != length or xxhash.xxh64_intdigest(body) != checksum:
            break
        frame: dict[str, tuple[tuple[int, ...], str]] = {}
        try:
            _decode_records(body, frame)
        except ValueError:
            break
        entries.update(frame)
        pos += head + length
    else:
        return entries, True
    if not entries:
        raise ValueError("no whole frame")
    return entries, False


# --- reading one file -------------------------------------------------------------


def hash_stable(
    full: str, before: Key, hook: ReadHook | None = None, *, dir_fd: int | None = None
) -> str | None:
    """The SHA-256 of the file at ``full`` if it is the file ``before`` described
    and did not change while read; None when it changed (or vanished).

    With ``dir_fd``, ``full`` is a name in that (pinned) directory: no path
    component above the file is resolved again."""
    try:
        fd = os.open(full, OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
            return None  # removed, or replaced by a link / a special file
        raise
    try:
        opened = os.fstat(fd)
        if (
            not stat.S_ISREG(opened.st_mode)
            or opened.st_dev != before[0]
            or opened.st_ino != before[1]
        ):
            return None
        sha = hashlib.sha256()
        while chunk := os.read(fd, READ_CHUNK):
            sha.update(chunk)
        if hook is not None:
            hook(full)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    try:
        again = os.stat(full, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if StatKey.of(after) != before or StatKey.of(again) != before:
        return None
    return sha.hexdigest()


# --- listing ------------------------------------------------------------------------


def walk_tree(root: Path, prune: Callable[[str, bool], bool] | None = None) -> list[str]:
    """Every path below ``root`` (relative, ``/``-separated), directories
    included, without following symbolic links. ``prune(path, is_dir)`` True
    leaves a path out (and, for a directory, everything below it)."""
    out: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(os.path.join(root, rel) if rel else root)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed while walking: the second listing notices
        with it:
            for entry in it:
                path = f"{rel}/{entry.name}" if rel else entry.name
                is_dir = entry.is_dir(follow_symlinks=False)
                if prune is not None and prune(path, is_dir):
                    continue
                out.append(path)
                if is_dir:
                    stack.append(path)
    return out


def _parents(paths: Iterable[str]) -> set[str]:
    dirs: set[str] = set()
    for path in paths:
        head = path.rpartition("/")[0]
        while head and head not in dirs:
            dirs.add(head)
            head = head.rpartition("/")[0]
    return dirs


_IFMT = stat.S_IFMT(0o177777)
_IFDIR = stat.S_IFDIR
_IFREG = stat.S_IFREG
_IFLNK = stat.S_IFLNK


@dataclass(slots=True)
class _Listing:
    paths: list[str]
    """What the lister named, sorted, without duplicates."""
    keys: list[Key | None]
    """The lstat of each of :attr:`paths` (the same index); None for a path
    that does not exist or lies below something that is not a directory."""
    hidden: dict[str, str]
    """Listed paths below something that is not a directory: path → the blocking parent."""
    parents: list[str]
    """Every directory above a listed path, sorted (a parent before its children)."""
    parent_keys: list[Key | None]
    """The lstat of each of :attr:`parents`; None when missing or below a non-directory."""
    raw: list[str] | None = None
    """What the lister returned, as it returned it: the same answer next time
    means the same :attr:`paths` and :attr:`parents` (the same objects)."""

    def key_of(self, path: str) -> Key | None:
        paths = self.paths
        i = bisect.bisect_left(paths, path)
        return self.keys[i] if i < len(paths) and paths[i] == path else None

    def fingerprint_of(self, name: str) -> tuple[int, ...] | None:
        """The fingerprint of a path, or of a directory above them (``/dir``)."""
        if name[:1] == "/":
            parents, d = self.parents, name[1:]
            i = bisect.bisect_left(parents, d)
            key = self.parent_keys[i] if i < len(parents) and parents[i] == d else None
            return None if key is None else (key[3], key[0], key[1])
        key = self.key_of(name)
        return None if key is None else _fingerprint_of(key)

    def fingerprint(self) -> dict[str, tuple[int, ...]]:
        """Every path's and every parent's (keyed ``/dir``) fingerprint."""
        out: dict[str, tuple[int, ...]] = {
            "/" + d: (key[3], key[0], key[1])
            for d, key in zip(self.parents, self.parent_keys, strict=True)
            if key is not None
        }
        out.update(
            (path, _fingerprint_of(key))
            for path, key in zip(self.paths, self.keys, strict=True)
            if key is not None
        )
        return out


def _fingerprint_of(key: Key) -> tuple[int, ...]:
    if key[3] & _IFMT == _IFDIR:
        # A directory's own times change with its entries; its entries are in
        # the listing themselves, so only what it is counts.
        return (key[3], key[0], key[1])
    return key


Trusted = Callable[[str], Key | None]
"""The key to use instead of an lstat for a path, or None to lstat it."""

DIR_FLAGS: Final = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
"""Open a directory only to name paths relative to it."""


_paused = 0
_paused_lock = threading.Lock()
_resume = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a scan builds its lists: a scan of
    20,000 members makes 20,000 key tuples, each allocation counts towards
    the next young collection, and every one of those (about 30 a scan)
    walks the long lists being built (3 ms a scan at 20,000 members). What
    a scan allocates holds no cycles; the collector runs as usual after it.
    Scans in several threads pause it once."""
    global _paused, _resume
    with _paused_lock:
        if _paused == 0:
            _resume = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if _paused == 0 and _resume:
                gc.enable()


def _lstat_list_py(
    fd: int, paths: list[str], previous: list[Key | None] | None = None
) -> list[Key | None]:
    """The keys of ``paths`` below the directory ``fd``, in Python: the
    bare calls (plain tuples: a StatKey built here costs a fifth of the
    loop). A second thread does not pay: the GIL handed back and forth costs
    more than the calls it spreads. ``previous`` is for the C loop's sake
    (it gives back an unchanged key's old tuple); equal keys are equal here too."""
    out: list[Key | None] = []
    append = out.append
    lstat = os.lstat
    for path in paths:
        try:
            st = lstat(path, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            append(None)
            continue
        append((st.st_dev, st.st_ino, st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns))
    return out


class LstatKeys(Protocol):
    def __call__(
        self, fd: int, paths: list[str], previous: list[Key | None] | None = None, /
    ) -> list[Key | None]: ...


def _c_loop() -> LstatKeys | None:
    if (sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()) != (
        "utf-8",
        "surrogateescape",
    ):
        return None  # the C loop passes names as their UTF-8
    try:
        from fsagent._lstat import lstat_keys as c_loop
    except ImportError:  # built without a C compiler: the same loop in Python
        return None
    return c_loop


lstat_keys: LstatKeys = _c_loop() or _lstat_list_py
"""The scan's hot loop: ``(dev, ino, size, mode, mtime_ns, ctime_ns)`` or
None (absent, or below a non-directory) for each path below a directory fd.
The C version (fsagent/_lstat.c) builds the same tuples at about a third of
the cost, with the GIL released while it calls ``lstat``."""


SPLIT_AT: Final = 8192
"""Paths from which the C loop's calls are shared with a second thread."""
_second: ThreadPoolExecutor | None = None
_second_lock = threading.Lock()


def _second_thread() -> ThreadPoolExecutor:
    global _second
    with _second_lock:
        if _second is None:
            _second = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lstat")
        return _second


def _lstat_list(
    base: str, paths: list[str], previous: list[Key | None] | None = None
) -> list[Key | None]:
    """lstat each path relative to the root, opened once (the kernel walks
    the path below it only: a third cheaper than the whole path). Many paths
    are split between this thread and a second one: the C loop holds the
    GIL only to build its tuples (20,000 paths: 16 against 10 ms here)."""
    try:
        fd = os.open(base, DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return [None] * len(paths)  # no root: nothing below it exists
    try:
        if len(paths) < SPLIT_AT or lstat_keys is _lstat_list_py:
            return lstat_keys(fd, paths, previous)
        half = len(paths) // 2
        rest = _second_thread().submit(
            lstat_keys, fd, paths[half:], None if previous is None else previous[half:]
        )
        try:
            first = lstat_keys(fd, paths[:half], None if previous is None else previous[:half])
        finally:
            wait([rest])  # it uses the descriptor
        return first + rest.result()
    finally:
        os.close(fd)


def _lstat_many(
    base: str,
    paths: list[str],
    trusted: Trusted | None = None,
    trusted_prefix: str = "",
    previous: list[Key | None] | None = None,
) -> list[Key | None]:
    """The keys of ``paths`` (sorted), in their order: the trusted ones (all
    below ``trusted_prefix``, one run of the sorted paths) asked first, the
    rest lstat'ed. ``previous``: the same paths' keys last time, if known
    (see :func:`lstat_keys`)."""
    lo = hi = 0
    middle: list[Key | None] = []
    if trusted is not None:
        lo = bisect.bisect_left(paths, trusted_prefix)
        hi = bisect.bisect_left(paths, trusted_prefix + "\U0010ffff")
        middle = [trusted(paths[i]) for i in range(lo, hi)]
    if not any(k is not None for k in middle):
        return _lstat_list(base, paths, previous)
    untrusted = [p for p, k in zip(paths[lo:hi], middle, strict=True) if k is None]
    before: list[Key | None] | None = None
    if previous is not None:
        kept = [old for old, k in zip(previous[lo:hi], middle, strict=True) if k is None]
        before = previous[:lo] + kept + previous[hi:]
    keys = _lstat_list(base, paths[:lo] + untrusted + paths[hi:], before)
    it = iter(keys[lo : lo + len(untrusted)])
    middle = [next(it) if k is None else k for k in middle]
    return keys[:lo] + middle + keys[lo + len(untrusted) :]


def _list(
    root: Path,
    list_paths: Callable[[], Iterable[str]],
    guess: list[str] | None,
    trusted: Trusted | None,
    trusted_prefix: str = "",
    previous: _Listing | None = None,
    guess_keys: list[Key | None] | None = None,
) -> _Listing:
    """List, then lstat what was listed and the directories above it. With a
    ``guess`` (the paths the listing most likely names, sorted: the last
    listing's), the guessed paths (and, with the ``previous`` listing of
    them, its directories) are lstat'ed while the lister runs in a thread
    (it is usually a subprocess), and only the surprises after it. The
    guessed paths are lstat'ed before the directories above them, as
    before: a directory swapped for a link in between hides them.
    ``guess_keys``: the guessed paths' keys last time (see :func:`lstat_keys`)."""
    base = os.fspath(root)
    early: list[Key | None] | None = None
    early_parents: list[Key | None] | None = None
    if guess:
        guessed_parents = (
            previous.parents
            if previous is not None and (previous.paths is guess or previous.paths == guess)
            else None
        )
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="scan-list") as pool:
            listing = pool.submit(lambda: list(list_paths()))
            early = _lstat_many(base, guess, trusted, trusted_prefix, guess_keys)
            if guessed_parents is not None:
                early_parents = _lstat_many(base, guessed_parents)
            listed = listing.result()
    else:
        listed = list(list_paths())
    if previous is not None and previous.raw is not None and listed == previous.raw:
        wanted, parents = previous.paths, previous.parents  # the same objects
    else:
        unique = set(listed)
        wanted = sorted(unique)
        if previous is not None and previous.paths == wanted:
            wanted, parents = previous.paths, previous.parents
        elif previous is not None and unique.issuperset(previous.paths):
            # Only additions: the directories above them join the last ones.
            added = unique.difference(previous.paths)
            parents = sorted(_parents(added).union(previous.parents))
        else:
            parents = sorted(_parents(wanted))
    if early is not None and guess is not None and (wanted is guess or wanted == guess):
        keys = early
    else:
        known = dict(zip(guess, early, strict=True)) if guess and early is not None else {}
        surprises = [p for p in wanted if p not in known]
        found = _lstat_many(base, surprises, trusted, trusted_prefix)
        known.update(zip(surprises, found, strict=True))
        keys = list(map(known.__getitem__, wanted))
    if early_parents is not None and previous is not None and parents is previous.parents:
        parent_keys = early_parents
    else:
        parent_keys = _lstat_many(base, parents)
    hidden: dict[str, str] = {}
    if any(key is None or key[3] & _IFMT != _IFDIR for key in parent_keys):
        parent_keys, hidden = _block(wanted, keys, parents, parent_keys)
        if hidden:
            keys = [None if p in hidden else k for p, k in zip(wanted, keys, strict=True)]
    return _Listing(wanted, keys, hidden, parents, parent_keys, listed)


def _block(
    paths: list[str],
    keys: list[Key | None],
    parents: list[str],
    parent_keys: list[Key | None],
) -> tuple[list[Key | None], dict[str, str]]:
    """A parent that is missing or not a real directory (a symbolic link,
    say) hides what is below it: the parents' keys with those below such a
    parent dropped, and the listed paths it hides (path → the parent)."""
    blocked: dict[str, str] = {}
    kept: list[Key | None] = []
    for d, key in zip(parents, parent_keys, strict=True):  # sorted: a parent before its children
        up = d.rpartition("/")[0]
        if up and up in blocked:
            blocked[d] = blocked[up]
            kept.append(None)  # not looked at: what is there is not in the tree
            continue
        kept.append(key)
        if key is None or key[3] & _IFMT != _IFDIR:
            blocked[d] = d
    hidden: dict[str, str] = {}
    for path in paths:
        head = path.rpartition("/")[0]
        if head and head in blocked:
            hidden[path] = blocked[head]
    return kept, hidden


# --- the scan ------------------------------------------------------------------------


def scan_tree(
    root: Path,
    list_paths: Callable[[], Iterable[str]],
    cache: MetadataCache | None = None,
    **options: Any,
) -> ScanResult:
    """Scan the paths ``list_paths()`` names under ``root`` (see the module
    doc and :class:`TreeScan` for the options): read, then verify."""
    scan = TreeScan(root, list_paths, cache, **options)
    scan.read()
    return scan.verify()


class TreeScan:
    """One scan in two steps (blocking I/O: run each in a worker thread).

    :meth:`read` lists and lstats the tree and reads what the cache does not
    know; :meth:`verify` lists and lstats it again and compares. Between the
    two the caller may start uploading what was read (contents only); nothing
    may be committed before :meth:`verify` says the result is stable.

    A listed path that does not exist is simply absent. ``list_paths`` is
    called twice, before and after reading: what it lists may change with
    the tree (new files).

    ``guess``: the paths the listing probably names (the last scan's
    :attr:`ScanResult.paths`); they are lstat'ed while the first listing
    runs, as the before-listing's paths are while the second one runs.
    ``immutable``: paths whose names fix their contents (Git's objects and
    packs are named by their hash). Such a path known to the cache is
    trusted by name: no lstat, no read; its presence in the listing is what
    the fingerprints compare. ``immutable`` is asked only about paths that
    start with ``immutable_prefix``.

    ``recheck`` and ``relist`` narrow :meth:`verify` to what can tear a
    result (the default, None, checks everything again): the directory
    ``recheck`` and every listed path below it, as ``relist()`` names them now
    (it must name exactly those), the files read in this scan, and every
    directory above them. A path outside that scope which changed after its
    lstat keeps what the scan saw of it: whole contents, read before (a cache
    hit) or checked while read (:func:`hash_stable`), never torn; its change
    is the next scan's. The repository saver rechecks ``.git`` this way,
    whose members must be consistent with each other (:mod:`fsagent.repos.save`).

    ``previous``: the last scan of the same tree; the directories above an
    unchanged listing are taken from it rather than worked out again, and
    its members that the cache confirmed (files whose digest the cache
    holds for their key, directories) are used again for the same path with
    the same key: the same objects, so a caller can compare them by
    identity. Whole runs of the listing whose keys are all unchanged are
    taken at once (:data:`REUSE_RUN`).
    """

    def __init__(
        self,
        root: Path,
        list_paths: Callable[[], Iterable[str]],
        cache: MetadataCache | None = None,
        *,
        path_rule: PathRule | None = None,
        link_rule: LinkRule | None = None,
        max_file_bytes: int | None = None,
        threads: int = HASH_THREADS,
        after_read: ReadHook | None = None,
        racy_margin_ns: int = RACY_MARGIN_NS,
        guess: list[str] | None = None,
        immutable: Callable[[str], bool] | None = None,
        immutable_prefix: str = "",
        recheck: str | None = None,
        relist: Callable[[], Iterable[str]] | None = None,
        previous: TreeScan | None = None,
    ) -> None:
        if (recheck is None) != (relist is None):
            raise ValueError("recheck and relist go together")
        self.root = root
        self.list_paths = list_paths
        self.cache = cache
        self.path_rule = path_rule
        self.link_rule = link_rule
        self.max_file_bytes = max_file_bytes
        self.threads = threads
        self.after_read = after_read
        self.racy_margin_ns = racy_margin_ns
        self.guess = guess
        self.immutable_prefix = immutable_prefix
        self.recheck = recheck
        self.relist = relist
        self._previous_listing = previous._before if previous is not None else None
        self._reusable: _Reusable | None = None
        self._retained: list[str] | None = None
        """The listing (object) the cache was last trimmed to."""
        if (
            previous is not None
            and previous.root == root
            and previous.cache is cache
            and previous.path_rule is path_rule
            and previous.max_file_bytes == max_file_bytes
            and previous.racy_margin_ns == racy_margin_ns
        ):
            self._reusable = previous._reusable
            self._retained = previous._retained
        self.trusted: Trusted | None = None
        if immutable is not None and cache is not None:
            known = cache

            def trusted(path: str) -> Key | None:
                return known.key_of(path) if immutable(path) else None

            self.trusted = trusted
        self._before: _Listing | None = None
        self._read: ScanResult | None = None
        self._hashed: list[str] = []
        """The files read in this scan (the narrowed verify checks them again)."""
        self._started = 0.0

    def read(self) -> ScanResult:
        """List, lstat and read: the members as they were read, with the
        paths found changed so far in ``unstable`` (more may follow)."""
        with collector_paused():
            return self._read_tree()

    def _read_tree(self) -> ScanResult:
        self._started = time.monotonic()
        not_after_ns = time.time_ns() - self.racy_margin_ns
        base = os.fspath(self.root)
        cache, path_rule, link_rule = self.cache, self.path_rule, self.link_rule
        max_file_bytes = self.max_file_bytes
        last_keys = None
        if self._reusable is not None and self._reusable.paths is self.guess:
            last_keys = self._reusable.keys  # unchanged keys come back as these tuples
        before = self._before = _list(
            self.root,
            self.list_paths,
            self.guess,
            self.trusted,
            self.immutable_prefix,
            self._previous_listing,
            last_keys,
        )
        self._previous_listing = None  # only its parents were wanted
        last, self._reusable = self._reusable, None
        paths, keys = before.paths, before.keys
        stats = ScanStats(listed=len(keys) - keys.count(None) + len(before.hidden))
        problems = [Problem(p, f"below_non_directory:{d}") for p, d in before.hidden.items()]
        members: list[Member] = []
        reusable: list[Member | None] = []
        """Aligned with ``paths``: what the next scan may use again."""
        gaps: list[int] = []
        """The indexes where ``reusable`` holds None, in order."""
        to_hash: list[tuple[int, str, Key]] = []
        unstable: list[str] = []
        cache_get = cache.get if cache is not None else None
        add, keep, gap = members.append, reusable.append, gaps.append

        def treat(i: int, path: str, key: Key | None) -> None:
            """One path, looked at afresh."""
            if key is None:  # absent, or hidden below a non-directory
                keep(None)
                gap(i)
                return
            if path_rule is not None:
                why = path_rule(path)
                if why is not None:
                    problems.append(Problem(path, why))
                    keep(None)
                    gap(i)
                    return
            mode = key[3]
            kind = mode & _IFMT
            if kind == _IFREG:
                size = key[2]
                if max_file_bytes is not None and size > max_file_bytes:
                    problems.append(Problem(path, "file_too_large"))
                    keep(None)
                    gap(i)
                    return
                digest = cache_get(path, key) if cache_get is not None else None
                if digest is None:
                    to_hash.append((i, path, key))
                    keep(None)  # filled in once read, when the cache keeps it
                    return
                member = Member(path, "file", digest, size, bool(mode & stat.S_IXUSR), key=key)
                add(member)
                keep(member)
            elif kind == _IFLNK:
                keep(None)
                gap(i)
                try:
                    target = os.readlink(f"{base}/{path}")
                except OSError:
                    unstable.append(path)  # replaced since the lstat
                    return
                why = link_rule(path, target) if link_rule is not None else None
                if why is not None:
                    problems.append(Problem(path, why))
                    return
                add(Member(path, "symlink", target=target))
            elif kind == _IFDIR:
                member = Member(path, "dir")
                add(member)
                keep(member)
            else:
                problems.append(Problem(path, "special_file"))  # socket, FIFO, device
                keep(None)
                gap(i)

        count = len(paths)
        if last is None:
            for i in range(count):
                treat(i, paths[i], keys[i])
        else:
            # Runs of the listing that the last scan saw with the same keys and
            # whose members it could use again are taken whole (C loops); a
            # run with a change is looked at path by path.
            lpaths, lkeys, lmembers, lgaps = last.paths, last.keys, last.members, last.gaps
            same_listing = lpaths is paths
            lcount = len(lpaths)
            for lo in range(0, count, REUSE_RUN):
                hi = min(lo + REUSE_RUN, count)
                at = lo if same_listing else bisect.bisect_left(lpaths, paths[lo])
                end = at + hi - lo
                if (
                    end <= lcount
                    and (same_listing or lpaths[at:end] == paths[lo:hi])
                    and lkeys[at:end] == keys[lo:hi]
                ):
                    g = bisect.bisect_left(lgaps, at)
                    if g == len(lgaps) or lgaps[g] >= end:  # every member there reusable
                        run = lmembers[at:end]
                        members.extend(run)  # type: ignore[arg-type]  # no None there
                        reusable.extend(run)
                        continue
                for i in range(lo, hi):
                    path, key = paths[i], keys[i]
                    while at < lcount and lpaths[at] < path:
                        at += 1
                    if at < lcount and lpaths[at] == path and key is not None:
                        old = lmembers[at]
                        if old is not None and lkeys[at] == key:
                            add(old)
                            keep(old)
                            continue
                    treat(i, path, key)

        after_read = self.after_read

        def hash_group(
            group: list[tuple[int, str, Key]],
        ) -> list[tuple[str, str | None]]:
            return [(p, hash_stable(f"{base}/{p}", key, after_read)) for _, p, key in group]

        groups = [to_hash[i : i + WORK_GROUP] for i in range(0, len(to_hash), WORK_GROUP)]
        if len(groups) > 1 and self.threads > 1:
            with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="scan") as pool:
                hashed = [r for rs in pool.map(hash_group, groups) for r in rs]
        else:
            hashed = [r for g in groups for r in hash_group(g)]
        self._hashed = [path for _, path, _ in to_hash]
        read: list[Member] = []
        racy: list[int] = []
        for (i, path, key), (_, digest) in zip(to_hash, hashed, strict=True):
            if digest is None:
                unstable.append(path)
                racy.append(i)
                continue
            stats.hashed += 1
            stats.hashed_bytes += key[2]
            member = Member(path, "file", digest, key[2], bool(key[3] & stat.S_IXUSR), key=key)
            read.append(member)
            if cache is not None and max(key[4], key[5]) < not_after_ns:
                cache.put(path, key, digest)
                reusable[i] = member
            else:
                racy.append(i)  # read again next time
        if racy:
            gaps = sorted(gaps + racy)
        if len(read) > WORK_GROUP:
            members += read
            members.sort(key=member_path)
        else:
            for member in read:  # members is sorted: put each where it belongs
                bisect.insort(members, member, key=member_path)
        kinds = list(map(member_kind, members))
        stats.cache_hits = kinds.count("file") - stats.hashed
        problems.sort(key=operator.attrgetter("path"))
        stats.seconds = time.monotonic() - self._started
        self._reusable = _Reusable(paths, keys, reusable, gaps)
        self._read = ScanResult(members, problems, sorted(unstable), stats, before.paths)
        return self._read

    def verify(self) -> ScanResult:
        """List and lstat again: the final result, unstable when anything
        changed since :meth:`read` began."""
        assert self._before is not None and self._read is not None, "read() first"
        before, first = self._before, self._read
        unstable = list(first.unstable)
        if self.recheck is None:
            after = _list(
                self.root,
                self.list_paths,
                before.paths,
                self.trusted,
                self.immutable_prefix,
                before,
            )
            changed = _differences(before.fingerprint(), after.fingerprint())
            paths = after.paths
        else:
            changed = self._narrow_differences(before)
            paths = before.paths
        unstable.extend(changed - set(unstable))
        # A next scan (``previous``) needs only the paths, their parents and
        # the lister's answer (to know the same one again).
        self._before = _Listing(before.paths, [], {}, before.parents, [], before.raw)
        if self.cache is not None and not unstable and self._retained is not before.paths:
            # Every cache entry not for a file of this scan goes. With the same
            # listing (object) as when it was last trimmed, the cache holds
            # entries for listed paths only (only those are put): nothing to do.
            self.cache.retain({m.path for m in first.members if m.kind == "file"})
            self._retained = before.paths
        first.stats.seconds = time.monotonic() - self._started
        return ScanResult(first.members, first.problems, sorted(unstable), first.stats, paths)

    def _narrow_differences(self, before: _Listing) -> set[str]:
        """The paths in the narrowed scope (see the class doc) that changed
        since :meth:`read` began."""
        assert self.recheck is not None and self.relist is not None
        scoped = _below(before.paths, self.recheck)
        relisted = sorted(set(self.relist()))
        hashed = self._hashed
        after = _list(
            self.root,
            lambda: relisted + hashed,
            None,
            self.trusted,
            self.immutable_prefix,
        )
        theirs = after.fingerprint()
        ours: dict[str, tuple[int, ...]] = {}
        for name in (*theirs, *scoped):
            fingerprint = before.fingerprint_of(name)
            if fingerprint is not None:
                ours[name] = fingerprint
        for path in hashed:  # their first lstat (hash_stable checked the read against it)
            key = before.key_of(path)
            if key is not None:
                ours[path] = key
        changed = _differences(ours, theirs)
        changed.update(set(scoped).symmetric_difference(relisted))
        return changed


REUSE_RUN: Final = 128
"""Listed paths compared at once with the last scan's (see :class:`TreeScan`)."""


@dataclass(slots=True)
class _Reusable:
    """What a scan's :meth:`TreeScan.read` leaves for the next one."""

    paths: list[str]
    keys: list[Key | None]
    members: list[Member | None]
    """Aligned with ``paths``: the member to use again for the same key, or None."""
    gaps: list[int]
    """The indexes of the Nones in ``members``, in order."""


member_path = operator.itemgetter(0)
"""A :class:`Member`'s path (a sort and bisect key, in C)."""
member_kind = operator.itemgetter(1)
"""A :class:`Member`'s kind."""


def _below(paths: list[str], top: str) -> list[str]:
    """``top`` and the paths below it, of sorted ``paths``."""
    # Every such path sorts in [top, top + "0"): "0" follows "/" in ASCII.
    lo, hi = bisect.bisect_left(paths, top), bisect.bisect_left(paths, top + "0")
    below = top + "/"
    return [p for p in paths[lo:hi] if p == top or p.startswith(below)]


def _differences(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]]) -> set[str]:
    """The paths whose fingerprints differ (a directory above a listed path
    is keyed ``/dir``: reported as ``dir``)."""
    if before == after:
        return set()
    return {p.lstrip("/") for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


def open_member(root: Path, member: Member) -> int:
    """Open a scanned file again (for upload) and check it is still the file the
    scan hashed: same inode and metadata. Returns the fd; raises
    :class:`MemberChanged` otherwise. The caller closes the fd."""
    assert member.key is not None
    full = os.path.join(root, member.path)
    try:
        fd = os.open(full, OPEN_FLAGS)
    except OSError as exc:
        raise MemberChanged(member.path, f"cannot open: {exc.strerror}") from None
    try:
        if StatKey.of(os.fstat(fd)) != member.key:
            raise MemberChanged(member.path, "changed since the scan")
    except BaseException:
        os.close(fd)
        raise
    return fd
