"""``fsagent up``: prepare the task's repository checkouts (``fsagent repos
prepare``), start the repository saver (``fsagent repos watch``) and the local
API endpoint (``fsagent bridge``), serve all four collections (one daemon
process each) under one home (as FUSE mounts, or as plain directories where
FUSE is unavailable: ``--mode``, decided once here for all four, following the
modes their state dirs record, and said in one line), write the agent's
environment file, and supervise them all until stopped.

The env file (:mod:`fsagent.commands.envfile`: ``KEY="value"`` lines that systemd,
sh and ``fsagent launch`` read alike) holds ``AGENT_HOME``,
``PAPERCLIP_{TASK,AGENT,USER,PROJECT}_DIR`` for the bound collections,
``PAPERCLIP_REPOS_DIR`` and ``PAPERCLIP_PRIMARY_REPO`` when the task binds
repositories, and ``PAPERCLIP_API_URL`` / ``PAPERCLIP_API_SOCKET`` for the
local endpoint. It never holds the run token.

A repository that cannot be prepared (a clone that fails, a directory of
another binding in its place) is reported on stderr and in ``fsagent repos
status``; the sandbox still starts, without that checkout.

Supervision (:class:`Supervisor`), what it guarantees and why:

- **A stop is a save, from the first instruction.** SIGTERM, SIGINT and
  SIGHUP (the last two unless inherited as ignored, as under ``nohup``) are
  handled before anything else, from ``fsagent.cli``'s first import on
  (:mod:`fsagent.earlystop`): a stop while ``up`` starts lets what was
  started stop with its final save, and starts nothing more. Once the
  checkouts are prepared the repository saver starts even when a stop is
  already pending: its final save is what keeps a commit made there.
- **Only ``up`` signals its children.** Each child runs in a session of its
  own, so a signal to the terminal's process group (Ctrl-C) reaches ``up``
  alone, and ``up`` sends the child SIGTERM itself, once the child handles it
  (SIGTERM in its ``SigCgt``, /proc/PID/status): a daemon signalled before its
  handler exists would die of the default action, without a final save. A
  child that never gets that far within ``--timeout`` of its start has served
  nothing and is signalled anyway. A saver gets one SIGTERM (``repos watch``
  and a dir-mode daemon drop their handler when their final save begins, and
  a second one would kill them); the bridge, which saves nothing, gets one
  every few seconds until it exits.
- **No child outlives ``up``.** Each child is started with
  ``PR_SET_PDEATHSIG=SIGTERM``, so a ``kill -9`` of ``up`` still stops every
  one of them, each with its own final save.
- **Stopping waits for the final saves.** A child gets as long as its final
  save's retry budget (:func:`stop_grace`) before it is killed, so a save that
  cannot finish ends in exit 4 and, for the agent folder, a failure receipt,
  never in a SIGKILL half-way; a dead mount left by a killed daemon is
  detached.
- **A child that dies is restarted**, like systemd's ``Restart=on-failure``:
  after 1 s (``--restart-delay``), doubling up to 30 s; a mount daemon's dead mount (ENOTCONN) is
  detached first. One that exits 0 stopped on purpose (``fsagent flush
  --final``, an unmount) and is not restarted. A child that fails before it
  first served, or dies a sixth time within five minutes, is reported and
  everything stops: exit 5.

Exit status: 0 when every child stopped cleanly; else the highest of their
exit codes (4: a final save failed; a child killed by a signal counts as 4
for a saver, 1 for the bridge, and is named with its signal); 5 when a child
could not be started or kept running.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

import trio

from common.limits import SCOPES
from fsagent import earlystop
from fsagent.bridge.base import RepoList, RunInfo
from fsagent.bridge.client import client_from_args
from fsagent.bridge.tls import forwarded_argv, options_from
from fsagent.checkpoint.lifecycle import AGENT_FINAL_ATTEMPTS
from fsagent.commands.daemon import ReadyPipe, detach_dead_mount
from fsagent.commands.envfile import format_env, write_env_file
from fsagent.dirmode.progress import ProgressView
from fsagent.errors import EXIT_SAVE_FAILED, MountFailed
from fsagent.fuse.probe import Decision, decide_all, dir_mode_line
from fsagent.state.store import default_state_root

REPO_STOP_SECONDS = 600.0
"""The least ``up`` waits at stop for the repository saver's final save: it
uploads what changed since the last one, which can be much more than a
collection's."""

REQUEST_SECONDS = 300.0
"""The longest one controller request waits for its answer (fsagent.bridge.http:
uploads and commits); a request begun just before ``--retry-deadline`` runs
that long past it."""

RECEIPT_SECONDS = 30.0
"""The bound on sending the agent folder's failure receipt (``_final_save`` in
fsagent.fuse.mount and fsagent.dirmode.serve)."""

STOP_MARGIN_SECONDS = 60.0
"""What a stop takes besides saving: flushing the kernel's pages, unmounting,
discarding the agent folder's local copy, taking a refresh."""

BRIDGE_STOP_SECONDS = 30.0
"""The bridge saves nothing: the time uvicorn gets to close its connections."""

BRIDGE_START_SECONDS = 60.0
RESEND_SECONDS = 5.0
"""The bridge's SIGTERM is sent again this often: one that arrives before
uvicorn took the signal over is swallowed by the bridge's own handler."""

RESTART_FIRST_DELAY = 1.0
"""The pause before a child's first restart (``up --restart-delay``); each
further restart within :data:`RESTART_WINDOW` doubles it."""
RESTART_MAX_DELAY = 30.0
RESTART_LIMIT = 5
RESTART_WINDOW = 300.0
"""At most RESTART_LIMIT restarts of one child within RESTART_WINDOW seconds."""

POLL_SECONDS = 0.05
STEADY_POLL_SECONDS = 0.2

ENV_NAMES = {
    "task": "PAPERCLIP_TASK_DIR",
    "agent": "PAPERCLIP_AGENT_DIR",
    "user": "PAPERCLIP_USER_DIR",
    "project": "PAPERCLIP_PROJECT_DIR",
}


def env_for(home: Path, run: RunInfo) -> dict[str, str]:
    """The environment an agent gets: only bound collections are exported."""
    env = {"AGENT_HOME": str(home / "agent")}
    for scope, name in ENV_NAMES.items():
        if run.bindings.get(scope) is not None:
            env[name] = str(home / scope)
    return env


def repos_env(home: Path, listing: RepoList) -> dict[str, str]:
    """``PAPERCLIP_REPOS_DIR`` and ``PAPERCLIP_PRIMARY_REPO`` (the primary
    workspace's checkout) when the task binds repositories."""
    if not listing.repos:
        return {}
    root = home / listing.repos_dir
    env = {"PAPERCLIP_REPOS_DIR": str(root)}
    primary = next((r for r in listing.repos if r.primary), None)
    if primary is not None:
        env["PAPERCLIP_PRIMARY_REPO"] = str(root / primary.name)
    return env


def fetch_repos_env(args: argparse.Namespace, home: Path) -> dict[str, str]:
    """:func:`repos_env` of the run's task (``GET /bridge/v1/repos``)."""
    client = client_from_args(args)

    async def listing() -> RepoList:
        from fsagent.repos.checkouts import bound_repos

        try:
            return await bound_repos(client)
        finally:
            await client.aclose()

    return repos_env(home, trio.run(listing))


def prepare_repos(args: argparse.Namespace, home: Path) -> RepoList:
    """``fsagent repos prepare`` for ``up``: every bound checkout made ready
    before the agent starts; problems are printed, never fatal."""
    from fsagent.repos.checkouts import describe_prepare, prepare_all

    client = client_from_args(args)

    async def prepare() -> RepoList:
        try:
            _, listing, results = await prepare_all(client, home)
        finally:
            await client.aclose()
        for result in results:
            line = f"fsagent up: repository {describe_prepare(result)}"
            print(line, file=sys.stdout if result.ok else sys.stderr, flush=True)
        return listing

    return trio.run(prepare)


def fetch_run(args: argparse.Namespace) -> RunInfo:
    """The run the token belongs to (``GET /bridge/v1/run``), with the usual retries."""
    client = client_from_args(args)

    async def get_run() -> RunInfo:
        try:
            return await client.get_run()
        finally:
            await client.aclose()

    return trio.run(get_run)


def served(where: Path, ready: ReadyPipe | None) -> bool:
    """Whether a collection's daemon serves it: mounted (FUSE, no ready pipe),
    or its ready record sent (dir mode)."""
    if ready is None:
        return os.path.ismount(where)
    return ready.poll() is not None


def say_dir_mode(modes: dict[str, Decision]) -> None:
    """Under ``auto``, the one line that says which work folders are plain
    directories and why: FUSE is not available (then all four are), or the
    state dirs record dir mode (then FUSE was not tried)."""
    plain = [scope for scope in SCOPES if modes[scope].mode == "dir"]
    if not plain:
        return
    decision = next((modes[s] for s in plain if not modes[s].recorded), modes[plain[0]])
    subject = "the work folders" if len(plain) == len(SCOPES) else ", ".join(plain)
    line = dir_mode_line(subject, decision, plural=len(plain) > 1)
    if len(plain) < len(SCOPES):
        line += "; the others are FUSE mounts"
    print(f"fsagent up: {line}", file=sys.stderr, flush=True)


def served_as(modes: dict[str, Decision]) -> str:
    """What ``up`` says it started: ``mounted task, agent, user, project``, or
    ``ready (plain directories, dir mode): ...``, or both in a mixed sandbox."""
    mounted = [scope for scope in SCOPES if modes[scope].mode == "fuse"]
    plain = [scope for scope in SCOPES if modes[scope].mode == "dir"]
    parts = [f"mounted {', '.join(mounted)}"] if mounted else []
    if plain:
        parts.append(f"ready (plain directories, dir mode): {', '.join(plain)}")
    return "; ".join(parts)


def say(message: str) -> None:
    print(f"fsagent up: {message}", file=sys.stderr, flush=True)


def detach_if_dead(mountpoint: Path) -> None:
    """Detach the dead mount (ENOTCONN) a killed daemon left at ``mountpoint``.

    Told by statvfs, which the kernel always asks the daemon: a stat is
    answered from the attribute cache (fsagent lets the kernel keep
    attributes an hour) without asking, so a dead mount whose root did not
    change lately stats fine, and :func:`fsagent.commands.daemon.detach_dead_mount`,
    which goes by stat, then leaves it; ``fusermount3`` detaches it here.
    """
    try:
        os.statvfs(mountpoint)
        return
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            return
    detach_dead_mount(mountpoint)
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            say(f"{mountpoint}: detaching the dead mount of a killed daemon")
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                           capture_output=True)  # fmt: skip


# --- stop budget, signals, exit codes -----------------------------------------------------


def stop_grace(retry_deadline: float, attempts: int) -> float:
    """How long a daemon may take to stop once asked: its final save's whole
    retry budget, so a save that cannot finish ends in exit 4 (and, for the
    agent folder, a failure receipt) rather than in a SIGKILL half-way.

    Each of the ``attempts`` final checkpoints retries its requests until
    ``retry_deadline``, and a request begun just before it may wait its whole
    timeout; one checkpoint more is counted for the periodic one a final save
    may wait behind. Then the pauses between attempts (as ``_final_save``
    sleeps them), the failure receipt's own bound and a margin for the rest.
    With the default deadline of 60 s: 810 s, and 1536 s for the agent folder's
    three attempts; a daemon whose controller answers stops in seconds.
    """
    checkpoint = max(retry_deadline, 0.0) + REQUEST_SECONDS
    pauses = sum(min(30.0, 2.0**attempt) for attempt in range(1, attempts))
    return (attempts + 1) * checkpoint + pauses + RECEIPT_SECONDS + STOP_MARGIN_SECONDS


class StopRequest:
    """The stop signals ``up`` answers, handled from its first instruction:
    the first one is recorded here and acted on by the supervisor's loop (a
    handler only sets a flag, so it may run at any point of ``up``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        earlystop.handle(self._on_signal)  # an inherited SIG_IGN stays (nohup)
        # One caught while ``up`` was still importing (after these handlers:
        # a signal between the two is then recorded here or there, not lost).
        self.signum = self.signum or earlystop.take()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal_name(self.signum or 0)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """``exited with 4`` or ``was killed by SIGKILL``."""
    if returncode < 0:
        return f"was killed by {signal_name(-returncode)}"
    return f"exited with {returncode}"


def handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler of its own for SIGTERM (its
    ``SigCgt`` mask in /proc/PID/status). A Python process has none until it
    installs one, so this says the daemon's stop handler exists; SIGINT would
    not (Python always catches it, to raise KeyboardInterrupt)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` that has the child sent SIGTERM when ``parent`` dies
    (the thread that forked it: ``up`` starts children from its main thread
    only). The prctl is looked up here, in the parent; between fork and exec
    the child only calls it. If ``parent`` died before the request took
    effect, the child is already another's: it stops itself."""
    sigterm = int(signal.SIGTERM)

    def arm() -> None:
        _prctl(PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sigterm)

    return arm


# --- the supervisor -----------------------------------------------------------------------


@dataclass(eq=False)
class Child:
    """One process ``up`` starts, restarts and stops, and what it knows of it."""

    name: str
    """How messages name it: ``task``, ``the bridge``, ``the repository saver``."""
    argv: list[str]
    stop_grace: float
    """Seconds from its SIGTERM to a SIGKILL (:func:`stop_grace`)."""
    failure_code: int
    """``up``'s exit code when it was killed by a signal: a saver's final save
    did not finish (4); the bridge saves nothing (1)."""
    serves: Callable[[subprocess.Popen[bytes]], bool] | None = None
    """Whether it serves; None: once it handles SIGTERM."""
    directory: Path | None = None
    """A collection's mountpoint: a dead mount there is detached and the
    directory made before each start."""
    ready_pipe: ReadyPipe | None = None
    """Its ready record's pipe, made anew at each start (``--ready-fd``)."""
    start_seconds: float = 300.0
    stdout: int | None = None
    resend_stop: bool = False
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    started_at: float = 0.0
    ready: bool = False
    armed: bool = False
    """Seen handling SIGTERM since its last start."""
    returncode: int | None = None
    restarts: list[float] = field(default_factory=list)
    restart_at: float | None = None
    stop_sent_at: float | None = None
    last_signal_at: float = 0.0
    killed: bool = False

    @property
    def exit_code(self) -> int:
        """Its last exit as ``up`` reports it: never negative."""
        if self.returncode is None:
            return 0
        return self.failure_code if self.returncode < 0 else self.returncode


class Supervisor:
    """``up``'s children: started in sessions of their own, watched, restarted
    after an unexpected death, stopped with their final saves (module docstring)."""

    def __init__(self, stop: StopRequest, restart_delay: float = RESTART_FIRST_DELAY) -> None:
        self.stop = stop
        self.restart_delay = restart_delay
        self.children: list[Child] = []
        self.fatal: str | None = None
        """Why ``up`` gave up (a child that could not start or stay up)."""
        self.fatal_child: Child | None = None
        self.stopping_all = False
        self.pid = os.getpid()

    def stopping(self) -> bool:
        """Whether ``up`` is stopping: asked to, given up, or past its supervision."""
        return self.stop.requested or self.fatal is not None or self.stopping_all

    def start(self, child: Child) -> None:
        if child not in self.children:
            self.children.append(child)
        child.restart_at = None
        child.starts += 1
        child.ready = child.armed = child.killed = False
        child.stop_sent_at = None
        child.started_at = time.monotonic()
        try:
            if child.directory is not None:
                # A daemon killed by a signal leaves a dead mount (ENOTCONN)
                # that mkdir cannot get past and a new mount must not hide under.
                detach_if_dead(child.directory)
                child.directory.mkdir(parents=True, exist_ok=True)
            argv, handed = child.argv, None
            if child.ready_pipe is not None:
                handed = child.ready_pipe.open()
                argv = [*argv, "--ready-fd", str(handed)]
            try:
                child.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=child.stdout,
                    start_new_session=True,
                    preexec_fn=die_with(self.pid),
                    pass_fds=() if handed is None else (handed,),
                )
            finally:
                if handed is not None:
                    os.close(handed)
        except OSError as exc:
            child.proc, child.returncode = None, 1
            self._failed(child, f"could not be started: {exc}")

    def watch(self) -> None:
        """One look at every child: exits, readiness, restarts that are due."""
        now = time.monotonic()
        for child in self.children:
            proc = child.proc
            if proc is None:
                if child.restart_at is not None and now >= child.restart_at and not self.stopping():
                    self.start(child)
                continue
            returncode = proc.poll()
            if returncode is not None:
                self._exited(child, returncode)
                continue
            if not child.armed and handles_sigterm(proc.pid):
                child.armed = True
            if child.ready:
                continue
            if child.serves(proc) if child.serves is not None else child.armed:
                child.ready = True
                if child.starts > 1:
                    say(f"{child.name} is served again (pid {proc.pid})")
            elif not self.stopping() and now - child.started_at > child.start_seconds:
                self._give_up(child, f"{child.name} was not served within {child.start_seconds:g}s")

    def run_until(self, done: Callable[[], bool], progress: ProgressView | None = None) -> None:
        """Watch the children until ``done()``, a stop, or a child ``up`` gives up on."""
        while not self.stopping() and not done():
            self.watch()
            if progress is not None:
                progress.refresh()
            time.sleep(POLL_SECONDS)

    def supervise(self) -> None:
        """Watch the children until a stop, a child ``up`` gives up on, or
        nothing left to watch (every child stopped on purpose)."""
        while not self.stopping() and any(
            c.proc is not None or c.restart_at is not None for c in self.children
        ):
            self.watch()
            time.sleep(STEADY_POLL_SECONDS)

    def stop_all(self) -> None:
        """Stop every child, each with its final save, and wait for them all."""
        self.stopping_all = True
        running = [c for c in self.children if c.proc is not None]
        if running and self.stop.requested:
            say(f"{self.stop.name}: stopping; each process saves before it exits")
        elif self.stop.requested:
            say(f"{self.stop.name}: stopped before anything started")
        while any(c.proc is not None for c in self.children):
            self._deliver_stop()
            self.watch()
            time.sleep(POLL_SECONDS)
        for child in self.children:
            child.restart_at = None
            if child.directory is not None:
                detach_if_dead(child.directory)

    def report(self) -> int:
        """The exit status of ``up``: the children's, never negative; the
        failed ones named on stderr (the one ``up`` gave up on aside)."""
        bad = [c for c in self.children if c.exit_code != 0 and c is not self.fatal_child]
        if bad:
            described = "; ".join(f"{c.name} {describe_exit(c.returncode or 0)}" for c in bad)
            say(f"stopped with errors: {described}")
        return max((c.exit_code for c in bad), default=0)

    def _deliver_stop(self) -> None:
        now = time.monotonic()
        for child in self.children:
            proc = child.proc
            if proc is None:
                continue
            if child.stop_sent_at is None:
                if handles_sigterm(proc.pid):
                    self._signal(child, signal.SIGTERM)
                    child.stop_sent_at = now
                elif child.armed:
                    # Its handler is gone: it is in its own stop already (fsagent
                    # flush --final, an unmount); a SIGTERM now would kill it.
                    child.stop_sent_at = now
                elif now - child.started_at > child.start_seconds:
                    # Never got as far as serving: nothing of the agent's to save.
                    self._signal(child, signal.SIGTERM)
                    child.stop_sent_at = now
            elif now - child.stop_sent_at > child.stop_grace:
                if not child.killed:
                    say(f"{child.name} did not stop within {child.stop_grace:g}s; killing it")
                    proc.kill()
                    child.killed = True
            elif child.resend_stop and now - child.last_signal_at >= RESEND_SECONDS:
                self._signal(child, signal.SIGTERM)

    def _signal(self, child: Child, signum: int) -> None:
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signum)
            child.last_signal_at = time.monotonic()

    def _exited(self, child: Child, returncode: int) -> None:
        child.proc = None
        child.returncode = returncode
        if self.stopping() or child.stop_sent_at is not None:
            return  # asked for: reported with the others at the end
        if returncode == 0 and child.ready:
            say(f"{child.name} stopped on its own (exit 0); not restarted")
            return
        self._failed(child, describe_exit(returncode))

    def _failed(self, child: Child, how: str) -> None:
        """An unexpected end (or a start that failed): restart it after a
        pause, unless it never served yet or keeps failing."""
        if child.starts == 1 and not child.ready:
            # The first start: a configuration problem restarting cannot fix.
            self._give_up(child, f"{child.name} {how}")
            return
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW]
        if len(child.restarts) >= RESTART_LIMIT:
            self._give_up(
                child,
                f"{child.name} {how}, after {len(child.restarts)} restarts within "
                f"{RESTART_WINDOW:g}s; not restarted again",
            )
            return
        delay = min(RESTART_MAX_DELAY, self.restart_delay * 2 ** len(child.restarts))
        child.restarts.append(now)
        child.restart_at = now + delay
        say(
            f"{child.name} {how}; restarting it in {delay:g}s "
            f"(restart {len(child.restarts)} of at most {RESTART_LIMIT} within {RESTART_WINDOW:g}s)"
        )

    def _give_up(self, child: Child, why: str) -> None:
        if self.fatal is None:
            self.fatal, self.fatal_child = why, child


# --- the children ---------------------------------------------------------------------------


def controller_argv(args: argparse.Namespace) -> list[str]:
    """The options every child that talks to the controller gets from ``up``."""
    argv = ["--controller", args.controller, "--retry-deadline", f"{args.retry_deadline:g}"]
    if args.token_file:
        argv += ["--token-file", args.token_file]
    return argv + forwarded_argv(options_from(args))


def log_argv(args: argparse.Namespace) -> list[str]:
    return ["--log-format", args.log_format] if args.log_format else []


def repo_saver(args: argparse.Namespace, home: Path, state_root: Path) -> Child:
    """``fsagent repos watch`` beside the mounts: checkpoints on the collections'
    cadence and a final save when ``up`` stops it."""
    argv = [sys.executable, "-m", "fsagent.cli", "repos", "watch", "--home", str(home),
            *controller_argv(args), "--state-root", str(state_root),
            "--interval", str(args.checkpoint_interval), *log_argv(args)]  # fmt: skip
    grace = max(REPO_STOP_SECONDS, stop_grace(args.retry_deadline, 1))
    return Child("the repository saver", argv, grace, EXIT_SAVE_FAILED,
                 start_seconds=args.timeout)  # fmt: skip


def bridge_argv(args: argparse.Namespace, sock: str, port: int) -> list[str]:
    return [sys.executable, "-m", "fsagent.cli", "bridge", *controller_argv(args),
            "--socket", sock, "--port", str(port)]  # fmt: skip


def bridge(args: argparse.Namespace, state_root: Path) -> Child:
    """``fsagent bridge``, the local API endpoint: served once its ready record
    names it (:class:`ReadyPipe`)."""
    from fsagent.state.statedir import default_socket, runtime_dir

    runtime_dir(state_root).mkdir(parents=True, exist_ok=True)
    sock = args.bridge_socket or str(default_socket(state_root))
    ready = ReadyPipe()
    return Child(
        "the bridge",
        bridge_argv(args, sock, args.bridge_port),
        BRIDGE_STOP_SECONDS,
        1,
        serves=lambda proc: ready.poll() is not None,
        ready_pipe=ready,
        start_seconds=BRIDGE_START_SECONDS,
        stdout=subprocess.DEVNULL,
        resend_stop=True,
    )


def bridge_env(args: argparse.Namespace, child: Child) -> dict[str, str]:
    """The served bridge's env file variables. A restart of it listens on the
    same port, so the env file stays true."""
    assert child.ready_pipe is not None
    info = child.ready_pipe.poll()
    assert info is not None, "the bridge is served: its record came"
    env = {k: str(info[k]) for k in ("PAPERCLIP_API_URL", "PAPERCLIP_API_SOCKET")}
    port = urlsplit(env["PAPERCLIP_API_URL"]).port or args.bridge_port
    child.argv = bridge_argv(args, env["PAPERCLIP_API_SOCKET"], port)
    return env


def mount_daemon(
    args: argparse.Namespace,
    scope: str,
    home: Path,
    state_root: Path,
    decision: Decision,
    progress_file: Path | None,
) -> Child:
    """``fsagent mount SCOPE`` in the foreground, in the mode ``up`` decided."""
    mp = home / scope
    ready = ReadyPipe() if decision.mode == "dir" else None
    argv = [sys.executable, "-m", "fsagent.cli", "mount", scope, str(mp), *controller_argv(args),
            "--state-dir", str(state_root / scope), "--foreground",
            "--prefetch", str(args.prefetch),
            "--checkpoint-interval", str(args.checkpoint_interval),
            "--spin-us", str(args.spin_us),
            "--mode", decision.mode, "--mode-reason", decision.reason]  # fmt: skip
    if decision.mode == "dir" and progress_file is not None:
        progress_file.unlink(missing_ok=True)
        argv += ["--progress-file", str(progress_file)]
    if args.allow_other:
        argv.append("--allow-other")
    argv += log_argv(args)
    attempts = AGENT_FINAL_ATTEMPTS if scope == "agent" else 1
    return Child(
        scope,
        argv,
        stop_grace(args.retry_deadline, attempts),
        EXIT_SAVE_FAILED,
        serves=lambda proc: served(mp, ready),
        directory=mp,
        ready_pipe=ready,
        start_seconds=args.timeout,
    )


# --- the command ----------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    """Start everything (module docstring), supervise it until stopped, stop
    it with its final saves; the exit status."""
    stop = StopRequest()  # first: from here on, a stop is a clean stop
    supervisor = Supervisor(stop, args.restart_delay)
    try:
        bring_up(args, supervisor)
        supervisor.supervise()
    finally:
        supervisor.stop_all()
    if supervisor.fatal is not None:
        supervisor.report()
        raise MountFailed(f"fsagent up: {supervisor.fatal}")
    return supervisor.report()


def bring_up(args: argparse.Namespace, supervisor: Supervisor) -> None:
    """Start the children in order, each step only while no stop is pending;
    the env file once every collection is served."""
    home = Path(args.home).absolute()
    state_root = Path(args.state_root) if args.state_root else default_state_root()
    run = fetch_run(args)
    format_env(env_for(home, run))  # a home no env file can name is refused before mounting
    if supervisor.stopping():
        return
    modes = decide_all(args.mode, {s: state_root / s for s in SCOPES}, args.mode_reason)
    if args.mode == "auto":
        say_dir_mode(modes)
    api_env: dict[str, str] = {}
    repo_env: dict[str, str] = {}
    if args.controller.startswith(("http://", "https://")):
        # A local directory source binds no repositories and has no API to serve.
        listing = prepare_repos(args, home)
        repo_env = repos_env(home, listing)
        if listing.repos:
            supervisor.start(repo_saver(args, home, state_root))
        if supervisor.stopping():
            return
        endpoint = bridge(args, state_root)
        supervisor.start(endpoint)
        supervisor.run_until(lambda: endpoint.ready)
        if supervisor.stopping():
            return
        api_env = bridge_env(args, endpoint)
    # On a terminal, the directories' hydration progress is one line here for
    # all of them (fsagent.dirmode.progress): four daemons rewriting lines on one
    # terminal would overwrite each other.
    progress_files: dict[str, Path] = {}
    if sys.stderr.isatty():
        (state_root / "run").mkdir(parents=True, exist_ok=True)
        progress_files = {s: state_root / "run" / f"{s}.progress" for s in SCOPES
                          if modes[s].mode == "dir"}  # fmt: skip
    mounts = [
        mount_daemon(args, scope, home, state_root, modes[scope], progress_files.get(scope))
        for scope in SCOPES
    ]
    for child in mounts:
        supervisor.start(child)
    progress = ProgressView("fsagent up: filling ", progress_files)
    supervisor.run_until(lambda: all(m.ready for m in mounts), progress)
    progress.finish()
    if supervisor.stopping():
        return
    env_file = Path(args.env_file) if args.env_file else state_root / "env"
    write_env_file(env_file, {**env_for(home, run), **repo_env, **api_env})
    print(f"fsagent: {served_as(modes)} under {home}; environment in {env_file}", flush=True)
