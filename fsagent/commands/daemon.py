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
from typing import Any, BinaryIO

import trio

from common.limits import SCOPES
from fsagent.bridge.client import client_from_args
from fsagent.dirmode.progress import ProgressView
from fsagent.errors import EXIT_SAVE_FAILED, FULL_DISK, FsagentError, MountFailed
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
    extra = ["--mode", decision.mode, "--mode-reason", decision.reason]
    # The daemon says it serves on a pipe (a ready file of its own needs room
    # a full disk may not have), unless told to write a ready file.
    pipe = ReadyPipe()
    ready = Path(args.ready_file) if args.ready_file else None
    if ready is not None:
        ready.unlink(missing_ok=True)
        write_end = None
    else:
        write_end = pipe.open()
        extra += ["--ready-fd", str(write_end)]
    progress = ProgressView("fsagent: ", {})
    if decision.mode == "dir" and sys.stderr.isatty():
        # The daemon's stderr is the log: its hydration progress is shown here.
        where = log_dir / "run" / f"{args.scope}.progress"
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            where.unlink(missing_ok=True)
        except OSError as exc:
            if exc.errno not in FULL_DISK:
                raise
        else:  # the figures are best effort (fsagent.dirmode.progress)
            extra += ["--progress-file", str(where)]
            progress = ProgressView("fsagent: ", {args.scope: where})
    try:
        with _open_log(log_path) as log_fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fsagent.cli", *argv, *extra, "--foreground"],
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=log_fh,
                start_new_session=True,
                pass_fds=() if write_end is None else (write_end,),
            )
    finally:
        if write_end is not None:
            os.close(write_end)
    deadline = time.monotonic() + 300
    served_at = "mounted at" if decision.mode == "fuse" else "ready at"

    def serves() -> bool:
        if os.path.ismount(mountpoint):
            return True
        if ready is not None:
            return is_ready(ready, proc.pid)
        record = pipe.poll()
        return record is not None and record.get("pid") == proc.pid

    while time.monotonic() < deadline:
        progress.refresh()
        if serves():
            progress.finish()
            print(f"fsagent: {args.scope} {served_at} {mountpoint} ({decision.mode} mode, "
                  f"pid {proc.pid}, log {log_path})")  # fmt: skip
            return 0
        if proc.poll() is not None:
            progress.finish()
            pipe.close()
            try:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            except OSError:
                tail = []
            print("\n".join(tail), file=sys.stderr)
            return proc.returncode or 1
        time.sleep(0.05)
    progress.finish()
    pipe.close()
    proc.terminate()
    raise MountFailed(f"{mountpoint} was not served within 300s (log {log_path})")


def _open_log(path: Path) -> BinaryIO:
    """The detached daemon's log, appended to; where a full disk has no room
    for a new one, its output is discarded (with a warning here) rather than
    the collection left unserved, since the agent that could free the room
    runs only once it is served."""
    try:
        return open(path, "ab")
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise
        print(f"fsagent: no room for the log {path} ({exc.strerror}); the daemon's output is "
              "discarded", file=sys.stderr)  # fmt: skip
        return open(os.devnull, "wb")


class ReadyPipe:
    """How a daemon tells the process that started it (``fsagent up``, a
    detaching ``fsagent mount``) that it serves, without a byte of the disk:
    it inherits the write end of a pipe (``--ready-fd N``) and writes its
    ready record there as one JSON line (fsagent.control.server.announce_ready).

    Ready files did this before, and each needed a block: a sandbox whose
    agent had filled the disk could not start again, so the agent that could
    free it never ran. Each start gets a pipe of its own, so a line of an
    earlier start is never taken for the new process's."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._buffer = b""
        self.record: dict[str, Any] | None = None

    def open(self) -> int:
        """A new pipe for the next start; the write end to hand over (the
        caller closes its copy once the child has it)."""
        self.close()
        read, write = os.pipe()
        os.set_blocking(read, False)
        self._fd = read
        return write

    def poll(self) -> dict[str, Any] | None:
        """The record once a whole line of it came; None until then (or when
        the child closed the pipe without one)."""
        if self.record is None and self._fd is not None:
            try:
                while chunk := os.read(self._fd, 4096):
                    self._buffer += chunk
            except BlockingIOError:
                pass
            line, newline, _ = self._buffer.partition(b"\n")
            if newline:
                self.record = json.loads(line)
        return self.record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._buffer, self.record = None, b"", None


def is_ready(ready_file: Path, pid: int) -> bool:
    """Whether the daemon ``pid`` wrote its ready file (``--ready-file``)."""
    try:
        return int(json.loads(ready_file.read_text())["pid"]) == pid
    except (OSError, ValueError, KeyError, TypeError):
        return False
