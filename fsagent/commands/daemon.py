"""``fsagent mount``: check the mountpoint, decide the mode (FUSE, or a plain
directory where FUSE is unavailable: fsagent.fuse.probe), then serve in the
foreground or start the foreground daemon detached and return once it serves.

Also the run-token and controller options every command shares
(:func:`fsagent.bridge.client.read_token`,
:func:`fsagent.bridge.client.client_from_args`).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import trio

from common.limits import SCOPES
from fsagent.bridge.client import client_from_args
from fsagent.dirmode.progress import ProgressView
from fsagent.errors import EXIT_SAVE_FAILED, FsagentError, MountFailed
from fsagent.fuse.probe import Decision, decide, dir_mode_line
from fsagent.state.store import default_state_root

log = logging.getLogger("fsagent")


def detach_dead_mount(mountpoint: Path) -> None:
    """Detach the mount a crashed fsagent left behind (ENOTCONN), so a restart can mount.

    Only a dead FUSE connection is detached; a live mount is left alone and
    the new mount then fails with a clear message.
    """
    try:
        # statvfs, not stat: the kernel answers stat from its attribute cache,
        # so a killed daemon's mount can look alive; statfs always asks it.
        os.statvfs(mountpoint)
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            return
        log.warning("%s: detaching the dead mount of a previous fsagent", mountpoint)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                       capture_output=True)  # fmt: skip


def cmd_mount(args: argparse.Namespace) -> int:
    if args.scope not in SCOPES:
        raise FsagentError(f"scope must be one of {', '.join(SCOPES)}")
    mountpoint = Path(args.mountpoint)
    detach_dead_mount(mountpoint)
    if not mountpoint.is_dir():
        raise MountFailed(f"mountpoint {mountpoint} is not an existing directory")
    state_dir = Path(args.state_dir) if args.state_dir else default_state_root() / args.scope
    decision = decide(args.mode, state_dir, args.mode_reason)
    if args.mode == "auto" and decision.mode == "dir" and not args.foreground:
        print(f"fsagent: {dir_mode_line(args.scope, decision)}", file=sys.stderr)
    if not args.foreground:
        return _daemonize(args, mountpoint, state_dir, decision)
    if decision.mode == "dir":
        return _serve_dir(args, mountpoint, state_dir, decision)
    from fsagent.fuse.mount import MountOptions, serve
    from fsagent.mountguard import MountGuard

    # From here on, a write to the mountpoint's path fails until the mount
    # serves it, instead of landing unseen underneath (fsagent.mountguard).
    guard = MountGuard.take(mountpoint)

    opts = MountOptions(
        args.scope,
        mountpoint,
        state_dir,
        args.allow_other,
        args.prefetch,
        args.checkpoint_interval,
        args.spin_us,
        decision.reason,
        guard,
    )

    async def main() -> bool:
        client = client_from_args(args)
        try:
            return (await serve(client, opts)).ok
        finally:
            await client.aclose()

    try:
        saved = trio.run(main)
    finally:
        if guard is not None:
            guard.close()
    return 0 if saved else EXIT_SAVE_FAILED


def _serve_dir(
    args: argparse.Namespace, directory: Path, state_dir: Path, decision: Decision
) -> int:
    """The foreground daemon of a plain-directory collection (fsagent.dirmode.serve)."""
    from fsagent.dirmode.serve import DirOptions, serve_dir

    if args.mode == "auto":
        print(f"fsagent: {dir_mode_line(args.scope, decision)}", file=sys.stderr)
    opts = DirOptions(
        args.scope,
        directory,
        state_dir,
        decision.reason,
        args.prefetch,
        args.checkpoint_interval,
        ready_file=Path(args.ready_file) if args.ready_file else None,
        ready_fd=args.ready_fd,
        progress_file=Path(args.progress_file) if args.progress_file else None,
    )

    async def main() -> bool:
        client = client_from_args(args)
        try:
            return (await serve_dir(client, opts)).ok
        finally:
            await client.aclose()

    return 0 if trio.run(main) else EXIT_SAVE_FAILED


def _daemonize(
    args: argparse.Namespace, mountpoint: Path, state_dir: Path, decision: Decision
) -> int:
    """Start the foreground daemon detached (in the mode decided here) and
    return once it serves the collection."""
    # The command line main() parsed, which is sys.argv only when run as a program.
    argv = [a for a in args.argv if a != "--foreground"]
    log_dir = state_dir.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{args.scope}.log"
    ready = Path(args.ready_file) if args.ready_file else log_dir / "run" / f"{args.scope}.ready"
    ready.unlink(missing_ok=True)
    extra = ["--mode", decision.mode, "--mode-reason", decision.reason]
    if not args.ready_file:
        extra += ["--ready-file", str(ready)]
    progress = ProgressView("fsagent: ", {})
    if decision.mode == "dir" and sys.stderr.isatty():
        # The daemon's stderr is the log: its hydration progress is shown here.
        where = ready.with_name(f"{args.scope}.progress")
        where.parent.mkdir(parents=True, exist_ok=True)
        where.unlink(missing_ok=True)
        extra += ["--progress-file", str(where)]
        progress = ProgressView("fsagent: ", {args.scope: where})
    with open(log_path, "ab") as log_fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsagent.cli", *argv, *extra, "--foreground"],
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=log_fh,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    served_at = "mounted at" if decision.mode == "fuse" else "ready at"
    while time.monotonic() < deadline:
        progress.refresh()
        if os.path.ismount(mountpoint) or is_ready(ready, proc.pid):
            progress.finish()
            print(f"fsagent: {args.scope} {served_at} {mountpoint} ({decision.mode} mode, "
                  f"pid {proc.pid}, log {log_path})")  # fmt: skip
            return 0
        if proc.poll() is not None:
            progress.finish()
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            print("\n".join(tail), file=sys.stderr)
            return proc.returncode or 1
        time.sleep(0.05)
    progress.finish()
    proc.terminate()
    raise MountFailed(f"{mountpoint} was not served within 300s (log {log_path})")


def is_ready(ready_file: Path, pid: int) -> bool:
    """Whether the daemon ``pid`` wrote its ready file (``--ready-file``)."""
    try:
        return int(json.loads(ready_file.read_text())["pid"]) == pid
    except (OSError, ValueError, KeyError, TypeError):
        return False
