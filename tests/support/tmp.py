"""Private temp dirs, each removed by whoever made it.

Under pytest, ``tempfile.gettempdir()`` is the session's own temp root (see
:mod:`tests.support.session`). A dir made here while a fixture is being set up
belongs to that fixture and is removed after the fixture's own teardown; one
made while a test runs is removed after the test's teardown. Outside pytest
(the benchmarks) nobody claims the dirs and the caller removes them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from fsagent.mountguard import release

_claims: list[list[Path]] = []
"""The innermost active claim (a fixture's setup, a test's call) gets each new dir."""


def claim_begin() -> None:
    _claims.append([])


def claim_end() -> list[Path]:
    return _claims.pop() if _claims else []


def _claimed(d: Path) -> Path:
    if _claims:
        _claims[-1].append(d)
    return d


def private_tmpdir(prefix: str) -> Path:
    """A fresh dir under the current temp root, short enough for unix socket paths."""
    return _claimed(Path(tempfile.mkdtemp(prefix=prefix)))


def world_searchable_tmpdir(prefix: str) -> Path:
    """A temp dir the postgres user can reach when tests run as root."""
    d = private_tmpdir(prefix)
    os.chmod(d, 0o711)
    return d


def mount_entries(root: Path) -> list[tuple[str, str, int]]:
    """(mount point, file system type, device minor) of each mount (alive or
    dead) below ``root``, from this process's mount table. For a FUSE mount
    the minor is its connection's number under /sys/fs/fuse/connections."""
    prefix = str(root) + "/"
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            if point.startswith(prefix):
                fstype = fields[fields.index("-") + 1]
                found.append((point, fstype, int(fields[2].split(":")[1])))
    return found


def mounts_under(root: Path) -> list[str]:
    """Mount points (alive or dead) below ``root``."""
    return [point for point, _, _ in mount_entries(root)]


def remove_tree(root: Path) -> None:
    """Detach any mount left below ``root`` (never recurse into a live one), then delete it."""
    if not root.exists():
        return
    for point in sorted(mounts_under(root), reverse=True):
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True, check=False)
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    shutil.rmtree(root, onerror=_unguard_and_retry)


def _unguard_and_retry(func: Any, path: str, exc_info: Any) -> None:
    """A guarded mountpoint (fsagent.mountguard: immutable, no write bits)
    refuses its removal: lift the guard and try once more; anything else
    that cannot be removed stays, and the session's check reports it."""
    if not isinstance(exc_info[1], PermissionError):
        return
    with contextlib.suppress(OSError):
        release(Path(path))
        if func in (os.rmdir, os.unlink):
            func(path)
