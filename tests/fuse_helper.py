"""Real fsagent mounts for tests: one helper, used by every FUSE test.

The daemon always runs in its own process (``python -m fsagent.cli mount ...
--foreground``); a test never touches a mount from the thread serving it.
:meth:`FsagentMount.start` polls ``os.path.ismount`` with a deadline and fails
at once, with the daemon's stderr, if the process dies first.  Teardown is
``fusermount3 -u -z``, wait, terminate, kill.

Sources: :func:`make_source` writes a DirectoryBridgeClient directory (run,
manifests, objects), so filesystem behaviour can be tested without a
controller; :func:`controller_source` is the same run served by the real
controller.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fsagent.mount import mount_device

REPO = Path(__file__).resolve().parent.parent
SCOPES = ("task", "agent", "user", "project")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_source(
    root: Path,
    folders: dict[str, dict[str, bytes | None]] | None = None,
    *,
    bindings: dict[str, str | None] | None = None,
    executable: set[str] = frozenset(),  # type: ignore[assignment]
    fetch_delay: float = 0.0,
    company_id: str | None = None,
) -> Path:
    """Write a DirectoryBridgeClient source: ``folders[scope][path] = bytes`` (None = a directory).

    Scopes missing from ``bindings`` are bound to a fresh owner when they
    appear in ``folders``; ``bindings`` can unbind (None) or pin owners.
    """
    folders = folders or {"agent": {}}
    root.mkdir(parents=True, exist_ok=True)
    owners: dict[str, str | None] = {s: None for s in SCOPES}
    owners["agent"] = str(uuid.uuid4())
    for scope in folders:
        owners[scope] = owners[scope] or str(uuid.uuid4())
    owners.update(bindings or {})
    run = {
        "runId": str(uuid.uuid4()),
        "companyId": company_id or str(uuid.uuid4()),
        "agentId": owners["agent"],
        "leaseEpoch": 1,
        "active": True,
        "bindings": owners,
    }
    (root / "run.json").write_text(json.dumps(run))
    if fetch_delay:
        (root / "config.json").write_text(json.dumps({"fetchDelay": fetch_delay}))
    for scope, files in folders.items():
        objects = root / scope / "objects"
        objects.mkdir(parents=True, exist_ok=True)
        entries = []
        for version, (path, data) in enumerate(sorted(files.items()), start=1):
            if data is None:
                entries.append(
                    {
                        "path": path,
                        "kind": "directory",
                        "digest": None,
                        "byteSize": 0,
                        "executable": False,
                        "version": version,
                        "deleted": False,
                    }
                )
                continue
            digest = sha256(data)
            if not (objects / digest).exists():
                (objects / digest).write_bytes(data)
            entries.append(
                {
                    "path": path,
                    "kind": "file",
                    "digest": digest,
                    "byteSize": len(data),
                    "executable": path in executable,
                    "version": version,
                    "deleted": False,
                }
            )
        (root / scope / "manifest.json").write_text(
            json.dumps({"entries": entries, "highWater": len(entries)})
        )
    return root


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
            *self.extra,
        ]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return argv

    def start(self, timeout: float = 60.0) -> FsagentMount:
        """Start the daemon; return once mounted, or fail with its stderr."""
        try:
            self.mountpoint.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:  # a crashed daemon's mount: fsagent detaches it
                raise
        self.stderr_path = Path(tempfile.mkstemp(prefix="fsagent-stderr-")[1])
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.argv(), stdout=err, stderr=err, cwd=REPO, stdin=subprocess.DEVNULL,
                user=self.user, group=self.user, env=self.env,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stderr_text = self.stderr()
                code = self.proc.returncode
                pytest.fail(f"fsagent exited with {code} before mounting:\n{self.stderr_text}")
            if is_mounted(self.mountpoint):
                with contextlib.suppress(OSError):
                    self.fuse_conn = os.minor(os.stat(self.mountpoint).st_dev)
                return self
            time.sleep(0.02)
        self.stop()
        pytest.fail(f"fsagent did not mount {self.mountpoint} within {timeout}s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path else ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """Unmount lazily, then wait / terminate / kill; returns the exit code."""
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
        subprocess.run(
            ["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False
        )

    def fsagent(self, *args: str) -> Any:
        """Run an fsagent subcommand with --json against this state dir; parsed output."""
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "fsagent.cli",
                *args,
                "--state-dir",
                str(self.state_dir),
                "--json",
            ],
            capture_output=True,
            check=True,
            cwd=REPO,
        )
        return json.loads(out.stdout)

    def changes(self) -> dict[str, dict[str, Any]]:
        """The state dir's change set since the baseline, keyed by path."""
        return {c["path"]: c for c in self.fsagent("changes")["changes"]}


@dataclass
class MountFactory:
    """Creates mounts under a test's tmp dir and tears every one down."""

    base: Path
    mounts: list[FsagentMount] = field(default_factory=list)
    counter: int = 0

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
        )
        self.mounts.append(m)
        return m.start() if start else m

    def close(self) -> None:
        for m in reversed(self.mounts):
            m.stop()


def short_tmp(prefix: str) -> Path:
    """A private temp dir on the normal /tmp (pytest's tmp_path can be long)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


@pytest.fixture
def mounts() -> Iterator[MountFactory]:
    base = short_tmp("fsa-fuse-")
    factory = MountFactory(base)
    try:
        yield factory
    finally:
        factory.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def module_mounts() -> Iterator[MountFactory]:
    base = short_tmp("fsa-fuse-")
    factory = MountFactory(base)
    try:
        yield factory
    finally:
        factory.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def mnt(mounts: MountFactory) -> FsagentMount:
    """A mounted, bound, empty agent collection."""
    return mounts.mount()
