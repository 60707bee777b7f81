"""How many of a file's pages are dirty in the page cache (``cachestat``, Linux 6.5+)."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

_NR_CACHESTAT = 451  # the same number on x86-64 and arm64
_libc = ctypes.CDLL(None, use_errno=True)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")
    ]


def dirty_pages(path: Path) -> int:
    """Pages of ``path`` dirty in the page cache and not yet being written back.
    Skips the test on a kernel without ``cachestat``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        whole, out = _Range(0, 0), _Stat()
        if _libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(whole), ctypes.byref(out), 0) != 0:
            code = ctypes.get_errno()
            if code == errno.ENOSYS:
                pytest.skip("this kernel has no cachestat (Linux 6.5+)")
            raise OSError(code, os.strerror(code))
        return int(out.dirty)
    finally:
        os.close(fd)
