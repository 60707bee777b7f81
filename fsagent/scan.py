"""The scan engine: the members of a tree on the sandbox's own disk, with
content digests, read stably, at a cost that follows the changes.

Two users: repository checkpoints (:mod:`fsagent.repocapture` lists a
checkout's members with Git) and plain-directory collections where FUSE is
unavailable (:mod:`fsagent.dirscan` walks the whole directory through pinned
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
   rewritten) and the result is unstable.

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

import contextlib
import errno
import hashlib
import logging
import os
import stat
import struct
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

from fsagent.errors import MemberChanged

log = logging.getLogger(__name__)

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


@dataclass(frozen=True, slots=True)
class Member:
    """One entry of a scanned tree: a regular file, a symbolic link or a directory."""

    path: str
    kind: Kind
    digest: str | None = None
    size: int = 0
    executable: bool = False
    target: str | None = None
    key: StatKey | None = None
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

_CACHE_MAGIC: Final = b"FSAMC1\n"
_CACHE_RECORD: Final = struct.Struct(">QQQIqq32sH")
"""dev, ino, size, mode, mtime_ns, ctime_ns, sha256, path length; then the path (UTF-8)."""


class MetadataCache:
    """path → (StatKey, digest), in memory, saved to ``file`` when it can be.

    Loading a missing or unreadable file gives an empty cache (a cache is
    never needed for correctness, only for speed). :meth:`save` writes a new
    file beside the old one and renames it over, so a crash or a full disk
    leaves the old file (whose entries are still right for the files they
    name: a key that no longer matches is a miss).
    """

    def __init__(self, file: Path | None = None) -> None:
        self.file = file
        self._entries: dict[str, tuple[tuple[int, ...], bytes]] = {}
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
            cache._entries = _decode_cache(data)
        except ValueError as exc:
            log.warning("metadata cache %s is damaged (%s); starting empty", file, exc)
        return cache

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, path: str, key: StatKey) -> str | None:
        hit = self._entries.get(path)
        if hit is None or hit[0] != key:
            return None
        return hit[1].hex()

    def put(self, path: str, key: StatKey, digest: str) -> None:
        entry = (tuple(key), bytes.fromhex(digest))
        if self._entries.get(path) != entry:
            self._entries[path] = entry
            self._dirty = True

    def retain(self, paths: set[str]) -> None:
        """Forget every path not in ``paths`` (gone from the tree)."""
        gone = [p for p in self._entries if p not in paths]
        for p in gone:
            del self._entries[p]
        if gone:
            self._dirty = True

    def save(self) -> bool:
        """Write the cache file if anything changed; False (and :attr:`degraded`
        set) when the write failed. Never raises for lack of space."""
        if self.file is None or not self._dirty:
            return True
        tmp = self.file.with_name(self.file.name + ".tmp")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            data = _encode_cache(self._entries)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            # No fsync: a cache file torn by a power loss reads as damaged
            # (an empty cache), and a record that decodes but is stale never
            # matches a file's key. The save stays cheap on every checkpoint.
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, self.file)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            reason = f"{errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror or exc}"
            if self.degraded is None:
                log.warning("metadata cache not saved (%s); using it in memory only", reason)
            self.degraded = reason
            return False
        self._dirty = False
        self.degraded = None
        return True


def _encode_cache(entries: dict[str, tuple[tuple[int, ...], bytes]]) -> bytes:
    out = [_CACHE_MAGIC]
    pack = _CACHE_RECORD.pack
    for path, (key, digest) in entries.items():
        raw = path.encode("utf-8", "surrogateescape")
        out.append(pack(*key, digest, len(raw)))
        out.append(raw)
    return b"".join(out)


def _decode_cache(data: bytes) -> dict[str, tuple[tuple[int, ...], bytes]]:
    if not data.startswith(_CACHE_MAGIC):
        raise ValueError("not a metadata cache file")
    entries: dict[str, tuple[tuple[int, ...], bytes]] = {}
    pos = len(_CACHE_MAGIC)
    end = len(data)
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
        entries[data[pos : pos + plen].decode("utf-8", "surrogateescape")] = (
            record[:6],
            record[6],
        )
        pos += plen
    return entries


# --- reading one file -------------------------------------------------------------


def hash_stable(
    full: str, before: os.stat_result, hook: ReadHook | None = None, *, dir_fd: int | None = None
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
        if not stat.S_ISREG(opened.st_mode) or _identity(opened) != _identity(before):
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
    if StatKey.of(after) != StatKey.of(before) or StatKey.of(again) != StatKey.of(before):
        return None
    return sha.hexdigest()


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


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


@dataclass
class _Listing:
    stats: dict[str, os.stat_result]
    """lstat of every listed path that exists (and whose parents are directories)."""
    hidden: dict[str, str]
    """Listed paths below something that is not a directory: path → the blocking parent."""
    fingerprint: dict[str, tuple[int, ...]]


def _fingerprint_of(st: os.stat_result) -> tuple[int, ...]:
    if stat.S_ISDIR(st.st_mode):
        # A directory's own times change with its entries; its entries are in
        # the listing themselves, so only what it is counts.
        return (st.st_mode, st.st_dev, st.st_ino)
    return (st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _list(root: Path, paths: Iterable[str]) -> _Listing:
    base = os.fspath(root)
    wanted = sorted(set(paths))
    parents = sorted(_parents(wanted))
    blocked: dict[str, str] = {}
    fingerprint: dict[str, tuple[int, ...]] = {}
    for d in parents:  # sorted: a parent before its children
        up = d.rpartition("/")[0]
        if up and up in blocked:
            blocked[d] = blocked[up]
            continue
        try:
            st = os.lstat(f"{base}/{d}")
        except FileNotFoundError:
            blocked[d] = d
            continue
        fingerprint["/" + d] = _fingerprint_of(st)  # "/" keeps parents apart from members
        if not stat.S_ISDIR(st.st_mode):
            blocked[d] = d
    stats: dict[str, os.stat_result] = {}
    hidden: dict[str, str] = {}
    for path in wanted:
        head = path.rpartition("/")[0]
        if head and head in blocked:
            hidden[path] = blocked[head]
            continue
        try:
            st = os.lstat(f"{base}/{path}")
        except FileNotFoundError:
            continue
        stats[path] = st
        fingerprint[path] = _fingerprint_of(st)
    return _Listing(stats, hidden, fingerprint)


# --- the scan ------------------------------------------------------------------------


def scan_tree(
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
) -> ScanResult:
    """Scan the paths ``list_paths()`` names under ``root`` (see the module doc).

    A listed path that does not exist is simply absent. ``list_paths`` is
    called twice, before and after reading: what it lists may change with
    the tree (new files). Blocking I/O: run it in a worker thread.
    """
    started = time.monotonic()
    not_after_ns = time.time_ns() - racy_margin_ns
    base = os.fspath(root)
    before = _list(root, list_paths())
    stats = ScanStats(listed=len(before.stats) + len(before.hidden))
    problems = [Problem(p, f"below_non_directory:{d}") for p, d in before.hidden.items()]
    members: list[Member] = []
    to_hash: list[tuple[str, os.stat_result]] = []
    unstable: list[str] = []
    for path, st in before.stats.items():
        if path_rule is not None:
            why = path_rule(path)
            if why is not None:
                problems.append(Problem(path, why))
                continue
        mode = st.st_mode
        if stat.S_ISREG(mode):
            if max_file_bytes is not None and st.st_size > max_file_bytes:
                problems.append(Problem(path, "file_too_large"))
                continue
            key = StatKey.of(st)
            digest = cache.get(path, key) if cache is not None else None
            if digest is None:
                to_hash.append((path, st))
                continue
            stats.cache_hits += 1
            members.append(
                Member(path, "file", digest, st.st_size, bool(mode & stat.S_IXUSR), key=key)
            )
        elif stat.S_ISLNK(mode):
            try:
                target = os.readlink(f"{base}/{path}")
            except OSError:
                unstable.append(path)  # replaced since the lstat
                continue
            why = link_rule(path, target) if link_rule is not None else None
            if why is not None:
                problems.append(Problem(path, why))
                continue
            members.append(Member(path, "symlink", target=target))
        elif stat.S_ISDIR(mode):
            members.append(Member(path, "dir"))
        else:
            problems.append(Problem(path, "special_file"))  # socket, FIFO, device

    def hash_group(group: list[tuple[str, os.stat_result]]) -> list[tuple[str, str | None]]:
        return [(p, hash_stable(f"{base}/{p}", st, after_read)) for p, st in group]

    groups = [to_hash[i : i + WORK_GROUP] for i in range(0, len(to_hash), WORK_GROUP)]
    if len(groups) > 1 and threads > 1:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="scan") as pool:
            hashed = [r for rs in pool.map(hash_group, groups) for r in rs]
    else:
        hashed = [r for g in groups for r in hash_group(g)]
    for (path, st), (_, digest) in zip(to_hash, hashed, strict=True):
        if digest is None:
            unstable.append(path)
            continue
        stats.hashed += 1
        stats.hashed_bytes += st.st_size
        key = StatKey.of(st)
        if cache is not None and max(key.mtime_ns, key.ctime_ns) < not_after_ns:
            cache.put(path, key, digest)
        members.append(
            Member(path, "file", digest, st.st_size, bool(st.st_mode & stat.S_IXUSR), key=key)
        )

    after = _list(root, list_paths())
    if after.fingerprint != before.fingerprint:
        changed = {
            p.lstrip("/")
            for p in before.fingerprint.keys() | after.fingerprint.keys()
            if before.fingerprint.get(p) != after.fingerprint.get(p)
        }
        unstable.extend(sorted(changed - set(unstable)))
    if cache is not None and not unstable:
        cache.retain({m.path for m in members if m.kind == "file"})
    members.sort(key=lambda m: m.path)
    problems.sort(key=lambda p: p.path)
    stats.seconds = time.monotonic() - started
    return ScanResult(members, problems, sorted(unstable), stats)


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
