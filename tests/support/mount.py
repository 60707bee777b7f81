"""Real fsagent mounts: one helper, used by every FUSE test and by the benchmarks.

The daemon always runs in its own process (``python -m fsagent.cli mount ...
--foreground``); a test never touches a mount from the thread serving it.
:meth:`FsagentMount.start` polls ``os.path.ismount`` with a deadline and fails
at once (:class:`MountError`, with the daemon's stderr) if the process dies
first. Teardown is ``fusermount3 -u -z``, wait, terminate, kill.

``mode="dir"`` starts the same daemon as a plain directory (``--mode dir``):
it is ready once its ``--ready-file`` names its pid, and it stops on SIGTERM
(its final save) instead of an unmount. Tests of the shared contract run in
both modes (the ``mode_mounts`` fixture).

Sources: :func:`tests.support.source.make_source` writes a
DirectoryBridgeClient directory (run, manifests, objects), so filesystem
behaviour can be tested without a controller; or point ``controller`` at a
real controller's URL.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsagent.dirmode.serve import release_directory
from fsagent.fuse.mount import mount_device
from tests.support.constants import REPO, SCOPES
from tests.support.procs import ProcessError, run_module_json
from tests.support.source import make_source, sha256
from tests.support.tmp import private_tmpdir, remove_tree


class MountError(RuntimeError):
    """The daemon died or did not mount in time; the message carries its stderr."""


def is_mounted(path: Path) -> bool:
    """os.path.ismount, plus the mount table: a FUSE mount of another user without
    allow_other cannot be stat()ed, not even by root."""
    if os.path.ismount(path):
        return True
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno != errno.EACCES:
            return False  # absent, or the dead mount of a crashed daemon (ENOTCONN)
    return in_mount_table(path)


def in_mount_table(path: Path) -> bool:
    """Whether anything, alive or dead, is mounted at ``path``."""
    return mount_device(Path(os.path.realpath(path.parent)) / path.name) is not None


@dataclass
class FsagentMount:
    """One ``fsagent mount --foreground`` subprocess and its mountpoint."""

    scope: str
    mountpoint: Path
    state_dir: Path
    controller: str
    token_file: Path | None = None
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    stderr_path: Path | None = None
    stderr_text: str = ""
    python: str = sys.executable
    user: int | None = None
    """Run the daemon as this uid (and the same gid), e.g. an unprivileged agent user."""
    env: dict[str, str] | None = None
    fuse_conn: int | None = None
    """Minor device number of the mount = its /sys/fs/fuse/connections entry."""
    log_dir: Path | None = None
    """Where the daemon's stderr file goes; None: a private temp dir (see tests.support.tmp)."""
    poll_interval: float = 0.02
    """How often :meth:`start` checks for the mount; benchmarks timing the mount poll faster."""
    mount_seconds: float = 0.0
    """Process start to the mount being there, measured by :meth:`start`."""
    mode: str = "fuse"
    """``fuse`` or ``dir`` (a plain directory, fsagent.dirmode.serve)."""

    @property
    def ready_file(self) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{self.state_dir.name}-{self.mountpoint.name}.ready"

    def served(self) -> bool:
        """Mounted (FUSE), or its ready file names this daemon (dir mode)."""
        if self.mode == "fuse":
            return is_mounted(self.mountpoint)
        assert self.proc is not None
        try:
            return int(json.loads(self.ready_file.read_text())["pid"]) == self.proc.pid
        except (OSError, ValueError, KeyError):
            return False

    def argv(self) -> list[str]:
        argv = [
            self.python,
            "-m",
            "fsagent.cli",
            "mount",
            self.scope,
            str(self.mountpoint),
            "--controller",
            self.controller,
            "--state-dir",
            str(self.state_dir),
            "--foreground",
            "--mode",
            self.mode,
            *self.extra,
        ]
        if self.mode == "dir":
            argv += ["--ready-file", str(self.ready_file)]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return argv

    def _new_stderr_path(self) -> Path:
        if self.log_dir is None:
            self.log_dir = private_tmpdir("fsagent-log-")  # removed with its claimant
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"{self.state_dir.name}-{self.mountpoint.name}.stderr"

    def start(self, timeout: float = 60.0) -> FsagentMount:
        """Start the daemon; return once mounted, or raise MountError with its stderr."""
        try:
            self.mountpoint.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:  # a crashed daemon's mount: fsagent detaches it
                raise
        self.stderr_path = self._new_stderr_path()
        self.ready_file.unlink(missing_ok=True)
        with open(self.stderr_path, "wb") as err:
            started = time.perf_counter()
            self.proc = subprocess.Popen(
                self.argv(), stdout=err, stderr=err, cwd=REPO, stdin=subprocess.DEVNULL,
                user=self.user, group=self.user, env=self.env,
            )  # fmt: skip
        deadline = started + timeout
        while time.perf_counter() < deadline:
            if self.served():
                self.mount_seconds = time.perf_counter() - started
                with contextlib.suppress(OSError):
                    self.fuse_conn = os.minor(os.stat(self.mountpoint).st_dev)
                return self
            if self.proc.poll() is not None:
                self.stderr_text = self.stderr()
                code = self.proc.returncode
                raise MountError(f"fsagent exited with {code} before mounting:\n{self.stderr_text}")
            time.sleep(self.poll_interval)
        self.stop()
        raise MountError(
            f"fsagent did not mount {self.mountpoint} within {timeout}s:\n{self.stderr()}"
        )

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path else ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """Unmount lazily, then wait / terminate / kill; returns the exit code.
        A plain directory's daemon is sent SIGTERM (its final save) instead."""
        if self.mode == "dir":
            if self.proc is None:
                return None
            if self.proc.poll() is None:
                self.proc.terminate()
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        if in_mount_table(self.mountpoint):
            subprocess.run(
                ["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False
            )
        if self.proc is None:
            return None
        for action in (None, self.proc.terminate, self.proc.kill, self.abort_connection):
            if action is not None:
                action()
            try:
                return self.proc.wait(timeout=timeout if action is None else 10)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.wait()

    def abort_connection(self) -> None:
        """Last resort: a daemon stuck in the kernel cannot even die until its FUSE
        connection is aborted (and neither can a test blocked on the mount)."""
        if self.fuse_conn is not None:
            with contextlib.suppress(OSError):
                Path(f"/sys/fs/fuse/connections/{self.fuse_conn}/abort").write_text("1")

    def signal(self, sig: int, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait for the daemon to exit (it unmounts itself)."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        return code

    def kill9(self) -> None:
        """SIGKILL the daemon and detach the dead mount (as a crash would leave it)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.mode == "fuse":
            subprocess.run(
                ["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False
            )

    def peak_rss_kib(self) -> int:
        """VmHWM of the daemon: its peak resident set so far, in KiB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise MountError("no VmHWM in /proc status")

    def fsagent(self, *args: str, timeout: float = 900.0) -> Any:
        """Run an fsagent subcommand with --json against this state dir; parsed output.

        Raises :class:`tests.support.procs.ProcessError` with its stderr if it fails.
        """
        return run_module_json(
            "fsagent.cli", *args, "--state-dir", str(self.state_dir), "--json", timeout=timeout
        )

    def changes(self) -> dict[str, dict[str, Any]]:
        """The state dir's change set since the baseline, keyed by path."""
        return {c["path"]: c for c in self.fsagent("changes")["changes"]}


@dataclass
class MountFactory:
    """Creates mounts under one base dir and tears every one down."""

    base: Path
    mounts: list[FsagentMount] = field(default_factory=list)
    counter: int = 0
    env: dict[str, str] | None = None
    """The daemons' environment (None: this process's); see tests/support/pyfuse3_patch.py."""
    mode: str = "fuse"
    """The mode of the mounts it makes (``fuse`` or ``dir``)."""

    def source(self, folders: dict[str, dict[str, bytes | None]] | None = None, **kw: Any) -> Path:
        self.counter += 1
        return make_source(self.base / f"source{self.counter}", folders, **kw)

    def mount(
        self,
        source: Path | str | None = None,
        scope: str = "agent",
        *,
        state_dir: Path | None = None,
        mountpoint: Path | None = None,
        token_file: Path | None = None,
        extra: list[str] | None = None,
        start: bool = True,
    ) -> FsagentMount:
        self.counter += 1
        if source is None:
            source = self.source()
        controller = source if isinstance(source, str) else f"dir:{source}"
        m = FsagentMount(
            scope,
            mountpoint or self.base / f"mnt{self.counter}",
            state_dir or self.base / f"state{self.counter}",
            controller,
            token_file,
            list(extra or []),
            log_dir=self.base / "logs",
            env=self.env,
            mode=self.mode,
        )
        self.mounts.append(m)
        return m.start() if start else m

    def close(self) -> None:
        for m in reversed(self.mounts):
            m.stop()


SYSTEM_PYTHON = "/usr/bin/python3"
"""The interpreter a daemon run as another user starts with (the venv's may
live where that user cannot read); it must share the venv's ABI."""


def system_python_matches() -> bool:
    """Whether :data:`SYSTEM_PYTHON` can import this venv's compiled packages."""
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    return probe.stdout.strip() == str(sys.version_info[:2])


def mount_as_user(
    factory: MountFactory, source: Path, uid: int, *, extra: list[str] | None = None
) -> FsagentMount:
    """Start a mount whose daemon runs as ``uid`` (group ``uid`` too), as an
    agent's own unprivileged user runs it, in the factory's FUSE mode.

    Its state dir is ``home-<uid>/agent`` (``HOME`` is ``home-<uid>``), its
    mountpoint ``mnt-<uid>``, both owned by ``uid``; the factory's base is
    made readable to everyone, so the daemon can read the source. The daemon
    imports this checkout and the venv's packages (the patched pyfuse3 first
    when the factory's environment names one). Needs root and
    :func:`system_python_matches`.
    """
    subprocess.run(["chmod", "-R", "a+rX", str(factory.base)], check=True)
    home, mnt = factory.base / f"home-{uid}", factory.base / f"mnt-{uid}"
    for d in (home, mnt):
        d.mkdir()
        os.chown(d, uid, uid)
    site = next(p for p in sys.path if p.endswith("site-packages"))
    daemon_env = factory.env if factory.env is not None else dict(os.environ)
    path = [p for p in daemon_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PATH": os.environ["PATH"], "HOME": str(home),
           "PYTHONPATH": os.pathsep.join([*path, str(REPO), site])}  # fmt: skip
    if "FSAGENT_FUSE_HANDLES" in daemon_env:
        env["FSAGENT_FUSE_HANDLES"] = daemon_env["FSAGENT_FUSE_HANDLES"]
    m = factory.mount(source, mountpoint=mnt, state_dir=home / "agent", extra=extra, start=False)
    m.python, m.user, m.env = SYSTEM_PYTHON, uid, env
    return m.start()


@contextlib.contextmanager
def mount_factory(prefix: str = "fsa-fuse-", mode: str = "fuse") -> Iterator[MountFactory]:
    """A factory in a fresh short temp dir; on exit every mount is stopped and the dir removed."""
    factory = MountFactory(private_tmpdir(prefix), mode=mode)
    try:
        yield factory
    finally:
        try:
            factory.close()
        finally:
            for m in factory.mounts:
                if m.mode == "dir":  # an unbound directory killed with -9 stays immutable
                    with contextlib.suppress(OSError):
                        release_directory(m.mountpoint)
            remove_tree(factory.base)  # guarded mountpoints included (fsagent.mountguard)


__all__ = [
    "REPO",
    "SCOPES",
    "SYSTEM_PYTHON",
    "FsagentMount",
    "MountError",
    "MountFactory",
    "ProcessError",
    "in_mount_table",
    "is_mounted",
    "make_source",
    "mount_as_user",
    "mount_factory",
    "sha256",
    "system_python_matches",
]
