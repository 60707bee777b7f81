"""fsagent's pyfuse3 patch (packaging/pyfuse3), on real mounts of a request-logging file system.

The probe (tests/support/pyfuse3_probe.py) runs with the patched pyfuse3 and
logs every request it answers; each test cuts the log at marker lookups and
checks which requests each step caused and what the handlers were given.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.constants import REPO
from tests.support.mount import in_mount_table
from tests.support.pyfuse3_patch import patched_pyfuse3_env
from tests.support.tmp import private_tmpdir

pytestmark = pytest.mark.fuse


class Probe:
    """One mounted probe and its request log."""

    def __init__(self, *flags: str) -> None:
        self.dir = private_tmpdir("fsa-probe-")
        self.mountpoint = self.dir / "mnt"
        self.mountpoint.mkdir()
        self.log_path = self.dir / "requests.log"
        self.log_path.touch()
        self.stderr = open(self.dir / "stderr", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.pyfuse3_probe", str(self.mountpoint),
             str(self.log_path), *flags],
            cwd=REPO, env=patched_pyfuse3_env(), stdout=self.stderr, stderr=self.stderr,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"probe did not mount: {(self.dir / 'stderr').read_text()}")
            time.sleep(0.02)
        self.marks = 0

    def step(self, fn: Any) -> list[list[Any]]:
        """Run ``fn`` and return the requests it caused (between two marker lookups)."""
        self._mark()
        fn()
        self._mark()
        entries = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        cuts = [i for i, e in enumerate(entries) if e[0] == "lookup" and e[2].startswith("MARK")]
        return entries[cuts[-2] + 1 : cuts[-1]]

    def _mark(self) -> None:
        self.marks += 1
        with pytest.raises(FileNotFoundError):
            os.stat(self.mountpoint / f"MARK{self.marks}")

    def ticks(self) -> int:
        with pytest.raises(FileNotFoundError):
            os.stat(self.mountpoint / "TICKS")
        entries = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        return int(next(e[1] for e in reversed(entries) if e[0] == "ticks"))

    def stop(self) -> None:
        if in_mount_table(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


@pytest.fixture
def probe() -> Iterator[Probe]:
    p = Probe()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def probe_with_open() -> Iterator[Probe]:
    p = Probe("--with-open")
    try:
        yield p
    finally:
        p.stop()


_libc = ctypes.CDLL(None, use_errno=True)
AT_STATX_FORCE_SYNC = 0x2000
STATX_SIZE = 0x200


def statx_size_from_daemon(path: Path) -> int:
    """st_size by statx(AT_STATX_FORCE_SYNC): always a GETATTR to the file system."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statx(-100, os.fsencode(path), AT_STATX_FORCE_SYNC, STATX_SIZE, buf) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(path))
    return int(struct.unpack_from("<Q", buf, 40)[0])  # struct statx: stx_size


def ops(entries: list[list[Any]]) -> list[str]:
    return [e[0] for e in entries]


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def read_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_without_an_open_handler_files_are_read_and_written_by_inode(probe: Probe) -> None:
    f = probe.mountpoint / "a"
    created = probe.step(lambda: write_file(f, b"hello world"))
    assert ops(created)[:3] == ["lookup", "create", "write"], created
    ino = created[1][1]
    assert created[2][1] == 1000 + ino  # create's own handle is passed as it is
    assert ["release", 1000 + ino, None] in created

    # Opening a cached file costs no request at all, and its data stays cached.
    assert probe.step(lambda: read_file(f) == b"hello world") == []
    for _ in range(3):
        assert probe.step(lambda: read_file(f)) == []
    assert read_file(f) == b"hello world"

    # Read and written through a file the kernel opened itself: the inode
    # stands in for the handle; no OPEN, no RELEASE.
    drop_cache(f)
    got: list[bytes] = []
    reread = probe.step(lambda: got.append(read_file(f)))
    assert got == [b"hello world"]
    assert ops(reread) == ["read"] and reread[0][1] == ino, reread

    def rewrite() -> None:
        with open(f, "r+b") as fh:
            fh.write(b"J")
            fh.flush()
            os.fsync(fh.fileno())

    written = probe.step(rewrite)
    assert ["write", ino, 0] in written and ["fsync", ino, None] in written, written
    assert not {"open", "release"} & set(ops(written)), written


def test_without_an_open_handler_o_trunc_arrives_as_a_setattr(probe: Probe) -> None:
    f = probe.mountpoint / "t"
    created = probe.step(lambda: write_file(f, b"0123456789"))
    ino = created[1][1]
    truncated = probe.step(lambda: os.close(os.open(f, os.O_WRONLY | os.O_TRUNC)))
    assert ["setattr", ino, 0] in truncated, truncated
    assert os.stat(f).st_size == 0
    drop_cache(f)
    assert read_file(f) == b""
    write_file(f, b"xy")
    drop_cache(f)
    assert read_file(f) == b"xy"  # nothing of the old bytes came back


def test_without_an_opendir_handler_listings_come_by_inode_and_stay_cached(probe: Probe) -> None:
    for name in ("b", "a", "c"):
        write_file(probe.mountpoint / name, name.encode())
    listed: list[list[str]] = []
    first = probe.step(lambda: listed.append(sorted(os.listdir(probe.mountpoint))))
    assert listed == [["a", "b", "c"]]
    assert "readdir" in ops(first) and "opendir" not in ops(first), first
    assert {e[1] for e in first if e[0] == "readdir"} == {1}  # the root's inode
    assert "releasedir" not in ops(probe.step(lambda: os.listdir(probe.mountpoint)))
    again = probe.step(lambda: listed.append(sorted(os.listdir(probe.mountpoint))))
    assert "readdir" not in ops(again), again  # served from the kernel's cache
    # A change to the directory drops the cached listing.
    write_file(probe.mountpoint / "d", b"d")
    changed = probe.step(lambda: listed.append(sorted(os.listdir(probe.mountpoint))))
    assert "readdir" in ops(changed)
    assert listed[-1] == ["a", "b", "c", "d"]


def test_with_open_handlers_every_open_still_goes_to_the_file_system(
    probe_with_open: Probe,
) -> None:
    p = probe_with_open
    f = p.mountpoint / "a"
    write_file(f, b"0123456789")
    for _ in range(2):
        reopened = p.step(lambda: read_file(f))
        assert ops(reopened)[0] == "open", reopened
        assert ops(reopened)[-1] == "release" and reopened[-1][1] > 1000, reopened
    truncated = p.step(lambda: os.close(os.open(f, os.O_WRONLY | os.O_TRUNC)))
    # Atomic O_TRUNC: the truncation is the open's own business, no SETATTR.
    assert ops(truncated)[0] == "open" and truncated[0][2] & os.O_TRUNC, truncated
    listed = p.step(lambda: os.listdir(p.mountpoint))
    assert ops(listed)[0] == "opendir" and "releasedir" in ops(listed), listed
    assert all(e[1] > 5000 for e in listed if e[0] in ("readdir", "releasedir")), listed


@pytest.mark.parametrize("awaiting", [False, True], ids=["at-once", "awaiting"])
def test_requests_back_to_back_from_many_threads_leave_other_tasks_running(
    awaiting: bool,
) -> None:
    """Many clients at once keep requests queued, so the session loop serves
    them back to back (the fast path); every answer is right, handlers that
    wait on the event loop finish, and a background task keeps its turns."""
    p = Probe(*(["--awaiting"] if awaiting else []))
    try:
        for i in range(8):
            write_file(p.mountpoint / f"f{i}", b"x" * (i + 1))
        before = p.ticks()
        errors: list[BaseException] = []

        def hammer(i: int) -> None:
            try:
                for _ in range(400):
                    assert statx_size_from_daemon(p.mountpoint / f"f{i}") == i + 1
                    with pytest.raises(FileNotFoundError):
                        os.stat(p.mountpoint / f"missing{i}")  # ENOENT is not cached
            except BaseException as exc:
                errors.append(exc)

        started = time.monotonic()
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - started
        assert not errors, errors
        ticked = p.ticks() - before
        # The ticker wakes once a millisecond when it gets to run; it must have
        # run throughout, not only once the requests stopped.
        assert ticked >= min(20, took * 1000 / 10), (ticked, took)
    finally:
        p.stop()
