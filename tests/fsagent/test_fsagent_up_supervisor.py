"""``fsagent up`` as a supervisor (fsagent/commands/up.py), end to end: the real
command against a real controller, real FUSE mounts and real Git.

Each test starts ``up`` in a session of its own (so a signal to its process
group is what a terminal's Ctrl-C or a container runtime sends) and finds its
children in /proc by the test's unique base path in their command lines.
Every wait polls a condition under a generous deadline; the assertions are
on exit codes, process lists, mounts and the bytes the controller holds."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from fsagent.checkpoint.lifecycle import FINAL_PAUSE_ENV
from fsagent.cli import build_parser
from fsagent.commands.up import (
    REQUEST_SECONDS,
    RESTART_FIRST_DELAY,
    RESTART_LIMIT,
    RESTART_MAX_DELAY,
    Child,
    describe_exit,
    handles_sigterm,
    stop_grace,
)
from fsagent.errors import EXIT_SAVE_FAILED
from tests.support.agentfiles import run_receipts
from tests.support.bridge import Run, start_run
from tests.support.constants import REPO
from tests.support.controller import ControllerProcess, Tenant
from tests.support.gitrepos import RepoTask, git, make_origin, new_repo_task
from tests.support.lossy_proxy import LossyProxy
from tests.support.tmp import mounts_under, private_tmpdir

SCOPES = ("task", "agent", "user", "project")
START_SECONDS = 240.0
"""Deadline for ``up`` to serve everything on a shared, loaded machine."""
STOP_SECONDS = 300.0


@dataclass
class Up:
    """One ``fsagent up`` process and its sandbox's paths."""

    base: Path
    proc: subprocess.Popen[bytes]

    @property
    def home(self) -> Path:
        return self.base / "home"

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def env_file(self) -> Path:
        return self.base / "env"

    def log(self) -> str:
        return (self.base / "up.log").read_text(errors="replace")

    def wait(self, timeout: float = STOP_SECONDS) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"fsagent up still runs after {timeout:.0f}s:\n{self.log()}")


def interruptible() -> None:
    """``up`` takes SIGINT as from a terminal, however the tests were started:
    a background job of a script ignores SIGINT, and ``up`` keeps an
    inherited SIG_IGN (fsagent.commands.up.StopRequest)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_up(
    ups: list[Up], controller: str, run: Run, *extra: str, env: dict[str, str] | None = None
) -> Up:
    base = private_tmpdir("fsa-sup-")
    (base / "token").write_text(run.token)
    with open(base / "up.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsagent.cli", "up", "--home", str(base / "home"),
             "--controller", controller, "--token-file", str(base / "token"),
             "--state-root", str(base / "state"), "--env-file", str(base / "env"),
             "--checkpoint-interval", "600", *extra],
            cwd=REPO, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env, preexec_fn=interruptible,
        )  # fmt: skip
    ups.append(Up(base, proc))
    return ups[-1]


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    session: int
    argv: list[str]


def processes_under(base: Path) -> dict[int, Proc]:
    """Every live process whose command line names a path below ``base``."""
    marker = str(base)
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        argv = [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]
        if not any(marker in a for a in argv):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        found[int(entry)] = Proc(int(entry), int(fields[1]), int(fields[3]), argv)
    return found


def children(up: Up) -> dict[str, Proc]:
    """``up``'s fsagent children by role: a scope, ``repos`` or ``bridge``."""
    out = {}
    for p in processes_under(up.base).values():
        if p.ppid != up.proc.pid or p.argv[1:3] != ["-m", "fsagent.cli"]:
            continue
        out[p.argv[4] if p.argv[3] == "mount" else p.argv[3]] = p
    return out


def wait_for(what: str, condition: Callable[[], bool], up: Up | None = None,
             timeout: float = START_SECONDS) -> None:  # fmt: skip
    """Poll ``condition`` until true; fail at once if ``up`` exited meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        if up is not None and up.proc.poll() is not None:
            pytest.fail(f"up exited {up.proc.returncode} waiting for {what}:\n{up.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s" + (f":\n{up.log()}" if up else ""))
        time.sleep(0.02)


def assert_nothing_left(up: Up) -> None:
    """No process of the sandbox and no mount (alive or dead) below it."""
    wait_for("end of every child", lambda: not processes_under(up.base), timeout=STOP_SECONDS)
    assert mounts_under(up.base) == [], up.log()


@pytest.fixture
def ups() -> Iterator[list[Up]]:
    """Each ``up`` the test started (:func:`start_up`); what still runs is stopped at the end."""
    started: list[Up] = []
    yield started
    for up in started:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)
            try:
                up.proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                up.proc.kill()
                up.proc.wait()
        for pid in processes_under(up.base):  # only what this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return make_origin(tmp_path / "origin")


@pytest.fixture
def repo_task(tenant: Tenant) -> RepoTask:
    return new_repo_task(tenant)


def saved_file(tenant: Tenant, scope: str, owner: str, path: str) -> bytes | None:
    """A file's bytes as the controller holds them (None: not there)."""
    with tenant.client() as c:
        r = c.get(tenant.folder(scope, owner) + "/content", params={"path": path})
    return r.content if r.status_code == 200 else None


def saved_members(repo_task: RepoTask, run: Run) -> dict[str, str | None]:
    """The current checkpoint of the task's one repository: digest by path."""
    client = repo_task.client(run)

    async def members() -> dict[str, str | None]:
        try:
            (repo,) = (await client.list_repos()).repos
            manifest = await client.repo_manifest(repo.workspace_id)
            return {m["path"]: m.get("digest") for m in manifest.members}
        finally:
            await client.aclose()

    return trio.run(members)


def write_synced(path: Path, data: bytes) -> None:
    """Write and fsync: the daemon has the bytes, not only the kernel's cache."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


@pytest.mark.fuse
def test_a_stop_while_up_prepares_saves_the_commit_and_leaves_nothing_running(
    origin: Path, repo_task: RepoTask, ups: list[Up]
) -> None:
    """SIGTERM to up's process group as soon as the checkout appears (the
    repository saver and the mounts not started or not ready yet): the saver
    still makes its final save, up exits 0 and nothing is left behind."""
    repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    up = start_up(ups, repo_task.tenant.controller.url, run)
    checkout = up.home / "repos" / "app"
    wait_for("checkout", lambda: (checkout / ".git").is_dir(), up)
    (checkout / "early.txt").write_text("committed while up started\n")
    git(checkout, "add", "early.txt")
    git(checkout, "commit", "-q", "-m", "early work")
    head = git(checkout, "rev-parse", "HEAD").strip()
    branch = git(checkout, "symbolic-ref", "--short", "HEAD").strip()
    os.killpg(up.proc.pid, signal.SIGTERM)
    assert up.wait() == 0, up.log()
    assert "SIGTERM: stopping" in up.log() and "killed by" not in up.log(), up.log()
    assert_nothing_left(up)
    members = saved_members(repo_task, run)
    assert members["early.txt"] == hashlib.sha256(b"committed while up started\n").hexdigest()
    assert members[f".git/refs/heads/{branch}"] == hashlib.sha256(f"{head}\n".encode()).hexdigest()


def test_a_stop_signal_while_up_imports_is_taken_over_by_its_stop_request() -> None:
    """``up`` spends a few hundred milliseconds importing before its
    StopRequest exists; a SIGTERM then is recorded (fsagent.earlystop) and
    the StopRequest takes it over, instead of the default action killing
    ``up`` with -15. SIGINT inherited as ignored stays ignored, and another
    command records nothing."""
    probe = (
        "import os, signal, sys\n"
        "from fsagent import earlystop\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "earlystop.install(['fsagent', 'mount'])\n"
        "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
        "earlystop.install(['fsagent', 'up', '--home', 'h'])\n"
        "assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "from fsagent.commands.up import StopRequest\n"
        "stop = StopRequest()\n"
        "print(stop.requested, stop.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert (out.returncode, out.stdout, out.stderr) == (0, "True SIGTERM\n", "")


def test_a_stop_as_soon_as_up_handles_signals_is_a_clean_stop(
    tenant: Tenant, ups: list[Up]
) -> None:
    """SIGTERM the moment ``up`` first handles it (SigCgt), while it is still
    importing: up stops cleanly (exit 0, the stop named in its log) and
    leaves nothing behind; it is never killed by the signal."""
    run = start_run(tenant)
    up = start_up(ups, tenant.controller.url, run)
    deadline = time.monotonic() + START_SECONDS
    while not handles_sigterm(up.proc.pid):
        assert up.proc.poll() is None, up.log()
        assert time.monotonic() < deadline, "up never handled SIGTERM"
        time.sleep(0.001)
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait() == 0, up.log()
    assert "SIGTERM: stopped before anything started" in up.log(), up.log()
    assert_nothing_left(up)
    assert not up.env_file.exists()


@pytest.mark.fuse
def test_a_stop_while_the_daemons_start_waits_for_them_and_exits_0(
    tenant: Tenant, ups: list[Up]
) -> None:
    """SIGTERM to the process group while the mount daemons are starting:
    it reaches up alone (each child is in a session of its own), up signals
    each daemon once its handler exists, and every one stops cleanly."""
    run = start_run(tenant)
    up = start_up(ups, tenant.controller.url, run)
    wait_for("mount daemons", lambda: set(SCOPES) <= children(up).keys(), up)
    started = children(up)
    assert all(p.session == p.pid for p in started.values()), started  # sessions of their own
    os.killpg(up.proc.pid, signal.SIGTERM)
    assert up.wait() == 0, up.log()
    assert "killed by" not in up.log() and "stopped with errors" not in up.log(), up.log()
    assert_nothing_left(up)


@pytest.mark.fuse
def test_a_mount_daemon_killed_with_9_is_restarted_and_the_others_keep_serving(
    tenant: Tenant, ups: list[Up]
) -> None:
    run = start_run(tenant)
    assert run.task is not None
    up = start_up(ups, tenant.controller.url, run)
    wait_for("env file", up.env_file.exists, up)
    home = up.home
    write_synced(home / "task" / "before.txt", b"written before the kill")
    write_synced(home / "agent" / "other.txt", b"the agent folder")
    before = children(up)
    os.kill(before["task"].pid, signal.SIGKILL)

    def task_served_again() -> bool:
        # The other collections serve throughout.
        for scope in ("agent", "user", "project"):
            assert os.path.ismount(home / scope), up.log()
        assert (home / "agent" / "other.txt").read_bytes() == b"the agent folder"
        now = children(up)
        return (
            "task" in now
            and now["task"].pid != before["task"].pid
            and os.path.ismount(home / "task")
            and "task is served again" in up.log()
        )

    wait_for("task served again", task_served_again, up)
    assert (home / "task" / "before.txt").read_bytes() == b"written before the kill"
    write_synced(home / "task" / "after.txt", b"written after the restart")
    after = children(up)
    for role in ("agent", "user", "project", "bridge"):
        assert after[role].pid == before[role].pid, role
    log = up.log()
    assert "task was killed by SIGKILL; restarting it in 1s" in log, log
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait() == 0, up.log()
    assert_nothing_left(up)
    assert saved_file(tenant, "task", run.task, "before.txt") == b"written before the kill"
    assert saved_file(tenant, "task", run.task, "after.txt") == b"written after the restart"
    assert saved_file(tenant, "agent", run.agent, "other.txt") == b"the agent folder"


@pytest.mark.fuse
def test_a_kill_9_of_up_stops_every_child_with_its_final_save(
    tenant: Tenant, ups: list[Up]
) -> None:
    run = start_run(tenant)
    assert run.task is not None
    up = start_up(ups, tenant.controller.url, run)
    wait_for("env file", up.env_file.exists, up)
    (up.home / "task" / "last.txt").write_bytes(b"saved by the orphaned daemon")
    assert set(children(up)) == {*SCOPES, "bridge"}
    up.proc.kill()
    assert up.proc.wait() == -signal.SIGKILL
    # PR_SET_PDEATHSIG: each child got SIGTERM when up died, and stops on its own.
    assert_nothing_left(up)
    assert saved_file(tenant, "task", run.task, "last.txt") == b"saved by the orphaned daemon"


@pytest.mark.fuse
def test_a_restart_loop_is_bounded_and_reported(tenant: Tenant, ups: list[Up]) -> None:
    """A daemon that fails at once on every restart (its state dir replaced by
    a foreign one) is restarted with a doubling pause, five times, then up
    says so and stops everything else cleanly: exit 5."""
    run = start_run(tenant)
    assert run.task is not None
    # The pauses start at 0.05 s instead of 1 s: the same doubling and bound,
    # without waiting 31 s through them (the default: the test above).
    up = start_up(ups, tenant.controller.url, run, "--restart-delay", "0.05")
    wait_for("env file", up.env_file.exists, up)
    (up.home / "agent" / "kept.txt").write_bytes(b"saved at the stop")
    state = up.state / "task"
    state.rename(up.state / "task-moved")
    state.mkdir()
    (state / "notes.txt").write_text("not a state dir")
    os.kill(children(up)["task"].pid, signal.SIGKILL)
    code = up.wait()
    log = up.log()
    assert code == 5, log
    delays = [line.split("restarting it in ")[1].split("s ")[0]
              for line in log.splitlines() if "task " in line and "restarting it in" in line]  # fmt: skip
    assert delays == ["0.05", "0.1", "0.2", "0.4", "0.8"], log
    assert sum("is not an fsagent state dir" in line for line in log.splitlines()) == RESTART_LIMIT
    assert (
        f"fsagent: fsagent up: task exited with 3, after {RESTART_LIMIT} restarts within 300s; "
        "not restarted again"
    ) in log, log
    assert "stopped with errors" not in log, log  # the others stopped cleanly
    assert "task is served again" not in log, log  # no restart got as far as mounting
    assert_nothing_left(up)
    assert saved_file(tenant, "agent", run.agent, "kept.txt") == b"saved at the stop"


@pytest.mark.fuse
def test_up_forwards_its_retry_deadline_to_every_child(
    origin: Path, repo_task: RepoTask, ups: list[Up]
) -> None:
    repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    up = start_up(ups, repo_task.tenant.controller.url, run, "--retry-deadline", "7.5")
    wait_for("env file", up.env_file.exists, up)
    found = children(up)
    assert set(found) == {*SCOPES, "repos", "bridge"}, found
    for role, p in found.items():
        i = p.argv.index("--retry-deadline")
        assert p.argv[i + 1] == "7.5", (role, p.argv)
        assert p.session == p.pid, role  # a session of its own
    up.proc.send_signal(signal.SIGINT)
    assert up.wait() == 0, up.log()
    assert_nothing_left(up)


@pytest.fixture
def proxy(controller: ControllerProcess) -> Iterator[LossyProxy]:
    p = LossyProxy(controller.url).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.fuse
def test_a_final_save_that_cannot_finish_ends_in_a_failure_receipt_not_a_kill(
    proxy: LossyProxy, tenant: Tenant, ups: list[Up]
) -> None:
    """The agent folder's final save fails on the way every time: up waits
    for all three attempts and the failure receipt, then exits 4."""
    run = start_run(tenant)
    # The attempts 0.05 s and 0.1 s apart instead of 2 s and 4 s (the
    # default: tests/system/test_agent_limits.py); up's children get its environment.
    env = {**os.environ, FINAL_PAUSE_ENV: "0.05"}
    up = start_up(ups, proxy.url, run, "--retry-deadline", "1", env=env)
    wait_for("env file", up.env_file.exists, up)
    (up.home / "agent" / "work.md").write_bytes(b"the run's work")
    proxy.fail_next("POST", r"/folders/agent/checkpoints$", 1_000_000)
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait() == EXIT_SAVE_FAILED, up.log()
    log = up.log()
    assert "fsagent up: stopped with errors: agent exited with 4" in log, log
    assert "killing it" not in log and "killed by" not in log, log
    assert_nothing_left(up)
    [receipt] = [r for r in run_receipts(tenant, run.run_id) if r["scope"] == "agent"]
    assert receipt["outcome"] == "failed" and receipt["final"] is True, receipt
    assert "after 3 attempt(s)" in receipt["error"], receipt
    assert saved_file(tenant, "agent", run.agent, "work.md") is None


def test_a_restart_waits_1s_by_default_doubling_up_to_30s() -> None:
    args = build_parser("up").parse_args(["up", "--home", "h", "--controller", "http://x"])
    assert args.restart_delay == RESTART_FIRST_DELAY == 1.0
    assert RESTART_MAX_DELAY == 30.0


def test_the_stop_grace_covers_the_final_saves_retry_budget() -> None:
    """What ``up`` waits before a SIGKILL: every attempt's deadline and one
    request's timeout past it, the pauses between attempts, the receipt."""
    for deadline in (0.0, 1.0, 60.0, 600.0):
        one_attempt = deadline + REQUEST_SECONDS
        assert stop_grace(deadline, 1) > one_attempt + 30
        assert stop_grace(deadline, 3) > 3 * one_attempt + 2 + 4 + 30
    # The controller down at the default deadline: three attempts of 60 s
    # each, with pauses and the receipt, outlast the 120 s up used to wait.
    assert stop_grace(60.0, 3) > 3 * 60 + 6 + 30 > 120


def test_a_child_killed_by_a_signal_is_a_named_failure_never_a_negative_status() -> None:
    saver = Child("task", [], 1.0, EXIT_SAVE_FAILED, returncode=-signal.SIGKILL)
    endpoint = Child("the bridge", [], 1.0, 1, returncode=-signal.SIGTERM)
    assert (saver.exit_code, endpoint.exit_code) == (EXIT_SAVE_FAILED, 1)
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(4) == "exited with 4"
    assert Child("agent", [], 1.0, EXIT_SAVE_FAILED, returncode=4).exit_code == 4
