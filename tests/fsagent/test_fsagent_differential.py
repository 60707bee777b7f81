"""The mount must behave like a plain directory: same random operations, same outcomes.

A hypothesis state machine applies each operation to a plain temp directory
and to the mount, and compares return values and errno, then the whole tree
(kinds, sizes, exec bits, contents) after every step.  A second test runs an
fsx-style seeded random I/O sequence on one large file, verifying every read
against an in-memory model.
"""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import random
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.support.mount import MountFactory

pytestmark = pytest.mark.fuse


@pytest.fixture
def mounts(mounts_in_both_modes: MountFactory) -> MountFactory:
    """Every test here runs in both of fsagent's FUSE modes."""
    return mounts_in_both_modes


# Two directories and three files exist from the start, so most operations
# land on something that exists (a random path three levels deep almost never
# does); rmdir and mkdir of "d" and "e" still reshape the tree.
NAMES = ("a", "b", "c")
DIRS = ("d", "e")
PATHS = [*NAMES, *DIRS, *(f"{d}/{n}" for d in DIRS for n in NAMES), "d/e/a"]
paths = st.sampled_from(PATHS)
payloads = st.binary(max_size=3000)
# Mostly small files; some offsets cross the 64 KiB inline limit, so files move
# out of LMDB into upper/ in the middle of random sequences.
offsets = st.integers(min_value=0, max_value=20_000) | st.integers(
    min_value=60_000, max_value=70_000
)

Outcome = tuple[str, Any]


def outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno or 0, exc.errno))


def snapshot(root: Path, *, owners: bool = False) -> dict[str, tuple[Any, ...]]:
    """Everything a user can observe about a tree, except times and inode numbers
    (and, unless ``owners``, the full mode and the owner: without them the
    mount shows its own user and the plain directory root)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            st_ = os.stat(os.path.join(dirpath, d))
            meta = (stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid) if owners else ()
            out[os.path.normpath(os.path.join(rel, d))] = ("dir", st_.st_nlink, *meta)
        for f in filenames:
            p = os.path.join(dirpath, f)
            st_ = os.stat(p)
            with open(p, "rb") as fh:
                # Drop the kernel's cached pages first, so the bytes come from
                # what the daemon stored, not from what the kernel remembers.
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                data = fh.read()
            key = os.path.normpath(os.path.join(rel, f))
            meta = (stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid) if owners else ()
            out[key] = ("file", st_.st_size, bool(st_.st_mode & stat.S_IXUSR), data, *meta)
    return out


def _write(path: Path, flags: int, data: bytes, off: int | None = None) -> int:
    fd = os.open(path, flags, 0o644)
    try:
        return os.write(fd, data) if off is None else os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _read(path: Path, off: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def _utime(path: Path, atime_ns: int, mtime_ns: int) -> tuple[int, int]:
    os.utime(path, ns=(atime_ns, mtime_ns))
    st_ = os.stat(path)
    return st_.st_atime_ns, st_.st_mtime_ns


class Differential(RuleBasedStateMachine):
    """Set ``plain`` and ``mount`` (two empty directories) in a subclass before running."""

    plain: Path
    mount: Path
    owners = False
    counter = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        n = next(self.counter)
        self.roots = (self.plain / f"ex{n}", self.mount / f"ex{n}")
        for r in self.roots:
            r.mkdir()
            for d in DIRS:
                (r / d).mkdir()
            for name, size in (("a", 100), ("d/b", 5000), ("e/c", 30_000)):
                (r / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))

    def both(self, op: Callable[[Path], Any]) -> Outcome:
        a, b = (outcome(lambda r=r: op(r)) for r in self.roots)
        assert a == b, f"plain dir gave {a!r}, mount gave {b!r}"
        return a

    @rule(path=paths, data=payloads)
    def create_file(self, path: str, data: bytes) -> None:
        self.both(lambda root: _write(root / path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, data))

    @rule(path=paths)
    def create_exclusive(self, path: str) -> None:
        self.both(lambda root: os.close(os.open(root / path, os.O_CREAT | os.O_EXCL, 0o644)))

    @rule(path=paths, off=offsets, data=payloads)
    def write_at(self, path: str, off: int, data: bytes) -> None:
        self.both(lambda root: _write(root / path, os.O_WRONLY, data, off))

    @rule(path=paths, data=payloads)
    def append(self, path: str, data: bytes) -> None:
        self.both(lambda root: _write(root / path, os.O_WRONLY | os.O_APPEND, data))

    @rule(path=paths, size=offsets)
    def truncate(self, path: str, size: int) -> None:
        self.both(lambda root: os.truncate(root / path, size))

    @rule(src=paths, dst=paths)
    def rename(self, src: str, dst: str) -> None:
        self.both(lambda root: os.rename(root / src, root / dst))

    @rule(path=paths)
    def unlink(self, path: str) -> None:
        self.both(lambda root: os.unlink(root / path))

    @rule(path=paths)
    def mkdir(self, path: str) -> None:
        self.both(lambda root: os.mkdir(root / path))

    @rule(path=paths)
    def rmdir(self, path: str) -> None:
        self.both(lambda root: os.rmdir(root / path))

    @rule(path=paths, on=st.booleans())
    def chmod_exec(self, path: str, on: bool) -> None:
        self.both(lambda root: os.chmod(root / path, 0o755 if on else 0o644))

    @rule(path=paths, off=offsets, size=st.integers(0, 5000))
    def read_back(self, path: str, off: int, size: int) -> None:
        self.both(lambda root: _read(root / path, off, size))

    @rule(path=paths)
    def listdir(self, path: str) -> None:
        self.both(lambda root: sorted(os.listdir(root / path)))

    @invariant()
    def trees_match(self) -> None:
        assert snapshot(self.roots[0], owners=self.owners) == snapshot(
            self.roots[1], owners=self.owners
        )


def run_differential(machine: type[Differential], plain: Path, mount: Path) -> None:
    run_state_machine_as_test(
        type("Run", (machine,), {"plain": plain, "mount": mount}),
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_mount_matches_plain_directory(mounts: MountFactory) -> None:
    m = mounts.mount()
    plain = Path(tempfile.mkdtemp(prefix="fsa-plain-"))
    try:
        run_differential(Differential, plain, m.mountpoint)
    finally:
        shutil.rmtree(plain, ignore_errors=True)
    # Every surviving file of the last examples is in the journal's change set.
    changes = m.changes()
    for path, info in snapshot(m.mountpoint).items():
        if info[0] == "file":
            assert changes[path]["action"] == "upload", path
            assert changes[path]["size"] == info[1], path


OTHER = 65534
"""The second user: ``nobody`` (a uid needs no passwd entry to act)."""
OTHER_GROUP = 100
SPECIAL_MODES = (0o644, 0o755, 0o700, 0o4755, 0o2755, 0o6755, 0o2644, 0o1777, 0o3777, 0o0)

_WORKER = """
import errno, json, os, sys
def call(op, a):
    if op == "create":
        fd = os.open(a[0], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try: return os.write(fd, bytes.fromhex(a[1]))
        finally: os.close(fd)
    if op == "write_at":
        fd = os.open(a[0], os.O_WRONLY)
        try: return os.pwrite(fd, bytes.fromhex(a[2]), a[1])
        finally: os.close(fd)
    if op == "truncate": return os.truncate(a[0], a[1])
    if op == "unlink": return os.unlink(a[0])
    if op == "mkdir": return os.mkdir(a[0])
    if op == "rmdir": return os.rmdir(a[0])
    if op == "rename": return os.rename(a[0], a[1])
    if op == "chmod": return os.chmod(a[0], a[1])
    if op == "chown": return os.chown(a[0], a[1], a[2])
    if op == "utime": return os.utime(a[0], ns=(a[1], a[2]))
    if op == "read":
        with open(a[0], "rb") as fh: return fh.read().hex()
    if op == "listdir": return sorted(os.listdir(a[0]))
    raise ValueError(op)
for line in sys.stdin:
    op, args = json.loads(line)
    try: out = ["ok", call(op, args)]
    except OSError as exc: out = ["err", errno.errorcode.get(exc.errno, exc.errno)]
    print(json.dumps(out), flush=True)
"""


class OtherUser:
    """A process running as ``OTHER`` that performs one operation per request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["/usr/bin/python3", "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, user=OTHER, group=OTHER, cwd="/",
        )  # fmt: skip

    def __call__(self, op: str, *args: Any) -> Outcome:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(
            json.dumps([op, [str(a) if isinstance(a, Path) else a for a in args]]) + "\n"
        )
        self.proc.stdin.flush()
        kind, value = json.loads(self.proc.stdout.readline())
        return (kind, value)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


times = st.integers(min_value=0, max_value=2**40) | st.integers(
    min_value=1_600_000_000 * 10**9, max_value=1_900_000_000 * 10**9
)
other_ops = st.sampled_from(
    ["create", "write_at", "truncate", "unlink", "mkdir", "rmdir", "rename", "chmod", "chown",
     "utime", "read", "listdir"]
)  # fmt: skip


class OwnedDifferential(Differential):
    """Also owners, special mode bits, atime and a second user acting in ``e``,
    which is handed to it (``other`` is set before running)."""

    owners = True
    other: OtherUser

    def __init__(self) -> None:
        super().__init__()
        for r in self.roots:
            os.chown(r / "e", OTHER, OTHER)
            os.chown(r / "e" / "c", OTHER, OTHER)

    def both_other(self, op: str, *args: Any) -> Outcome:
        a, b = (self.other(op, *[r / x if isinstance(x, Path) else x for x in args])
                for r in self.roots)  # fmt: skip
        assert a == b, f"{op}{args} as uid {OTHER}: plain dir gave {a!r}, mount gave {b!r}"
        return a

    @rule(path=paths, uid=st.sampled_from([-1, 0, OTHER]),
          gid=st.sampled_from([-1, 0, OTHER_GROUP, OTHER]))  # fmt: skip
    def chown(self, path: str, uid: int, gid: int) -> None:
        self.both(lambda root: os.chown(root / path, uid, gid))

    @rule(path=paths, mode=st.sampled_from(SPECIAL_MODES))
    def chmod_special(self, path: str, mode: int) -> None:
        self.both(lambda root: os.chmod(root / path, mode))

    @rule(path=paths, atime=times, mtime=times)
    def utimens(self, path: str, atime: int, mtime: int) -> None:
        self.both(lambda root: _utime(root / path, atime, mtime))

    @rule(op=other_ops, path=paths, dst=paths, off=st.integers(0, 70_000), data=payloads,
          mode=st.sampled_from(SPECIAL_MODES), uid=st.sampled_from([-1, 0, OTHER]),
          gid=st.sampled_from([-1, OTHER_GROUP, OTHER]))  # fmt: skip
    def as_other(
        self, op: str, path: str, dst: str, off: int, data: bytes, mode: int, uid: int, gid: int
    ) -> None:
        p = Path(path)
        args: dict[str, tuple[Any, ...]] = {
            "create": (p, data.hex()), "write_at": (p, off, data.hex()), "truncate": (p, off),
            "unlink": (p,), "mkdir": (p,), "rmdir": (p,), "rename": (p, Path(dst)),
            "chmod": (p, mode), "chown": (p, uid, gid), "utime": (p, off, off * 3),
            "read": (p,), "listdir": (p,),
        }  # fmt: skip
        self.both_other(op, *args[op])


def test_mount_matches_plain_directory_with_owners_and_a_second_user(
    mounts: MountFactory,
) -> None:
    """As root, with --allow-other: chown, setuid/setgid/sticky, utimensat, and
    ``nobody`` acting in a directory handed to it, compared with a plain directory."""
    if os.getuid() != 0:
        pytest.skip("needs root to change owners and act as another user")
    m = mounts.mount(extra=["--allow-other"])
    plain = mounts.base / "plain"
    plain.mkdir()
    for d in (mounts.base, plain, m.mountpoint):
        os.chmod(d, 0o755)
    other = OtherUser()
    try:
        run_differential(
            type("WithOther", (OwnedDifferential,), {"other": other}), plain, m.mountpoint
        )
    finally:
        other.close()
        shutil.rmtree(plain, ignore_errors=True)


FSX_SEED = int(os.environ.get("FSX_SEED", "20261202"))
FSX_OPS = int(os.environ.get("FSX_OPS", "20000"))
FSX_MAX = 4 * 1024 * 1024


def test_fsx_random_io_on_one_large_file(mounts: MountFactory) -> None:
    """fsx-style: seeded random writes, truncates, mmap I/O and reopens; every read verified."""
    m = mounts.mount()
    rng = random.Random(FSX_SEED)
    path = m.mountpoint / "fsx.bin"
    model = bytearray()
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    counts: dict[str, int] = {}

    def verify(off: int, got: bytes, size: int) -> None:
        want = bytes(model[off : off + size])
        if got != want:
            bad = next(
                i for i in range(min(len(got), len(want)) + 1) if got[i : i + 1] != want[i : i + 1]
            )
            pytest.fail(f"seed {FSX_SEED} op {i}: read at {off}+{size} differs at byte "
                        f"{off + bad} (got {len(got)} bytes, want {len(want)})")  # fmt: skip

    ops = ["read", "write", "write", "truncate", "mapread", "mapwrite", "reopen", "fsync"]
    weights = [30, 30, 10, 4, 8, 8, 3, 2]
    for i in range(FSX_OPS):
        op = rng.choices(ops, weights)[0]
        size = len(model)
        if op == "read":
            off = rng.randrange(0, size + 1) if size else 0
            n = rng.randint(0, 65536)
            verify(off, os.pread(fd, n, off), n)
        elif op == "write":
            off = rng.randrange(0, FSX_MAX - 65536)
            if rng.random() < 0.7 and size:
                off = rng.randrange(0, size)  # mostly near existing data
            data = rng.randbytes(rng.randint(1, 65536))
            assert os.pwrite(fd, data, off) == len(data)
            if off > len(model):
                model.extend(b"\0" * (off - len(model)))
            model[off : off + len(data)] = data
        elif op == "truncate":
            new = rng.randrange(0, FSX_MAX)
            os.ftruncate(fd, new)
            if new < len(model):
                del model[new:]
            else:
                model.extend(b"\0" * (new - len(model)))
        elif op in ("mapread", "mapwrite") and size:
            with mmap.mmap(fd, size) as mm:
                off = rng.randrange(0, size)
                n = min(rng.randint(1, 32768), size - off)
                if op == "mapread":
                    verify(off, mm[off : off + n], n)
                else:
                    data = rng.randbytes(n)
                    mm[off : off + n] = data
                    model[off : off + n] = data
                    mm.flush()
        elif op == "reopen":
            os.close(fd)
            fd = os.open(path, os.O_RDWR)
        elif op == "fsync":
            os.fsync(fd)
        counts[op] = counts.get(op, 0) + 1
        if os.fstat(fd).st_size != len(model):
            pytest.fail(
                f"seed {FSX_SEED} op {i} ({op}): size {os.fstat(fd).st_size} != {len(model)}"
            )
    os.close(fd)
    assert path.read_bytes() == bytes(model)
    print(f"fsx: {FSX_OPS} ops with seed {FSX_SEED}: {counts}")
    # The content survives an unmount and a remount from the same state dir.
    assert m.signal(15) == 0
    again = mounts.mount(m.controller, state_dir=m.state_dir, mountpoint=m.mountpoint)
    assert (again.mountpoint / "fsx.bin").read_bytes() == bytes(model)
    assert again.changes()["fsx.bin"]["size"] == len(model)
