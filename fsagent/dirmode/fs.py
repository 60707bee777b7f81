"""A plain-directory collection's files, reached only through pinned descriptors.

In dir mode the agent owns the directory and may put anything in it,
symbolic links included, while fsagent may run as another (stronger) user.
So no path below the collection is ever resolved by the kernel from its
text: the root is opened once (``O_NOFOLLOW``) and kept open, and every
other directory is reached from it one name at a time with ``O_NOFOLLOW |
O_DIRECTORY``. A symbolic link swapped in for a directory on the way fails
with ``ELOOP`` or ``ENOTDIR`` instead of leading out of the collection, so
fsagent never reads, writes or removes anything outside it on the agent's
say-so: it pins parent directory descriptors and uses no-follow opens.

Writes (hydration and the server's changes at a warm start) happen while no
agent runs; a file is placed whole, by a rename, so a crash leaves the old
file or the new one (copies are staged in fsagent's reserved ``.fsagent``
directory at the root).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Final

from common.limits import RESERVED_SEGMENT
from fsagent.scan.engine import OPEN_FLAGS, StatKey

DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
COPY_CHUNK: Final = 1 << 20
STAGING: Final = RESERVED_SEGMENT
"""fsagent's own directory at the collection's root while it places files (the
name is reserved for fsagent's runtime): a copy is written there under
a name of its own, then renamed into place. No saved path can have this name,
so what a crash leaves there is refused by the next scan (reported, never
saved) and removed when placing starts again."""


class NotInCollection(OSError):
    """A path's parent is not a directory of the collection (a symbolic link,
    a file, or gone): nothing below it can be reached."""


def open_root(path: Path) -> int:
    """The collection's root, pinned: a symbolic link there is refused."""
    return os.open(path, DIR_FLAGS)


@contextlib.contextmanager
def parent_of(root_fd: int, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """(descriptor of the directory holding ``path``, its last name), reached
    name by name from ``root_fd``; ``create`` makes missing directories (0o755).

    Raises :class:`NotInCollection` when a component is not a directory.
    """
    *dirs, name = path.split("/")
    fd = root_fd
    try:
        for part in dirs:
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                child = _open_dir(fd, part, path)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotInCollection(exc.errno, f"{part!r} is not a directory", path) from None
                raise
            if fd != root_fd:
                os.close(fd)
            fd = child
        yield fd, name
    finally:
        if fd != root_fd:
            os.close(fd)


def _open_dir(fd: int, name: str, path: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotInCollection(exc.errno, f"{name!r} is not a directory", path) from None
        raise


def lstat_at(root_fd: int, path: str) -> os.stat_result:
    """``lstat`` of ``path`` below the root (FileNotFoundError when it or a
    parent is gone or not a directory)."""
    try:
        with parent_of(root_fd, path) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except NotInCollection:
        raise FileNotFoundError(errno.ENOENT, "not in the collection", path) from None


def open_scanned(root_fd: int, path: str, key: StatKey) -> BinaryIO:
    """Open a file for reading if it is still exactly the file a scan saw
    (same ``lstat`` key); FileNotFoundError otherwise (it changed: the next
    scan looks again)."""
    try:
        with parent_of(root_fd, path) as (dfd, name):
            fd = os.open(name, OPEN_FLAGS, dir_fd=dfd)
    except NotInCollection:
        raise FileNotFoundError(errno.ENOENT, "not in the collection", path) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
            raise FileNotFoundError(errno.ENOENT, "no longer a regular file", path) from None
        raise
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or StatKey.of(opened) != key:
            raise FileNotFoundError(errno.ENOENT, "changed since the scan", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def staging(root_fd: int) -> Iterator[int]:
    """fsagent's staging directory (:data:`STAGING`), new and empty for one
    session of placing files; removed at the end."""
    remove_path(root_fd, STAGING)  # a crash's leftover: never anything saved
    os.mkdir(STAGING, 0o700, dir_fd=root_fd)
    fd = os.open(STAGING, DIR_FLAGS, dir_fd=root_fd)
    try:
        yield fd
    finally:
        os.close(fd)
        remove_path(root_fd, STAGING)


def place_file(
    root_fd: int,
    path: str,
    source: Path,
    executable: bool,
    *,
    keep_source: bool,
    staging_fd: int,
) -> os.stat_result:
    """Put the contents of ``source`` (a verified file in the state dir) at
    ``path``, replacing a file or link there; returns the placed file's lstat.

    The source is renamed into place when it need not be kept and is on the
    collection's filesystem; otherwise it is copied into the staging
    directory (:func:`staging`) under a name of its own and that copy is
    renamed into place. Missing parent directories are created. A directory
    at ``path`` is left to the caller (it may hold unsaved work).
    """
    mode = 0o755 if executable else 0o644
    with parent_of(root_fd, path, create=True) as (dfd, name):
        if not keep_source:
            os.chmod(source, mode)
            try:
                os.rename(source, name, dst_dir_fd=dfd)
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
        tmp = secrets.token_hex(8)
        out = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
            dir_fd=staging_fd,
        )  # fmt: skip
        try:
            with open(source, "rb") as src:
                while chunk := src.read(COPY_CHUNK):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view) :]
            os.fchmod(out, mode)  # the umask may have narrowed the create mode
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=staging_fd)
            raise
        os.close(out)
        os.rename(tmp, name, src_dir_fd=staging_fd, dst_dir_fd=dfd)
        if not keep_source:
            source.unlink(missing_ok=True)
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)


def make_directory(root_fd: int, path: str) -> os.stat_result:
    """A directory at ``path`` (and its parents); an existing one is kept.
    FileExistsError when something else is there."""
    with parent_of(root_fd, path, create=True) as (dfd, name):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=dfd)
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise FileExistsError(errno.EEXIST, "not a directory", path)
        return st


def remove_path(root_fd: int, path: str) -> None:
    """Remove what is at ``path`` (a directory with everything below it) without
    following any link; nothing there is fine."""
    try:
        with parent_of(root_fd, path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(
                    name, dir_fd=dfd
                )  # fd-based on Linux: links are removed, not followed
            else:
                os.unlink(name, dir_fd=dfd)
    except (FileNotFoundError, NotInCollection):
        return


def is_empty(root_fd: int) -> bool:
    with os.scandir(root_fd) as it:
        return next(it, None) is None


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(fd: int) -> None:
    """syncfs(2) of the filesystem holding ``fd``: one call makes every placed
    file durable (cheaper than an fsync per file of a large hydration)."""
    if _libc.syncfs(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
