"""State dirs, bindings and the CLI around the mount: helper errors, status, up.

(``fsagent doctor`` is tested in test_fsagent_launch.py.)"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsagent.commands.envfile import read_env_file
from tests.support.mount import (
    REPO,
    MountError,
    MountFactory,
    mount_as_user,
    system_python_matches,
)

pytestmark = pytest.mark.fuse


def fsagent(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsagent.cli", *args],
        capture_output=True, text=True, cwd=REPO, env=env, check=False, timeout=120,
    )  # fmt: skip


def mount_fails(mounts: MountFactory, src: Path, **kw: object) -> str:
    """Start a mount that must fail; the helper reports the daemon's exit and stderr."""
    started = time.monotonic()
    with pytest.raises(MountError) as info:
        mounts.mount(src, **kw)  # type: ignore[arg-type]
    assert time.monotonic() - started < 20, "the helper did not fail fast"
    return str(info.value)


def tree(root: Path) -> dict[str, bytes]:
    """Contents of a state dir, without LMDB's reader table (it changes on every open)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name != "lock.mdb"
    }


def test_helper_fails_fast_with_the_daemon_message_on_a_foreign_state_dir(
    mounts: MountFactory,
) -> None:
    foreign = mounts.base / "not-state"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's")
    msg = mount_fails(mounts, mounts.source(), state_dir=foreign)
    assert "exited with 3" in msg and "is not an fsagent state dir" in msg
    assert tree(foreign) == {"notes.txt": b"someone else's"}


def test_corrupt_state_dir_is_refused_and_kept(mounts: MountFactory) -> None:
    m = mounts.mount()
    (m.mountpoint / "work").write_bytes(b"unsaved")
    assert m.signal(signal.SIGTERM) == 0
    db = m.state_dir / "db" / "data.mdb"
    db.write_bytes(b"\0garbage" * 100)
    before = tree(m.state_dir)
    msg = mount_fails(mounts, Path(m.controller[4:]), state_dir=m.state_dir)
    assert "exited with 3" in msg and "not a readable fsagent database" in msg
    assert tree(m.state_dir) == before


def test_state_bound_to_another_owner_is_refused_and_kept(mounts: MountFactory) -> None:
    first_src = mounts.source()
    m = mounts.mount(first_src)
    (m.mountpoint / "mine").write_bytes(b"first run's work")
    assert m.signal(signal.SIGTERM) == 0
    before = tree(m.state_dir)
    other_src = mounts.source()  # same scope, another agent
    msg = mount_fails(mounts, other_src, state_dir=m.state_dir)
    assert "exited with 3" in msg and "belongs to company" in msg
    assert tree(m.state_dir) == before
    # A run with a different task binding (same agent) may not reuse it either.
    run = json.loads((first_src / "run.json").read_text())
    run["bindings"]["task"] = "11111111-1111-1111-1111-111111111111"
    (first_src / "run.json").write_text(json.dumps(run))
    msg = mount_fails(mounts, first_src, state_dir=m.state_dir)
    assert "exited with 3" in msg and "task=11111111" in msg
    run["bindings"]["task"] = None
    (first_src / "run.json").write_text(json.dumps(run))
    again = mounts.mount(first_src, state_dir=m.state_dir)
    assert (again.mountpoint / "mine").read_bytes() == b"first run's work"


def test_state_dir_in_use_by_another_daemon(mounts: MountFactory) -> None:
    m = mounts.mount()
    msg = mount_fails(mounts, Path(m.controller[4:]), state_dir=m.state_dir)
    assert "exited with 3" in msg and "in use" in msg
    assert os.path.ismount(m.mountpoint)


def test_status_reports_owner_unsaved_changes_and_state(mounts: MountFactory) -> None:
    src = mounts.source()
    owner = json.loads((src / "run.json").read_text())["bindings"]["agent"]
    m = mounts.mount(src)
    (m.mountpoint / "a").write_bytes(b"1")
    (m.mountpoint / "d").mkdir()
    (m.mountpoint / "gone").write_bytes(b"x")
    (m.mountpoint / "gone").unlink()
    status = m.fsagent("status")["collections"][0]
    assert status["ownerId"] == owner and status["scope"] == "agent"
    assert status["unsavedChanges"] == 2 and status["state"] == "mounted"
    assert status["mountpoint"] == str(m.mountpoint)
    text = fsagent("status", "--state-dir", str(m.state_dir)).stdout
    assert text.startswith(f"agent: owner {owner}, 2 unsaved change(s), mounted at")
    assert text.splitlines()[1] == "  mode: fuse (--mode fuse)", text
    assert m.signal(signal.SIGTERM) == 0
    assert m.fsagent("status")["collections"][0]["state"] == "stopped"


def test_up_mounts_all_four_and_writes_the_env_file(mounts: MountFactory) -> None:
    src = mounts.source({"agent": {"a.txt": b"agent file"}, "task": {"t.txt": b"task file"}})
    home = mounts.base / "home"
    state_root = mounts.base / "state-root"
    env_file = mounts.base / "agent.env"
    log = open(mounts.base / "up.log", "wb")  # noqa: SIM115 - handed to the child, closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsagent.cli", "up", "--home", str(home), "--controller",
         f"dir:{src}", "--state-root", str(state_root), "--env-file", str(env_file)],
        cwd=REPO, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not env_file.exists():
            assert proc.poll() is None, (mounts.base / "up.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        env = read_env_file(env_file)
        assert env == {"AGENT_HOME": str(home / "agent"), "PAPERCLIP_AGENT_DIR": str(home / "agent"),
                       "PAPERCLIP_TASK_DIR": str(home / "task")}  # fmt: skip
        for scope in ("task", "agent", "user", "project"):
            assert os.path.ismount(home / scope), scope
        assert (home / "agent" / "a.txt").read_bytes() == b"agent file"
        assert (home / "task" / "t.txt").read_bytes() == b"task file"
        (home / "task" / "new").write_bytes(b"new")
        with pytest.raises(OSError) as info:
            (home / "user" / "x").write_bytes(b"x")
        assert info.value.errno == errno.EROFS
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for scope in ("task", "agent", "user", "project"):
            assert not os.path.ismount(home / scope), scope
        res = fsagent("status", "--state-dir", str(state_root / "task"), "--json")
        status = json.loads(res.stdout)["collections"][0]
        assert status["unsavedChanges"] == 1
        fuse_env = env_file.read_bytes()
        # The same sandbox served as plain directories (dir mode, a state root
        # of its own, the same home, empty once unmounted): the same env file.
        assert os.listdir(home / "task") == []
        dir_env = mounts.base / "agent-dir.env"
        with open(mounts.base / "up-dir.log", "wb") as dir_log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fsagent.cli", "up", "--home", str(home), "--controller",
                 f"dir:{src}", "--state-root", str(mounts.base / "state-root-dir"),
                 "--env-file", str(dir_env), "--mode", "dir"],
                cwd=REPO, stdout=dir_log, stderr=dir_log,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while not dir_env.exists():
            assert proc.poll() is None, (mounts.base / "up-dir.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (home / "agent" / "a.txt").read_bytes() == b"agent file"
        assert not os.path.ismount(home / "agent")
        assert dir_env.read_bytes() == fuse_env
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (mounts.base / "up-dir.log").read_text()
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for scope in ("task", "agent", "user", "project"):
            subprocess.run(["fusermount3", "-u", "-z", str(home / scope)], capture_output=True,
                           check=False)  # fmt: skip


def test_allow_other_lets_another_user_use_the_mount(mounts: MountFactory) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    src = mounts.source({"agent": {"shared.txt": b"readable"}})
    private = mounts.mount(src, extra=["--prefetch", "0"])
    shared = mounts.mount(mounts.source({"agent": {"shared.txt": b"readable"}}),
                          extra=["--allow-other"])  # fmt: skip
    os.chmod(mounts.base, 0o755)

    def as_nobody(code: str, root: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["/usr/bin/python3", "-c", code, str(root)], capture_output=True, text=True,
            user=65534, group=65534, check=False, cwd="/",
        )  # fmt: skip

    read = "import sys; print(open(sys.argv[1] + '/shared.txt').read())"
    write = (
        "import sys, errno\ntry:\n  open(sys.argv[1] + '/new', 'w')\n"
        "except OSError as e: print(errno.errorcode[e.errno])"
    )
    denied = as_nobody(read, private.mountpoint)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert as_nobody(read, shared.mountpoint).stdout == "readable\n"
    # default_permissions: the file modes still apply to the other user.
    assert as_nobody(write, shared.mountpoint).stdout.strip() == "EACCES"


def test_unprivileged_daemon_mounts_through_fusermount3(mounts: MountFactory) -> None:
    """The usual sandbox case: fsagent runs as the agent's own, unprivileged user."""
    if os.getuid() != 0:
        pytest.skip("needs root to start the daemon as another user")
    if not system_python_matches():
        pytest.skip("no system python with the same ABI as the venv")
    nobody = 65534
    src = mounts.source({"agent": {"saved.txt": b"saved"}})
    m = mount_as_user(mounts, src, nobody)

    def as_nobody(cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, user=nobody,
                              group=nobody, cwd="/", check=False)  # fmt: skip

    mp = m.mountpoint
    res = as_nobody(
        f"cat {mp}/saved.txt && echo new > {mp}/new && cat {mp}/new && stat -c %u {mp}/new"
    )
    assert res.stdout.split() == ["savednew", str(nobody)], res.stderr
    # Without allow_other even root is kept out of the agent's mount.
    with pytest.raises(PermissionError):
        os.listdir(mp)
    assert as_nobody(f"fusermount3 -u {mp}").returncode == 0
    assert m.proc is not None and m.proc.wait(timeout=30) == 0
    assert (m.state_dir / "upper").stat().st_uid == nobody


def test_mount_without_foreground_detaches_and_sigint_unmounts(mounts: MountFactory) -> None:
    src = mounts.source({"agent": {"a": b"A"}})
    mp, state = mounts.base / "bg-mnt", mounts.base / "bg" / "agent"
    mp.mkdir()
    res = fsagent(
        "mount", "agent", str(mp), "--controller", f"dir:{src}", "--state-dir", str(state)
    )
    assert res.returncode == 0, res.stderr
    try:
        assert "agent mounted at" in res.stdout and os.path.ismount(mp)
        assert (mp / "a").read_bytes() == b"A"
        pid = json.loads((state / "daemon.json").read_text())["pid"]
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while os.path.ismount(mp):
            assert time.monotonic() < deadline, "SIGINT did not unmount"
            time.sleep(0.05)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True, check=False)
    assert "mounted" in (mounts.base / "bg" / "agent.log").read_text()
