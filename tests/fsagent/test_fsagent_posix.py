"""POSIX behaviour agents rely on, on a real mount; refusals; the journal's change set."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.mount import FsagentMount, MountFactory

pytestmark = pytest.mark.fuse


@pytest.fixture
def mounts(mounts_in_both_modes: MountFactory) -> MountFactory:
    """Every test here runs in both of fsagent's FUSE modes."""
    return mounts_in_both_modes


def expect_errno(code: int, fn: object, *args: object) -> None:
    with pytest.raises(OSError) as info:
        fn(*args)  # type: ignore[operator]
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {info.value!r}"


def test_create_read_write_roundtrip_and_journal(mnt: FsagentMount) -> None:
    p = mnt.mountpoint / "hello.txt"
    p.write_bytes(b"hello world")
    assert p.read_bytes() == b"hello world"
    st = p.stat()
    assert stat.S_ISREG(st.st_mode) and st.st_size == 11
    changes = mnt.changes()
    assert changes["hello.txt"]["action"] == "upload"
    assert changes["hello.txt"]["size"] == 11


def test_unlink_while_open_keeps_file_readable(mnt: FsagentMount) -> None:
    p = mnt.mountpoint / "doomed"
    p.write_bytes(b"still here")
    fd = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        assert not p.exists()
        assert os.pread(fd, 100, 0) == b"still here"
        os.pwrite(fd, b"STILL", 0)
        assert os.pread(fd, 100, 0) == b"STILL here"
        assert os.fstat(fd).st_size == 10
    finally:
        os.close(fd)
    assert "doomed" not in os.listdir(mnt.mountpoint)
    # Created and deleted between checkpoints: nothing to ship.
    assert "doomed" not in mnt.changes()
    assert os.listdir(mnt.state_dir / "upper") == []


def test_rename_over_existing_is_atomic_replace(mnt: FsagentMount) -> None:
    a, b = mnt.mountpoint / "a", mnt.mountpoint / "b"
    a.write_bytes(b"new")
    b.write_bytes(b"old")
    fd = os.open(b, os.O_RDONLY)
    try:
        os.rename(a, b)
        assert b.read_bytes() == b"new"
        assert not a.exists()
        assert os.pread(fd, 10, 0) == b"old"  # the replaced file lives on while open
    finally:
        os.close(fd)
    os.mkdir(mnt.mountpoint / "d1")
    os.mkdir(mnt.mountpoint / "d2")
    (mnt.mountpoint / "d2" / "x").write_bytes(b"x")
    expect_errno(errno.ENOTEMPTY, os.rename, mnt.mountpoint / "d1", mnt.mountpoint / "d2")
    expect_errno(errno.EISDIR, os.rename, b, mnt.mountpoint / "d1")
    expect_errno(errno.ENOTDIR, os.rename, mnt.mountpoint / "d1", b)
    expect_errno(errno.EINVAL, os.rename, mnt.mountpoint / "d2", mnt.mountpoint / "d2" / "sub")
    os.rename(mnt.mountpoint / "d2", mnt.mountpoint / "d1")
    assert os.listdir(mnt.mountpoint / "d1") == ["x"]


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def renameat2(old: object, new: object, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD = -100
    res = libc.renameat2(AT_FDCWD, os.fsencode(str(old)), AT_FDCWD, os.fsencode(str(new)), flags)
    if res != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def test_renameat2_noreplace_and_exchange(mnt: FsagentMount) -> None:
    a, b = mnt.mountpoint / "a", mnt.mountpoint / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    expect_errno(errno.EEXIST, renameat2, a, b, RENAME_NOREPLACE)
    renameat2(a, b, RENAME_EXCHANGE)
    assert a.read_bytes() == b"B" and b.read_bytes() == b"A"
    expect_errno(errno.ENOENT, renameat2, a, mnt.mountpoint / "c", RENAME_EXCHANGE)
    renameat2(a, mnt.mountpoint / "c", RENAME_NOREPLACE)
    assert (mnt.mountpoint / "c").read_bytes() == b"B" and not a.exists()


def test_directory_link_count_is_two_plus_its_subdirectories(mounts: MountFactory) -> None:
    """As on ext4: find and fts rely on it to know when a directory has no
    more subdirectories; a count too low would make them skip some."""
    m = mounts.mount()
    top, other = m.mountpoint / "top", m.mountpoint / "other"
    top.mkdir()
    other.mkdir()

    def nlink(p: Path) -> int:
        return os.stat(p).st_nlink

    assert nlink(top) == 2
    for d in ("a", "b", "c"):
        (top / d).mkdir()
    (top / "f").write_bytes(b"x")
    (top / "a" / "deep").mkdir()
    assert (nlink(top), nlink(top / "a"), nlink(top / "f")) == (5, 3, 1)
    root_links = nlink(m.mountpoint)
    assert root_links == 4  # top and other
    os.rename(top / "a", other / "a")  # a directory changes parents
    assert (nlink(top), nlink(other)) == (4, 3)
    os.rename(top / "c", top / "b")  # replaces the empty b
    assert nlink(top) == 3
    renameat2(other / "a", top / "f", RENAME_EXCHANGE)  # a directory swaps with a file
    assert (nlink(top), nlink(other)) == (4, 2)
    assert nlink(other / "a") == 1 and nlink(top / "f") == 3
    os.rmdir(top / "b")
    assert nlink(top) == 3
    held = os.open(top / "f" / "deep", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(top / "f" / "deep")
        assert os.fstat(held).st_nlink == 0  # removed while open, as on Linux
        assert nlink(top / "f") == 2
    finally:
        os.close(held)
    # Counted again from the state after a restart, and what find sees.
    want = {p: nlink(m.mountpoint / p) for p in ("", "top", "top/f", "other")}
    assert m.signal(signal.SIGTERM) == 0
    again = mounts.mount(m.controller, state_dir=m.state_dir, mountpoint=m.mountpoint)
    assert {p: nlink(again.mountpoint / p) for p in want} == want
    found = subprocess.run(["find", str(again.mountpoint), "-mindepth", "1", "-type", "d"],
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    walked = [d for d, _, _ in os.walk(again.mountpoint)][1:]
    assert sorted(found) == sorted(walked) and len(found) == 3


def test_o_append_o_excl_truncate_ftruncate(mnt: FsagentMount) -> None:
    p = mnt.mountpoint / "f"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, b"0123456789")
    os.close(fd)
    expect_errno(errno.EEXIST, os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, b"AB")  # O_APPEND ignores the seek
    os.close(fd)
    assert p.read_bytes() == b"0123456789AB"
    os.truncate(p, 4)
    assert p.read_bytes() == b"0123"
    fd = os.open(p, os.O_RDWR)
    os.ftruncate(fd, 8)
    assert os.pread(fd, 100, 0) == b"0123\0\0\0\0"
    os.close(fd)
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert p.read_bytes() == b""
    # The kernel leaves O_TRUNC to open(): the daemon must have truncated too.
    assert mnt.changes()["f"]["size"] == 0


def test_small_files_live_in_the_store_and_move_out_when_they_grow(
    mounts: MountFactory,
) -> None:
    big = os.urandom(200_000)
    m = mounts.mount(mounts.source({"agent": {"saved.txt": b"saved bytes", "big.bin": big}}))
    root = m.mountpoint
    want: dict[str, bytes] = {}
    want["small"] = os.urandom(1000)
    (root / "small").write_bytes(want["small"])
    # Grows past the inline limit (64 KiB) in steps the daemon sees one by one.
    fd = os.open(root / "grows", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    chunks = [os.urandom(12_000) for _ in range(9)]
    for chunk in chunks:
        os.write(fd, chunk)
        os.fsync(fd)
    os.close(fd)
    want["grows"] = b"".join(chunks)
    # Copy-on-write of a small saved file stays inline; of a large one, not.
    with open(root / "saved.txt", "r+b") as fh:
        fh.seek(6)
        fh.write(b"BYTES")
    want["saved.txt"] = b"saved BYTES"
    with open(root / "big.bin", "r+b") as fh:
        fh.write(b"HEAD")
    want["big.bin"] = b"HEAD" + big[4:]
    # Truncated past the limit (a hole) and back.
    (root / "t").write_bytes(b"abc")
    os.truncate(root / "t", 100_000)
    assert (root / "t").read_bytes() == b"abc" + bytes(100_000 - 3)
    os.truncate(root / "t", 2)
    want["t"] = b"ab"
    # Emptied by O_TRUNC without a write after it.
    (root / "trunc").write_bytes(b"old contents")
    os.close(os.open(root / "trunc", os.O_WRONLY | os.O_TRUNC))
    want["trunc"] = b""
    for name, data in want.items():
        assert (root / name).read_bytes() == data, name
    # Only the files that outgrew the limit have an upper file on disk.
    assert len(os.listdir(m.state_dir / "upper")) == 3
    changes = m.changes()
    assert {k: (v["action"], v["size"]) for k, v in changes.items()} == {
        k: ("upload", len(v)) for k, v in want.items()
    }
    assert m.signal(signal.SIGTERM) == 0
    again = mounts.mount(m.controller, state_dir=m.state_dir, mountpoint=m.mountpoint)
    for name, data in want.items():
        assert (again.mountpoint / name).read_bytes() == data, name


def test_readahead_is_raised_for_the_mount(mounts: MountFactory) -> None:
    if os.getuid() != 0:
        pytest.skip("only root may change a mount's readahead")
    where = mounts.base / "mount point\twith space"
    where.mkdir()
    m = mounts.mount(mountpoint=where)
    dev = os.stat(m.mountpoint).st_dev
    setting = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    # Raised by a task of the daemon once INIT is answered: a moment after mounting.
    deadline = time.monotonic() + 10
    while setting.read_text().strip() != "1024" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert setting.read_text().strip() == "1024"
    data = os.urandom(3 << 20)
    (m.mountpoint / "big").write_bytes(data)
    assert (m.mountpoint / "big").read_bytes() == data


def test_sparse_write_and_fsync(mnt: FsagentMount) -> None:
    p = mnt.mountpoint / "sparse"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"end", 10 * 1024 * 1024)
    os.fsync(fd)
    assert os.fstat(fd).st_size == 10 * 1024 * 1024 + 3
    assert os.pread(fd, 4, 5 * 1024 * 1024) == b"\0\0\0\0"
    os.close(fd)
    assert mnt.changes()["sparse"]["size"] == 10 * 1024 * 1024 + 3
    # The hole stays a hole in the upper layer.
    upper = next((mnt.state_dir / "upper").iterdir())
    assert upper.stat().st_blocks * 512 < 1024 * 1024


def test_mmap_read_and_write(mnt: FsagentMount) -> None:
    p = mnt.mountpoint / "mapped"
    p.write_bytes(b"a" * 8192)
    with open(p, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as m:
        assert m[:4] == b"aaaa"
        m[4096:4100] = b"MMAP"
        m.flush()
    data = p.read_bytes()
    assert data[4096:4100] == b"MMAP" and len(data) == 8192
    assert mnt.changes()["mapped"]["action"] == "upload"


def test_large_directory_10k_entries(mnt: FsagentMount) -> None:
    d = mnt.mountpoint / "big"
    d.mkdir()
    names = {f"file-{i:05d}" for i in range(10_000)}
    for n in names:
        fd = os.open(d / n, os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)
    assert set(os.listdir(d)) == names
    with os.scandir(d) as it:
        assert sum(1 for e in it if e.is_file()) == 10_000
    os.unlink(d / "file-00042")
    assert len(os.listdir(d)) == 9_999


def test_statfs_and_chmod_exec_bit(mnt: FsagentMount) -> None:
    vfs = os.statvfs(mnt.mountpoint)
    assert vfs.f_namemax == 255 and vfs.f_bsize > 0 and vfs.f_blocks > 0
    p = mnt.mountpoint / "run.sh"
    p.write_bytes(b"#!/bin/sh\necho ok\n")
    os.chmod(p, 0o755)
    assert os.stat(p).st_mode & 0o111 == 0o111
    assert subprocess.run([str(p)], capture_output=True, check=True).stdout == b"ok\n"
    assert mnt.changes()["run.sh"]["executable"] is True


def test_refusals_symlink_link_mknod_eperm(mnt: FsagentMount) -> None:
    p = mnt.mountpoint / "plain"
    p.write_bytes(b"x")
    expect_errno(errno.EPERM, os.symlink, "plain", mnt.mountpoint / "sym")
    expect_errno(errno.EPERM, os.link, p, mnt.mountpoint / "hard")
    expect_errno(errno.EPERM, os.mkfifo, mnt.mountpoint / "fifo")
    expect_errno(
        errno.EPERM, os.mknod, mnt.mountpoint / "dev", 0o600 | stat.S_IFCHR, os.makedev(1, 3)
    )
    assert sorted(os.listdir(mnt.mountpoint)) == ["plain"]


def test_invalid_and_reserved_names(mnt: FsagentMount) -> None:
    expect_errno(errno.EPERM, os.mkdir, mnt.mountpoint / ".fsagent")
    expect_errno(errno.EINVAL, open, mnt.mountpoint / "bad\x01name", "wb")
    expect_errno(errno.EINVAL, os.mkdir, os.fsencode(mnt.mountpoint) + b"/\xff\xfe")
    nfd = "e\u0301"  # not NFC: two spellings of one name are refused, not normalized
    expect_errno(errno.EINVAL, open, mnt.mountpoint / nfd, "wb")
    expect_errno(errno.ENAMETOOLONG, open, mnt.mountpoint / ("x" * 256), "wb")
    assert os.listdir(mnt.mountpoint) == []


def test_unbound_collection_is_empty_and_read_only(mounts: MountFactory) -> None:
    src = mounts.source({"agent": {}}, bindings={"task": None})
    m = mounts.mount(src, scope="task")
    assert os.listdir(m.mountpoint) == []
    expect_errno(errno.EROFS, open, m.mountpoint / "x", "wb")
    expect_errno(errno.EROFS, os.mkdir, m.mountpoint / "d")
    assert not m.state_dir.exists()  # nothing is kept for an unbound collection


def test_saved_files_are_served_and_copied_on_write(mounts: MountFactory) -> None:
    src = mounts.source(
        {"agent": {"docs/a.md": b"alpha", "tool": b"#!/bin/sh\n", "empty": b"", "dir/sub": None}},
        executable={"tool"},
    )
    m = mounts.mount(src)
    root = m.mountpoint
    assert (root / "docs" / "a.md").read_bytes() == b"alpha"
    assert (root / "empty").read_bytes() == b""
    assert os.stat(root / "tool").st_mode & 0o100
    assert (root / "dir" / "sub").is_dir()
    assert m.changes() == {}
    # Copy-on-write: the saved object stays intact, the upper copy changes.
    with open(root / "docs" / "a.md", "r+b") as fh:
        fh.seek(5)
        fh.write(b"-beta")
    assert (root / "docs" / "a.md").read_bytes() == b"alpha-beta"
    objs = {p.name: p.read_bytes() for p in (m.state_dir / "objects").iterdir()}
    assert b"alpha" in objs.values()
    # Rename of an unchanged file ships as a reference to its saved digest.
    os.rename(root / "tool", root / "docs" / "tool")
    # chmod -x of a saved file: a reference with the new exec bit, no upload.
    changes = m.changes()
    assert changes["docs/a.md"]["action"] == "upload"
    assert changes["tool"]["action"] == "delete"
    assert changes["docs/tool"]["action"] == "reference"
    assert changes["docs/tool"]["executable"] is True
    assert len(changes) == 3


def test_sigterm_unmounts_cleanly_and_state_survives(mounts: MountFactory) -> None:
    m = mounts.mount()
    (m.mountpoint / "kept").write_bytes(b"data")
    assert m.signal(15) == 0
    assert not os.path.ismount(m.mountpoint)
    again = mounts.mount(m.controller, state_dir=m.state_dir, mountpoint=m.mountpoint)
    assert (again.mountpoint / "kept").read_bytes() == b"data"
    subprocess.run(["fusermount3", "-u", str(again.mountpoint)], check=True)
    assert again.proc is not None and again.proc.wait(timeout=30) == 0


def test_sigterm_writes_back_dirty_pages_of_open_files(mounts: MountFactory) -> None:
    m = mounts.mount()
    data = os.urandom(3 * 1024 * 1024 + 17)
    fd = os.open(m.mountpoint / "open-at-stop", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, data)  # still in the kernel's writeback cache, never closed
    try:
        assert m.signal(signal.SIGTERM) == 0
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    again = mounts.mount(m.controller, state_dir=m.state_dir, mountpoint=m.mountpoint)
    assert (again.mountpoint / "open-at-stop").read_bytes() == data
    assert again.changes()["open-at-stop"]["size"] == len(data)


def test_disk_full_reports_enospc_and_keeps_earlier_files(mounts: MountFactory) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    small = mounts.base / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)],
                      capture_output=True, check=False).returncode != 0:  # fmt: skip
        pytest.skip("cannot mount tmpfs here")
    try:
        m = mounts.mount(state_dir=small / "state")
        (m.mountpoint / "first").write_bytes(b"kept" * 1000)
        with pytest.raises(OSError) as info, open(m.mountpoint / "huge", "wb") as fh:
            for _ in range(32):
                fh.write(os.urandom(1024 * 1024))
            fh.flush()
            os.fsync(fh.fileno())
        assert info.value.errno == errno.ENOSPC
        assert (m.mountpoint / "first").read_bytes() == b"kept" * 1000
        os.unlink(m.mountpoint / "huge")
        # Its upper file is freed when the kernel forgets the inode (it may
        # still be open elsewhere until then): the FORGET comes on its own time.
        deadline = time.monotonic() + 30
        while True:
            try:
                (m.mountpoint / "after").write_bytes(b"room again")
                break
            except OSError as exc:
                if exc.errno != errno.ENOSPC or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert (m.mountpoint / "after").read_bytes() == b"room again"
        assert m.signal(signal.SIGTERM) == 0
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True, check=False)
