"""The filesystems bench.fsops compares: native, fsagent and four FUSE peers.

Each one is a directory to run the workload in (``root``) plus the directories
whose files hold its bytes on the real disk (``backing``, so that the page
cache can be dropped on both layers):

- ``native``: a plain directory on the disk under ``--base``;
- ``fsagent``: a ``task`` mount of a real controller (embedded PostgreSQL,
  local_disk storage), with the options ``fsagent up`` passes (prefetch 4,
  180 s checkpoint cadence, adaptive polling, writeback cache);
- ``bindfs``: bindfs (C, libfuse) over a plain directory, its defaults;
- ``pyfuse3 passthrough``: pyfuse3's example passthrough file system over a
  plain directory, run with this venv's pyfuse3 (its sdist is fetched once
  into ``build/``, checked against its SHA-256), plus the ``fsync`` and
  ``fsyncdir`` handlers the example leaves out (:mod:`bench.passthrough_fsync`),
  so that its ``fsync(2)`` reaches the disk as everyone else's does;
- ``rclone``: ``rclone mount`` of a local directory with
  ``--vfs-cache-mode writes`` (without it rclone cannot do the random writes
  SQLite needs);
- ``libfuse passthrough_ll``: libfuse's low-level passthrough example in C
  (``passthrough_ll.c`` from libfuse3-dev's examples, built once into
  ``build/``), with the writeback cache and long cache timeouts as fsagent
  mounts: a daemon that does nothing but forward each request to the disk,
  in C, over the same FUSE protocol. It sets the floor that protocol puts
  under a phase on this kernel, whatever the daemon is written in.

With ``allow_other``, a second fsagent peer, ``fsagent --allow-other``,
mounts another task of the same controller with ``--allow-other``, as a
multi-user sandbox runs it: the kernel then checks modes itself
(``default_permissions``), which costs a GETATTR of a directory after each
change in it, so the run measures that against the default mount.

An fsagent peer also tells which FUSE requests its daemon has served so far
(``requests``: per operation, from the daemon's control socket, the
``live.fuse`` figures of ``fsagent status --json``), so a phase can show the
requests it caused.

bindfs and rclone come from Debian packages (``packaging/install-deps.sh
--bench``); a peer whose binary is missing is skipped and named in the report.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.checkpoint import Controller
from fsagent.control import protocol as control
from tests.support.mount import FsagentMount, in_mount_table


@dataclass
class Peer:
    """One filesystem under test; ``start`` and ``stop`` bracket the whole run."""

    name: str
    root: Path
    backing: list[Path] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    mount: FsagentMount | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        pass

    def pid(self) -> int | None:
        if self.mount is not None and self.mount.proc is not None:
            return self.mount.proc.pid
        return None if self.proc is None else self.proc.pid

    def requests(self) -> dict[str, int] | None:
        """FUSE requests served so far, per operation; None: not counted."""
        return None


@dataclass
class FusePeer(Peer):
    """A FUSE daemon started with ``argv`` (in the foreground) that serves ``root``."""

    argv: list[str] = field(default_factory=list)
    log: Path | None = None

    def start(self) -> None:
        for d in (self.root, *self.backing):
            d.mkdir(parents=True, exist_ok=True)
        assert self.log is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.root):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not mount:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        if in_mount_table(self.root):
            subprocess.run(["fusermount3", "-u", str(self.root)], capture_output=True, check=False)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if in_mount_table(self.root):
            subprocess.run(["fusermount3", "-u", "-z", str(self.root)], check=False)


def bindfs(work: Path) -> Peer | None:
    if shutil.which("bindfs") is None:
        return None
    src = work / "bindfs-src"
    mnt = work / "bindfs-mnt"
    return FusePeer(
        "bindfs", mnt, [src], argv=["bindfs", "-f", str(src), str(mnt)], log=work / "bindfs.log"
    )


PASSTHROUGH = "pyfuse3 passthrough"
"""pyfuse3's own example (``examples/passthroughfs.py`` of its sdist): the
floor a Python FUSE daemon that only forwards each request to the disk sets."""

PYFUSE3_SDIST_SHA256 = "88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24"


def passthrough_script() -> Path | None:
    """``examples/passthroughfs.py`` of the pyfuse3 release this venv runs,
    fetched once from the package index into ``build/pyfuse3-sdist`` (the
    sdist is checked against the SHA-256 packaging/pyfuse3/build.sh pins)."""
    version = "3.5.0"
    dest = Path(__file__).resolve().parent.parent / "build" / "pyfuse3-sdist"
    script = dest / f"pyfuse3-{version}" / "examples" / "passthroughfs.py"
    if script.exists():
        return script
    dest.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "pyfuse3",
         "-d", str(dest), f"pyfuse3=={version}"],
        capture_output=True, check=False,
    )  # fmt: skip
    sdist = dest / f"pyfuse3-{version}.tar.gz"
    if got.returncode != 0 or not sdist.exists():
        return None
    if hashlib.sha256(sdist.read_bytes()).hexdigest() != PYFUSE3_SDIST_SHA256:
        raise RuntimeError(f"{sdist}: unexpected SHA-256")
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    return script if script.exists() else None


def passthrough(work: Path) -> Peer | None:
    """pyfuse3's passthrough example with this venv's pyfuse3, its defaults
    (no writeback cache), run by this Python, with the fsync handlers it
    lacks (:mod:`bench.passthrough_fsync`): without them the kernel stops
    sending FSYNC after the first ``ENOSYS`` and ``fsync(2)`` syncs nothing."""
    script = passthrough_script()
    if script is None:
        return None
    src, mnt = work / "passthrough-src", work / "passthrough-mnt"
    wrapper = Path(__file__).with_name("passthrough_fsync.py")
    argv = [sys.executable, str(wrapper), str(script), str(src), str(mnt)]
    return FusePeer(PASSTHROUGH, mnt, [src], argv=argv, log=work / "passthrough.log")


C_PASSTHROUGH = "libfuse passthrough_ll"
"""libfuse's low-level passthrough example in C (:func:`c_passthrough`)."""

C_PASSTHROUGH_SOURCE = Path("/usr/share/doc/libfuse3-dev/examples/passthrough_ll.c")


def c_passthrough_binary() -> Path | None:
    """``passthrough_ll`` built from the libfuse3-dev this machine has, once,
    into ``build/libfuse-examples`` (rebuilt when the source is newer); None
    without the source or a compiler."""
    if not C_PASSTHROUGH_SOURCE.exists() or shutil.which("gcc") is None:
        return None
    dest = Path(__file__).resolve().parent.parent / "build" / "libfuse-examples"
    binary = dest / "passthrough_ll"
    if binary.exists() and binary.stat().st_mtime >= C_PASSTHROUGH_SOURCE.stat().st_mtime:
        return binary
    dest.mkdir(parents=True, exist_ok=True)
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True, check=False
    )
    if flags.returncode != 0:
        return None
    built = subprocess.run(
        ["gcc", "-O2", "-Wall", "-I", str(C_PASSTHROUGH_SOURCE.parent),
         str(C_PASSTHROUGH_SOURCE), *flags.stdout.split(), "-o", str(binary)],
        capture_output=True, check=False,
    )  # fmt: skip
    return binary if built.returncode == 0 and binary.exists() else None


def c_passthrough(work: Path, *, writeback: bool = True) -> Peer | None:
    """libfuse's ``passthrough_ll`` in C with the kernel caching entries and
    attributes as long as it likes (``cache=always``) and, unless told
    otherwise, the writeback cache: as fsagent mounts. Without it the kernel
    sends each write() as it comes and keeps no times of its own (no SETATTR
    of a ctime after an unlink or a rename)."""
    binary = c_passthrough_binary()
    if binary is None:
        return None
    name, slug = C_PASSTHROUGH, "passthrough-ll"
    if not writeback:
        name, slug = f"{C_PASSTHROUGH}, no writeback cache", "passthrough-ll-nowb"
    src, mnt = work / f"{slug}-src", work / f"{slug}-mnt"
    cache = "writeback" if writeback else "no_writeback"
    argv = [str(binary), "-f", "-o", f"source={src},{cache},cache=always", str(mnt)]
    return FusePeer(name, mnt, [src], argv=argv, log=work / f"{slug}.log")


def rclone(work: Path) -> Peer | None:
    if shutil.which("rclone") is None:
        return None
    src, cache, mnt = work / "rclone-src", work / "rclone-cache", work / "rclone-mnt"
    argv = ["rclone", "mount", str(src), str(mnt), "--config", "/dev/null",
            "--vfs-cache-mode", "writes", "--cache-dir", str(cache)]  # fmt: skip
    return FusePeer("rclone", mnt, [src, cache], argv=argv, log=work / "rclone.log")


class FsagentPeer(Peer):
    """A task-folder mount of a real controller; the controller outlives the rounds.

    ``controller``: another fsagent peer's, shared (that peer starts and stops
    it); None: its own. ``extra``: more ``fsagent mount`` options.
    """

    def __init__(
        self,
        work: Path,
        name: str = "fsagent",
        *,
        extra: list[str] | None = None,
        controller: Controller | None = None,
    ) -> None:
        slug = name.replace(" --", "-")
        super().__init__(name, work / f"{slug}-mnt", [work / f"{slug}-state" / "upper"])
        self.work = work
        self.slug = slug
        self.extra = list(extra or [])
        self.owns_controller = controller is None
        if controller is None:
            (work / "controller").mkdir()
            os.chmod(work, 0o711)  # the embedded PostgreSQL runs as its own user
            controller = Controller(None, work / "controller", gc_args=["--gc-interval", "0"])
        self.controller = controller

    def start(self) -> None:
        if self.owns_controller:
            self.controller.start_with_company()
        run = self.controller.new_run(f"fsops-{self.slug}")
        token = self.work / f"{self.slug}-token"
        token.write_text(run["token"])
        self.mount = FsagentMount(
            "task", self.root, self.work / f"{self.slug}-state", self.controller.url,
            token_file=token, extra=self.extra, log_dir=self.work, poll_interval=0.005,
        ).start(timeout=300)  # fmt: skip

    def stop(self) -> None:
        try:
            if self.mount is not None:
                self.mount.stop(timeout=120)
        finally:
            if self.owns_controller:
                self.controller.stop(timeout=60)

    def requests(self) -> dict[str, int]:
        """Per operation (``fsyncDataOnly`` too: FSYNCs answered by fdatasync
        alone; ``writesBehind``: WRITEs answered without an LMDB commit)."""
        assert self.mount is not None
        reply = control.request(self.mount.state_dir / "control.sock", {"cmd": "stats"}, 30.0)
        if not reply.get("ok"):
            raise RuntimeError(f"{self.name}: stats request failed: {reply}")
        fuse = reply["fuse"]
        counts: dict[str, int] = dict(fuse["byOperation"])
        counts["fsyncDataOnly"] = fuse["fsyncDataOnly"]
        counts["writesBehind"] = fuse["writesBehind"]
        return counts


ALLOW_OTHER = "fsagent --allow-other"
"""The name of the second fsagent peer (``all_peers(..., allow_other=True)``)."""


def all_peers(work: Path, *, allow_other: bool = False) -> tuple[list[Peer], list[str]]:
    """Native, fsagent (and with ``allow_other`` fsagent --allow-other), bindfs,
    the pyfuse3 passthrough, rclone and libfuse's passthrough_ll, in the order
    each round runs them; and
    the names of the peers that are not installed."""
    fsagent = FsagentPeer(work)
    peers: list[Peer] = [Peer("native", work / "native"), fsagent]
    if allow_other:
        peers.append(
            FsagentPeer(work, ALLOW_OTHER, extra=["--allow-other"], controller=fsagent.controller)
        )
    missing = []
    makers = (
        ("bindfs", bindfs),
        (PASSTHROUGH, passthrough),
        ("rclone", rclone),
        (C_PASSTHROUGH, c_passthrough),
    )
    for name, make in makers:
        peer = make(work)
        if peer is None:
            missing.append(name)
        else:
            peers.append(peer)
    return peers, missing


def stop_all(peers: list[Peer]) -> None:
    for peer in reversed(peers):
        with contextlib.suppress(Exception):
            peer.stop()
