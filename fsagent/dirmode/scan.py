"""The scan of a plain-directory collection (dir mode): what is there now, with
content digests, at a cost that follows the changes.

Where FUSE is unavailable the collection is an ordinary directory, and what
the kernel side of the mount enforced must be found at scan time instead.
One scan (:func:`scan_directory`):

1. **Walk** the directory from its pinned root (fsagent.dirmode.fs): each
   directory is opened by name from its parent with ``O_NOFOLLOW |
   O_DIRECTORY``, ``fstat``\\ ed (its *stamp*: device, inode, mtime, ctime),
   and listed; every entry is ``lstat``\\ ed once, relative to it.
2. **Refuse** what a mount would have refused, each by name (a
   :class:`Problem`), never following or reading it: symbolic links, hard
   links (a regular file with more than one link), special files (FIFOs,
   sockets, devices), names the path rules refuse (``common.paths``; a
   directory with such a name is not entered), files over 1 GiB, and
   entries past the 100,000-entry limit (those already saved keep their
   place; new ones are admitted in path order).
3. **Hash** only the regular files whose ``lstat`` key (device, inode,
   size, mode, mtime, ctime) differs from what the last scan recorded, or
   whose record is not yet trusted (below). Reads go through the directory's
   descriptor with the scan engine's stable read (:func:`fsagent.scan.engine.hash_stable`):
   a file that changes while read is *unstable*, left out of this
   checkpoint and looked at again by the next one; torn content is never
   shipped.
4. **Check the stamps** of every directory again. A directory whose stamp
   moved (an entry created, removed or renamed in it while the walk ran) is
   listed again, its new subdirectories walked; up to :data:`RELIST_ROUNDS`
   rounds. A scan whose directories all held still is *stable*; only a
   stable scan may ship deletions, because a file renamed from a directory
   not yet listed into one already listed is missing from both listings.

**Timestamp ticks.** mtime and ctime come from the kernel's coarse clock: two
changes within one tick (a few milliseconds) can leave the same key. So a
file is read only once its last change is at least :data:`TICK_NS` old (the
scan waits that long for a file changed just now), a directory listed within a
tick of its last change is listed again, and a record is *trusted* only if
its digest was verified at least a tick after the file's last change. Any
later change then moves ctime, which no user can set. (This assumes local
Linux filesystems, whose timestamps come from the kernel clock.)

Blocking I/O throughout: run it in a worker thread.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Container, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

from common.bridge import LOCAL_REFUSAL_CODES, MAX_LOCAL_REFUSAL_PATH, MAX_LOCAL_REFUSALS
from common.errors import InvalidPath
from common.limits import MAX_ENTRIES, MAX_FILE_BYTES
from common.paths import validate_path
from common.types import Digest
from fsagent.dirmode.fs import DIR_FLAGS, parent_of
from fsagent.scan.engine import (
    HASH_THREADS,
    WORK_GROUP,
    Problem,
    ReadHook,
    ScanStats,
    StatKey,
    hash_stable,
)
from fsagent.state.records import LocalEntry

TICK_NS: Final = 20_000_000
"""Longer than two ticks of the kernel's coarse clock at HZ=100: a change
after a moment at least this long after a file's last change gets a later
timestamp."""
RELIST_ROUNDS: Final = 3
"""Times a directory that changed during the scan is listed again before the
scan gives up on holding it still (its changes wait for the next checkpoint)."""

Stamp = tuple[int, int, int, int, int]
"""A directory's device, inode, mtime, ctime, and when it was listed."""


def refusal_of_path(path: str) -> str | None:
    """Why the path rules refuse ``path`` (``invalid_name: ...``), or None."""
    try:
        validate_path(path)
    except InvalidPath as exc:
        detail = (exc.details or [{}])[0].get("message", exc.reason)
        return f"invalid_name: {detail}"
    return None


def trusted(entry: LocalEntry) -> bool:
    """Whether a record's digest may stand for its key (see the module doc)."""
    return entry.verified_ns - max(entry.mtime_ns, entry.ctime_ns) >= TICK_NS


@dataclass
class DirScan:
    """What one scan found. ``entries`` are the admitted files and directories."""

    entries: dict[str, LocalEntry]
    problems: dict[str, str]
    """Refused paths and why (a refused directory's contents are not listed)."""
    unstable: set[str]
    """Files that changed while read, and directories that kept changing."""
    stable: bool
    """No directory changed after it was last listed: deletions may ship."""
    stats: ScanStats = field(default_factory=ScanStats)

    def withheld(self, path: str) -> bool:
        """Whether this scan says nothing reliable about ``path``: it, or a
        directory above it, was refused or unstable."""
        if path in self.problems or path in self.unstable:
            return True
        head = path.rpartition("/")[0]
        while head:
            if head in self.problems or head in self.unstable:
                return True
            head = head.rpartition("/")[0]
        return False

    def problem_list(self) -> list[Problem]:
        return [Problem(p, why) for p, why in sorted(self.problems.items())]


class _Walk:
    """One scan's state; see :func:`scan_directory`."""

    def __init__(
        self,
        root_fd: int,
        known: Mapping[str, LocalEntry],
        path_rule: Callable[[str], str | None],
        max_file_bytes: int,
        threads: int,
        after_read: ReadHook | None,
    ) -> None:
        self.root_fd = root_fd
        self.known = known
        self.path_rule = path_rule
        self.max_file_bytes = max_file_bytes
        self.threads = threads
        self.after_read = after_read
        self.entries: dict[str, LocalEntry] = {}
        self.problems: dict[str, str] = {}
        self.unstable: set[str] = set()
        self.stamps: dict[str, Stamp] = {}
        self.names: dict[str, list[str]] = {}
        self.stats = ScanStats()
        self.hashed: dict[str, LocalEntry] = {}
        """Files this scan read."""
        self.merged: dict[str, LocalEntry] | None = None
        """Once a directory is listed again: the records with what this scan
        hashed, so that no file is read twice."""
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    # --- listing -------------------------------------------------------------

    def walk(self, path: str, fd: int, *, into_known: bool = True) -> None:
        """List the directory ``path`` (open as ``fd``) and walk its
        subdirectories; ``into_known`` False walks only subdirectories this
        scan has not listed yet (a directory listed again)."""
        listed_at = time.time_ns()
        dst = os.fstat(fd)
        self.stamps[path] = (dst.st_dev, dst.st_ino, dst.st_mtime_ns, dst.st_ctime_ns, listed_at)
        known = self.known if self.merged is None else self.merged
        entries = self.entries
        names: list[str] = []
        to_hash: list[tuple[str, str, os.stat_result]] = []
        subdirs: list[tuple[str, str, os.stat_result]] = []
        prefix = f"{path}/" if path else ""
        hits = 0
        # The loop runs once per entry of the collection on every checkpoint:
        # the unchanged case (a record with the same key) is kept to a few
        # comparisons of tuple items.
        with os.scandir(fd) as it:
            for e in it:
                name = e.name
                p = prefix + name
                names.append(name)
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since listed: the directory's stamp moved
                mode = st.st_mode
                k = known.get(p)
                if (
                    k is not None
                    and k[5] == st.st_mtime_ns
                    and k[6] == st.st_ctime_ns
                    and k[2] == st.st_ino
                    and k[3] == st.st_size
                    and k[4] == mode
                    and k[1] == st.st_dev
                ):
                    # Same key as recorded: link() and chmod() move ctime, so it
                    # is still the same kind of entry with one link.
                    if k[0] == "directory":
                        entries[p] = k
                        subdirs.append((p, name, st))
                        continue
                    if k[8] - (k[5] if k[5] > k[6] else k[6]) >= TICK_NS:
                        entries[p] = k
                        hits += 1
                        continue
                elif k is None:
                    why = self.path_rule(p)  # a recorded path passed the rules already
                    if why is not None:
                        self.problems[p] = why
                        continue
                if stat.S_ISREG(mode):
                    if st.st_nlink > 1:
                        self.problems[p] = "hard_link"
                    elif st.st_size > self.max_file_bytes:
                        self.problems[p] = "file_too_large"
                    else:
                        to_hash.append((p, name, st))
                elif stat.S_ISDIR(mode):
                    entries[p] = LocalEntry(
                        "directory", st.st_dev, st.st_ino, 0, mode,
                        st.st_mtime_ns, st.st_ctime_ns, None, 0,
                    )  # fmt: skip
                    subdirs.append((p, name, st))
                elif stat.S_ISLNK(mode):
                    self.problems[p] = "symlink"
                else:
                    self.problems[p] = "special_file"
        self.stats.listed += len(names)
        self.stats.cache_hits += hits
        self.names[path] = names
        if to_hash:
            self._hash(fd, to_hash)
        for p, name, st in subdirs:
            if not into_known and p in self.stamps:
                continue
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.EACCES:
                    self.problems[p] = "unreadable"
                    del entries[p]
                else:  # replaced or removed since listed: the stamp check notices
                    self.unstable.add(p)
                continue
            try:
                opened = os.fstat(child)
                if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                    self.unstable.add(p)
                    continue
                self.walk(p, child)
            finally:
                os.close(child)

    def _hash(self, fd: int, files: list[tuple[str, str, os.stat_result]]) -> None:
        newest = max(max(st.st_mtime_ns, st.st_ctime_ns) for _, _, st in files)
        wait = newest + TICK_NS - time.time_ns()
        if wait > 0:  # changed within a tick: a change during the read could keep its key
            time.sleep(wait / 1e9)
        verified = time.time_ns()
        hook = self.after_read

        def hash_group(group: list[tuple[str, str, os.stat_result]]) -> list[str | None]:
            out: list[str | None] = []
            for p, name, st in group:
                # The hook hears the collection path, not the name in this directory.
                told = None if hook is None else (lambda _, p=p: hook(p))
                try:
                    out.append(hash_stable(name, StatKey.of(st), told, dir_fd=fd))
                except PermissionError:
                    out.append("")  # cannot be read by fsagent: refused below
            return out

        groups = [files[i : i + WORK_GROUP] for i in range(0, len(files), WORK_GROUP)]
        if len(groups) > 1 and self.threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dirscan")
            digests = [d for ds in self._pool.map(hash_group, groups) for d in ds]
        else:
            digests = [d for g in groups for d in hash_group(g)]
        for (p, _, st), digest in zip(files, digests, strict=True):
            if digest is None:
                self.unstable.add(p)
            elif digest == "":
                self.problems[p] = "unreadable"
            else:
                self.stats.hashed += 1
                self.stats.hashed_bytes += st.st_size
                entry = LocalEntry(
                    "file", st.st_dev, st.st_ino, st.st_size, st.st_mode,
                    st.st_mtime_ns, st.st_ctime_ns, Digest(digest), verified,
                )  # fmt: skip
                self.entries[p] = self.hashed[p] = entry
                if self.merged is not None:
                    self.merged[p] = entry

    # --- holding still ---------------------------------------------------------

    def moved(self) -> list[str]:
        """Directories whose stamp moved since they were listed, or that were
        listed within a tick of their last change (parents first)."""
        out = []
        for path, (dev, ino, mtime, ctime, listed_at) in self.stamps.items():
            try:
                st = os.stat(path or ".", dir_fd=self.root_fd, follow_symlinks=False)
            except OSError:
                out.append(path)
                continue
            now = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            if now != (dev, ino, mtime, ctime) or listed_at - max(mtime, ctime) < TICK_NS:
                out.append(path)  # changed, or listed too soon after a change to tell
        return sorted(out, key=lambda p: p.encode("utf-8", "surrogateescape"))

    def relist(self, path: str) -> None:
        """List one directory again. Its files and refusals are forgotten first;
        subdirectories listed before keep their subtree (their own stamps
        decide about it), new ones are walked. :meth:`prune` then drops what
        is no longer reachable."""
        if self.merged is None:
            self.merged = {**self.known, **self.hashed}
        for n in self.names.pop(path, []):
            p = f"{path}/{n}" if path else n
            self.problems.pop(p, None)
            self.unstable.discard(p)
            entry = self.entries.get(p)
            if entry is None or entry.kind != "directory":
                self.entries.pop(p, None)
        self.stamps.pop(path, None)
        try:
            if path:
                with parent_of(self.root_fd, path) as (pfd, name):
                    fd = os.open(name, DIR_FLAGS, dir_fd=pfd)
            else:
                fd = os.dup(self.root_fd)
        except OSError:
            return  # gone or replaced: its parent's listing says what is there now
        try:
            self.walk(path, fd, into_known=False)
        finally:
            os.close(fd)

    def prune(self) -> None:
        """Keep only what hangs off directories listed in this scan and still
        named by their parent's latest listing; a directory its parent names
        but this scan could not list again is unstable (its contents unknown)."""
        listed: set[str] = set()
        for d in sorted(self.stamps, key=lambda p: p.encode("utf-8", "surrogateescape")):
            head, _, name = d.rpartition("/")
            entry = self.entries.get(d)
            if d == "" or (
                head in listed
                and name in self.names.get(head, ())
                and entry is not None
                and entry.kind == "directory"
            ):
                listed.add(d)
        for d in [d for d in self.stamps if d not in listed]:
            del self.stamps[d]
            self.names.pop(d, None)

        def reachable(p: str) -> bool:
            return p.rpartition("/")[0] in listed

        self.entries = {p: e for p, e in self.entries.items() if reachable(p)}
        self.problems = {p: r for p, r in self.problems.items() if reachable(p)}
        self.unstable = {p for p in self.unstable if reachable(p)}
        for p, e in self.entries.items():
            if e.kind == "directory" and p not in listed:
                self.unstable.add(p)


ENTRY_LIMIT_ENV: Final = "FSAGENT_TEST_MAX_ENTRIES"
"""Lowers the entry limit a scan enforces (tests: 100,000 files are minutes of
hydration); never raises it, since the controller's limit is 100,000."""


def entry_limit() -> int:
    """The entries a collection may hold: :data:`MAX_ENTRIES`, or fewer where
    ``$FSAGENT_TEST_MAX_ENTRIES`` names a smaller positive number (any other
    value is ignored, so the limit can never be lifted by it)."""
    value = os.environ.get(ENTRY_LIMIT_ENV, "")
    return min(int(value), MAX_ENTRIES) if value.isdigit() and int(value) > 0 else MAX_ENTRIES


def scan_directory(
    root_fd: int,
    known: Mapping[str, LocalEntry],
    *,
    saved: Container[str] = frozenset(),
    path_rule: Callable[[str], str | None] = refusal_of_path,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_entries: int = MAX_ENTRIES,
    threads: int = HASH_THREADS,
    after_read: ReadHook | None = None,
) -> DirScan:
    """Scan the collection below ``root_fd`` (see the module doc).

    ``known`` is what the last scan recorded (path → entry): a file whose key
    matches a trusted record is not read. ``saved`` holds the paths the
    controller already has; over ``max_entries`` they keep their place.
    """
    started = time.monotonic()
    walk = _Walk(root_fd, known, path_rule, max_file_bytes, threads, after_read)
    try:
        top = os.dup(root_fd)
        try:
            walk.walk("", top)
        finally:
            os.close(top)
        moved = walk.moved()
        for _ in range(RELIST_ROUNDS):
            if not moved:
                break
            newest = max(max(walk.stamps[p][2], walk.stamps[p][3]) for p in moved)
            wait = newest + TICK_NS - time.time_ns()
            if wait > 0:  # changed within a tick of its listing: let the tick pass
                time.sleep(wait / 1e9)
            for path in moved:  # parents first
                if path in walk.stamps:  # not dropped with a parent listed again
                    walk.relist(path)
            walk.prune()
            moved = walk.moved()
    finally:
        walk.close()
    walk.unstable.update(moved)
    _admit(walk.entries, walk.problems, saved, max_entries)
    walk.stats.seconds = time.monotonic() - started
    return DirScan(walk.entries, walk.problems, walk.unstable, not moved, walk.stats)


def _admit(
    entries: dict[str, LocalEntry], problems: dict[str, str], saved: Container[str], limit: int
) -> None:
    """Refuse entries past ``limit``: saved paths keep their place, new ones are
    admitted in path order, and a refused directory takes its subtree along."""
    if len(entries) <= limit:
        return
    room = limit - sum(1 for p in entries if p in saved)
    refused: set[str] = set()
    for path in sorted(entries, key=lambda p: p.encode("utf-8")):
        if path in saved:
            continue
        head = path.rpartition("/")[0]
        if room > 0 and head not in refused:
            room -= 1
            continue
        refused.add(path)
        problems[path] = "entry_limit"
    for path in refused:
        del entries[path]


def shown_name(path: str) -> str:
    """A refused name as the controller may hear it: bytes that are not UTF-8
    as ``\\xNN`` and every other non-printable character escaped."""
    text = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def local_refusals(scan: DirScan) -> dict[str, object]:
    """The checkpoint body's ``localRefusals`` and ``localRefusedMore``
    (common/bridge.py): the first refused paths in path order with their code,
    and how many more. A path the controller's rules would not take under its
    code is counted, not listed, so it can never fail the save."""
    listed: list[dict[str, str]] = []
    more = 0
    for path, why in sorted(scan.problems.items()):
        code = why.partition(":")[0]
        if code == "invalid_name":
            path = shown_name(path)[:MAX_LOCAL_REFUSAL_PATH]
        elif refusal_of_path(path) is not None:
            code = ""
        if code not in LOCAL_REFUSAL_CODES or len(listed) >= MAX_LOCAL_REFUSALS:
            more += 1
        else:
            listed.append({"path": path, "code": code})
    return {"localRefusals": listed, "localRefusedMore": more}


def report(scan: DirScan, limit: int = 1000) -> dict[str, object]:
    """The scan as ``fsagent status`` and a flush reply show it: refused paths
    by name (the first ``limit``, with their count), the paths to retry, and
    the scan's figures. Names that are not UTF-8 are shown with escapes."""

    def shown(path: str) -> str:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")

    refused = [{"path": shown(p), "reason": r} for p, r in sorted(scan.problems.items())]
    retry = sorted(shown(p) for p in scan.unstable)
    return {
        "refused": refused[:limit],
        "refusedCount": len(refused),
        "retrying": retry[:limit],
        "retryingCount": len(retry),
        "stable": scan.stable,
        "scan": scan.stats.to_json(),
    }
