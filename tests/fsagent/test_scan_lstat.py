"""The scan's lstat loop in C (fsagent/_lstat.c) against the same loop in
Python: the same keys, the same Nones and the same errors, for every kind
of path a checkout can hold."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsagent._lstat import lstat_keys as c_lstat_keys
from fsagent.scan import engine as scan

NS = 1_000_000_000


@pytest.fixture
def root(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def both(fd: int, paths: list[str]) -> list[scan.Key | None]:
    ours = c_lstat_keys(fd, paths)
    assert ours == scan._lstat_list_py(fd, paths)
    return ours


def test_an_installed_fsagent_scans_with_the_c_loop() -> None:
    # `make deps` builds the extension; a scan that fell back to Python would
    # pass every other test three times slower.
    assert scan.lstat_keys is c_lstat_keys


def test_every_kind_of_path_gets_the_key_python_gives(tmp_path: Path, root: int) -> None:
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "file").write_bytes(b"x" * 1234)
    (tmp_path / "exec").write_bytes(b"#!/bin/sh\n")
    os.chmod(tmp_path / "exec", 0o755)
    os.symlink("dir/file", tmp_path / "link")
    os.symlink("nowhere", tmp_path / "dangling")
    os.symlink("dir", tmp_path / "dirlink")
    os.mkfifo(tmp_path / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.fspath(tmp_path / "sock"))
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(5 << 30)  # past 32 bits
    weird = os.fsdecode(b"caf\xe9-\xff.txt")  # not UTF-8: surrogate escapes
    (tmp_path / weird).write_bytes(b"w")
    (tmp_path / "unicode-\u00e9\u4e2d").write_bytes(b"u")
    future = tmp_path / "future"
    future.write_bytes(b"f")
    # ext4 keeps times to 2446: seconds * 10**9 no longer fits in 64 bits.
    os.utime(future, ns=(0, 13_000_000_000 * NS + 123_456_789))
    past = tmp_path / "past"
    past.write_bytes(b"p")
    os.utime(past, ns=(0, -315_619_200 * NS + 5))  # 1960
    paths = [
        "dir",
        "dir/sub",
        "dir/file",
        "exec",
        "link",
        "dangling",
        "dirlink",
        "dirlink/file",  # through a link above: followed, as os.lstat does
        "fifo",
        "sock",
        "sparse",
        weird,
        "unicode-\u00e9\u4e2d",
        "future",
        "past",
        "missing",
        "dir/file/below-a-file",  # ENOTDIR
        "missing/below",
        os.fspath(tmp_path / "dir" / "file"),  # absolute: the fd is not used
    ]
    keys = both(root, paths)
    got = dict(zip(paths, keys, strict=True))
    st = os.lstat(tmp_path / "dir" / "file")
    assert got["dir/file"] == (
        st.st_dev,
        st.st_ino,
        1234,
        st.st_mode,
        st.st_mtime_ns,
        st.st_ctime_ns,
    )
    assert got["sparse"] is not None and got["sparse"][2] == 5 << 30
    assert got["future"] is not None and got["future"][4] == 13_000_000_000 * NS + 123_456_789
    assert got["past"] is not None and got["past"][4] == -315_619_200 * NS + 5
    assert got["link"] is not None and got["link"][3] & 0o170000 == 0o120000
    assert got["dirlink/file"] == got["dir/file"]
    assert got[os.fspath(tmp_path / "dir" / "file")] == got["dir/file"]
    assert [p for p, k in got.items() if k is None] == [
        "missing",
        "dir/file/below-a-file",
        "missing/below",
    ]


def test_batches_and_their_edges(tmp_path: Path, root: int) -> None:
    # The C loop stats 512 paths per GIL release: cross a few boundaries.
    for i in range(700):
        (tmp_path / f"f{i:04}").write_bytes(b"")
    paths = [f"f{i:04}" if i % 3 else f"gone{i}" for i in range(1537)]
    keys = both(root, paths)
    assert sum(k is None for k in keys) == 1537 - sum(1 for i in range(1537) if i % 3 and i < 700)
    assert both(root, []) == []


@pytest.mark.parametrize(
    ("make", "path", "code"),
    [
        (lambda d: os.symlink("loop", d / "loop"), "loop/x", errno.ELOOP),
        (lambda d: None, "n" * 300, errno.ENAMETOOLONG),
    ],
    ids=["ELOOP", "ENAMETOOLONG"],
)
def test_other_errors_raise_as_os_lstat_does(
    tmp_path: Path, root: int, make: object, path: str, code: int
) -> None:
    make(tmp_path)  # type: ignore[operator]
    # In the second batch, after good paths: what was built is let go.
    for i in range(600):
        (tmp_path / f"ok{i}").write_bytes(b"")
    paths = [f"ok{i}" for i in range(600)] + [path, "ok1"]
    with pytest.raises(OSError) as ours:
        c_lstat_keys(root, paths)
    with pytest.raises(OSError) as theirs:
        scan._lstat_list_py(root, paths)
    assert ours.value.errno == theirs.value.errno == code
    assert ours.value.filename == theirs.value.filename == path


def test_bad_arguments_are_refused(root: int) -> None:
    with pytest.raises(ValueError, match="null"):
        c_lstat_keys(root, ["a\0b"])
    with pytest.raises(ValueError, match="null"):
        scan._lstat_list_py(root, ["a\0b"])
    with pytest.raises(TypeError):
        c_lstat_keys(root, [b"bytes"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        c_lstat_keys(root, ("a", "b"))  # type: ignore[arg-type]
    with pytest.raises(OSError) as exc:
        c_lstat_keys(-1, ["a"])
    assert exc.value.errno == errno.EBADF


def test_a_scan_gives_the_same_result_with_either_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    for i in range(50):
        (tmp_path / "a" / "b" / f"{i}.txt").write_text(str(i))
    os.symlink("b/0.txt", tmp_path / "a" / "l")
    paths = sorted(["a/l", *(f"a/b/{i}.txt" for i in range(50)), "a/gone"])
    with_c = scan.scan_tree(tmp_path, lambda: paths)
    monkeypatch.setattr(scan, "lstat_keys", scan._lstat_list_py)
    with_py = scan.scan_tree(tmp_path, lambda: paths)
    assert with_c.members == with_py.members
    assert with_c.stable and with_py.stable
    assert len(with_c.members) == 51


def test_unchanged_keys_come_back_as_the_previous_tuples(tmp_path: Path, root: int) -> None:
    for name in ("a", "b", "c", "future"):
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / "future", ns=(0, 13_000_000_000 * NS))  # past 2**63 ns: built again
    paths = ["a", "b", "c", "future", "gone"]
    first = c_lstat_keys(root, paths)
    with open(tmp_path / "b", "ab") as f:
        f.write(b"more")
    again = c_lstat_keys(root, paths, first)
    assert again == scan._lstat_list_py(root, paths)
    assert again[0] is first[0] and again[2] is first[2]
    assert again[1] is not first[1] and again[1] != first[1]
    assert again[3] == first[3] and again[3] is not first[3]
    assert again[4] is None
    # Whatever the previous list holds, the answer is the fresh keys.
    key_a = first[0]
    assert key_a is not None
    odd: list[object] = [
        scan.StatKey(*key_a),  # equal, but not a plain tuple
        (1, 2, 3),
        None,
        (-1, -2, 2**70, -5, 2**80, "x"),
        "not a key",
    ]
    fresh = c_lstat_keys(root, paths, odd)  # type: ignore[arg-type]
    assert fresh == scan._lstat_list_py(root, paths)
    assert fresh[0] is not odd[0]
    with pytest.raises(ValueError, match="as long as paths"):
        c_lstat_keys(root, paths, first[:2])
    with pytest.raises(ValueError, match="as long as paths"):
        c_lstat_keys(root, paths, tuple(first))  # type: ignore[arg-type]
