"""``fsagent up``: prepare the task's repository checkouts (``fsagent repos
prepare``), start the local API endpoint (``fsagent bridge``), mount all four
collections (one daemon process each) under one home (as FUSE mounts, or as
plain directories where FUSE is unavailable: ``--mode``, decided once here
for all four, following the modes their state dirs record, and said in one
line), start the repository
saver (``fsagent repos watch``), write the agent's environment file, and
supervise them all.

The env file (:mod:`fsagent.envfile`: ``KEY="value"`` lines that systemd,
sh and ``fsagent launch`` read alike) holds ``AGENT_HOME``,
``PAPERCLIP_{TASK,AGENT,USER,PROJECT}_DIR`` for the bound collections,
``PAPERCLIP_REPOS_DIR`` and ``PAPERCLIP_PRIMARY_REPO`` when the task binds
repositories, and ``PAPERCLIP_API_URL`` / ``PAPERCLIP_API_SOCKET`` for the
local endpoint. It never holds the run token.

A repository that cannot be prepared (a clone that fails, a directory of
another binding in its place) is reported on stderr and in ``fsagent repos
status``; the sandbox still starts, without that checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import trio

from common.limits import SCOPES
from fsagent.client import RepoList, RunInfo
from fsagent.daemon import client_from_args, is_ready
from fsagent.envfile import format_env, write_env_file
from fsagent.errors import MountFailed
from fsagent.fuseprobe import Decision, decide_all, dir_mode_line
from fsagent.progress import ProgressView
from fsagent.store import default_state_root
from fsagent.tls import forwarded_argv, options_from

REPO_STOP_SECONDS = 600
"""How long ``up`` waits at stop for the repository saver's final save."""

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
        from fsagent.repos import bound_repos

        try:
            return await bound_repos(client)
        finally:
            await client.aclose()

    return repos_env(home, trio.run(listing))


def prepare_repos(args: argparse.Namespace, home: Path) -> RepoList:
    """``fsagent repos prepare`` for ``up``: every bound checkout made ready
    before the agent starts; problems are printed, never fatal."""
    from fsagent.repos import describe_prepare, prepare_all

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


def start_repo_saver(
    args: argparse.Namespace, home: Path, state_root: Path
) -> subprocess.Popen[bytes]:
    """``fsagent repos watch`` beside the mounts: checkpoints on the collections'
    cadence and a final save when ``up`` stops it."""
    argv = [sys.executable, "-m", "fsagent.cli", "repos", "watch", "--home", str(home),
            "--controller", args.controller, "--state-root", str(state_root),
            "--interval", str(args.checkpoint_interval)]  # fmt: skip
    if args.token_file:
        argv += ["--token-file", args.token_file]
    argv += forwarded_argv(options_from(args))
    if args.log_format:
        argv += ["--log-format", args.log_format]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def fetch_run(args: argparse.Namespace) -> RunInfo:
    """The run the token belongs to (``GET /bridge/v1/run``), with the usual retries."""
    client = client_from_args(args)

    async def get_run() -> RunInfo:
        try:
            return await client.get_run()
        finally:
            await client.aclose()

    return trio.run(get_run)


def start_bridge(
    args: argparse.Namespace, state_root: Path
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """Start ``fsagent bridge`` and wait until it listens; its env file variables."""
    from fsagent.localbridge import default_socket, runtime_dir

    ready = runtime_dir(state_root) / "bridge.json"
    ready.parent.mkdir(parents=True, exist_ok=True)
    ready.unlink(missing_ok=True)
    sock = args.bridge_socket or str(default_socket(state_root))
    argv = [sys.executable, "-m", "fsagent.cli", "bridge", "--controller", args.controller,
            "--token-file", args.token_file, "--socket", sock, "--port", str(args.bridge_port),
            "--ready-file", str(ready)]  # fmt: skip
    argv += forwarded_argv(options_from(args))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None:
            raise MountFailed(f"fsagent up: the bridge exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise MountFailed("fsagent up: the bridge did not start within 60s")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, {k: str(info[k]) for k in ("PAPERCLIP_API_URL", "PAPERCLIP_API_SOCKET")}


def served(mode: str, where: Path, ready: Path, child: subprocess.Popen[bytes]) -> bool:
    """Whether a collection's daemon serves it: mounted (FUSE), or its ready
    file written (dir mode)."""
    if mode == "fuse":
        return os.path.ismount(where)
    return is_ready(ready, child.pid)


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


def cmd_up(args: argparse.Namespace) -> int:
    """Mount all four collections (one process each) and supervise them."""
    home = Path(args.home).absolute()
    state_root = Path(args.state_root) if args.state_root else default_state_root()
    run = fetch_run(args)
    format_env(env_for(home, run))  # a home no env file can name is refused before mounting
    modes = decide_all(args.mode, {s: state_root / s for s in SCOPES}, args.mode_reason)
    if args.mode == "auto":
        say_dir_mode(modes)
    ready_dir = state_root / "run"
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children: dict[str, subprocess.Popen[bytes]] = {}
    api_env: dict[str, str] = {}
    repo_env: dict[str, str] = {}
    if args.controller.startswith(("http://", "https://")):
        # A local directory source binds no repositories and has no API to serve.
        listing = prepare_repos(args, home)
        repo_env = repos_env(home, listing)
        if listing.repos:
            children["repos"] = start_repo_saver(args, home, state_root)
        children["bridge"], api_env = start_bridge(args, state_root)
    # On a terminal, the directories' hydration progress is one line here for
    # all of them (fsagent.progress): four daemons rewriting lines on one
    # terminal would overwrite each other.
    show_progress = sys.stderr.isatty()
    progress_files: dict[str, Path] = {}
    if show_progress:
        ready_dir.mkdir(parents=True, exist_ok=True)
    for scope in SCOPES:
        mp = home / scope
        mp.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "fsagent.cli",
            "mount",
            scope,
            str(mp),
            "--controller",
            args.controller,
            "--state-dir",
            str(state_root / scope),
            "--foreground",
            "--prefetch",
            str(args.prefetch),
            "--checkpoint-interval",
            str(args.checkpoint_interval),
            "--spin-us",
            str(args.spin_us),
        ]
        argv += ["--mode", modes[scope].mode, "--mode-reason", modes[scope].reason]
        if modes[scope].mode == "dir":
            ready = ready_dir / f"{scope}.ready"
            ready.unlink(missing_ok=True)
            argv += ["--ready-file", str(ready)]
            if show_progress:
                progress_files[scope] = ready_dir / f"{scope}.progress"
                progress_files[scope].unlink(missing_ok=True)
                argv += ["--progress-file", str(progress_files[scope])]
        if args.token_file:
            argv += ["--token-file", args.token_file]
        if args.allow_other:
            argv.append("--allow-other")
        argv += forwarded_argv(options_from(args))
        if args.log_format:
            argv += ["--log-format", args.log_format]
        children[scope] = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + args.timeout
    pending = set(SCOPES)
    failed: str | None = None
    progress = ProgressView("fsagent up: filling ", progress_files)
    while pending and not stop and failed is None:
        progress.refresh()
        for scope in list(pending):
            if served(
                modes[scope].mode, home / scope, ready_dir / f"{scope}.ready", children[scope]
            ):
                pending.discard(scope)
            elif children[scope].poll() is not None:
                failed = f"{scope} exited with {children[scope].returncode}"
        if time.monotonic() > deadline:
            failed = f"not mounted within {args.timeout}s: {', '.join(sorted(pending))}"
        time.sleep(0.05)
    progress.finish()
    if failed is None and not stop:
        env_file = Path(args.env_file) if args.env_file else state_root / "env"
        write_env_file(env_file, {**env_for(home, run), **repo_env, **api_env})
        print(f"fsagent: {served_as(modes)} under {home}; environment in {env_file}", flush=True)
        while not stop and all(c.poll() is None for c in children.values()):
            time.sleep(0.2)
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    codes = {}
    for scope, child in children.items():
        try:
            # A repository's final save uploads what changed since the last
            # one, which can be much more than a collection's.
            codes[scope] = child.wait(timeout=REPO_STOP_SECONDS if scope == "repos" else 120)
        except subprocess.TimeoutExpired:
            child.kill()
            codes[scope] = child.wait()
    if failed is not None:
        raise MountFailed(f"fsagent up: {failed}")
    bad = {s: c for s, c in codes.items() if c != 0}
    if bad:
        print(f"fsagent up: collections stopped with errors: {bad}", file=sys.stderr)
        return max(bad.values())
    return 0
