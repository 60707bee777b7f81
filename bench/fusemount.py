"""What both filesystem benchmarks share: an fsagent daemon in its own process,
a DirectoryBridgeClient source written from a list of entries, and the
machine / load line every result section carries.

The benchmark process never serves the mount it measures: the daemon is
``python -m fsagent.cli mount ... --foreground`` in a subprocess, the
benchmark only touches the mountpoint from outside, like an agent would.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class MountError(RuntimeError):
    """The daemon died or did not mount in time; carries its stderr."""


@dataclass
class DaemonMount:
    """One ``fsagent mount --foreground`` subprocess."""

    scope: str
    mountpoint: Path
    state_dir: Path
    controller: str
    token_file: Path | None = None
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    mount_seconds: float = 0.0
    """Process start to ``os.path.ismount`` true, polled every 5 ms."""

    def start(self, timeout: float = 120.0) -> DaemonMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.log_path = self.state_dir.parent / f"{self.state_dir.name}.log"
        argv = [
            sys.executable,
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
        with open(self.log_path, "wb") as log:
            started = time.perf_counter()
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO
            )
        deadline = started + timeout
        while time.perf_counter() < deadline:
            if os.path.ismount(self.mountpoint):
                self.mount_seconds = time.perf_counter() - started
                return self
            if self.proc.poll() is not None:
                raise MountError(f"fsagent exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.005)
        self.stop()
        raise MountError(f"fsagent did not mount within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def peak_rss_kib(self) -> int:
        """VmHWM of the daemon: its peak resident set so far, in KiB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise MountError("no VmHWM in /proc status")

    def fsagent(self, *args: str, timeout: float = 900.0) -> dict[str, object]:
        """Run an fsagent subcommand with --json against this state dir."""
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
            check=False,
            cwd=REPO,
            timeout=timeout,
        )
        if out.returncode != 0:
            raise MountError(f"fsagent {' '.join(args)} failed: {out.stderr.decode()}")
        result: dict[str, object] = json.loads(out.stdout)
        return result

    def stop(self) -> int | None:
        """Unmount lazily, then wait / terminate / kill the daemon."""
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
        if self.proc is None:
            return None
        for action in (None, self.proc.terminate, self.proc.kill):
            if action is not None:
                action()
            try:
                return self.proc.wait(timeout=60 if action is None else 10)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.wait()


def write_directory_source(
    root: Path,
    scope: str,
    files: Iterable[tuple[str, bytes]],
    directories: Iterable[str] = (),
) -> Path:
    """A DirectoryBridgeClient source with one bound collection.

    Identical contents are stored once, as the controller would.
    """
    objects = root / scope / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    owner = str(uuid.uuid4())
    bindings: dict[str, str | None] = {s: None for s in ("task", "agent", "user", "project")}
    bindings["agent"] = str(uuid.uuid4())  # a run always has an agent folder
    bindings[scope] = owner
    run = {
        "runId": str(uuid.uuid4()),
        "companyId": str(uuid.uuid4()),
        "agentId": bindings["agent"],
        "leaseEpoch": 1,
        "active": True,
        "bindings": bindings,
    }
    (root / "run.json").write_text(json.dumps(run))
    entries: list[dict[str, object]] = []
    for path in directories:
        entries.append(
            {
                "path": path,
                "kind": "directory",
                "digest": None,
                "byteSize": 0,
                "executable": False,
                "version": len(entries) + 1,
                "deleted": False,
            }
        )
    written: set[str] = set()
    for path, data in files:
        digest = hashlib.sha256(data).hexdigest()
        if digest not in written:
            (objects / digest).write_bytes(data)
            written.add(digest)
        entries.append(
            {
                "path": path,
                "kind": "file",
                "digest": digest,
                "byteSize": len(data),
                "executable": False,
                "version": len(entries) + 1,
                "deleted": False,
            }
        )
    manifest = {"entries": entries, "highWater": len(entries)}
    (root / scope / "manifest.json").write_text(json.dumps(manifest))
    return root


def machine_line() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.node()}, {os.cpu_count()} cores ({cpu}), Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"
