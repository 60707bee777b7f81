"""The boundary of every FUSE handler: errno mapping, names, attributes, the request spinner."""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final, ParamSpec, TypeVar

import pyfuse3
import trio

from common.errors import InvalidPath
from common.limits import MAX_COMPONENT_BYTES
from common.paths import decode_fs_name
from fsagent.fuse import stats
from fsagent.state.records import Inode

log = logging.getLogger("fsagent.fs")

TIMEOUT: Final = 3600.0
"""Entry/attr cache lifetime: nobody but this daemon changes the tree during a run."""
BLKSIZE: Final = 128 * 1024

_P = ParamSpec("_P")
_R = TypeVar("_R")

# OSError numbers that mean something to the caller and pass through as-is;
# anything else from the local disk is an internal failure (EIO).
_PASS_THROUGH: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class Spinner:
    """Keep the trio loop polling for a short window after each request.

    A round trip to the daemon costs two wake-ups: the daemon's when the
    request arrives and the caller's when the reply does.  On virtual machines
    an idle vCPU halts, and waking it costs tens of microseconds, more than
    most handlers.  Agents often issue requests back to back (a ``git status``
    stats every file), so after a request the loop keeps polling /dev/fuse
    for a while before it sleeps: the next request is picked up at once.

    The window adapts, like the kernel's guest halt-polling: when a request
    arrives after the window ended but within ``max_ns`` of the previous one,
    a longer window would have caught it, so it doubles (up to ``max_ns``);
    when requests are further apart than ``max_ns``, polling is wasted CPU,
    so it halves, down to nothing.  ``max_ns=0`` disables polling.
    """

    GROW_START_NS: Final = 25_000

    def __init__(self, max_ns: int) -> None:
        self.max_ns = max_ns
        self.window_ns = max_ns
        self._last = 0
        self._wake = trio.Event()

    def poke(self) -> None:
        now = time.perf_counter_ns()
        idle = now - self._last
        if idle > self.window_ns:  # the loop had gone to sleep
            if idle <= self.max_ns:
                self.window_ns = min(self.max_ns, max(2 * self.window_ns, self.GROW_START_NS))
            else:
                self.window_ns //= 2
                if self.window_ns < self.GROW_START_NS:
                    self.window_ns = 0
        self._last = now
        if not self._wake.is_set():
            self._wake.set()

    async def run(self) -> None:
        if self.max_ns <= 0:
            return
        clock = time.perf_counter_ns
        checkpoint = trio.lowlevel.checkpoint
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while clock() - self._last < self.window_ns:
                await checkpoint()


def fuse_boundary(
    fn: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """Let only FUSEError out of a handler: log anything else once, answer EIO."""

    @functools.wraps(fn)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        args[0].spinner.poke()  # type: ignore[attr-defined]
        started = stats.now_ns()
        failed = True
        try:
            result = await fn(*args, **kwargs)
            failed = False
            return result
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            if exc.errno in _PASS_THROUGH:
                raise pyfuse3.FUSEError(exc.errno) from None
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            stats.FUSE.record(fn.__name__, stats.now_ns() - started, failed)

    return wrapper


def fuse_err(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)


def name_errno(exc: InvalidPath) -> int:
    if exc.reason == "reserved_segment":
        return errno.EPERM
    if exc.reason == "segment_too_long":
        return errno.ENAMETOOLONG
    return errno.EINVAL


def entry_attributes(inode: Inode, readonly: bool, nlink: int) -> pyfuse3.EntryAttributes:
    """What the kernel is told about ``inode`` (cached for ``TIMEOUT``).

    Owner, group and the full mode (setuid, setgid, sticky) are the inode's
    own; with ``default_permissions`` the kernel checks access against them.
    A read-only mount shows no write bits.  ``nlink``: Tree.nlink.
    """
    a = pyfuse3.EntryAttributes()
    a.st_ino = inode.ino
    a.generation = 0
    a.entry_timeout = TIMEOUT
    a.attr_timeout = TIMEOUT
    kind_bits = stat.S_IFDIR if inode.kind == "directory" else stat.S_IFREG
    mode = inode.mode & (0o7555 if readonly else 0o7777)
    a.st_mode = kind_bits | mode
    a.st_nlink = nlink
    a.st_uid = inode.uid
    a.st_gid = inode.gid
    a.st_rdev = 0
    a.st_size = inode.size
    a.st_blksize = BLKSIZE
    a.st_blocks = (inode.size + 511) // 512
    a.st_atime_ns = inode.atime_ns
    a.st_mtime_ns = inode.mtime_ns
    a.st_ctime_ns = inode.ctime_ns
    return a


def drop_kernel_entry(parent: int, name: bytes) -> None:
    """Make the kernel drop its directory entry ``name`` in ``parent``: once
    nothing holds the file open it forgets the inode, and the next lookup
    takes the file's size and bytes from us.

    Not the file's pages (``invalidate_inode``): that waits for pages under
    writeback, that is for our answers to WRITEs, and a daemon killed
    meanwhile leaves the thread in the kernel unkillable, holding the FUSE
    device open, so the mount's requests are never aborted. Dropping an entry
    waits only for requests in flight on ``parent`` (a lookup, a create), and
    only while they are served. Blocks: call it from a worker thread while the
    mount serves. An entry the kernel does not know (ENOENT) needs nothing;
    another failure is logged, since nothing waits for the outcome.
    """
    try:
        pyfuse3.invalidate_entry(pyfuse3.InodeT(parent), pyfuse3.FileNameT(name))
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.error("the kernel kept its entry %r in directory %d: %s", name, parent, exc)


def kill_suid(mode: int) -> int:
    """``mode`` without setuid, and without setgid when group exec is set (a
    setgid bit without group exec means mandatory locking, which Linux keeps)."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


def set_metadata(
    node: Inode, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields
) -> list[str]:
    """Apply a SETATTR's mode, owner and times to ``node``; the journal
    operations among them (an owner exec bit change, an mtime)."""
    ops: list[str] = []
    if fields.update_mode:
        executable = node.executable
        node.mode = attr.st_mode & 0o7777
        if node.executable != executable:
            ops.append("chmod")
    elif (fields.update_uid or fields.update_gid) and node.kind == "file":
        node.mode = kill_suid(node.mode)
    if fields.update_uid:
        node.uid = attr.st_uid
    if fields.update_gid:
        node.gid = attr.st_gid
    if fields.update_atime:
        node.atime_ns = attr.st_atime_ns
    if fields.update_mtime:
        node.mtime_ns = attr.st_mtime_ns
        ops.append("utimens")
    return ops


def statfs_reply(vfs: os.statvfs_result, readonly: bool, used: int) -> pyfuse3.StatvfsData:
    """STATFS: the state dir's disk (``vfs``); nothing free on a read-only mount."""
    out = pyfuse3.StatvfsData()
    out.f_bsize = vfs.f_bsize
    out.f_frsize = vfs.f_frsize
    out.f_blocks = vfs.f_blocks
    out.f_bfree = 0 if readonly else vfs.f_bfree
    out.f_bavail = 0 if readonly else vfs.f_bavail
    out.f_files = max(vfs.f_files, used)
    out.f_ffree = 0 if readonly else max(vfs.f_ffree, 0)
    out.f_favail = out.f_ffree
    out.f_namemax = MAX_COMPONENT_BYTES
    return out


def existing_name(raw: bytes) -> str:
    """Decode a name that must already exist (invalid names cannot)."""
    try:
        return decode_fs_name(raw)
    except InvalidPath as exc:
        raise fuse_err(
            errno.ENAMETOOLONG if len(raw) > MAX_COMPONENT_BYTES else errno.ENOENT
        ) from exc
