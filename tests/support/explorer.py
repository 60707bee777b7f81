"""The lifecycle explorer: random schedules of a run's life, checked against a model.

One schedule drives the real ``fsagent up`` (FUSE or dir mode) and a real
controller through events drawn from a seed: writes, overwrites, renames and
deletes in all four work folders (each write fsynced, by path, as an agent
writes), empty directories made and removed there, ``fsagent flush``,
SIGTERM to ``up`` at any moment (while it starts, while it saves, during the
final save), ``kill -9`` of ``up`` or of one of its
mount daemons, the controller killed and restarted (also across a stop), a
newer run for the same sandbox (fencing), a warm restart under a new run, and
a replacement sandbox; ``kill -9`` of any child of ``up`` (a mount daemon, the
bridge, the repository saver), PostgreSQL killed (also across a stop), the
sandbox's disk full (each sandbox is a small tmpfs of its own), and the agent
folder over its file-size limit, then cleaned up.

The model (:class:`Model`) keeps, per folder and path, the contents that may
be there: one value after an acknowledged operation (the call returned), the
old and the new (or anything, for a write) after one that failed part way.
After every schedule the controller is up, one last ``up`` stops cleanly, and:

* every path's saved content is one the model allows (an acknowledged write
  byte for byte; an acknowledged delete absent; an acknowledged ``mkdir`` a
  directory);
* the last ``up`` exited 0 (its final saves succeeded: no folder stayed unable
  to save once the cause was gone);
* no process of the sandbox is left and no mount (alive or dead) under it;
* every status tells the truth (:meth:`Explorer.check_status`, after every
  SIGTERM stop, and :meth:`Explorer.check_flushed` after a flush): a stop
  that exited 0 leaves ``fsagent status`` and ``fsagent repos status``
  without an error or anything unsaved, and the controller's run details
  with the run stopped, every folder and repository saved, and each
  checkout's last save the repository's current checkpoint; a stop that
  did not exit 0 shows a failed save in the sandbox's status;
* a replacement sandbox, when the schedule made one, showed exactly what the
  model allows.

A schedule is reproducible from its seed (the events, not the timing of real
processes). ``python -m tests.support.explorer --schedules N`` (``make
explore``) runs many; ``tests/system/test_lifecycle_explorer.py`` runs fixed seeds
and one random one.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsagent.state.statedir import MARKER
from tests.support.agentfiles import folder_entries, run_detail
from tests.support.constants import REPO
from tests.support.controller import ControllerProcess, PgCluster, Tenant, bootstrap_tenant
from tests.support.gitrepos import make_origin
from tests.support.smallfs import fill, free_fill
from tests.support.tmp import mounts_under, private_tmpdir, remove_tree, world_searchable_tmpdir

SCOPES = ("task", "agent", "user", "project")
ANY = b"\0any"
"""A value the model allows when a write failed part way: any content."""
DIR = b"\0dir"
"""A value: the path is a directory (an empty one, made by ``mkdir``)."""
START_SECONDS = 240.0
STOP_SECONDS = 400.0
RETRY_DEADLINE = "8"
"""``up --retry-deadline``: a save meeting a down controller gives up soon."""
AGENT_MAX_FILE_BYTES = 1 << 20
"""The explorer's controller runs with this agent-folder file limit (see
:data:`CONTROLLER_ARGS`): the ``agent_limit`` event writes past it."""
CONTROLLER_ARGS = ("--agent-max-file-bytes", str(AGENT_MAX_FILE_BYTES))
SANDBOX_DISK = "size=384m,nr_inodes=65536,mode=0700"
"""Each sandbox's disk: a tmpfs this small, so that ``disk_full`` can fill it."""

EVENTS_V1 = (
    "write",
    "write",
    "write",
    "overwrite",
    "rename",
    "delete",
    "flush",
    "sigterm",
    "sigterm_during_save",
    "kill9_child",
    "kill9_up",
    "controller_bounce",
    "controller_down_at_stop",
    "newer_run",
    "new_run_restart",
    "replace_sandbox",
    "repo_commit",
    "repo_worktree",
    "repo_branch",
)
"""The events of the first explorer (its seeds replay with these)."""
EVENTS_V2 = (
    *EVENTS_V1,
    "pg_kill",
    "disk_full",
    "agent_limit",
)
"""The second catalogue (the seeds recorded before ``mkdir`` replay with these)."""
EVENTS = (*EVENTS_V2, "mkdir")


class Violation(AssertionError):
    """A schedule broke an invariant; the message names the seed."""


@dataclass
class Model:
    """What each folder may hold: scope -> path -> allowed contents (None: absent)."""

    files: dict[str, dict[str, set[bytes | None]]] = field(
        default_factory=lambda: {s: {} for s in SCOPES}
    )

    def allowed(self, scope: str, path: str) -> set[bytes | None]:
        return self.files[scope].get(path, {None})

    def acked(self, scope: str, path: str, value: bytes | None) -> None:
        self.files[scope][path] = {value}

    def maybe(self, scope: str, path: str, value: bytes | None) -> None:
        self.files[scope][path] = self.allowed(scope, path) | {value}

    def ok(self, scope: str, path: str, value: bytes | None) -> bool:
        allowed = self.allowed(scope, path)
        return value in allowed or (value is not None and ANY in allowed)

    def live(self, scope: str) -> list[str]:
        """Paths that may hold a file."""
        return sorted(p for p, v in self.files[scope].items() if v != {None} and DIR not in v)

    def made_dirs(self, scope: str) -> list[str]:
        """Directories ``mkdir`` made and nothing removed since."""
        return sorted(p for p, v in self.files[scope].items() if v == {DIR})


@dataclass
class RepoModel:
    """The task's checkout: the commits its HEAD may be at, and what each
    working-tree file the schedule wrote may hold."""

    heads: set[str] = field(default_factory=set)
    files: dict[str, set[bytes | None]] = field(default_factory=dict)
    changed: bool = False
    """Changed since the last replacement sandbox checked it."""


@dataclass
class Identity:
    """Who a run is: the ids ``start-run`` takes."""

    company: str
    agent: str
    task: str
    user: str
    project: str


@dataclass
class Sandbox:
    """One sandbox: its home, state root and run token, and its ``up``."""

    base: Path
    """The sandbox's disk (a small tmpfs)."""
    logs: Path
    """Where ``up``'s output goes: not the sandbox's disk, as a journal would."""
    sandbox_id: str
    token: str
    up: subprocess.Popen[bytes] | None = None
    ups: int = 0

    @property
    def home(self) -> Path:
        return self.base / "home"

    def log(self) -> str:
        return self.full_log()[-4000:]

    def full_log(self) -> str:
        """The log of the newest ``up``, whole."""
        try:
            return (self.logs / f"up{self.ups}.log").read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Explorer:
    """Runs one schedule from its seed."""

    ctl: ControllerProcess
    tenant: Tenant
    seed: int
    mode: str
    events: int = 14
    cluster: PgCluster | None = None
    """The controller's PostgreSQL, for ``pg_kill`` (without it, that event
    bounces the controller instead)."""
    catalog: tuple[str, ...] = EVENTS
    script: list[str] | None = None
    """Events to run in this order instead of drawing them (the data and
    every other choice still come from the seed)."""
    trace: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.model = Model()
        ctl, company = self.ctl, self.tenant.company_id
        project = ctl.admin("create-project", company, f"p{self.seed}")["id"]
        task = ctl.admin("create-task", company, project, f"t{self.seed}")["id"]
        agent = ctl.admin("create-agent", company, f"a{self.seed}")["id"]
        self.who = Identity(company, agent, task, self.tenant.user_id, project)
        self.bases: list[Path] = []
        self.run_ids: dict[str, str] = {}
        """Run token -> run id."""
        origin_base = private_tmpdir("fsa-xo-")
        self.bases.append(origin_base)
        origin = make_origin(origin_base)
        ctl.admin("add-workspace", project, "--repo-url", str(origin), "--primary")
        self.repo = RepoModel()
        self.agent_since: dict[str, set[bytes | None]] = {}
        """Every content each agent-folder path has had since the last final
        save known to have succeeded: what a later successful save may hold."""
        self.sandbox = self._new_sandbox()
        self.counter = 0

    # --- the system ---------------------------------------------------------------

    def _start_run(self, sandbox_id: str) -> str:
        w = self.who
        out = self.ctl.admin("start-run", w.company, "--agent", w.agent, "--task", w.task,
                             "--user", w.user, "--sandbox", sandbox_id)  # fmt: skip
        token = str(out["token"])
        self.run_ids[token] = str(out["run_id"])
        return token

    def _new_sandbox(self) -> Sandbox:
        base, logs = private_tmpdir("fsa-xp-"), private_tmpdir("fsa-xl-")
        self.bases += [base, logs]
        subprocess.run(["mount", "-t", "tmpfs", "-o", SANDBOX_DISK, "tmpfs", str(base)],
                       check=True, capture_output=True)  # fmt: skip
        sandbox_id = f"sb-{self.seed}-{len(self.bases)}"
        return Sandbox(base, logs, sandbox_id, self._start_run(sandbox_id))

    def _launch(self) -> None:
        sb = self.sandbox
        assert sb.up is None or sb.up.poll() is not None
        sb.ups += 1
        (sb.base / "token").write_text(sb.token)
        with open(sb.logs / f"up{sb.ups}.log", "wb") as log:
            sb.up = subprocess.Popen(
                [sys.executable, "-m", "fsagent.cli", "up", "--home", str(sb.home),
                 "--controller", self.ctl.url, "--token-file", str(sb.base / "token"),
                 "--state-root", str(sb.base / "state"), "--env-file", str(sb.base / "env"),
                 "--mode", self.mode, "--checkpoint-interval", "3600",
                 "--retry-deadline", RETRY_DEADLINE],
                cwd=REPO, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def _served(self) -> bool:
        sb = self.sandbox
        env = sb.base / "env"
        return env.exists() and sb.up is not None and sb.up.poll() is None

    def start(self) -> None:
        """``up``, until it serves every folder (its env file is written)."""
        (self.sandbox.base / "env").unlink(missing_ok=True)
        self._launch()
        self._wait("up to serve", self._served, fail_on_exit=True)

    def stop(self, sig: int = signal.SIGTERM, *, controller_up: bool = True) -> int:
        """Signal ``up`` and wait for it and its children to end. After a
        SIGTERM, every status is checked against the controller
        (:meth:`check_status`; ``controller_up=False``: the sandbox's side only)."""
        sb = self.sandbox
        if sb.up is None or sb.up.poll() is not None:
            return sb.up.returncode if sb.up is not None else 0
        sb.up.send_signal(sig)
        try:
            code = sb.up.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            raise self.violation(f"up still runs {STOP_SECONDS:.0f}s after signal {sig}") from None
        self._wait("every child of up to end", lambda: not self._processes(), timeout=STOP_SECONDS)
        if code == 0 and sig == signal.SIGTERM:
            self.agent_since = {p: set(v) for p, v in self.model.files["agent"].items()}
        if sig == signal.SIGTERM:
            self.check_status(code, controller_up=controller_up)
        return code

    def _processes(self) -> list[int]:
        return _processes_under(self.sandbox.base)

    def _wait(
        self,
        what: str,
        cond: Callable[[], bool],
        timeout: float = START_SECONDS,
        fail_on_exit: bool = False,
    ) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            up = self.sandbox.up
            if fail_on_exit and up is not None and up.poll() is not None:
                raise self.violation(f"up exited {up.returncode} waiting for {what}")
            if time.monotonic() > deadline:
                raise self.violation(f"no {what} within {timeout:.0f}s")
            time.sleep(0.05)

    def violation(self, message: str) -> Violation:
        return Violation(
            f"seed {self.seed} ({self.mode}): {message}\nevents: {self.trace}\n"
            f"up's log:\n{self.sandbox.log()}"
        )

    # --- agent operations ---------------------------------------------------------

    def _path(self, scope: str) -> str:
        self.counter += 1
        d = self.rng.choice(["", "d0/", "d1/", "d1/e/"])
        return f"{d}f{self.counter}"

    def _data(self) -> bytes:
        size = self.rng.choice([0, 1, 100, 4096, 70_000, 300_000])
        return self.rng.randbytes(size)

    def write(self, scope: str, path: str, data: bytes) -> None:
        where = self.sandbox.home / scope / path
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(where, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:  # a nearly full disk takes part of a write
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            self.model.maybe(scope, path, ANY)
            return
        self.model.acked(scope, path, data)

    def delete(self, scope: str, path: str) -> None:
        try:
            os.unlink(self.sandbox.home / scope / path)
        except FileNotFoundError:
            if self.model.allowed(scope, path) == {None}:
                return
            self.model.maybe(scope, path, None)
            return
        except OSError:
            self.model.maybe(scope, path, None)
            return
        self.model.acked(scope, path, None)

    def rename(self, scope: str, src: str, dst: str) -> None:
        home = self.sandbox.home / scope
        before = self.model.allowed(scope, src)
        try:
            (home / dst).parent.mkdir(parents=True, exist_ok=True)
            os.rename(home / src, home / dst)
        except OSError:
            for value in before:
                self.model.maybe(scope, dst, value)
            self.model.maybe(scope, src, None)
            return
        self.model.files[scope][dst] = set(before)
        self.model.acked(scope, src, None)

    def agent_work(self, n: int) -> None:
        self._agent_work(n)
        self._note_agent()

    def _note_agent(self) -> None:
        for path, allowed in self.model.files["agent"].items():
            self.agent_since.setdefault(path, {None}).update(allowed)

    def _agent_may_have_given_up(self) -> None:
        """After a failed final save the agent folder, under its contract,
        gives up after three attempts with an explicit failure receipt and
        discards its local copy: what it held since its
        last save may be lost."""
        agent = self.model.files["agent"]
        for path in list(agent):
            agent[path] = agent[path] | self.agent_since.get(path, {None})

    def _agent_work(self, n: int) -> None:
        for _ in range(n):
            scope = self.rng.choice(SCOPES)
            live = self.model.live(scope)
            r = self.rng.random()
            if r < 0.55 or not live:
                self.write(scope, self._path(scope), self._data())
            elif r < 0.75:
                self.write(scope, self.rng.choice(live), self._data())
            elif r < 0.88:
                self.rename(scope, self.rng.choice(live), self._path(scope))
            else:
                self.delete(scope, self.rng.choice(live))

    def on_mkdir(self) -> None:
        """``mkdir`` of an empty directory in one of the four folders, or now
        and then ``rmdir`` of one made before: saved as files are (each call
        that returned is acknowledged, like a rename or a delete)."""
        self.agent_work(self.rng.randint(0, 3))
        scope = self.rng.choice(SCOPES)
        home = self.sandbox.home / scope
        made = self.model.made_dirs(scope)
        if made and self.rng.random() < 0.4:
            path = self.rng.choice(made)
            try:
                os.rmdir(home / path)
            except OSError:
                self.model.maybe(scope, path, None)
            else:
                self.model.acked(scope, path, None)
        else:
            self.counter += 1
            path = f"{self.rng.choice(['', 'd0/', 'd1/e/'])}g{self.counter}"
            try:
                (home / path).parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(home / path)
            except OSError:
                self.model.maybe(scope, path, DIR)
            else:
                self.model.acked(scope, path, DIR)
        self._note_agent()

    # --- repository work -------------------------------------------------------------

    def _checkout(self) -> Path | None:
        root = self.sandbox.home / "repos"
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return None
        return root / names[0] if names else None

    def _git(self, *args: str) -> str | None:
        checkout = self._checkout()
        if checkout is None:
            raise self.violation("no checkout of the task's repository under up")
        done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True,
                              text=True, check=False)  # fmt: skip
        return done.stdout.strip() if done.returncode == 0 else None

    def _repo_write(self, path: str, *, stage: bool = False) -> None:
        checkout = self._checkout()
        assert checkout is not None
        data = self.rng.randbytes(self.rng.choice([0, 10, 5000]))
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / path).write_bytes(data)
        self.repo.files[path] = {data}
        self.repo.changed = True
        if stage:
            self._git("add", "--", path)

    def _head(self) -> None:
        head = self._git("rev-parse", "HEAD")
        if head is None:
            raise self.violation("git rev-parse HEAD failed in the checkout")
        self.repo.heads = {head}

    def on_repo_commit(self) -> None:
        if not self.repo.heads:
            self._head()  # as prepared (cloned or restored)
        self.counter += 1
        self._repo_write(f"src/c{self.counter}.txt", stage=True)
        if self._git("commit", "-q", "-m", f"commit {self.counter}") is None:
            raise self.violation("git commit failed in the checkout")
        self._head()

    def on_repo_worktree(self) -> None:
        """Unstaged, staged and untracked work."""
        if not self.repo.heads:
            self._head()
        self.counter += 1
        self._repo_write("README.md")  # unstaged
        self._repo_write(f"staged/s{self.counter}.txt", stage=True)
        self._repo_write(f"untracked/u{self.counter}.txt")

    def on_repo_branch(self) -> None:
        if not self.repo.heads:
            self._head()
        self.counter += 1
        if self._git("checkout", "-q", "-b", f"b{self.counter}") is None:
            raise self.violation("git checkout -b failed in the checkout")
        self.on_repo_commit()

    # --- events ---------------------------------------------------------------------

    def run(self) -> None:
        self.start()
        for i in range(self.events if self.script is None else len(self.script)):
            event = self.rng.choice(self.catalog) if self.script is None else self.script[i]
            self.trace.append(event)
            getattr(self, f"on_{event}")()
        self.finish()

    def on_write(self) -> None:
        self.agent_work(self.rng.randint(1, 12))

    on_overwrite = on_write

    def on_rename(self) -> None:
        self.agent_work(3)

    on_delete = on_rename

    def on_flush(self, *, controller_up: bool = True) -> None:
        scope = self.rng.choice(SCOPES)
        if self._flush(scope).returncode == 0:
            self.check_flushed(scope, controller_up=controller_up)

    def _flush(self, scope: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "flush", scope, "--state-dir",
             str(self.sandbox.base / "state" / scope), "--timeout", "120"],
            cwd=REPO, capture_output=True, check=False, timeout=300, text=True,
        )  # fmt: skip

    def _stop_and_restart(self, sig: int, *, during_save: bool = False, work: bool = True) -> None:
        if work:
            self.agent_work(self.rng.randint(0, 6))
        if during_save:
            self.agent_work(8)
            time.sleep(self.rng.uniform(0.0, 0.4))
        self.stop(sig)
        self.start()

    def on_sigterm(self) -> None:
        if self.rng.random() < 0.4:
            # A stop while up starts: somewhere in its first seconds.
            self.stop()
            self._launch()
            time.sleep(self.rng.uniform(0.0, 3.0))
            self.stop()
            self.start()
            return
        self._stop_and_restart(signal.SIGTERM)

    def on_sigterm_during_save(self) -> None:
        self._stop_and_restart(signal.SIGTERM, during_save=True)

    def on_kill9_up(self) -> None:
        self._stop_and_restart(signal.SIGKILL)

    def on_kill9_child(self) -> None:
        """``kill -9`` of one child of ``up`` (a mount daemon, the bridge or the
        repository saver): ``up`` restarts it, and it serves again."""
        v1 = self.catalog is EVENTS_V1
        if v1 and self.mode != "fuse":
            return self.on_kill9_up()
        self.agent_work(self.rng.randint(0, 6))
        sb = self.sandbox
        kinds = SCOPES if v1 else tuple(sorted(self._children()))
        if not kinds:
            raise self.violation("no child of up to kill")
        kind = self.rng.choice(kinds)
        pid = self._children().get(kind)
        if pid is None:
            raise self.violation(f"no {kind} daemon under up")
        os.kill(pid, signal.SIGKILL)

        def served_again() -> bool:
            now = self._children().get(kind)
            if now in (None, pid):
                return False
            if kind not in SCOPES and kind != "bridge":
                return True
            if kind in SCOPES and self.mode == "fuse" and not os.path.ismount(sb.home / kind):
                return False
            # What up says once its ready record came on the child's pipe.
            name = "the bridge" if kind == "bridge" else kind
            return f"{name} is served again (pid {now})" in sb.full_log()

        self._wait(f"{kind} served again", served_again, fail_on_exit=True)
        self.agent_work(self.rng.randint(0, 4))

    def _children(self) -> dict[str, int]:
        """``up``'s children by what they serve: a scope, ``bridge``, ``repos``."""
        up = self.sandbox.up
        assert up is not None
        found = {}
        for pid in self._processes():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid != up.pid or argv[1:3] != [b"-m", b"fsagent.cli"] or len(argv) < 5:
                continue
            if argv[3] == b"mount":
                found[argv[4].decode()] = pid
            elif argv[3] in (b"bridge", b"repos"):
                found[argv[3].decode()] = pid
        return found

    def on_controller_bounce(self) -> None:
        self.ctl.kill()
        self.agent_work(self.rng.randint(0, 6))  # the mounts keep serving meanwhile
        self.ctl.start()

    def on_controller_down_at_stop(self) -> None:
        self.agent_work(self.rng.randint(1, 6))
        self.ctl.kill()
        # Its final saves fail: the state stays for the next run, and the
        # exit status says so (a status never claims a save that did not happen).
        code = self.stop(controller_up=False)
        if code == 0:
            raise self.violation("up exited 0 though no final save could reach the controller")
        self._agent_may_have_given_up()
        self.ctl.start()
        self.sandbox.token = self._start_run(self.sandbox.sandbox_id)
        self.start()

    def on_newer_run(self) -> None:
        """A newer run for this sandbox while up serves the older one."""
        self.agent_work(self.rng.randint(1, 6))
        token = self._start_run(self.sandbox.sandbox_id)
        self.agent_work(self.rng.randint(0, 4))  # the fenced run's writes: kept locally
        self.stop()
        self.sandbox.token = token
        self.start()

    def on_new_run_restart(self) -> None:
        self.agent_work(self.rng.randint(0, 6))
        self.stop()
        self.sandbox.token = self._start_run(self.sandbox.sandbox_id)
        self.start()

    def on_pg_kill(self) -> None:
        """PostgreSQL killed with -9 (every server process) while the sandbox
        works and saves, now and then across a stop; then restarted. The
        controller recovers by itself, and so does saving."""
        if self.cluster is None:
            return self.on_controller_bounce()
        pg = self.cluster.pg
        self.cluster.kill()
        self.agent_work(self.rng.randint(0, 6))
        if self.rng.random() < 0.5:
            self.on_flush(controller_up=False)  # a save meets the database down
        stopped = self.rng.random() < 0.3
        if stopped and self.stop(controller_up=False) != 0:
            self._agent_may_have_given_up()
        pg.start()  # crash recovery
        self._wait("the controller to serve again after PostgreSQL restarted",
                   self._controller_serves, timeout=120)  # fmt: skip
        if stopped:
            self.sandbox.token = self._start_run(self.sandbox.sandbox_id)
            self.start()

    def _controller_serves(self) -> bool:
        with self.tenant.client() as c:
            try:
                return c.get(self._folder("task")).status_code == 200
            except OSError:
                return False

    def on_disk_full(self) -> None:
        """The sandbox's disk fills up while the agent works and saves, then
        space comes back: a write refused meanwhile is the agent's to see,
        nothing acknowledged before is lost, and saving resumes."""
        self.agent_work(self.rng.randint(0, 3))
        base = self.sandbox.base
        fill(base)
        try:
            self.agent_work(self.rng.randint(1, 6))
            if self.rng.random() < 0.5:
                self.on_flush()
        finally:
            free_fill(base)
        self.agent_work(self.rng.randint(0, 4))

    def on_agent_limit(self) -> None:
        """A file past the agent folder's size limit: the save is refused with
        AGENT_FILES_LIMIT_EXCEEDED naming it; once it is gone, the next save
        of the folder succeeds."""
        self.agent_work(self.rng.randint(0, 3))
        self.counter += 1
        path = f"d0/big{self.counter}"
        self.write("agent", path, self.rng.randbytes(AGENT_MAX_FILE_BYTES + 4096))
        self._note_agent()
        refused = self._flush("agent")
        said = refused.stdout + refused.stderr
        if self.model.allowed("agent", path) != {ANY} and (
            "AGENT_FILES_LIMIT_EXCEEDED" not in said or path not in said
        ):
            raise self.violation(f"a save over the agent folder's file limit said: {said[-800:]}")
        self.delete("agent", path)
        self.agent_work(self.rng.randint(0, 3))
        again = self._flush("agent")
        if again.returncode != 0:
            raise self.violation(
                f"the agent folder's save still fails once under its limit "
                f"(exit {again.returncode}): {(again.stdout + again.stderr)[-800:]}"
            )

    def on_replace_sandbox(self, work: bool = True) -> None:
        """The sandbox ends (a clean stop that saved) and a new one takes the
        next run: it must show what the model allows."""
        if work:
            self.agent_work(self.rng.randint(0, 6))
        code = self.stop()
        if code != 0:
            raise self.violation(f"a clean stop exited {code}")
        self.check_no_leftovers()
        self.sandbox = self._new_sandbox()
        self.start()
        self.check_visible()

    # --- invariants -----------------------------------------------------------------

    def finish(self) -> None:
        if self.ctl.proc is None or self.ctl.proc.poll() is not None:
            self.ctl.start()
        if self.sandbox.up is None or self.sandbox.up.poll() is not None:
            self.start()
        code = self.stop()
        if code != 0:
            raise self.violation(f"the last clean stop exited {code}")
        self.check_no_leftovers()
        self.check_saved()
        if self.repo.changed:
            # The repository's save is checked the way a user meets it: a
            # replacement sandbox restores the checkout.
            self.trace.append("replace_sandbox (final check)")
            self.on_replace_sandbox(work=False)
            if self.stop() != 0:
                raise self.violation("the replacement sandbox's clean stop failed")
            self.check_no_leftovers()

    def _fsagent_json(self, *args: str) -> Any:
        out = subprocess.run([sys.executable, "-m", "fsagent.cli", *args, "--json"],
                             cwd=REPO, capture_output=True, check=False, timeout=120,
                             text=True)  # fmt: skip
        if out.returncode != 0:
            raise self.violation(f"fsagent {' '.join(args)} exited {out.returncode}: "
                                 f"{out.stderr[-800:]}")  # fmt: skip
        return json.loads(out.stdout)

    def _collections_status(self) -> dict[str, dict[str, Any]]:
        """``fsagent status`` of the sandbox's collections, by scope."""
        state = self.sandbox.base / "state"
        # A state dir without its marker was discarded (the agent folder's,
        # after a final save given up on): it has no status to show.
        dirs = [a for s in SCOPES if (state / s / MARKER).exists()
                for a in ("--state-dir", str(state / s))]  # fmt: skip
        if not dirs:
            return {}
        rows = self._fsagent_json("status", *dirs)["collections"]
        return {str(r["scope"]): r for r in rows if r.get("scope")}

    def _repos_status(self) -> list[dict[str, Any]]:
        sb = self.sandbox
        rows: list[dict[str, Any]] = self._fsagent_json(
            "repos", "status", "--home", str(sb.home), "--state-root", str(sb.base / "state")
        )["repos"]
        return rows

    def _run_details(self) -> dict[str, Any]:
        r = run_detail(self.tenant, self.run_ids[self.sandbox.token])
        if r.status_code != 200:
            raise self.violation(f"run details: HTTP {r.status_code} {r.text[:400]}")
        details: dict[str, Any] = r.json()
        return details

    def check_status(self, code: int, *, controller_up: bool = True) -> None:
        """After a stop, every status tells the truth (a status never claims a
        save that did not happen):

        * a stop that exited 0 leaves ``fsagent status`` and ``fsagent repos
          status`` with no error and nothing unsaved, and, on the controller,
          the run stopped with every folder and repository saved and each
          checkout's last save the repository's current checkpoint;
        * a stop that did not exit 0 shows a failed save, with its message,
          in the sandbox's status of some folder or repository.
        """
        if code == -signal.SIGTERM and not self.sandbox.log().strip():
            # Killed by the signal in the interpreter's own start-up, before
            # fsagent's first line could handle it (fsagent.earlystop): no
            # line written, nothing of up started, no save to claim: the
            # statuses are the previous stop's, checked then.
            self.trace.append("sigterm (before up's first line)")
            return
        collections, repos = self._collections_status(), self._repos_status()
        failed = [f"{s}: {r['lastError']}" for s, r in collections.items() if r.get("lastError")]
        failed += [f"repo {r.get('name')}: {r['lastError']}" for r in repos if r.get("lastError")]
        if code != 0:
            if not failed:
                raise self.violation(f"up exited {code} but no status shows a failed save: "
                                     f"{collections} {repos}")  # fmt: skip
            return
        bad = list(failed)
        bad += [f"{s}: {r['unsavedChanges']} unsaved, pending {r['pendingCheckpoint']}"
                for s, r in collections.items()
                if r["unsavedChanges"] or r["pendingCheckpoint"]]  # fmt: skip
        bad += [f"repo {r.get('name')}: {r.get('state')}" for r in repos
                if r.get("state") not in ("saved", "restored")]  # fmt: skip
        if controller_up:
            run = self._run_details()
            if run.get("stoppedAt") is None:
                bad.append("the controller shows the run not stopped")
            bad += [f"controller: {f['scope']} {f['state']} {f['code']} {f['error']}"
                    for f in run["folders"] if f["state"] != "saved"]  # fmt: skip
            shown = {str(r.get("name")): r for r in repos}
            for r in run["repos"]:
                mine = shown.get(r["name"])
                said = mine and ((mine.get("lastSave") or mine.get("restoredFrom") or {})
                                 .get("checkpointId"))  # fmt: skip
                if r["state"] != "saved":
                    bad.append(f"controller: repo {r['name']} {r['state']} {r['code']}")
                elif mine is not None and str(said) != str(r["checkpointId"]):
                    bad.append(f"repo {r['name']}: status names checkpoint {said}, "
                               f"the controller's is {r['checkpointId']}")  # fmt: skip
        if bad:
            raise self.violation(f"a clean stop's status does not match: {bad[:8]}")

    def check_flushed(self, scope: str, *, controller_up: bool = True) -> None:
        """A flush that succeeded: the folder's status shows nothing unsaved
        and no error, and the controller does not show this run's save of it
        failed (a flush with nothing to send leaves a new run "starting")."""
        row = self._collections_status().get(scope)
        if row is None or row.get("lastError") or row["unsavedChanges"] or row["pendingCheckpoint"]:
            raise self.violation(f"after a flush of {scope} that succeeded, status says {row}")
        if not controller_up:
            return  # nothing to send: it succeeded without the controller
        (folder,) = [f for f in self._run_details()["folders"] if f["scope"] == scope]
        if folder["state"] not in ("saved", "starting"):
            raise self.violation(f"after a flush of {scope} that succeeded, "
                                 f"the controller shows {folder}")  # fmt: skip

    def check_no_leftovers(self) -> None:
        left = self._processes()
        if left:
            raise self.violation(f"processes left: {left}")
        mounts = mounts_under(self.sandbox.base)
        if mounts:
            raise self.violation(f"mounts left: {mounts}")

    def check_saved(self) -> None:
        bad = []
        with self.tenant.client() as c:
            for scope in SCOPES:
                folder = self._folder(scope)
                try:
                    kinds = {e["path"]: e["kind"] for e in folder_entries(c, folder)}
                except AssertionError as exc:
                    raise self.violation(str(exc)) from None
                for path in sorted(self.model.files[scope]):
                    if kinds.get(path) == "directory":
                        value: bytes | None = DIR
                    else:
                        r = c.get(folder + "/content", params={"path": path})
                        value = r.content if r.status_code == 200 else None
                        if r.status_code not in (200, 404):
                            bad.append(f"{scope}/{path}: HTTP {r.status_code}")
                            continue
                    if not self.model.ok(scope, path, value):
                        bad.append(f"{scope}/{path}: {_describe(value)}, allowed "
                                   f"{sorted(_describe(v) for v in self.model.allowed(scope, path))}")  # fmt: skip
        if bad:
            raise self.violation(f"{len(bad)} path(s) not as acknowledged: {bad[:8]}")

    def _folder(self, scope: str) -> str:
        w = self.who
        owner = {"task": w.task, "agent": w.agent, "user": w.user, "project": w.project}[scope]
        return self.tenant.folder(scope, owner)

    def check_visible(self) -> None:
        bad = []
        for scope in SCOPES:
            for path in sorted(self.model.files[scope]):
                where = self.sandbox.home / scope / path
                try:
                    value: bytes | None = DIR if where.is_dir() else where.read_bytes()
                except FileNotFoundError:
                    value = None
                except OSError as exc:
                    bad.append(f"{scope}/{path}: {errno.errorcode.get(exc.errno or 0)}")
                    continue
                if not self.model.ok(scope, path, value):
                    bad.append(f"{scope}/{path}: {_describe(value)}")
        if self.repo.heads:
            head = self._git("rev-parse", "HEAD")
            if head not in self.repo.heads:
                bad.append(f"repository HEAD {head}, allowed {sorted(self.repo.heads)}")
            checkout = self._checkout()
            assert checkout is not None
            for path, allowed in sorted(self.repo.files.items()):
                try:
                    got: bytes | None = (checkout / path).read_bytes()
                except FileNotFoundError:
                    got = None
                if got not in allowed:
                    bad.append(f"repository {path}: {_describe(got)}")
            self.repo.changed = False
        if bad:
            raise self.violation(f"the replacement sandbox shows {len(bad)} wrong: {bad[:8]}")

    def close(self) -> None:
        if self.cluster is not None and not self.cluster.pg.running():
            self.cluster.pg.start()  # a schedule that failed between kill and start
        sb = self.sandbox
        if sb.up is not None and sb.up.poll() is None:
            sb.up.kill()
            sb.up.wait()
        for base in self.bases:
            for pid in _processes_under(base):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not os.environ.get("EXPLORE_KEEP"):
                remove_tree(base)
                # A sandbox's disk: its tmpfs goes after what was below it.
                subprocess.run(["umount", "-l", str(base)], capture_output=True, check=False)
                with contextlib.suppress(OSError):
                    base.rmdir()


def _processes_under(base: Path) -> list[int]:
    """Live processes (zombies left out) whose command line names ``base``."""
    marker = str(base).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if marker in raw and state[state.rindex(")") + 2] != "Z":
            found.append(int(entry))
    return found


def _describe(value: bytes | None) -> str:
    if value is None:
        return "absent"
    if value == ANY:
        return "any"
    if value == DIR:
        return "a directory"
    return f"{len(value)} bytes {value[:4].hex()}"


def run_schedule(ctl: ControllerProcess, tenant: Tenant, seed: int, mode: str,
                 events: int = 14, cluster: PgCluster | None = None,
                 catalog: tuple[str, ...] = EVENTS,
                 script: list[str] | None = None) -> list[str]:  # fmt: skip
    """Run one schedule; returns its events; raises :class:`Violation`."""
    explorer = Explorer(ctl, tenant, seed, mode, events, cluster, catalog, script)
    try:
        explorer.run()
        return explorer.trace
    finally:
        explorer.close()


@contextlib.contextmanager
def explorer_controller() -> Iterator[tuple[ControllerProcess, Tenant, PgCluster]]:
    """A PostgreSQL cluster and a controller of their own (for the long mode)."""
    cluster = PgCluster()
    try:
        ctl = ControllerProcess(
            cluster.create_database(), world_searchable_tmpdir("fsa-xc-"),
            extra_args=list(CONTROLLER_ARGS),
        )  # fmt: skip
        ctl.start()
        try:
            yield ctl, bootstrap_tenant(ctl), cluster
        finally:
            ctl.stop()
            remove_tree(ctl.data_dir)
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.explorer")
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument(
        "--seconds", type=float, default=0, help="stop after this long (0: no limit)"
    )
    parser.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    parser.add_argument("--mode", choices=["fuse", "dir", "both"], default="both")
    parser.add_argument("--events", type=int, default=14)
    parser.add_argument(
        "--script", default=None, help="comma-separated events to run instead of drawn ones"
    )
    parser.add_argument("--record", type=Path, default=None, help="append a JSON line per schedule")
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="schedules run side by side, each job with a PostgreSQL and a controller of its own",
    )  # fmt: skip
    parser.add_argument("--stride", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    first = args.seed if args.seed is not None else random.randrange(1 << 30)
    if args.jobs > 1:
        return _jobs(args, first)
    modes = ["fuse", "dir"] if args.mode == "both" else [args.mode]
    started = time.monotonic()
    failures = 0
    done = 0
    with explorer_controller() as (ctl, tenant, cluster):
        for i in range(args.schedules):
            if args.seconds and time.monotonic() - started > args.seconds:
                break
            seed, mode = first + i * args.stride, modes[i % len(modes)]
            t0 = time.monotonic()
            try:
                script = args.script.split(",") if args.script else None
                events = run_schedule(ctl, tenant, seed, mode, args.events, cluster, EVENTS, script)
                outcome, detail = "ok", ""
            except Violation as exc:
                failures += 1
                events, outcome, detail = [], "violation", str(exc)
            done += 1
            line = {"seed": seed, "mode": mode, "outcome": outcome,
                    "seconds": round(time.monotonic() - t0, 1), "events": events}  # fmt: skip
            print(json.dumps(line), flush=True)
            if detail:
                print(detail, file=sys.stderr, flush=True)
            if args.record is not None:
                with open(args.record, "a") as fh:
                    fh.write(json.dumps({**line, "detail": detail[:4000]}) + "\n")
    print(f"explorer: {done} schedules, {failures} violations (first seed {first})")
    return 1 if failures else 0


def _jobs(args: argparse.Namespace, first: int) -> int:
    """``--jobs N``: N explorers, job j taking seeds first + j, first + j + N, ..."""
    each = -(-args.schedules // args.jobs)
    common = ["--schedules", str(each), "--seconds", str(args.seconds), "--mode", args.mode,
              "--events", str(args.events), "--stride", str(args.jobs)]  # fmt: skip
    if args.script:
        common += ["--script", args.script]
    if args.record is not None:
        common += ["--record", str(args.record)]
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.explorer", "--seed", str(first + j), *common],
            cwd=REPO,
        )
        for j in range(args.jobs)
    ]
    codes = [job.wait() for job in jobs]
    print(f"explorer: {args.jobs} jobs from first seed {first}, exit codes {codes}")
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
