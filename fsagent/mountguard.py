"""A mountpoint that no daemon serves refuses writes; what landed there anyway is adopted.

When a FUSE daemon dies (``kill -9``, the OOM killer) its mount goes dead
(ENOTCONN) and the restart detaches it. From the detach until the new mount
is attached, which includes the restart's warm start, the mountpoint's path
names the plain directory underneath. A writer that keeps going after an
error (an agent retrying) creates files there; their ``fsync`` succeeds, on
the sandbox's own disk, and the new mount then hides them: acknowledged
writes, lost without a trace. (A writer that works through a descriptor of
the dead mount fails instead; one that opens by path does not.)

So the mountpoint directory itself is guarded before the mount and the guard
is never lifted by the daemon: as root it is immutable (``FS_IMMUTABLE_FL``:
root's writes fail with EPERM too), and it loses its write bits (EACCES for
everyone else). Mounted over, the guard is invisible; once nothing serves the
path, a write there fails loudly instead of vanishing.

The guard can only be set after the dead mount is detached, so a write can
still land in that moment, or before fsagent first ran: once the new mount
serves, :func:`adopt_strays` copies each regular file and directory found
underneath into the collection through the mount (it was written after the
daemon's last answer, so it is newer than the collection's copy, unless the
path was written again in the new mount since) and only then removes it from
underneath. Symbolic links and special files are left there
(a collection cannot hold them) and named in a warning.

``release`` removes the guard (for tests and for an owner who wants the
directory back: ``chattr -i`` and ``chmod u+w`` do the same).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

# FS_IOC_GETFLAGS / FS_IOC_SETFLAGS and FS_IMMUTABLE_FL from linux/fs.h.
_GETFLAGS: Final = 0x80086601
_SETFLAGS: Final = 0x40086602
_IMMUTABLE: Final = 0x10
_WRITE_BITS: Final = 0o222


def set_immutable(fd: int, on: bool) -> str | None:
    """Best effort, as root: mode bits do not stop root from writing, the
    immutable flag does. None when done, or when not root (nothing to do:
    the mode bits stop everyone else); else why a file system without the
    flag, or a runtime that withholds CAP_LINUX_IMMUTABLE, refused (the
    caller warns, since root's writes are no longer stopped)."""
    if os.geteuid() != 0:
        return None
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, _GETFLAGS, b"\0" * 4))[0]
        new = flags | _IMMUTABLE if on else flags & ~_IMMUTABLE
        if new != flags:
            fcntl.ioctl(fd, _SETFLAGS, struct.pack("i", new))
    except OSError as exc:
        if exc.errno not in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EPERM, errno.EINVAL):
            raise
        return exc.strerror or errno.errorcode.get(exc.errno or 0, "unsupported")
    return None


@dataclass
class MountGuard:
    """The guarded directory under one mountpoint, held open by descriptor
    (after the mount, its path names the mount's root instead)."""

    path: Path
    fd: int
    mode: int
    """The directory's permission bits before the guard took its write bits."""
    immutable: bool
    leftovers: list[str] = field(default_factory=list)
    """Entries underneath that could not be adopted (links, special files)."""

    @classmethod
    def take(cls, mountpoint: Path) -> MountGuard | None:
        """Guard ``mountpoint`` (an existing directory) until it is released;
        None when something is mounted there already (the mount then fails
        with its own message) or it cannot be opened."""
        if os.path.ismount(mountpoint):
            return None
        try:
            fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        guard = cls(mountpoint, fd, mode, immutable=False)
        guard.lock()
        return guard

    def lock(self) -> None:
        self.immutable = os.geteuid() == 0 and set_immutable(self.fd, True) is None
        # Another user's directory: its owner decides who writes there.
        with contextlib.suppress(PermissionError):
            os.fchmod(self.fd, self.mode & ~_WRITE_BITS)

    def unlock(self) -> None:
        set_immutable(self.fd, False)
        with contextlib.suppress(PermissionError):
            os.fchmod(self.fd, self.mode | 0o200)

    def open_for_mount(self) -> None:
        """Give the owner's write bit back for the moment of the mount:
        ``fusermount3`` (an unprivileged daemon's way to mount) refuses a
        mountpoint its user cannot write. Root mounts by itself and keeps the
        immutable flag throughout. :meth:`lock` once mounted."""
        if not self.immutable:
            with contextlib.suppress(PermissionError):
                os.fchmod(self.fd, self.mode | 0o200)

    def strays(self) -> list[str]:
        """Names in the directory underneath the mount."""
        return sorted(os.listdir(self.fd))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def adopt_strays(guard: MountGuard, mountpoint: Path) -> int:
    """Copy what lies underneath the (now served) mount into it, then remove
    it from underneath; returns the number of files adopted.

    Runs in a worker thread, never on the thread that serves the mount. A
    file is fsynced in the mount before its copy underneath goes, so at every
    moment one of the two holds it.
    """
    names = guard.strays()
    if not names:
        return 0
    adopted = 0
    done: list[str] = []
    for name in names:
        try:
            count = _adopt(guard.fd, name, mountpoint / name, guard.leftovers, name)
        except OSError as exc:
            guard.leftovers.append(f"{name} ({exc.strerror})")
            count = None
        if count is not None:
            adopted += count
            done.append(name)
    if done:
        guard.unlock()
        try:
            for name in done:
                _remove(guard.fd, name)
        finally:
            guard.lock()
    if guard.leftovers:
        log.warning(
            "%s: left underneath the mount (not a regular file or directory, or not copied): %s",
            guard.path,
            ", ".join(guard.leftovers[:20]),
        )
    return adopted


def _adopt(dir_fd: int, name: str, target: Path, leftovers: list[str], rel: str) -> int | None:
    """Copy ``name`` (below ``dir_fd``) to ``target`` in the mount; the number
    of files copied, or None when something below could not be (it stays)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISREG(st.st_mode):
        try:
            if target.stat().st_mtime_ns > st.st_mtime_ns:
                return 1  # written again in the mount since: the newer write wins
        except FileNotFoundError:
            pass
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            with open(src, "rb", closefd=False) as fin, open(target, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
                fout.flush()
                os.fsync(fout.fileno())
        finally:
            os.close(src)
        os.chmod(target, stat.S_IMODE(st.st_mode))
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        return 1
    if stat.S_ISDIR(st.st_mode):
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                      dir_fd=dir_fd)  # fmt: skip
        try:
            if not target.is_dir():
                target.mkdir()
            count: int | None = 0
            for child in sorted(os.listdir(sub)):
                got = _adopt(sub, child, target / child, leftovers, f"{rel}/{child}")
                count = None if got is None or count is None else count + got
            return count
        finally:
            os.close(sub)
    leftovers.append(rel)
    return None


def _remove(dir_fd: int, name: str) -> None:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        for child in os.listdir(sub):
            _remove(sub, child)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dir_fd)


def release(path: Path) -> None:
    """Lift the guard of an unmounted directory (its write bits back for its owner)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        set_immutable(fd, False)
        with_write = stat.S_IMODE(os.fstat(fd).st_mode) | 0o200
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, with_write)
    finally:
        os.close(fd)
