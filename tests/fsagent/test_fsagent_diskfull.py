"""A file cut short by a full disk reads back in the sandbox as it is saved.

The state dir sits on a small tmpfs that fills up (tests.support.smallfs).
With the kernel's writeback cache an agent's write() goes to the page cache
and succeeds; the daemon's WRITE of those pages is what meets ENOSPC, and the
agent hears of it at fsync or close. The kernel used to keep the refused pages
and the length they gave the file: a file of which nothing reached the disk
read back as 5,000,000 bytes and was saved empty. The daemon now makes the
kernel drop the entry of a file whose WRITE it refused (fsagent.fuse.fs,
``_refuse``), so the next lookup reads size and bytes from the daemon.

Each file is written as an agent writes, in 1 MiB write() calls, then fsync
and close, until one of them fails:

- ``big``: over ``INLINE_MAX`` and in ``upper/`` when the disk fills under
  it: its bytes are cut short in the middle;
- ``grown``: 30,000 bytes inline, appended to on the full disk: its move out
  of line (the spill) fails, and it stays inline as it was;
- ``fresh``: 5,000,000 bytes into a new file on the full disk: nothing
  reaches the disk (the reported case);
- ``small``: 50,000 bytes into a new file on the full disk: an inline write
  refused for the metadata reserve.

Against a real controller, in both FUSE modes. In process: a move out of
line whose commit the full disk refuses leaves the file as it was.

A daemon started on a disk already full serves its collection all the same
(a FUSE mount in both modes, and a plain directory); its control socket and
``daemon.json`` are made once there is room, and ``fsagent flush`` answers
from then on (fsagent.control.server.WhenThereIsRoom).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pyfuse3
import pytest
import trio

from fsagent.fuse.fs import WorkFolderFS
from fsagent.state.hydrate import ContentFetcher
from fsagent.state.store import ROOT_INODE, InodeNo, Store
from tests.support.bridge import Run, start_run
from tests.support.constants import REPO
from tests.support.controller import Tenant
from tests.support.memclient import MemoryBridgeClient
from tests.support.mount import FsagentMount, MountFactory, mount_factory
from tests.support.smallfs import BALLAST, assert_full, fill, free_fill, small_tmpfs

CHUNK = 1 << 20
LEFT_FOR_BIG = 8 << 20
"""Free space left before ``big`` is written: it runs out in the middle of it."""
FILES = ("big", "grown", "fresh", "small")


@pytest.fixture
def mounts(mounts_in_both_modes: MountFactory) -> MountFactory:
    """Every test here runs in both of fsagent's FUSE modes."""
    return mounts_in_both_modes


@pytest.fixture
def small() -> Iterator[Path]:
    """The small disk the state dir lives on."""
    if os.getuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    with small_tmpfs("64m") as where:
        yield where


class Sandbox:
    """A run of a task, its collection mounted with the state dir on ``small``."""

    def __init__(self, mounts: MountFactory, tenant: Tenant, small: Path) -> None:
        self.mounts, self.tenant, self.small = mounts, tenant, small
        self.run: Run = start_run(tenant)
        self.token = mounts.base / "token"
        self.token.write_text(self.run.token)
        self.m = self.mount()

    def mount(self, state_dir: Path | None = None, mountpoint: Path | None = None) -> FsagentMount:
        return self.mounts.mount(
            self.tenant.controller.url,
            "task",
            state_dir=state_dir or self.small / "state",
            mountpoint=mountpoint,
            token_file=self.token,
        )

    def path(self, name: str) -> Path:
        return self.m.mountpoint / name

    def saved(self, name: str) -> bytes:
        """The file's bytes on the controller (REST API)."""
        assert self.run.task is not None
        with self.tenant.client() as c:
            answer = c.get(
                self.tenant.folder("task", self.run.task) + "/content", params={"path": name}
            )
        assert answer.status_code == 200, answer.text
        return answer.content

    def flush(self) -> None:
        out = self.m.fsagent("flush")
        assert out["ok"] is True, out

    def stop(self) -> None:
        """Unmount before the small disk goes (the factory's teardown comes later)."""
        self.m.stop()


@pytest.fixture
def sandbox(mounts: MountFactory, tenant: Tenant, small: Path) -> Iterator[Sandbox]:
    box = Sandbox(mounts, tenant, small)
    try:
        yield box
    finally:
        box.stop()


def write_as_agent(path: Path, data: bytes, *, append: bool = False) -> int | None:
    """Write ``data`` in 1 MiB write() calls, then fsync and close; the errno
    of the first call that fails (0: none did)."""
    flags = os.O_CREAT | os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    failed: int | None = 0
    try:
        for at in range(0, len(data), CHUNK):
            os.write(fd, data[at : at + CHUNK])
        os.fsync(fd)
    except OSError as exc:
        failed = exc.errno
    try:
        os.close(fd)
    except OSError as exc:
        failed = failed or exc.errno
    return failed


def leave_free(root: Path, nbytes: int) -> None:
    """Ballast that leaves about ``nbytes`` free on the disk of ``root``."""
    vfs = os.statvfs(root)
    ballast = root / BALLAST
    ballast.mkdir(exist_ok=True)
    with open(ballast / "leave-free", "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, vfs.f_bavail * vfs.f_frsize - nbytes)


def fill_while_writing(box: Sandbox) -> dict[str, bytes]:
    """Write the four files as the disk fills up; what the agent wrote to each."""
    wrote = {"grown": os.urandom(30_000)}
    assert write_as_agent(box.path("grown"), wrote["grown"]) == 0  # inline, on a roomy disk
    leave_free(box.small, LEFT_FOR_BIG)
    wrote["big"] = os.urandom(20 << 20)
    assert write_as_agent(box.path("big"), wrote["big"]) == errno.ENOSPC
    fill(box.small)  # every block and inode left
    assert_full(box.small)
    more = os.urandom(5_000_000)
    assert write_as_agent(box.path("grown"), more, append=True) == errno.ENOSPC
    wrote["grown"] += more
    wrote["fresh"] = os.urandom(5_000_000)
    assert write_as_agent(box.path("fresh"), wrote["fresh"]) == errno.ENOSPC
    wrote["small"] = os.urandom(50_000)
    assert write_as_agent(box.path("small"), wrote["small"]) == errno.ENOSPC
    return wrote


def read_back_as_kept(box: Sandbox, wrote: dict[str, bytes]) -> dict[str, bytes]:
    """Wait until the mount shows each file at the size the daemon kept (the
    kernel drops a refused file's entry once the refusal is answered), then
    read every file back: a prefix of what was written, cut where the disk
    filled up."""
    kept = {name: int(box.m.changes()[name]["size"]) for name in FILES}
    assert 0 < kept["big"] < len(wrote["big"])
    assert kept["grown"] == 30_000  # its spill failed: still the inline bytes
    assert kept["fresh"] == kept["small"] == 0

    def shown() -> dict[str, int]:
        return {name: os.stat(box.path(name)).st_size for name in FILES}

    deadline = time.monotonic() + 60
    while shown() != kept and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shown() == kept  # the kernel's sizes, then the daemon's
    back = {name: box.path(name).read_bytes() for name in FILES}
    for name in FILES:
        assert len(back[name]) == kept[name], name
        assert back[name] == wrote[name][: kept[name]], name
    return back


@pytest.mark.fuse
def test_a_file_cut_short_by_a_full_disk_reads_back_as_saved(sandbox: Sandbox) -> None:
    """After ENOSPC the mount reads back exactly what ``fsagent flush`` saves;
    once there is room again a write saves the new whole file."""
    wrote = fill_while_writing(sandbox)
    back = read_back_as_kept(sandbox, wrote)
    sandbox.flush()
    for name in FILES:
        assert sandbox.saved(name) == back[name], name
    free_fill(sandbox.small)
    new = {"big": os.urandom(20 << 20), "fresh": os.urandom(5_000_000)}
    for name, data in new.items():
        assert write_as_agent(sandbox.path(name), data) == 0, name
    appended = os.urandom(100_000)  # across INLINE_MAX: out of line now
    assert write_as_agent(sandbox.path("grown"), appended, append=True) == 0
    new["grown"] = back["grown"] + appended
    sandbox.flush()
    for name, data in new.items():
        assert sandbox.path(name).read_bytes() == data, name
        assert sandbox.saved(name) == data, name


@pytest.mark.fuse
def test_kill9_after_a_full_disk_keeps_what_the_mount_read_back(sandbox: Sandbox) -> None:
    """A kill -9 after the ENOSPC: the restarted mount reads back what the mount
    read before, and its warm start saved exactly that. The disk stays full:
    the daemon starts without room for its control socket (which it makes
    later, fsagent.control.server)."""
    wrote = fill_while_writing(sandbox)
    back = read_back_as_kept(sandbox, wrote)
    old = sandbox.m
    old.kill9()
    assert_full(sandbox.small)
    sandbox.m = sandbox.mount(state_dir=old.state_dir, mountpoint=old.mountpoint)
    for name in FILES:
        assert sandbox.path(name).read_bytes() == back[name], name
        assert sandbox.saved(name) == back[name], name


def fsagent_cli(box: Sandbox, *args: str) -> subprocess.CompletedProcess[str]:
    """``fsagent ARGS --state-dir ... --json``, whatever its exit code."""
    argv = [sys.executable, "-m", "fsagent.cli", *args, "--state-dir", str(box.m.state_dir),
            "--json"]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def start_on_a_full_disk(box: Sandbox) -> None:
    """The first run saves ``early`` and stops; the disk fills up; the daemon
    is started again on it: it serves ``early`` without its control socket,
    and ``fsagent flush`` says plainly that it cannot reach it. Once the
    ballast goes, ``late`` is written and a flush (polled: the socket is made
    on the daemon's next try) saves it; the stop saves ``last``."""
    early, late, last = os.urandom(300_000), os.urandom(200_000), b"written last\n"
    box.path("early").write_bytes(early)
    box.flush()
    assert box.m.stop() == 0
    state, where = box.m.state_dir, box.m.mountpoint
    fill(box.small)
    assert_full(box.small)
    box.m = box.mount(state_dir=state, mountpoint=where)
    assert box.path("early").read_bytes() == early
    assert not (state / "control.sock").exists()
    refused = fsagent_cli(box, "flush")
    assert refused.returncode == 1, refused
    assert refused.stderr == f"fsagent: no running fsagent daemon for {state}\n"
    status = fsagent_cli(box, "status")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["collections"][0]["live"] is None
    free_fill(box.small)
    assert write_as_agent(box.path("late"), late) == 0
    deadline = time.monotonic() + 120
    flushed = fsagent_cli(box, "flush")
    while flushed.returncode != 0 and time.monotonic() < deadline:
        assert "Traceback" not in flushed.stderr, flushed.stderr
        time.sleep(0.1)
        flushed = fsagent_cli(box, "flush")
    assert flushed.returncode == 0, flushed.stderr
    assert json.loads(flushed.stdout)["ok"] is True
    assert box.saved("late") == late
    status = fsagent_cli(box, "status")
    assert status.returncode == 0, status.stderr
    row = json.loads(status.stdout)["collections"][0]
    assert box.m.proc is not None and row["pid"] == box.m.proc.pid
    assert row["live"] is not None
    box.path("last").write_bytes(last)
    assert box.m.stop() == 0
    assert not (state / "control.sock").exists()
    assert not (state / "daemon.json").exists()
    assert {name: box.saved(name) for name in ("early", "late", "last")} == {
        "early": early, "late": late, "last": last,
    }  # fmt: skip
    log = box.m.stderr()
    assert log.count("cannot make the control socket") == 1, log
    assert log.count("made the control socket") == 1, log


@pytest.mark.fuse
def test_a_mount_started_on_a_full_disk_serves_and_flushes_once_there_is_room(
    sandbox: Sandbox,
) -> None:
    start_on_a_full_disk(sandbox)


def test_a_directory_served_from_a_full_disk_flushes_once_there_is_room(
    tenant: Tenant, small: Path
) -> None:
    """The same in dir mode (fsagent.dirmode.serve): the agent's files are in
    the directory, the state dir on the full disk."""
    with mount_factory(mode="dir") as mounts:
        box = Sandbox(mounts, tenant, small)
        try:
            start_on_a_full_disk(box)
        finally:
            box.stop()


def test_a_move_out_of_line_the_disk_refuses_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upper file is complete before the inline copy is dropped; when that
    commit fails (the metadata reserve used up), the write is refused, the file
    stays inline with its bytes, and no upper file is left taking the space."""
    store = Store.open(tmp_path / "state")
    store.tree.hydrate([], high_water=0)
    fs = WorkFolderFS(store, ContentFetcher(store, MemoryBridgeClient(), "agent"))
    ctx = cast(pyfuse3.RequestContext, SimpleNamespace(uid=os.getuid(), gid=os.getgid()))
    first, second = os.urandom(30_000), os.urandom(100_000)

    async def write(off: int, data: bytes) -> int:
        return await fs.write(pyfuse3.FileHandleT(node), off, data)

    async def read() -> bytes:
        return await fs.read(pyfuse3.FileHandleT(node), 0, 1 << 20)

    made = trio.run(fs.mknod, ROOT_INODE, b"grown", stat.S_IFREG | 0o644, 0, ctx)
    node = InodeNo(made.st_ino)
    assert trio.run(write, 0, first) == len(first)

    def disk_full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "state database: no space")

    monkeypatch.setattr(store.tree, "drop_inline", disk_full)
    with pytest.raises(pyfuse3.FUSEError) as refused:
        trio.run(write, len(first), second)
    assert refused.value.errno == errno.ENOSPC
    assert os.listdir(store.root / "upper") == []
    assert store.inline_data(node) == first
    assert store.get(node).size == len(first)
    assert trio.run(read) == first
    monkeypatch.undo()
    assert trio.run(write, len(first), second) == len(second)  # room again
    assert store.inline_data(node) is None
    assert trio.run(read) == first + second
    assert (store.root / "upper" / str(node)).read_bytes() == first + second
    fs.shutdown()
    store.close()
