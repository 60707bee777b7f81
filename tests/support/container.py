"""A container engine for the controller image test, the image's local Python
base, and a PostgreSQL a container on the host network can reach.

The engine is rootful podman with settings of its own, all given on its
command line (no file of the host's is edited): its storage under
:data:`CACHE` (overlay where the kernel and file system take it, else vfs),
its run state under ``/run``, cgroupfs where PID 1 is not systemd, events in
a file (no journald needed), no systemd timers for health checks (the test
runs them itself with ``podman healthcheck run``), the first OCI runtime that
runs a container here (crun refuses a cgroup v1 host whose cgroup2 hierarchy
holds a controller, runc does not), and resource limits the containers can
have without CAP_SYS_RESOURCE (podman's default of 1048576 open files and
processes raises the hard limits, which a root without that capability, as in
some VMs, may not). Docker is used instead when podman is missing and a
docker daemon answers.

The base image is made, without any registry, from a Debian rootfs built by
``packaging/controller-base-rootfs.sh`` (debootstrap minbase, bookworm's
Python 3.11), cached under :data:`CACHE` by the hash of that script
(:mod:`tests.support.rootfs`) and imported into the engine's storage once.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import psycopg

from controller.pgembed import EmbeddedPostgres, find_bindir
from tests.support.constants import REPO
from tests.support.procs import free_port
from tests.support.rootfs import cached, digest
from tests.support.tmp import world_searchable_tmpdir

CACHE = Path("/var/cache/fsagent-workfolders-controller-image")
"""Owned by the container image test: the base rootfs (``rootfs-KEY``), podman's
storage (``storage-DRIVER``) with the imported base and the build's layer cache."""
RUN_STATE = Path("/run/fsagent-workfolders-podman")
"""Podman's run state (``--runroot``, ``--tmpdir``), one dir per storage driver."""
BASE_SCRIPT = REPO / "packaging" / "controller-base-rootfs.sh"
BASE_NAME = "localhost/fsagent-workfolders-controller-base"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DOCKERFILE = REPO / "packaging" / "controller.Dockerfile"
PYFUSE3_BUILD = REPO / "packaging" / "pyfuse3" / "build.sh"
HOST_PYFUSE3_WHEELS = REPO / "build" / "pyfuse3-wheels"
"""Where ``make deps`` leaves the patched pyfuse3 wheel (build.sh's default --wheel-dir)."""
STORAGE_DRIVERS = ("overlay", "vfs")
"""Tried in this order: overlay shares layers; vfs copies them (slow, big) but
works on any file system."""
CACHE_DAYS = 1
"""The layer cache keeps what a build made within this many days."""
OCI_RUNTIMES = ("crun", "runc")
"""Podman's runtimes, tried in this order (crun is podman's default)."""
NPROC = 4096
"""The containers' process limit: far above what a controller or a build
step starts (root is not held to it)."""


def _limits() -> list[str]:
    """``--ulimit`` options no higher than this process's own hard limits."""
    _, files = resource.getrlimit(resource.RLIMIT_NOFILE)
    _, procs = resource.getrlimit(resource.RLIMIT_NPROC)
    files = min(files, 1 << 20) if files != resource.RLIM_INFINITY else 1 << 20
    procs = min(procs, NPROC) if procs != resource.RLIM_INFINITY else NPROC
    return ["--ulimit", f"nofile={files}:{files}", "--ulimit", f"nproc={procs}:{procs}"]


@dataclass(frozen=True)
class Engine:
    """A container engine: its command with global options, its environment,
    and (podman) the OCI runtime it runs containers with."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    runtime: str | None = None

    def cmd(self, *args: str) -> list[str]:
        return [*self.argv, *args]

    def run_options(self) -> list[str]:
        """What ``run`` (and ``build``) needs here: (podman) the limits."""
        return _limits() if self.name == "podman" else []

    def with_runtime(self, image: str) -> Engine | str:
        """This engine with the first OCI runtime that runs a container of
        ``image`` (podman), or why none does."""
        if self.name != "podman":
            return self
        tried = []
        for runtime in OCI_RUNTIMES:
            if shutil.which(runtime) is None:
                continue
            engine = replace(self, argv=(*self.argv, "--runtime", runtime), runtime=runtime)
            out = engine.run("run", "--rm", "--network", "none", *engine.run_options(), image,
                             "true")  # fmt: skip
            if out.returncode == 0:
                return engine
            tried.append(f"{runtime}: {out.stderr.strip()[-300:]}")
        return "; ".join(tried) or f"none of {', '.join(OCI_RUNTIMES)} is installed"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.cmd(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
            check=False,
        )

    def build_options(self) -> list[str]:
        """What ``build`` needs beyond the Dockerfile, tag and build args: the
        RUN steps on the host network (Debian's mirror and the package index);
        with podman the docker image format (the OCI format has no
        HEALTHCHECK: podman drops it), the ignore file beside the Dockerfile
        (docker finds it by itself), the local base never pulled, the limits,
        the host's CA bundle mounted over the image's for the RUN steps
        only, so pip trusts what this host trusts (a TLS-inspecting egress
        proxy's CA, say) without the image keeping it, and the patched pyfuse3
        wheel ``make deps`` built here (:func:`host_pyfuse3_wheels`)."""
        options = ["--network", "host"]
        if self.name == "podman":
            options += ["--format", "docker", *self.run_options(), "--pull=never", "--layers",
                        "--ignorefile", str(REPO / "packaging" / "controller.Dockerfile.dockerignore")]  # fmt: skip
            if HOST_CA_BUNDLE.is_file():
                options += ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
            for wheel, target in host_pyfuse3_wheels():
                options += ["--volume", f"{wheel}:{target}:ro"]
        return options

    def image_exists(self, name: str) -> bool:
        return self.run("image", "inspect", name).returncode == 0

    def health(self, container: str) -> tuple[bool, str]:
        """Runs the image's HEALTHCHECK once (podman), or waits for the engine's
        own verdict (docker runs it every interval); healthy, and what was said."""
        if self.name == "podman":
            out = self.run("healthcheck", "run", container, timeout=60)
            return out.returncode == 0, (out.stdout + out.stderr).strip()
        status = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = self.health_status(container)
            if status in ("healthy", "unhealthy"):
                break
            time.sleep(1)
        return status == "healthy", status

    def health_status(self, container: str) -> str:
        """The status the engine records from the health checks run so far."""
        return self.run("inspect", "--format", "{{.State.Health.Status}}", container).stdout.strip()

    def prune_cache(self) -> None:
        """Drops cached layers older than :data:`CACHE_DAYS` (podman's own storage only)."""
        if self.name == "podman":
            self.run("image", "prune", "--all", "--force",
                     "--filter", f"until={24 * CACHE_DAYS}h", timeout=600)  # fmt: skip


def os_codename(root: Path) -> str | None:
    """``VERSION_CODENAME`` of the system whose root is ``root``."""
    try:
        text = (root / "etc" / "os-release").read_text()
    except OSError:
        return None
    m = re.search(r"^VERSION_CODENAME=\"?([^\"\n]*)\"?$", text, re.MULTILINE)
    return m[1] if m else None


def host_pyfuse3_wheels() -> list[tuple[Path, str]]:
    """The patched pyfuse3 wheels ``make deps`` built on this host, each with
    where the builder stage's ``build.sh --wheel-dir`` looks for it.

    build.sh reuses a wheel of its version and label found there (one for the
    image's Python; another is ignored and the sdist compiled as before), so
    the builder installs the wheel this host compiled from the same sdist and
    patch instead of compiling it again (minutes on a busy 2-core machine).
    Only where this host runs the base image's Debian release, so the wheel
    links against the same glibc and libfuse3.
    """
    base_rootfs = CACHE / f"rootfs-{digest(BASE_SCRIPT)}"
    if os_codename(Path("/")) is None or os_codename(Path("/")) != os_codename(base_rootfs):
        return []
    script = PYFUSE3_BUILD.read_text()
    version = re.search(r"^version=(\S+)$", script, re.MULTILINE)
    label = re.search(r"^label=(\S+)$", script, re.MULTILINE)
    wheel_dir = re.search(r"packaging/pyfuse3/build\.sh .*?--wheel-dir (\S+)",
                          " ".join(DOCKERFILE.read_text().split()))  # fmt: skip
    if not (version and label and wheel_dir):
        return []
    wheels = sorted(HOST_PYFUSE3_WHEELS.glob(f"pyfuse3-{version[1]}+{label[1]}-*.whl"))
    return [(w, f"{wheel_dir[1]}/{w.name}") for w in wheels]


def _podman(driver: str) -> Engine:
    state = RUN_STATE / driver
    argv = ["podman", "--root", str(CACHE / f"storage-{driver}"),
            "--runroot", str(state / "storage"), "--tmpdir", str(state / "libpod"),
            "--storage-driver", driver, "--events-backend", "file"]  # fmt: skip
    if not Path("/run/systemd/system").exists():
        argv += ["--cgroup-manager", "cgroupfs"]
    # Health checks only when asked: no transient systemd timer per container.
    # TMPDIR: podman's temp files go where podman puts them by default, not in
    # the test session's temp root.
    return Engine("podman", tuple(argv), {"DISABLE_HC_SYSTEMD": "true", "TMPDIR": "/var/tmp"})


def container_engine() -> tuple[Engine, str] | str:
    """A container engine that runs a container of the local base image here,
    and that image's name; or why there is none (the reason a test skips
    with). Podman's storage drivers are tried in turn, each with every OCI
    runtime."""
    reasons = []
    if shutil.which("podman") is None:
        reasons.append("podman is not installed (packaging/install-deps.sh --test)")
    elif os.geteuid() != 0:
        reasons.append("podman runs rootful here, and this process is not root")
    else:
        CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
        for driver in STORAGE_DRIVERS:
            engine = _podman(driver)
            probe = engine.run("info", timeout=60)
            if probe.returncode != 0:
                reasons.append(f"podman with {driver} storage: {probe.stderr.strip()[-300:]}")
                continue
            base = python_base(engine)
            runnable = engine.with_runtime(base)
            if isinstance(runnable, Engine):
                return runnable, base
            reasons.append(f"podman with {driver} storage: {runnable}")
    if shutil.which("docker") is not None:
        probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            engine = Engine("docker", ("docker",))
            return engine, python_base(engine)
        reasons.append("docker has no reachable daemon")
    return "no container engine runs a container here: " + "; ".join(reasons)


def _base_rootfs(tmp: Path) -> None:
    subprocess.run([str(BASE_SCRIPT), str(tmp)], check=True, stdout=subprocess.DEVNULL)


BASE_CONFIG = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "ENV LANG=C.UTF-8")  # fmt: skip
"""The imported base's configuration, as a python image has it: a rootfs
carries no environment, and the Dockerfile's ``ENV PATH=...:$PATH`` needs one."""


def python_base(engine: Engine) -> str:
    """The local base image's name, imported from the cached rootfs when the
    engine lacks it (older tags of it are removed)."""
    rootfs = cached(CACHE, f"rootfs-{digest(BASE_SCRIPT)}", _base_rootfs)
    name = f"{BASE_NAME}:{digest(BASE_SCRIPT, extra=repr(BASE_CONFIG))}"
    if not engine.image_exists(name):
        changes = [a for change in BASE_CONFIG for a in ("--change", change)]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(
                engine.cmd("import", *changes, "-", name), stdin=tar.stdout, capture_output=True,
                text=True, timeout=600, env={**os.environ, **engine.env},
            )  # fmt: skip
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
        assert imported.returncode == 0 and tar.returncode == 0, imported.stderr
    listed = engine.run("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    for old in listed:
        if old.startswith(f"{BASE_NAME}:") and old != name:
            engine.run("rmi", old)
    return name


def server_major() -> int:
    """The major version of this host's PostgreSQL server binaries."""
    out = subprocess.run(
        [str(find_bindir() / "postgres"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    m = re.search(r"\(PostgreSQL\) (\d+)", out)
    assert m, out
    return int(m[1])


@contextlib.contextmanager
def tcp_postgres() -> Iterator[str]:
    """A PostgreSQL cluster of this host's server binaries, listening on
    127.0.0.1 at a free port as well as on its private socket (what an
    external server is to a container on the host network); yields its URL
    without a database name (the user ``controller``, trusted on loopback)."""
    root = world_searchable_tmpdir("fsa-pgtcp-")
    pg = EmbeddedPostgres(root)
    port = free_port()
    try:
        pg.init()
        opts = (f"-k {shlex.quote(str(pg.sockdir))} -c listen_addresses=127.0.0.1 -p {port} "
                "-c max_connections=50 -c shared_buffers=32MB")  # fmt: skip
        subprocess.run(
            pg._cmd(str(pg.bindir / "pg_ctl"), "start", "-D", str(pg.pgdata), "-w", "-t", "60",
                    "-l", str(pg.logfile), "-o", opts),
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        yield f"postgresql://controller@127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def create_database(server_url: str, name: str) -> str:
    with psycopg.connect(f"{server_url}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server_url}/{name}"
