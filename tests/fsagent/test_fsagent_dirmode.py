"""Plain-directory mode end to end: a sandbox without FUSE (simulated for real:
a mount namespace where ``/dev/fuse`` is ``/dev/null``), refusals reported by
name while the rest is saved, and the start-up refusals that protect a
directory. The daemon runs as a subprocess against a real controller.

(The shared contract, checkpoints, warm start, fencing, crashes and faults,
runs in both modes in test_checkpoints.py and test_checkpoint_faults*.py.)
"""

from __future__ import annotations

import errno
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from common.limits import MAX_FILE_BYTES
from fsagent.bridge.client import open_client
from fsagent.dirmode.fs import open_root
from fsagent.dirmode.scan import ENTRY_LIMIT_ENV
from fsagent.dirmode.serve import DirShipper, hydrate_directory
from fsagent.dirmode.store import DirStore
from fsagent.state.store import Store
from tests.support.agentfiles import run_receipts
from tests.support.checkpoints import assert_local_copy_discarded
from tests.support.controller import Tenant
from tests.support.mount import REPO, MountFactory, mount_factory
from tests.support.tmp import private_tmpdir
from tests.system.test_checkpoints import server_files, start_run, token_file

OCTET = {"Content-Type": "application/octet-stream"}
NO_FUSE = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           'mount --bind /dev/null /dev/fuse && exec "$0" "$@"']  # fmt: skip
"""Run a command where /dev/fuse is /dev/null: it opens, and no FUSE mount can
be made (the kernel refuses the device), as in a container without FUSE."""


@pytest.fixture
def mounts() -> Iterator[MountFactory]:
    """Plain-directory mounts only: what these tests check, a FUSE mount refuses
    at write time (test_fsagent_posix.py)."""
    with mount_factory(mode="dir") as factory:
        yield factory


def fsagent_json(*args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", *args, "--json"],
        capture_output=True, text=True, cwd=REPO, check=False, timeout=300,
    )  # fmt: skip
    assert out.returncode in (0, 4), out.stdout + out.stderr
    return json.loads(out.stdout)


def start_up(base: Path, name: str, controller: str, token: Path) -> subprocess.Popen[bytes]:
    """``fsagent up`` (mode auto) in a mount namespace without a usable FUSE device."""
    home, state = base / name / "home", base / name / "state"
    with open(base / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [*NO_FUSE, sys.executable, "-m", "fsagent.cli", "up", "--home", str(home),
             "--controller", controller, "--token-file", str(token), "--state-root", str(state),
             "--env-file", str(base / name / "env"), "--checkpoint-interval", "600"],
            cwd=REPO, stdout=log, stderr=log,
        )  # fmt: skip


def wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path) -> None:
    """Until ``ready`` (the env file, or a ready file) exists; fails if ``proc`` died."""
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.mark.fuse
def test_without_fuse_up_serves_plain_directories_that_save_and_restore(tenant: Tenant) -> None:
    run = start_run(tenant)
    folder = tenant.folder("task", run["task"])
    with tenant.client() as c:
        r = c.put(folder + "/content", params={"path": "notes/plan.md"}, content=b"the plan",
                  headers=OCTET)  # fmt: skip
        assert r.status_code == 201, r.text
    base = private_tmpdir("fsa-nofuse-")
    token = base / "token"
    token.write_text(run["token"])
    first = start_up(base, "first", tenant.controller.url, token)
    try:
        wait_ready(first, base / "first" / "env", base / "first.log")
        home = base / "first" / "home"
        out = (base / "first.log").read_text()
        assert out.count("FUSE is not available") == 1, out  # said once, for all four
        assert "a test FUSE mount failed" in out
        for scope in ("task", "agent", "user", "project"):
            assert (home / scope).is_dir() and not os.path.ismount(home / scope), scope
        assert (home / "task" / "notes" / "plan.md").read_bytes() == b"the plan"
        # An unbound collection is an empty directory nothing can be written to.
        assert list((home / "user").iterdir()) == []
        with pytest.raises(OSError) as info:
            (home / "user" / "x").write_bytes(b"x")
        assert info.value.errno in (errno.EACCES, errno.EPERM)
        [user] = fsagent_json("status", "--state-dir", str(base / "first" / "state" / "user"))[
            "collections"
        ]
        assert user["unbound"] is True and user["state"] == "serving", user
        assert user["warning"] is None  # immutable here: root's writes are stopped too
        (home / "task" / "result.txt").write_bytes(b"agent's work")
        (home / "agent" / "memory.md").write_bytes(b"remember this")
        (home / "task" / "notes" / "plan.md").write_bytes(b"the plan, revised")
        status = fsagent_json("status", "--state-dir", str(base / "first" / "state" / "task"))
        [task] = status["collections"]
        assert task["mode"]["mode"] == "dir" and task["state"] == "serving"
        assert "a test FUSE mount failed" in task["mode"]["reason"]
        assert task["unsavedChanges"] == 2
        text = subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "status", "--state-dir",
             str(base / "first" / "state" / "task")],
            capture_output=True, text=True, cwd=REPO, check=True, timeout=120,
        ).stdout  # fmt: skip
        assert text.splitlines()[1] == f"  mode: dir ({task['mode']['reason']})", text
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=180) == 0, (base / "first.log").read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert os.access(base / "first" / "home" / "user", os.W_OK)  # read-only only while served
    assert server_files(tenant, "task", run["task"]) == {
        "notes/plan.md": b"the plan, revised",
        "result.txt": b"agent's work",
    }
    assert server_files(tenant, "agent", run["agent"]) == {
        "AGENTS.md": b"",  # the agent's instruction entry, made with the agent
        "memory.md": b"remember this",
    }
    # The agent folder's local copy ends with the run (its contract); the others stay.
    assert list((base / "first" / "home" / "agent").iterdir()) == []
    assert_local_copy_discarded(base / "first" / "state" / "agent")
    assert (base / "first" / "home" / "task" / "result.txt").read_bytes() == b"agent's work"
    # A replacement sandbox (new home, no state) gets its task folder back:
    # `fsagent mount` on its own decides the same way.
    directory, ready = base / "again" / "task", base / "again" / "ready"
    directory.mkdir(parents=True)
    with open(base / "again.log", "wb") as log:
        again = subprocess.Popen(
            [*NO_FUSE, sys.executable, "-m", "fsagent.cli", "mount", "task", str(directory),
             "--controller", tenant.controller.url, "--token-file", str(token), "--state-dir",
             str(base / "again" / "state"), "--foreground", "--ready-file", str(ready)],
            cwd=REPO, stdout=log, stderr=log,
        )  # fmt: skip
    try:
        wait_ready(again, ready, base / "again.log")
        assert json.loads(ready.read_text())["mode"] == "dir"
        assert (directory / "result.txt").read_bytes() == b"agent's work"
        assert (directory / "notes" / "plan.md").read_bytes() == b"the plan, revised"
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=180) == 0, (base / "again.log").read_text()
        assert (base / "again.log").read_text().count("FUSE is not available") == 1
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_refused_paths_are_named_by_flush_and_status_and_the_rest_is_saved(
    mounts: MountFactory, tenant: Tenant
) -> None:
    run = start_run(tenant)
    folder = tenant.folder("task", run["task"])
    with tenant.client() as c:
        for path, data in (("saved.txt", b"saved"), ("linked-later.txt", b"was a file")):
            r = c.put(folder + "/content", params={"path": path}, content=data, headers=OCTET)
            assert r.status_code == 201, r.text
    secret = mounts.base / "secret"
    secret.write_bytes(b"outside the collection")
    m = mounts.mount(tenant.controller.url, scope="task", token_file=token_file(mounts, run))
    root = m.mountpoint
    os.symlink(secret, root / "link")
    os.symlink(mounts.base, root / "linked-dir")
    os.link(root / "saved.txt", root / "hard")
    os.mkfifo(root / "fifo")
    fd = os.open(root / "huge.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    os.ftruncate(fd, MAX_FILE_BYTES + 1)  # sparse
    os.close(fd)
    (root / "tab\tname").write_bytes(b"x")
    (root / "linked-later.txt").unlink()
    os.symlink(secret, root / "linked-later.txt")
    (root / "work.txt").write_bytes(b"the valid change")
    reply = m.fsagent("flush", "task")
    assert reply["ok"] is True, reply
    refused = {r["path"]: r["reason"] for r in reply["result"]["dir"]["refused"]}
    assert refused == {
        "fifo": "special_file",
        "hard": "hard_link",
        "huge.bin": "file_too_large",
        "link": "symlink",
        "linked-dir": "symlink",
        "linked-later.txt": "symlink",
        "saved.txt": "hard_link",
        "tab\tname": "invalid_name: path contains forbidden character U+0009",
    }
    assert reply["result"]["entries"] == 1
    assert server_files(tenant, "task", run["task"]) == {
        "saved.txt": b"saved",
        "linked-later.txt": b"was a file",
        "work.txt": b"the valid change",
    }
    status = m.fsagent("status")["collections"][0]
    assert status["mode"]["mode"] == "dir" and status["mode"]["reason"] == "--mode dir"
    assert {r["path"] for r in status["scan"]["refused"]} == set(refused)
    text = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "status", "--state-dir", str(m.state_dir)],
        capture_output=True, text=True, cwd=REPO, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert "refused (never saved, never followed): 8 path(s)" in text
    assert text.splitlines()[1] == "  mode: dir (--mode dir)", text
    assert "    fifo: special_file" in text and "    linked-dir: symlink" in text
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert "final save: 0 change(s) saved; 8 path(s) refused" in m.stderr()
    # The controller's receipts (the REST route) name them too, by the sandbox.
    sandbox_named = {
        "fifo": "special_file",
        "hard": "hard_link",
        "huge.bin": "file_too_large",
        "link": "symlink",
        "linked-dir": "symlink",
        "linked-later.txt": "symlink",
        "saved.txt": "hard_link",
        "tab\\tname": "invalid_name",
    }
    receipts = run_receipts(tenant, run["run_id"])
    assert [(r["outcome"], r["filesChanged"], r["final"]) for r in receipts] == [
        ("saved", 1, False),
        ("saved", 0, True),
    ]
    for receipt in receipts:
        named = {e["path"]: e["code"] for e in receipt["refusedEntries"] if e["by"] == "sandbox"}
        assert named == sandbox_named, receipt
        assert [(w["code"], w["count"]) for w in receipt["warnings"]] == [("SANDBOX_REFUSED", 8)]


def test_entries_past_the_limit_are_refused_by_name_and_the_rest_is_saved(
    mounts: MountFactory, tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 100,000-entry limit, lowered to 5 (``$FSAGENT_TEST_MAX_ENTRIES``,
    seen by the daemon and by ``status``): saved paths keep their place, new
    ones are admitted in path order, a refused directory takes its subtree
    along; the refused are named by flush, status, the final save and the
    receipts, and a freed place admits the next one."""
    monkeypatch.setenv(ENTRY_LIMIT_ENV, "5")
    run = start_run(tenant)
    folder = tenant.folder("task", run["task"])
    with tenant.client() as c:
        for path in ("a.txt", "b.txt"):
            r = c.put(folder + "/content", params={"path": path}, content=b"saved " + path.encode(),
                      headers=OCTET)  # fmt: skip
            assert r.status_code == 201, r.text
    m = mounts.mount(tenant.controller.url, scope="task", token_file=token_file(mounts, run))
    root = m.mountpoint
    for name in ("c.txt", "d.txt", "e.txt", "f.txt"):
        (root / name).write_bytes(name.encode())
    (root / "g").mkdir()
    (root / "g" / "h.txt").write_bytes(b"h")
    reply = m.fsagent("flush", "task")
    assert reply["ok"] is True, reply
    refused = {r["path"]: r["reason"] for r in reply["result"]["dir"]["refused"]}
    assert refused == {"f.txt": "entry_limit", "g": "entry_limit", "g/h.txt": "entry_limit"}
    saved = {"a.txt": b"saved a.txt", "b.txt": b"saved b.txt", "c.txt": b"c.txt",
             "d.txt": b"d.txt", "e.txt": b"e.txt"}  # fmt: skip
    assert server_files(tenant, "task", run["task"]) == saved
    status = m.fsagent("status")["collections"][0]
    assert {r["path"]: r["reason"] for r in status["scan"]["refused"]} == refused
    text = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "status", "--state-dir", str(m.state_dir)],
        capture_output=True, text=True, cwd=REPO, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert "refused (never saved, never followed): 3 path(s)" in text, text
    assert "    f.txt: entry_limit" in text and "    g/h.txt: entry_limit" in text

    # A saved path keeps its place (b.txt, rewritten); a deleted one frees
    # its place for the first refused path, f.txt.
    (root / "c.txt").unlink()
    (root / "b.txt").write_bytes(b"b, rewritten")
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert "final save: 3 change(s) saved; 2 path(s) refused" in m.stderr(), m.stderr()
    del saved["c.txt"]
    assert server_files(tenant, "task", run["task"]) == {
        **saved, "b.txt": b"b, rewritten", "f.txt": b"f.txt",
    }  # fmt: skip
    receipts = run_receipts(tenant, run["run_id"])
    assert [(r["outcome"], r["filesChanged"], r["final"]) for r in receipts] == [
        ("saved", 3, False),
        ("saved", 3, True),
    ]
    named = [
        {e["path"]: e["code"] for e in r["refusedEntries"] if e["by"] == "sandbox"}
        for r in receipts
    ]
    assert named == [
        {"f.txt": "entry_limit", "g": "entry_limit", "g/h.txt": "entry_limit"},
        {"g": "entry_limit", "g/h.txt": "entry_limit"},
    ]


def test_an_unbound_directory_root_can_write_to_is_named_by_a_warning_and_status(
    mounts: MountFactory,
) -> None:
    """As root, an unbound collection is made immutable, since its mode does not
    stop root. On a filesystem without the flag (ramfs, in a mount namespace
    of the daemon's own), a WARNING names the directory and ``status`` shows
    the collection with that warning while it is served."""
    if os.getuid() != 0:
        pytest.skip("needs root: only root's writes get past the directory's mode")
    src = mounts.source({"agent": {"a.txt": b"bound"}})  # the user folder is unbound
    ramfs = mounts.base / "ramfs"
    ramfs.mkdir()
    directory, state = ramfs / "user", mounts.base / "state" / "user"
    ready, log = mounts.base / "user.ready", mounts.base / "unbound.log"
    on_ramfs = 'mount -t ramfs none "$0" && mkdir "$0/user" && exec "$@"'
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", on_ramfs, str(ramfs),
             sys.executable, "-m", "fsagent.cli", "mount", "user", str(directory), "--controller",
             f"dir:{src}", "--state-dir", str(state), "--mode", "dir", "--foreground",
             "--ready-file", str(ready)],
            cwd=REPO, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        wait_ready(proc, ready, log)
        warning = json.loads(ready.read_text())["warning"]
        assert warning.startswith(
            f"{directory} is read-only by its mode alone: the immutable flag cannot be set there ("
        ), warning
        assert warning.endswith(
            "), so a process running as root can still write into it, and nothing written "
            "there is saved"
        ), warning
        logged = [json.loads(line) for line in log.read_text().splitlines() if line[:1] == "{"]
        assert [r["msg"] for r in logged if r["level"] == "WARNING"] == [warning], logged
        # What it warns of: root writes into it (in the daemon's mount namespace).
        wrote = subprocess.run(
            ["nsenter", "-t", str(proc.pid), "-m", "sh", "-c", f'echo x > "{directory}/root-wrote"'],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert wrote.returncode == 0, wrote.stderr
        [row] = fsagent_json("status", "--state-dir", str(state))["collections"]
        assert row["unbound"] is True and row["warning"] == warning, row
        assert (row["scope"], row["state"], row["pid"], row["mountpoint"], row["ownerId"]) == (
            "user",
            "serving",
            proc.pid,
            str(directory),
            None,
        )
        assert row["mode"] == {"mode": "dir", "reason": "--mode dir", "path": str(directory)}
        text = subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "status", "--state-dir", str(state)],
            capture_output=True, text=True, cwd=REPO, check=True, timeout=120,
        ).stdout  # fmt: skip
        assert text.splitlines() == [
            f"user: unbound (nothing is saved), read-only, serving at {directory} (pid {proc.pid})",
            "  mode: dir (--mode dir)",
            f"  warning: {warning}",
        ], text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The record lives only while the daemon serves; no state dir was made.
    assert not (mounts.base / "state" / "user.unbound").exists()
    assert not state.exists()


class Terminal:
    """A command whose stdout and stderr are a pseudo-terminal (output
    post-processing off, so what it writes is read byte for byte)."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=slave,
                                     stderr=slave)  # fmt: skip
        os.close(slave)
        self.out = b""

    def read_until(self, text: str, timeout: float = 120) -> str:
        """What it wrote until ``text`` (or, with ``text`` empty, until it closed)."""
        deadline = time.monotonic() + timeout
        while not text or text.encode() not in self.out:
            assert time.monotonic() < deadline, self.out
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: every writer closed it
                    chunk = b""
                if not chunk:
                    assert not text, self.out
                    break
                self.out += chunk
        return self.out.decode()

    def close(self) -> None:
        if self.proc.poll() is None:  # up stops its daemons on SIGTERM, not on a kill
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self.master)


def progress_frames(out: str, prefix: str) -> list[str]:
    """The frames of the progress line (each ``\r``, the line, clear to its
    end), which ends with a newline; nothing else is written into it."""
    start = out.index("\r" + prefix)
    line, _, _ = out[start:].partition("\n")
    frames = line.split("\r")[1:]
    assert all(f.startswith(prefix) and f.endswith("\x1b[K") for f in frames), frames
    return [f[len(prefix) : -len("\x1b[K")] for f in frames]


def test_hydration_progress_is_one_line_on_the_terminal_of_up_and_of_mount(
    mounts: MountFactory,
) -> None:
    """On a terminal, ``up`` shows the hydration of all its plain directories
    as one line rewritten in place (its daemons write no lines of their own
    into it), a detaching ``mount`` shows its daemon's, whose stderr is the
    log, and a daemon in the foreground shows its own."""
    mib = 1 << 20
    task = {f"t{i}.bin": bytes([i]) * mib for i in range(4)}
    src = mounts.source({"task": task, "agent": {"a.txt": b"a", "b.txt": b"b"}},
                        fetch_delay=0.3)  # fmt: skip
    home, state = mounts.base / "home", mounts.base / "state"
    up = Terminal(
        [sys.executable, "-m", "fsagent.cli", "up", "--home", str(home), "--controller",
         f"dir:{src}", "--state-root", str(state), "--env-file", str(mounts.base / "env"),
         "--mode", "dir", "--prefetch", "1", "--checkpoint-interval", "600"]
    )  # fmt: skip
    try:
        out = up.read_until("; environment in ")
        frames = progress_frames(out, "fsagent up: filling ")
        assert frames[-1] == "task: 4/4 files, 4.0/4.0 MiB; agent: 2/2 files, 0.0/0.0 MiB", out
        assert len(frames) >= 2, frames  # 1.2 s of downloads: shown while they ran
        # Each collection's figures as its daemon writes them, in the order of
        # the scopes; the task folder's grow.
        figures = re.compile(
            r"(task: (\d)/4 files, \d\.0/4\.0 MiB)?(; )?(agent: \d/2 files, 0\.0/0\.0 MiB)?"
        )
        done = [figures.fullmatch(f) for f in frames]
        assert all(done), frames
        task_done = [int(m.group(2)) for m in done if m and m.group(2)]
        assert task_done == sorted(task_done) and task_done[0] < 4, frames
        after = out[out.index(frames[-1]) :].split("\n")[1:]
        assert after[0].startswith("fsagent: ready (plain directories, dir mode): task, agent, "), (
            out
        )
        # Nothing of the daemons' own: no line of theirs, ready or hydrated.
        assert "fsagent: task" not in out and "hydrated" not in out and "ready at" not in out, out
        assert (home / "task" / "t3.bin").read_bytes() == bytes([3]) * mib
        up.proc.send_signal(signal.SIGTERM)
        up.read_until("")
        assert up.proc.wait(timeout=120) == 0, up.out
    finally:
        up.close()

    directory = mounts.base / "detached"
    directory.mkdir()
    mount = Terminal(
        [sys.executable, "-m", "fsagent.cli", "mount", "task", str(directory), "--controller",
         f"dir:{src}", "--state-dir", str(mounts.base / "detached-state"), "--mode", "dir",
         "--prefetch", "1"]
    )  # fmt: skip
    try:
        out = mount.read_until("")
        assert mount.proc.wait(timeout=60) == 0, out
        frames = progress_frames(out, "fsagent: ")
        assert frames[-1] == "task: 4/4 files, 4.0/4.0 MiB" and len(frames) >= 2, out
        assert out.split("\n")[1].startswith(f"fsagent: task ready at {directory} (dir mode, pid ")
        assert (directory / "t0.bin").read_bytes() == bytes([0]) * mib
    finally:
        mount.close()
        stop_detached(mounts.base / "detached-state")

    # In the foreground the daemon shows its own, on its own terminal.
    directory, ready = mounts.base / "foreground", mounts.base / "foreground.ready"
    directory.mkdir()
    mount = Terminal(
        [sys.executable, "-m", "fsagent.cli", "mount", "task", str(directory), "--controller",
         f"dir:{src}", "--state-dir", str(mounts.base / "foreground-state"), "--mode", "dir",
         "--prefetch", "1", "--foreground", "--ready-file", str(ready)]
    )  # fmt: skip
    try:
        out = mount.read_until(f"fsagent: task ready at {directory} (dir mode: --mode dir)")
        frames = progress_frames(out, "fsagent: ")
        assert frames[-1] == "task: 4/4 files, 4.0/4.0 MiB" and len(frames) >= 2, out
        assert out.split("\n")[1].startswith("fsagent: hydrated 4 entries in "), out
        mount.proc.send_signal(signal.SIGTERM)
        mount.read_until("")
        assert mount.proc.wait(timeout=60) == 0, mount.out
    finally:
        mount.close()


def stop_detached(state_dir: Path) -> None:
    """Stop the daemon a detaching ``mount`` left running, if it is."""
    daemon = state_dir / "daemon.json"
    if daemon.exists():
        os.kill(json.loads(daemon.read_text())["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while daemon.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_dir_mode_fills_only_an_empty_directory_and_needs_no_pyfuse3(mounts: MountFactory) -> None:
    src = mounts.source({"agent": {"a.txt": b"from the source"}})
    m = mounts.mount(src, start=False)
    m.mountpoint.mkdir()
    (m.mountpoint / "mine.txt").write_bytes(b"already here")
    proc = subprocess.run(m.argv(), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 5, proc.stderr
    assert "is not empty; dir mode fills an empty directory" in proc.stderr
    assert os.listdir(m.mountpoint) == ["mine.txt"]
    assert (m.mountpoint / "mine.txt").read_bytes() == b"already here"
    # Emptied, it is filled, by a daemon that cannot load pyfuse3 (a sandbox
    # without libfuse): dir mode never needs it.
    (m.mountpoint / "mine.txt").unlink()
    no_pyfuse3 = "import sys; sys.modules['pyfuse3'] = None; from fsagent.cli import main; "
    argv = [sys.executable, "-c", no_pyfuse3 + "sys.exit(main(sys.argv[1:]))", *m.argv()[3:]]
    with open(mounts.base / "no-pyfuse3.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log)
    try:
        wait_ready(proc, m.ready_file, mounts.base / "no-pyfuse3.log")
        assert (m.mountpoint / "a.txt").read_bytes() == b"from the source"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (mounts.base / "no-pyfuse3.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_mount_detaches_once_the_directory_is_ready(mounts: MountFactory) -> None:
    src = mounts.source({"agent": {"a.txt": b"hydrated before mount returns"}})
    m = mounts.mount(src, start=False)
    m.mountpoint.mkdir()
    argv = [a for a in m.argv() if a != "--foreground"]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"agent ready at {m.mountpoint} (dir mode" in res.stdout
    assert (m.mountpoint / "a.txt").read_bytes() == b"hydrated before mount returns"
    daemon = json.loads((m.state_dir / "daemon.json").read_text())
    os.kill(daemon["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 60
    while (m.state_dir / "daemon.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.fuse
def test_auto_never_serves_a_fuse_collection_as_a_directory(mounts: MountFactory) -> None:
    src = mounts.source({"agent": {"a.txt": b"saved"}})
    state = mounts.base / "fuse-state"
    store = Store.open(state)
    store.tree.hydrate([], 1)  # a FUSE collection that may hold unsaved changes
    store.dir.claim_mode("fuse", "a test mount works", "/elsewhere")
    store.close()
    directory = mounts.base / "agent"
    directory.mkdir()
    res = subprocess.run(
        [*NO_FUSE, sys.executable, "-m", "fsagent.cli", "mount", "agent", str(directory),
         "--controller", f"dir:{src}", "--state-dir", str(state), "--foreground"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert res.returncode == 5, res.stderr
    assert "FUSE is not available here" in res.stderr
    assert "holds a FUSE collection" in res.stderr
    assert os.listdir(directory) == []


def run_fsagent(
    *args: str, home: Path, extra: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """An fsagent command with ``home`` as $HOME (doctor's state root is under it)."""
    return subprocess.run(
        [*(extra or []), sys.executable, "-m", "fsagent.cli", *args],
        capture_output=True, text=True, cwd=REPO, check=False, timeout=300,
        env={**os.environ, "HOME": str(home)},
    )  # fmt: skip


def start_up_here(base: Path, name: str, state: Path, controller: str, token: Path,
                  *mode: str) -> subprocess.Popen[bytes]:  # fmt: skip
    """``fsagent up`` where FUSE works, with ``state`` as its state root."""
    with open(base / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fsagent.cli", "up", "--home", str(base / "home"),
             "--controller", controller, "--token-file", str(token), "--state-root", str(state),
             "--env-file", str(base / f"{name}.env"), "--checkpoint-interval", "600", *mode],
            cwd=REPO, stdout=log, stderr=log,
        )  # fmt: skip


def stop_up(proc: subprocess.Popen[bytes], log: Path) -> None:
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.fuse
def test_auto_keeps_a_dir_mode_sandbox_in_dir_mode_where_fuse_works(tenant: Tenant) -> None:
    """A sandbox first served as plain directories (``up --mode dir``), started
    again with ``auto`` where FUSE works: ``up``, ``doctor`` and ``mount``
    follow the mode its state records, and say that the recorded state chose it."""
    run = start_run(tenant)
    base = private_tmpdir("fsa-recorded-")
    token = base / "token"
    token.write_text(run["token"])
    state = base / ".local" / "state" / "fsagent"  # doctor's state root, with HOME=base
    home = base / "home"
    try:
        first = start_up_here(base, "first", state, tenant.controller.url, token, "--mode", "dir")
        try:
            wait_ready(first, base / "first.env", base / "first.log")
            (home / "task" / "result.txt").write_bytes(b"saved in dir mode")
        finally:
            stop_up(first, base / "first.log")
        assert "stay plain directories" not in (base / "first.log").read_text()  # --mode dir

        # doctor decides as up does: the record, not the working FUSE.
        res = run_fsagent("doctor", "--home", str(home), "--json", home=base)
        assert res.returncode == 0, res.stdout + res.stderr
        checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
        assert checks["mode"]["status"] == "ok"
        assert checks["mode"]["detail"] == (
            "dir (the state dirs of task, project record dir mode (they hold plain-directory "
            "collections); FUSE not tried); in use: task=dir, project=dir"
        )
        for name in ("fusermount3", "/dev/fuse"):
            assert checks[name]["status"] == "skip", checks[name]
            assert checks[name]["detail"].endswith("(not needed: dir mode)"), checks[name]

        again = start_up_here(base, "again", state, tenant.controller.url, token)
        try:
            wait_ready(again, base / "again.env", base / "again.log")
            out = (base / "again.log").read_text()
            assert out.count("fsagent up: the work folders stay plain directories (dir mode): "
                             "the state dirs of task, project record dir mode") == 1, out  # fmt: skip
            assert "FUSE is not available" not in out
            assert (
                f"ready (plain directories, dir mode): task, agent, user, project under {home}"
                in out
            )
            for scope in ("task", "agent", "user", "project"):
                assert not os.path.ismount(home / scope), scope
            assert (home / "task" / "result.txt").read_bytes() == b"saved in dir mode"
            [task] = fsagent_json("status", "--state-dir", str(state / "task"))["collections"]
            assert task["mode"]["mode"] == "dir", task["mode"]
            assert "the state dirs of task, project record dir mode" in task["mode"]["reason"]
            (home / "task" / "more.txt").write_bytes(b"saved again")
        finally:
            stop_up(again, base / "again.log")
        assert server_files(tenant, "task", run["task"]) == {
            "result.txt": b"saved in dir mode",
            "more.txt": b"saved again",
        }

        # `fsagent mount` alone (auto) says the same of its one collection.
        ready = base / "task.ready"
        with open(base / "mount.log", "wb") as log:
            mount = subprocess.Popen(
                [sys.executable, "-m", "fsagent.cli", "mount", "task", str(home / "task"),
                 "--controller", tenant.controller.url, "--token-file", str(token),
                 "--state-dir", str(state / "task"), "--foreground", "--ready-file", str(ready)],
                cwd=REPO, stdout=log, stderr=log,
            )  # fmt: skip
        try:
            wait_ready(mount, ready, base / "mount.log")
            assert json.loads(ready.read_text())["mode"] == "dir"
        finally:
            stop_up(mount, base / "mount.log")
        out = (base / "mount.log").read_text()
        assert out.count("fsagent: task stays a plain directory (dir mode): the state dir "
                         "records dir mode (it holds a plain-directory collection); "
                         "FUSE not tried") == 1, out  # fmt: skip
        assert "FUSE is not available" not in out
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.fuse
def test_a_sandbox_of_mixed_records_serves_each_collection_in_its_own_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where records differ (one collection mounted by hand with ``--mode
    dir``), each follows its own and the ones without a record follow the
    probe; where all records say dir, FUSE is not even tried."""
    from fsagent.commands.up import say_dir_mode, served_as
    from fsagent.fuse import probe as fuseprobe

    dirs = {scope: tmp_path / scope for scope in ("task", "agent", "user", "project")}
    plain = DirStore.open(dirs["task"])
    plain.dir.claim_mode("dir", "--mode dir", "/home/agent/task")
    plain.close()
    fused = Store.open(dirs["agent"])
    fused.tree.hydrate([], 1)
    fused.dir.claim_mode("fuse", "a test mount works", "/home/agent/agent")
    fused.close()
    modes = fuseprobe.decide_all("auto", dirs)
    assert {s: d.mode for s, d in modes.items()} == {
        "task": "dir", "agent": "fuse", "user": "fuse", "project": "fuse",
    }  # fmt: skip
    assert modes["task"].recorded and modes["task"].reason == fuseprobe.DIR_STATE
    assert modes["agent"].reason.endswith(fuseprobe.FUSE_STATE)
    assert modes["user"].reason == "/dev/fuse opens and a test mount works"
    say_dir_mode(modes)
    assert capsys.readouterr().err == (
        "fsagent up: task stays a plain directory (dir mode): the state dir records dir mode "
        "(it holds a plain-directory collection); FUSE not tried; the others are FUSE mounts\n"
    )
    assert served_as(modes) == (
        "mounted agent, user, project; ready (plain directories, dir mode): task"
    )
    # --mode decides for all, whatever is recorded.
    assert {d.mode for d in fuseprobe.decide_all("dir", dirs).values()} == {"dir"}

    shutil.rmtree(dirs["agent"])

    def no_probe(timeout: float = 0.0) -> fuseprobe.Decision:
        raise AssertionError("FUSE was tried")

    monkeypatch.setattr(fuseprobe, "probe_fuse", no_probe)
    modes = fuseprobe.decide_all("auto", dirs)
    assert {d.mode for d in modes.values()} == {"dir"}
    assert all(d.recorded for d in modes.values())


def test_a_torn_write_is_never_saved_and_saves_whole_later(tenant: Tenant, tmp_path: Path) -> None:
    """The shipper of a plain directory, in process against the real controller:
    a file rewritten while it is read is left out (reported as retrying) while
    the rest saves, and the next checkpoint saves it whole."""
    run = start_run(tenant)
    directory = tmp_path / "task"
    directory.mkdir()
    busy = directory / "busy.bin"

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        client = open_client(tenant.controller.url, run["token"])
        fd = open_root(directory)
        store = DirStore.open(tmp_path / "state")
        try:
            store.attach(fd)
            await hydrate_directory(store, client, "task", fd, 2)
            shipper = DirShipper(store, client, "task", run["lease_epoch"])
            busy.write_bytes(b"A" * (3 << 20))
            (directory / "calm.txt").write_bytes(b"calm")

            def rewrite(path: str) -> None:
                if path == "busy.bin":  # each read: the second half changes under the reader
                    with open(busy, "r+b") as fh:
                        fh.seek(3 << 19)
                        fh.write(os.urandom(3 << 19))

            store.after_read = rewrite
            first = (await shipper.ship_checkpoint()).to_json()
            first["dir"] = shipper.last_report
            store.after_read = None
            second = (await shipper.ship_checkpoint()).to_json()
            second["dir"] = shipper.last_report
            return first, second
        finally:
            store.close()
            os.close(fd)
            await client.aclose()

    first, second = trio.run(scenario)
    assert first["entries"] == 1 and first["dir"]["retrying"] == ["busy.bin"]
    assert second["entries"] == 1 and second["dir"]["retrying"] == []
    assert server_files(tenant, "task", run["task"]) == {
        "calm.txt": b"calm",
        "busy.bin": busy.read_bytes(),
    }


@pytest.mark.fuse
def test_the_fuse_probe_says_dir_when_the_device_refuses_or_the_test_mount_hangs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The two ways ``auto`` falls back besides a failed mount: /dev/fuse
    that does not open, and a test mount that does not finish in time (the
    probe process is killed and its mountpoint lazily unmounted and removed)."""
    from fsagent.fuse import probe as fuseprobe

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    works = fuseprobe.probe_fuse()
    assert (works.mode, works.reason) == ("fuse", "/dev/fuse opens and a test mount works")
    slow = fuseprobe.probe_fuse(timeout=0.001)
    assert slow.mode == "dir" and slow.reason.startswith("a test FUSE mount did not finish")
    assert list(tmp_path.iterdir()) == []  # the probe's mountpoint is gone
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()

    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any) -> int:
        if str(path) == "/dev/fuse":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(fuseprobe.os, "open", refusing_open)
    refused = fuseprobe.probe_fuse()
    assert (refused.mode, refused.reason) == (
        "dir",
        "/dev/fuse cannot be opened (Permission denied)",
    )
