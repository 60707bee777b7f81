"""The sandbox image boots under systemd: packaging/sandbox-image/ turns a
minimal Debian rootfs into an image whose fsagent@ units mount the four work
folders as the agent user at boot and save them at shutdown.

The base rootfs (``debootstrap --variant=minbase``) is cached under
:data:`CACHE`, keyed by a hash of its recipe; every test run installs fsagent
into a fresh copy of it and boots that with ``systemd-nspawn --boot`` on the
host network, so the container reaches the test's controller on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.bridge import Run, start_run
from tests.support.constants import REPO, SCOPES
from tests.support.controller import ControllerProcess, Tenant
from tests.support.rootfs import cached, digest
from tests.support.tmp import private_tmpdir

IMAGE = REPO / "packaging" / "sandbox-image"
CACHE = Path("/var/cache/fsagent-workfolders-boot-rootfs")
"""Owned by this test: base rootfs and dependency wheels, one dir per recipe hash."""
AGENT = "agent"
HOME = f"/home/{AGENT}"
BOOT_TIMEOUT = 120.0
WALL_BUDGET = 300.0
"""The whole file, rootfs and image builds included, must finish within 5
minutes (it runs in `make test` wherever the tools are)."""


def _missing() -> str | None:
    for tool in ("debootstrap", "systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (packaging/install-deps.sh --test)"
    if os.geteuid() != 0:
        return "booting a container needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.fuse,
    pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
]


def _debootstrap(tmp: Path) -> None:
    subprocess.run([str(IMAGE / "debootstrap-base.sh"), str(tmp)], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip


def _dependency_wheels(tmp: Path, python: str) -> None:
    """Wheels of the dependencies and of the build backend; the project itself is
    built from source inside the image (building it here would leave build/ in
    the checkout, whose stale files end up in the next wheel)."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = [*meta["build-system"]["requires"], *meta["project"]["dependencies"]]
    subprocess.run(
        [python, "-m", "pip", "wheel", "-q", "--wheel-dir", str(tmp), *wanted],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _wheel_python(image_python: str) -> str | None:
    """A host interpreter of the image's Python version with pip: this one, or
    ``pythonX.Y`` on PATH (say a 3.12 venv on a host whose system Python is
    the image's 3.11); None when there is none."""
    if image_python == f"python{sys.version_info.major}.{sys.version_info.minor}":
        return sys.executable
    found = shutil.which(image_python)
    if found is None:
        return None
    pip = subprocess.run([found, "-m", "pip", "--version"], capture_output=True, timeout=60)
    return found if pip.returncode == 0 else None


@pytest.fixture(scope="session")
def base_rootfs() -> Path:
    """The minimal Debian rootfs, built once per recipe (about 70 s cold)."""
    return cached(CACHE, f"rootfs-{digest(IMAGE / 'debootstrap-base.sh')}", _debootstrap)


@pytest.fixture(scope="session")
def dependency_wheels(base_rootfs: Path) -> Path:
    """Wheels of fsagent's dependencies built on the host with its pip index,
    by an interpreter of the image's Python version: pyfuse3 has no wheel and
    is compiled here against that version's headers, since the minbase image
    has no compiler."""
    image_python = os.readlink(base_rootfs / "usr/bin/python3")
    python = _wheel_python(image_python)
    if python is None:
        pytest.skip(
            f"the image has {image_python} and this host has no {image_python} with pip: "
            "pyfuse3 (no wheel) must be compiled for the image's Python, which only an "
            f"interpreter of that version can do here (install {image_python} and its pip)"
        )
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    key = digest(REPO / "pyproject.toml", extra=f"{version.strip()} with build backend")
    return cached(CACHE, f"wheels-{key}", lambda tmp: _dependency_wheels(tmp, python))


@pytest.fixture(scope="session")
def built_image(base_rootfs: Path, dependency_wheels: Path, controller: ControllerProcess) -> Path:
    """The base rootfs made into a sandbox image by build-rootfs.sh, once per
    test session (its tests boot copies of it)."""
    rootfs = private_tmpdir("fsa-boot-image-") / "rootfs"
    subprocess.run(["cp", "-a", "--reflink=auto", str(base_rootfs), str(rootfs)], check=True)
    subprocess.run(
        [str(IMAGE / "build-rootfs.sh"), str(rootfs), "--controller", controller.url,
         "--user", AGENT, "--wheelhouse", str(dependency_wheels)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return rootfs


@pytest.fixture
def image(built_image: Path) -> Path:
    """A fresh copy of the built image: a test's boots and its state dirs are
    its own."""
    rootfs = private_tmpdir("fsa-boot-") / "rootfs"
    subprocess.run(["cp", "-a", "--reflink=auto", str(built_image), str(rootfs)], check=True)
    return rootfs


@pytest.fixture(scope="session", autouse=True)
def file_started() -> float:
    """When this file's first test began its setup (autouse: before the
    session fixtures that build the rootfs, the wheels and the image)."""
    return time.monotonic()


@pytest.fixture(scope="module", autouse=True)
def wall_time(request: pytest.FixtureRequest, file_started: float) -> Iterator[None]:
    """Prints how long this file took, image builds and boots included, and
    holds it to :data:`WALL_BUDGET` (a fresh machine, nothing cached: 86.5 s
    on the 2-core VM, 2026-12-05)."""
    yield
    elapsed = time.monotonic() - file_started
    line = f"{Path(__file__).name}: {elapsed:.1f} s wall time"
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n{line}", file=sys.stderr)
    assert elapsed < WALL_BUDGET, f"{line}: over its budget of {WALL_BUDGET:.0f} s"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _private_cgroups(name: str) -> list[Path]:
    """A fresh cgroup below this process's, in each hierarchy, where PID 1 is not
    systemd: there nspawn --keep-unit makes payload/ and supervisor/ cgroups
    below its caller's and leaves them behind (build-rootfs.sh does the same)."""
    if Path("/run/systemd/system").exists():
        return []
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        num, ctl, rel = line.split(":", 2)
        if ctl == "name=systemd":
            own["systemd"] = rel
        elif num == "0":
            own["unified"] = rel
    dirs = []
    for hierarchy, rel in own.items():
        root = Path("/sys/fs/cgroup", hierarchy)
        if (root / "cgroup.procs").exists():
            d = root / rel.strip("/") / name
            d.mkdir()
            dirs.append(d)
    return dirs


def _remove_cgroups(dirs: list[Path]) -> None:
    for d in dirs:
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), reverse=True):
            sub.rmdir()
        d.rmdir()


class Container:
    """One ``systemd-nspawn --boot`` of an image; commands enter it with nsenter."""

    def __init__(self, rootfs: Path, log: Path) -> None:
        self.rootfs = rootfs
        self.log = log
        self.cgroups = _private_cgroups(f"fsa-boot-{os.getpid()}-{time.monotonic_ns()}")
        join = 'for d in $FSA_CGROUPS; do echo $$ >"$d/cgroup.procs"; done; exec "$@"'
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                ["sh", "-c", join, "sh", "systemd-nspawn", "--boot", "--register=no", "--keep-unit", "--quiet",
                 "--console=read-only", "--bind=/dev/fuse", f"--directory={rootfs}",
                 "--machine=fsa-boot"],
                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                env={**os.environ, "FSA_CGROUPS": " ".join(map(str, self.cgroups))},
            )  # fmt: skip
        self.leader = self._find_leader()

    def _find_leader(self) -> int:
        """The container's PID 1 as the host sees it: nspawn's child running systemd."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"nspawn exited {self.proc.returncode}: {self.output()}")
            for child in _children(self.proc.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                        return child
            time.sleep(0.05)
        raise AssertionError(f"no systemd in the container: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def run(self, *argv: str, user: str | None = None, check: bool = True) -> str:
        """``argv`` inside the container, as root or (``user``) in that user's login shell."""
        cmd = ["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "--"]
        if user is not None:
            cmd += ["runuser", "-l", user, "-c", " ".join(argv)]
        else:
            cmd += list(argv)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"{argv} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc.stdout + proc.stderr

    def fuse_mounts(self) -> dict[str, str]:
        """Mount point -> mount options of the container's FUSE mounts."""
        found = {}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.leader}/mountinfo").read_text().splitlines():
                head, _, tail = line.partition(" - ")
                if tail.startswith("fuse"):
                    found[head.split()[4]] = tail.split()[-1]
        return found

    def wait_for_mounts(self) -> dict[str, str]:
        want = {f"{HOME}/{s}" for s in SCOPES}
        deadline = time.monotonic() + BOOT_TIMEOUT
        while time.monotonic() < deadline:
            mounts = self.fuse_mounts()
            if want <= mounts.keys():
                return mounts
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        status = self.run("systemctl", "status", "--no-pager", "fsagent@*", check=False)
        missing = sorted(want - self.fuse_mounts().keys())
        # The units' own words: systemctl status shows only their last lines.
        journal = self.run("journalctl", "--no-pager", "-o", "short-monotonic", "-n", "300",
                           *(f"--unit=fsagent@{Path(m).name}.service" for m in missing),
                           check=False)  # fmt: skip
        raise AssertionError(
            f"mounted: {sorted(self.fuse_mounts())}\n{status}\n{journal}\n{self.output()}"
        )

    def poweroff(self, timeout: float = 240.0) -> int:
        """A clean shutdown (SIGRTMIN+4 to systemd); nspawn's exit code."""
        if self.proc.poll() is None:
            os.kill(self.leader, signal.SIGRTMIN + 4)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"no clean stop within {timeout}s: {self.output()}") from None

    def kill(self) -> None:
        """Kill PID 1 (and so the whole container), then nspawn."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.leader, signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def booted(rootfs: Path) -> Iterator[Container]:
    box = Container(rootfs, rootfs.parent / f"console-{time.monotonic_ns()}.log")
    try:
        yield box
    finally:
        if box.proc.poll() is None:
            with contextlib.suppress(AssertionError):
                box.poweroff(timeout=60)
        if box.proc.poll() is None:
            box.kill()
        _remove_cgroups(box.cgroups)


def _controller_file(tenant: Tenant, run: Run, path: str) -> bytes | None:
    with tenant.client() as http:
        r = http.get(tenant.folder("task", run.task) + "/content", params={"path": path})
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    return r.content


def _install_token(rootfs: Path, token: str) -> None:
    uid, gid = _ids(rootfs, AGENT)
    path = rootfs / "etc/fsagent/run-token"
    path.write_text(token + "\n")
    os.chown(path, uid, gid)
    path.chmod(0o400)


def _ids(rootfs: Path, user: str) -> tuple[int, int]:
    for line in (rootfs / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise AssertionError(f"no user {user} in the image")


def _doctor(box: Container) -> dict[str, Any]:
    """``fsagent doctor --json`` as the agent, once the local endpoint's env
    file is there (fsagent-bridge.service writes it after boot)."""
    deadline = time.monotonic() + BOOT_TIMEOUT
    env_file = f"{HOME}/.local/state/fsagent/env"
    while "PAPERCLIP_API_SOCKET" not in box.run("cat", env_file, check=False):
        assert time.monotonic() < deadline, box.run(
            "systemctl", "status", "--no-pager", "fsagent-bridge.service", check=False
        )
        time.sleep(0.2)
    out = box.run("/opt/fsagent/venv/bin/fsagent", "doctor", "--json", user=AGENT, check=False)
    found: dict[str, Any] = json.loads(out[out.index("{") :])
    return found


def test_the_image_keeps_no_copy_of_the_source(built_image: Path) -> None:
    """What build-rootfs.sh copied in to build fsagent from
    (packaging/sandbox-image/source-files.sh) is gone from the image."""
    assert not (built_image / "var/tmp/fsagent-src").exists()


def test_boot_mounts_as_agent_and_shutdown_saves(image: Path, tenant: Tenant) -> None:
    run = start_run(tenant)
    _install_token(image, run.token)
    uid, _ = _ids(image, AGENT)
    payload = os.urandom(1 << 16)
    with booted(image) as box:
        mounts = box.wait_for_mounts()
        for scope in SCOPES:
            opts = mounts[f"{HOME}/{scope}"]
            assert f"user_id={uid}" in opts, (scope, opts)
        env = box.run("env", user=AGENT)
        assert f"PAPERCLIP_TASK_DIR={HOME}/task" in env
        # The image meets the runtime contract it checks, with no step of its own.
        assert re.fullmatch(r"v\d+\.\d+\.\d+\n", box.run("node", "--version", user=AGENT))
        assert "required CLI" not in box.run("sh", "-c", "'command -v node'", user=AGENT)
        doctor = _doctor(box)
        assert doctor["ok"] is True, doctor
        assert {c["name"]: c["status"] for c in doctor["checks"]}["node"] == "ok", doctor
        launched = box.run("/opt/fsagent/venv/bin/fsagent", "launch", "--home", HOME, "--",
                           "'node -e \"console.log(process.env.PAPERCLIP_TASK_DIR)\"'",
                           user=AGENT)  # fmt: skip
        assert f"{HOME}/task\n" in launched, launched
        # The repository checkouts are the image's too: git, and their unit.
        assert box.run("git", "--version", user=AGENT).startswith("git version")
        enabled = box.run("systemctl", "is-enabled", "fsagent-repos.service", check=False)
        assert enabled.strip() == "enabled", enabled
        assert f"AGENT_HOME={HOME}/agent" in env
        # Written by the agent through its mount.
        (image / "var/tmp/payload").write_bytes(payload)
        box.run("cp", "/var/tmp/payload", '"$PAPERCLIP_TASK_DIR/notes.bin"', user=AGENT)
        assert box.run("stat", "-c", "%U", f"{HOME}/task/notes.bin", user=AGENT).strip() == AGENT
        assert box.poweroff() == 0, box.output()
    assert _controller_file(tenant, run, "notes.bin") == payload


def test_failed_save_shows_in_systemctl_status(image: Path, tenant: Tenant) -> None:
    run = start_run(tenant)
    _install_token(image, run.token)
    with booted(image) as box:
        box.wait_for_mounts()
        box.run("sh", "-c", f"'echo unsaved > {HOME}/task/lost.txt'", user=AGENT)
        # The run ends before the agent's change is saved: the controller refuses it.
        tenant.controller.admin("end-run", run.run_id)
        box.run("systemctl", "stop", "fsagent@task.service", check=False)
        status = box.run("systemctl", "status", "--no-pager", "fsagent@task.service",
                         check=False)  # fmt: skip
        assert re.search(r"Active: failed .*", status), status
        assert "status=4" in status, status
        assert box.run("systemctl", "is-failed", "fsagent@task.service", check=False).strip() == (
            "failed"
        )
        assert box.poweroff() == 0, box.output()
    assert _controller_file(tenant, run, "lost.txt") is None
    # The state dir kept the change: the next run of the same folders ships it.
    again = tenant.controller.admin(
        "start-run", tenant.company_id, "--agent", run.agent, "--task", run.task,
        "--project", run.project, "--user", tenant.user_id,
    )  # fmt: skip
    _install_token(image, again["token"])
    with booted(image) as box:
        box.wait_for_mounts()
        assert box.poweroff() == 0, box.output()
    assert _controller_file(tenant, run, "lost.txt") == b"unsaved\n"
