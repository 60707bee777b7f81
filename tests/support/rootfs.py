"""Debian rootfs trees built once and kept in a cache directory a test owns.

A tree is named ``KIND-KEY``, KEY a hash of its recipe (:func:`digest`): it is
built when missing, under the cache's lock, into a temporary name renamed into
place when complete, and the older keys of the same kind are removed. The
sandbox boot test keeps its minimal rootfs and wheels this way
(tests/system/test_sandbox_boot.py), the container image test the rootfs of its
local Python base image (:mod:`tests.support.container`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


def digest(*paths: Path, extra: str = "") -> str:
    """A short hash of files' bytes and ``extra``: the key of what they build."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def cache_lock(cache: Path) -> Iterator[None]:
    """``cache`` (created root-only) held exclusively: one builder at a time,
    across processes and test sessions."""
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def cached(cache: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``cache/name``, built by ``build(tmp_dir)`` when missing; older keys of
    the same kind (the part of ``name`` before its first ``-``) are removed."""
    kind = name.split("-", 1)[0]
    target = cache / name
    with cache_lock(cache):
        if not target.exists():
            tmp = cache / f".{name}.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                build(tmp)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        for old in cache.glob(f"{kind}-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    return target
