"""File contents on the state dir's disk: saved objects, inline contents and
``upper/<inode>``.

Reads of unchanged files come from ``objects/<digest>`` (fetched on first
open); the first write copies the file to the upper layer (a truncation to
zero copies nothing) and from then on the upper copy is the content.  The
upper copy of a file of at most ``INLINE_MAX`` bytes lives in the store's
``inline`` table: creating, writing and removing one is a single LMDB commit,
with no file created or deleted on the disk (on ext4 an inode allocation can
take a millisecond).  A larger one is ``upper/<inode>``, and a file moves
there once it grows past the limit.  This module is the only one that knows
the ``upper/`` layout (:class:`UpperFiles`); the open files of a mount and
their copy-on-write are :mod:`fsagent.fuse.content`'s.

After a crash the size of an upper file is recovered from the file itself,
which is always exactly as long as the logical file (fsagent.state.tree,
``recover``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Final

from fsagent.state.records import InodeNo

INLINE_MAX: Final = 64 * 1024


class UpperFiles:
    """``upper/<inode>``: the copy-on-write contents of changed files over ``INLINE_MAX``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, ino: int) -> Path:
        return self.directory / str(ino)

    def open_rw(self, ino: int) -> int:
        return os.open(self.path(ino), os.O_RDWR | os.O_CLOEXEC)

    def open_read(self, ino: int) -> BinaryIO:
        return open(self.path(ino), "rb")

    def write_complete(self, ino: int, fill: Callable[[Path], object]) -> None:
        """Create ``upper/<ino>`` complete or not at all: ``fill`` writes a temp
        name that is renamed into place (on ENOSPC and friends no half copy stays)."""
        tmp = self.directory / f"{ino}.tmp"
        try:
            fill(tmp)
            os.replace(tmp, self.path(ino))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def truncate(self, ino: int, size: int) -> None:
        os.truncate(self.path(ino), size)

    def sync_directory(self) -> None:
        """Make the names in ``upper/`` durable: each file got its name by a rename."""
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, ino: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(ino))

    def sizes(self) -> dict[InodeNo, int]:
        """Length of every upper file (recovery: the length is the file's size)."""
        out: dict[InodeNo, int] = {}
        for name in os.listdir(self.directory):
            if name.isdigit():
                with contextlib.suppress(FileNotFoundError):
                    out[InodeNo(int(name))] = os.stat(self.directory / name).st_size
        return out

    def remove_all_but(self, keep: set[InodeNo]) -> None:
        """Remove every upper file (and temp copy cut short) not in ``keep``."""
        for name in os.listdir(self.directory):
            if not (name.isdigit() and InodeNo(int(name)) in keep):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / name)
