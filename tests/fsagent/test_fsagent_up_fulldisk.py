"""``fsagent up`` started again after its agent filled the disk: the
sandbox's home, state root and env file on one small filesystem, filled to
its last block and inode.

A restart must still serve the collections, write the env file and start the
bridge, so that the agent can run (and free room); and its stop must save
what the disk holds. Before, the dir-mode daemons and the bridge could not
write their ready files, the bridge could not make its socket, ``up`` could
not write its env file and the agent folder's daemon could not make its new
state dir: the start failed until someone freed the disk by hand.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fsagent.commands.daemon import ReadyPipe
from fsagent.commands.envfile import read_env_file, write_env_file
from fsagent.control.server import announce_ready
from fsagent.state.records import Binding
from fsagent.state.statedir import HEADROOM, MARKER, discard_state_dir
from fsagent.state.store import Store
from tests.support.bridge import start_run
from tests.support.checkpoints import assert_local_copy_discarded
from tests.support.constants import REPO
from tests.support.controller import Tenant
from tests.support.mount import MountFactory
from tests.support.smallfs import assert_full, fill, free_fill, small_tmpfs

pytestmark = pytest.mark.fuse

READY = "; environment in "
DEADLINE = 180.0


def start_up(
    disk: Path, logs: Path, name: str, controller: str, mode: str
) -> subprocess.Popen[bytes]:
    with open(logs / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fsagent.cli", "up", "--home", str(disk / "home"),
             "--controller", controller, "--token-file", str(disk / "token"),
             "--state-root", str(disk / "state"), "--env-file", str(disk / "env"),
             "--mode", mode, "--checkpoint-interval", "600"],
            cwd=REPO, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        )  # fmt: skip


def log_of(logs: Path, name: str) -> str:
    return (logs / f"{name}.log").read_text(errors="replace")


def wait_said(proc: subprocess.Popen[bytes], logs: Path, name: str, line: str) -> None:
    """Until ``up``'s log has ``line``; fails if it exits first or takes too long."""
    deadline = time.monotonic() + DEADLINE
    while line not in log_of(logs, name):
        assert proc.poll() is None, log_of(logs, name)
        assert time.monotonic() < deadline, log_of(logs, name)
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes], logs: Path, name: str) -> None:
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE) == 0, log_of(logs, name)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def listening(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def saved(tenant: Tenant, task: str, path: str) -> bytes | None:
    with tenant.client() as c:
        r = c.get(tenant.folder("task", task) + "/content", params={"path": path})
    return r.content if r.status_code == 200 else None


@pytest.mark.parametrize("mode", ["fuse", "dir"])
def test_up_started_again_after_the_agent_filled_the_disk_serves_and_saves(
    tenant: Tenant, mode: str, tmp_path: Path
) -> None:
    run = start_run(tenant)
    assert run.task is not None
    with small_tmpfs(prefix="fsa-upfull-") as disk:
        (disk / "token").write_text(run.token)
        task = disk / "home" / "task"
        first = start_up(disk, tmp_path, "first", tenant.controller.url, mode)
        big: dict[str, bytes] = {}
        try:
            wait_said(first, tmp_path, "first", READY)
            synced(task / "before.txt", b"written before the disk filled")
            for i in range(40):  # 40 x 4 MiB cannot fit on 64 MiB
                data = os.urandom(4 << 20)
                try:
                    synced(task / f"big{i:02}.bin", data)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    (task / f"big{i:02}.bin").unlink(missing_ok=True)
                    break
                big[f"big{i:02}.bin"] = data
            else:
                raise AssertionError("the disk never filled")
            fill(disk)  # the last blocks and inodes, as the agent's other processes would
        finally:
            stop(first, tmp_path, "first")
        assert saved(tenant, run.task, "before.txt") == b"written before the disk filled"
        assert len(big) >= 8 and all(saved(tenant, run.task, k) == v for k, v in big.items())
        before = read_env_file(disk / "env")
        if mode == "fuse":
            # Not a block or an inode of what the stop freed is left: the
            # agent folder's new state dir was made at the stop, in its room.
            # (Dir mode needs room for the agent folder's files again.)
            fill(disk)
            assert_full(disk)

        again = start_up(disk, tmp_path, "again", tenant.controller.url, mode)
        try:
            wait_said(again, tmp_path, "again", READY)
            log = log_of(tmp_path, "again")
            assert "Traceback" not in log, log
            env = read_env_file(disk / "env")
            assert {k: v for k, v in env.items() if not k.startswith("PAPERCLIP_API_")} == {
                k: v for k, v in before.items() if not k.startswith("PAPERCLIP_API_")
            }
            # The env file names the new bridge, and it serves the run's API.
            url = f"{tenant.folder('task', run.task)}/content"
            r = httpx.get(env["PAPERCLIP_API_URL"] + url, params={"path": "before.txt"})
            assert r.status_code == 200, r.text
            assert r.content == b"written before the disk filled"

            # The agent, running now, finds the disk full, then frees room.
            assert (task / "before.txt").read_bytes() == b"written before the disk filled"
            with pytest.raises(OSError) as full:
                synced(task / "more.txt", os.urandom(1 << 20))
            assert full.value.errno == errno.ENOSPC
            (task / "more.txt").unlink(missing_ok=True)
            free_fill(disk)
            for name in ("big00.bin", "big01.bin", "big02.bin"):
                (task / name).unlink()
            # A FUSE mount frees a removed file's blocks once the kernel forgets
            # it, and keeps 4 MiB in reserve: the room shows within moments.
            deadline = time.monotonic() + DEADLINE
            while True:
                try:
                    synced(task / "after.txt", b"written once there was room")
                    break
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    assert time.monotonic() < deadline, log_of(tmp_path, "again")
                    time.sleep(0.2)
            # The bridge's socket, which the full disk had no inode for, is
            # made once there is room.
            deadline = time.monotonic() + DEADLINE
            while not listening(env["PAPERCLIP_API_SOCKET"]):
                assert time.monotonic() < deadline, log_of(tmp_path, "again")
                time.sleep(0.2)
            transport = httpx.HTTPTransport(uds=env["PAPERCLIP_API_SOCKET"])
            with httpx.Client(transport=transport, base_url="http://bridge") as c:
                r = c.get(url, params={"path": "before.txt"})
            assert r.status_code == 200 and r.content == b"written before the disk filled"
        finally:
            stop(again, tmp_path, "again")
        assert saved(tenant, run.task, "after.txt") == b"written once there was room"
        assert saved(tenant, run.task, "before.txt") == b"written before the disk filled"
        assert saved(tenant, run.task, "big00.bin") is None
        assert saved(tenant, run.task, "big03.bin") == big["big03.bin"]


# --- the parts, each on a full disk ------------------------------------------------------


def test_an_env_file_is_rewritten_in_place_when_a_new_one_has_no_room() -> None:
    with small_tmpfs(prefix="fsa-envfull-") as disk:
        env = disk / "env"
        write_env_file(env, {"AGENT_HOME": "/home/agent", "PAPERCLIP_API_URL": "http://x:1"})
        inode = env.stat().st_ino
        fill(disk)
        assert_full(disk)
        write_env_file(env, {"AGENT_HOME": "/home/agent", "PAPERCLIP_API_URL": "http://x:23456"})
        assert read_env_file(env) == {
            "AGENT_HOME": "/home/agent",
            "PAPERCLIP_API_URL": "http://x:23456",
        }
        assert env.stat().st_ino == inode  # in place: no new file
        assert not (disk / "env.tmp").exists()
        # More than its blocks hold: the full disk's error, the file as it was.
        with pytest.raises(OSError) as full:
            write_env_file(env, {"AGENT_HOME": "/home/agent", "BIG": "x" * 20_000})
        assert full.value.errno == errno.ENOSPC
        assert read_env_file(env)["PAPERCLIP_API_URL"] == "http://x:23456"
        # No env file yet: nothing to rewrite, the error stands.
        with pytest.raises(OSError) as none:
            write_env_file(disk / "other.env", {"AGENT_HOME": "/home/agent"})
        assert none.value.errno == errno.ENOSPC
        free_fill(disk)


def test_the_agent_folders_discard_leaves_a_new_state_dir_or_an_empty_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "agent"
    store = Store.open(root)
    store.dir.bind(Binding("c1", "agent", "a1"))
    (root / "upper" / "7").write_bytes(b"the agent's unsaved bytes")
    store.close()
    (tmp_path / ".agent.fresh").mkdir()  # what an interrupted discard left
    discard_state_dir(root, fresh=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent"]
    assert_local_copy_discarded(root)
    assert (root / MARKER).exists()
    fresh = Store.open(root)  # ours, unbound, with room in reserve for its first commits
    try:
        assert fresh.dir.binding() is None
        reserve = (root / "db" / "data.mdb").stat().st_blocks * 512
        assert reserve >= HEADROOM, reserve
    finally:
        fresh.close()

    with small_tmpfs(prefix="fsa-discardfull-") as disk:
        root = disk / "agent"
        Store.open(root).close()
        fill(disk)
        discard_state_dir(root, fresh=True)  # freed little, and fill takes it first
        # Either way the next start finds a state dir it can use: here the
        # old one's room sufficed for the new one, or it is left empty.
        names = sorted(p.name for p in root.iterdir())
        assert names in ([], sorted([MARKER, "lock", "objects", "upper", "db"])), names
        assert not (disk / ".agent.fresh").exists()
        assert_local_copy_discarded(root)
        # What the full disk refused is said, never raised.
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert said and all(
            m.startswith("cannot reserve ") or " is left empty: " in m for m in said
        ), said
        free_fill(disk)


def test_a_ready_pipe_takes_only_a_whole_line_of_this_start() -> None:
    pipe = ReadyPipe()
    for record in ({"pid": 1}, {"pid": 2}):
        write = pipe.open()
        try:
            assert pipe.poll() is None
            line = json.dumps(record).encode() + b"\n"
            os.write(write, line[:5])
            assert pipe.poll() is None  # half a line
            os.write(write, line[5:])
        finally:
            os.close(write)
        assert pipe.poll() == record
    write = pipe.open()  # a start that dies before it serves: the pipe ends, no record
    os.close(write)
    assert pipe.poll() is None
    pipe.close()


def test_announce_ready_writes_one_line_and_closes_the_pipe() -> None:
    read, write = os.pipe()
    announce_ready({"pid": 7, "mode": "dir"}, None, write)
    with pytest.raises(OSError):
        os.fstat(write)  # closed
    with os.fdopen(read, "rb") as fh:
        assert fh.read() == b'{"pid": 7, "mode": "dir"}\n'
    read, write = os.pipe()
    os.close(read)  # whoever waited is gone: not an error
    announce_ready({"pid": 8}, None, write)


def test_a_detached_dir_mode_mount_starts_again_on_a_full_disk(mounts: MountFactory) -> None:
    """``fsagent mount`` without ``--foreground`` on a disk with no block and
    no inode left: the daemon it starts says it serves on a pipe, not in a
    ready file, so the command returns and the folder is served; its log,
    already there, takes what it can. Before, the daemon could not write its
    ready file and exited, and the command failed."""
    src = mounts.source({"task": {"a.txt": b"from the source"}})
    with small_tmpfs(prefix="fsa-mountfull-") as disk:
        directory, state = disk / "task", disk / "state" / "task"
        directory.mkdir()
        argv = [sys.executable, "-m", "fsagent.cli", "mount", "task", str(directory),
                "--controller", f"dir:{src}", "--state-dir", str(state), "--mode", "dir"]  # fmt: skip

        def start() -> int:
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE)
            assert done.returncode == 0, done.stdout + done.stderr
            said = done.stdout.strip()
            assert said.startswith(f"fsagent: task ready at {directory} (dir mode, pid "), said
            return int(said.split(", pid ", 1)[1].split(",", 1)[0])

        stop_daemon(start())
        (directory / "mine.txt").write_bytes(b"the agent's")
        fill(disk)
        assert_full(disk)
        pid = start()
        try:
            assert not (disk / "state" / "run").exists()  # no ready file, none needed
            assert (directory / "a.txt").read_bytes() == b"from the source"
            assert (directory / "mine.txt").read_bytes() == b"the agent's"
            with pytest.raises(OSError) as full:
                (directory / "more.txt").write_bytes(os.urandom(1 << 20))
            assert full.value.errno == errno.ENOSPC
        finally:
            stop_daemon(pid)


def stop_daemon(pid: int) -> None:
    """SIGTERM a detached daemon (not this process's child) and wait until it
    is gone or a zombie nobody here can reap."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        assert time.monotonic() < deadline, f"daemon {pid} did not stop"
        time.sleep(0.05)
