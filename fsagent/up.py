"""``fsagent up``: mount all four collections (one daemon process each) under
one home, write the agent's environment file, and supervise the daemons."""

from __future__ import annotations

import argparse
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


def cmd_up(args: argparse.Namespace) -> int:
    """Mount all four collections (one process each) and supervise them."""
    home = Path(args.home).absolute()
    state_root = Path(args.state_root) if args.state_root else default_state_root()
    client = client_from_args(args)

    async def get_run() -> RunInfo:
        try:
            return await client.get_run()
        finally:
            await client.aclose()

    run = trio.run(get_run)
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children: dict[str, subprocess.Popen[bytes]] = {}
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
        env_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = env_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{k}={v}\n" for k, v in env_for(home, run).items()))
        os.replace(tmp, env_file)
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
