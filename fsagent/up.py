"""``fsagent up``: start the local API endpoint (``fsagent bridge``), mount all
four collections (one daemon process each) under one home, write the agent's
environment file, and supervise them all.

The env file (:mod:`fsagent.envfile`: ``KEY="value"`` lines that systemd,
sh and ``fsagent launch`` read alike) holds ``AGENT_HOME``,
``PAPERCLIP_{TASK,AGENT,USER,PROJECT}_DIR`` for the bound collections, and
``PAPERCLIP_API_URL`` / ``PAPERCLIP_API_SOCKET`` for the local endpoint.
It never holds the run token.
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
from fsagent.client import RunInfo
from fsagent.daemon import client_from_args
from fsagent.envfile import format_env, write_env_file
from fsagent.errors import MountFailed
from fsagent.store import default_state_root
from fsagent.tls import forwarded_argv, options_from

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


def cmd_up(args: argparse.Namespace) -> int:
    """Mount all four collections (one process each) and supervise them."""
    home = Path(args.home).absolute()
    state_root = Path(args.state_root) if args.state_root else default_state_root()
    run = fetch_run(args)
    format_env(env_for(home, run))  # a home no env file can name is refused before mounting
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children: dict[str, subprocess.Popen[bytes]] = {}
    api_env: dict[str, str] = {}
    if args.controller.startswith(("http://", "https://")):
        # A local directory source has no API to serve: no endpoint then.
        children["bridge"], api_env = start_bridge(args, state_root)
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
    while pending and not stop and failed is None:
        for scope in list(pending):
            if os.path.ismount(home / scope):
                pending.discard(scope)
            elif children[scope].poll() is not None:
                failed = f"{scope} exited with {children[scope].returncode}"
        if time.monotonic() > deadline:
            failed = f"not mounted within {args.timeout}s: {', '.join(sorted(pending))}"
        time.sleep(0.05)
    if failed is None and not stop:
        env_file = Path(args.env_file) if args.env_file else state_root / "env"
        write_env_file(env_file, {**env_for(home, run), **api_env})
        print(
            f"fsagent: mounted {', '.join(SCOPES)} under {home}; environment in {env_file}",
            flush=True,
        )
        while not stop and all(c.poll() is None for c in children.values()):
            time.sleep(0.2)
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    codes = {}
    for scope, child in children.items():
        try:
            codes[scope] = child.wait(timeout=120)
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
