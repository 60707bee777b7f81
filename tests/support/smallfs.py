"""A small real filesystem that can be filled up: a size-limited tmpfs mounted
on a private temp dir (needs root, as the FUSE tests do).

``fill(path)`` writes until the kernel answers ENOSPC, so the disk is full
for every later write (until ``free_fill`` removes the ballast).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.support.tmp import private_tmpdir

BALLAST = ".ballast"


@contextlib.contextmanager
def small_tmpfs(
    size: str = "64m", inodes: int = 8192, prefix: str = "fsa-small-"
) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes and ``inodes`` inodes mounted on a fresh dir,
    unmounted and removed afterwards."""
    where = private_tmpdir(prefix)
    options = f"size={size},nr_inodes={inodes},mode=0755"
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
        check=True,
        capture_output=True,
    )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


def fill(root: Path) -> int:
    """Write ballast files under ``root`` until the filesystem is full; the bytes written.

    Big writes first, then smaller ones, then inodes of empty files, so no
    block and no inode a later write could take is left."""
    written = 0
    ballast = root / BALLAST
    ballast.mkdir(exist_ok=True)
    for n, chunk in enumerate((1 << 20, 4096, 1)):
        block = b"\xa5" * chunk
        try:
            with open(ballast / f"fill-{n}", "wb", buffering=0) as fh:
                while True:
                    written += fh.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    # Empty files take inodes (tmpfs: nr_inodes bounds them): tens of
    # thousands, made relative to the directory's descriptor (a third of the
    # time Path.touch takes for each).
    dir_fd = os.open(ballast, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i in range(10_000_000):
            try:
                os.close(os.open(f"i{i}", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o666,
                                 dir_fd=dir_fd))  # fmt: skip
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(dir_fd)
    return written


def assert_full(root: Path) -> None:
    """A new one-byte file cannot be written under ``root``."""
    probe = root / BALLAST / "probe"
    try:
        with open(probe, "wb", buffering=0) as fh:
            fh.write(b"x")
            os.fsync(fh.fileno())
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        return
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    raise AssertionError(f"{root} is not full")


def free_fill(root: Path) -> None:
    shutil.rmtree(root / BALLAST, ignore_errors=True)
