"""The controller's systemd unit and container image; what the sandbox image
scripts install and enable (booting one is tests/system/test_sandbox_boot.py)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from controller.healthcheck import ProbeError, Target, is_serve, target_of
from controller.storage import object_key
from tests.support import container
from tests.support.constants import REPO
from tests.support.container import (
    Engine,
    container_engine,
    create_database,
    server_major,
    tcp_postgres,
)
from tests.support.controller import ControllerProcess, PgCluster
from tests.support.pki import Pki, TlsControllerProcess, made_pki, running_tls_controller
from tests.support.procs import free_port
from tests.support.s3server import FAKE_CREDENTIALS, S3Server
from tests.support.storage import s3_client

UNIT = REPO / "packaging" / "systemd" / "controller.service"
DOCKERFILE = REPO / "packaging" / "controller.Dockerfile"
DOCKERIGNORE = REPO / "packaging" / "controller.Dockerfile.dockerignore"
PYPROJECT = REPO / "pyproject.toml"
SANDBOX_IMAGE = REPO / "packaging" / "sandbox-image"
VENV_CONTROLLER = Path(sys.executable).parent / "controller"


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_is_hardened_and_runs_as_its_own_user() -> None:
    d = directives(UNIT.read_text())
    assert d["Type"] in (["exec"], ["notify"])
    assert d["User"] == ["controller"] and d["Group"] == ["controller"]
    assert d["ProtectSystem"] == ["strict"]
    assert d["NoNewPrivileges"] == ["yes"]
    assert d["PrivateTmp"] == ["yes"]
    assert d["StateDirectory"] == ["controller"]
    assert d["EnvironmentFile"] == ["/etc/controller/controller.env"]
    assert d["CapabilityBoundingSet"] == [""]
    assert "CONTROLLER_DATA_DIR=/var/lib/controller" in d["Environment"]


def test_the_units_documentation_is_what_its_install_lines_copy() -> None:
    """Documentation= names a page the header's install lines put there."""
    text = UNIT.read_text()
    (doc,) = directives(text)["Documentation"]
    prefix = "file:///opt/controller/doc/"
    assert doc.startswith(prefix), doc
    page = doc.removeprefix(prefix)
    assert (REPO / "docs" / page).is_file(), page
    copied = re.search(r"^#\s+install -d /opt/controller/doc && cp -r docs/(\S+) /opt/controller/doc/$",
                       text, re.M)  # fmt: skip
    assert copied is not None and page.startswith(copied.group(1) + "/"), page


def verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # verify checks that ExecStart= is executable: point it at this checkout's script.
    unit = tmp_path / "controller.service"
    unit.write_text(unit_text.replace("/opt/controller/venv/bin/controller", str(VENV_CONTROLLER)))
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    assert VENV_CONTROLLER.exists(), "the controller script is not installed next to python"
    out = verify(UNIT.read_text(), tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "", out.stderr
    # The check can fail: a broken unit is reported.
    broken = verify(UNIT.read_text().replace("Type=exec", "Type=bogus"), tmp_path)
    assert "bogus" in broken.stderr


@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[tuple[str, str]]

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def apt_packages(self) -> set[str]:
        """What the stage's ``apt-get install`` commands install (its ARGs substituted)."""
        args = {}
        for arg in self.all("ARG"):
            name, _, default = arg.partition("=")
            args[name] = default
        found: set[str] = set()
        for run in self.all("RUN"):
            for cmd in re.findall(r"apt-get install ([^&;]+)", run):
                for word in cmd.split():
                    word = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], word.strip('"'))
                    if not word.startswith("-"):
                        found.add(word)
        return found


def dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARGs and the stages of a Dockerfile: each instruction on one
    line (continuations joined, comments dropped)."""
    lines: list[str] = []
    buf = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        if (buf + line).strip():
            lines.append(" ".join((buf + line).split()))
        buf = ""
    assert buf == "", "a continuation runs off the end"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?: AS (\S+))?", rest, re.IGNORECASE)
            assert m, line
            stages.append(Stage(m[2], m[1], []))
        elif not stages:
            assert keyword == "ARG", line
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


def ignored_by(dockerignore: str, path: str) -> bool:
    """Whether the build context leaves ``path`` out (the ``*`` then ``!keep``
    form this repository's ignore file uses)."""
    rules = [r for r in dockerignore.splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*", "the ignore file lets in only what it names"
    kept = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    return not any(path == k or path.startswith(k + "/") for k in kept)


def test_dockerfile_builds_in_a_builder_stage_and_runs_slim_and_non_root() -> None:
    global_args, stages = dockerfile(DOCKERFILE.read_text())
    assert [s.name for s in stages] == ["builder", "runtime"]
    builder, runtime = stages
    # One base image for both, so the virtualenv's interpreter paths hold.
    base = global_args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.\d+-slim-\w+", base), base
    assert builder.base == runtime.base == "${PYTHON_IMAGE}"
    (minimum,) = re.findall(r'^requires-python = ">=(3\.\d+)"$', PYPROJECT.read_text(), re.M)
    image_python = base.split(":")[1].split("-")[0]
    assert tuple(map(int, image_python.split("."))) >= tuple(map(int, minimum.split(".")))

    # The builder compiles pyfuse3 (no wheel on the package index) with the patch.
    assert {"gcc", "pkg-config", "libfuse3-dev"} <= builder.apt_packages()
    assert any("packaging/pyfuse3/build.sh" in r for r in builder.all("RUN"))
    # With the controller's extra: the base dependencies are fsagent's alone.
    assert any(
        r.startswith("pip install --no-cache-dir '.[controller]' ") for r in builder.all("RUN")
    )

    # The runtime has libraries and client tools, no compiler, no headers.
    shipped = runtime.apt_packages()
    assert "libfuse3-3" in shipped
    assert any(re.fullmatch(r"postgresql-client-\d+", p) for p in shipped), shipped
    assert not {p for p in shipped if p.endswith("-dev") or p in ("gcc", "pkg-config", "make")}
    assert "postgresql" not in shipped  # no server: CONTROLLER_DATABASE_URL is external
    assert runtime.all("COPY") == ["--from=builder /opt/controller/venv /opt/controller/venv"]
    assert any("PATH=/opt/controller/venv/bin:$PATH" in e for e in runtime.all("ENV"))

    # Non-root: the last USER is a system user the stage creates, with a uid.
    (useradd,) = [r for r in runtime.all("RUN") if "useradd" in r]
    uid = re.search(r"useradd --system --uid (\d+) .* controller$", useradd)
    assert uid and int(uid[1]) != 0, useradd
    assert runtime.all("USER") == ["controller"]
    keywords = [kw for kw, _ in runtime.instructions]
    assert keywords.index("USER") > max(i for i, kw in enumerate(keywords) if kw == "RUN")
    assert "CONTROLLER_DATABASE_URL" in DOCKERFILE.read_text()  # documented, never baked in
    assert not any("CONTROLLER_DATABASE_URL" in e for e in runtime.all("ENV"))

    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert json.loads(entrypoint)[:2] == ["controller", "serve"]
    (healthcheck,) = runtime.all("HEALTHCHECK")
    assert json.loads(healthcheck.partition(" CMD ")[2]) == HEALTHCHECK

    # Everything the builder copies exists and is in the build context.
    ignore = DOCKERIGNORE.read_text()
    for copy in builder.all("COPY"):
        *sources, _ = copy.split()
        for src in sources:
            assert (REPO / src).exists(), src
            assert not ignored_by(ignore, src), f"{src} is left out of the build context"
    assert ignored_by(ignore, "tests/system/test_ops_packaging.py")  # the check can fail


HEALTHCHECK = ["python", "-m", "controller.healthcheck"]
"""The image's HEALTHCHECK command (asserted against the Dockerfile above)."""


def entrypoint_args() -> list[str]:
    _, stages = dockerfile(DOCKERFILE.read_text())
    (entrypoint,) = stages[-1].all("ENTRYPOINT")
    args: list[str] = json.loads(entrypoint)
    return args[1:]


def test_the_healthcheck_reads_how_serve_was_started(tmp_path: Path) -> None:
    """The image's command line, with and without TLS arguments added after
    the image name, and the ways ``--listen`` is spelled."""
    image = entrypoint_args()
    assert target_of(image, tmp_path) == Target("127.0.0.1", 8750, None)
    assert target_of(image, tmp_path).url == "http://127.0.0.1:8750/readyz"
    tls = target_of([*image, "--tls-cert", "/run/secrets/c.pem", "--tls-key", "k"], tmp_path)
    assert tls == Target("127.0.0.1", 8750, Path("/run/secrets/c.pem"))
    assert tls.url == "https://127.0.0.1:8750/readyz"
    relative = target_of([*image, "--tls-cert=c.pem", "--tls-key=k", "--listen=[::]:9"], tmp_path)
    assert relative == Target("::1", 9, tmp_path / "c.pem")
    assert relative.url == "https://[::1]:9/readyz"
    assert target_of(["serve", "--listen", "10.1.2.3:80"], tmp_path).host == "10.1.2.3"
    with pytest.raises(ProbeError, match="unusable --listen"):
        target_of(["serve", "--listen", "nowhere"], tmp_path)


def test_the_healthcheck_knows_a_serve_command_line() -> None:
    assert is_serve(["/opt/controller/venv/bin/python", "/opt/controller/venv/bin/controller",
                     *entrypoint_args()])  # fmt: skip
    assert is_serve(["python3", "-m", "controller.cli", "serve", "--listen", "x:1"])
    assert not is_serve(["controller", "migrate"])
    assert not is_serve(["controller"])
    assert not is_serve(["python3", "-m", "pytest", "-k", "serve"])
    assert not is_serve(["/sbin/docker-init", "--", "controller", "-h", "serve"])


def test_the_healthcheck_finds_serve_under_an_init(pg_cluster: PgCluster, tmp_path: Path) -> None:
    """PID 1 is an init that started ``controller serve`` as its child. In a
    PID namespace of its own (PID 1 a shell script) the probe without
    ``--pid`` finds the server and its answer; ``--pid 1`` is refused."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a PID namespace")
    serve = [sys.executable, "-m", "controller.cli", "serve", "--database-url",
             pg_cluster.create_database(), "--data-dir", str(tmp_path / "data"),
             "--listen", f"0.0.0.0:{free_port()}"]  # fmt: skip
    py, err = shlex.quote(sys.executable), shlex.quote(str(tmp_path / "probe.err"))
    init = tmp_path / "init.sh"
    init.write_text(
        f"{shlex.join(serve)} >{shlex.quote(str(tmp_path / 'serve.log'))} 2>&1 & server=$!\n"
        "for _ in $(seq 150); do\n"
        f"  if {py} -m controller.healthcheck 2>{err}; then\n"
        f'    {py} -m controller.healthcheck --pid 1 2>&1; echo "pid1=$?"\n'
        "    kill -TERM $server; wait $server; exit 0\n"
        "  fi\n"
        "  sleep 0.2\n"
        "done\n"
        f"cat {err}; kill -TERM $server; wait $server; exit 1\n"
    )
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", str(init)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr + (tmp_path / "serve.log").read_text()
    assert out.stdout == f"healthcheck: process 1 is not `controller serve`: sh {init}\npid1=1\n"


def probe(pid: int) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK command, run on this host against process ``pid``."""
    return subprocess.run(
        [sys.executable, *HEALTHCHECK[1:], "--pid", str(pid)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    yield from made_pki()


@pytest.fixture(scope="module")
def tls_controller(pg_cluster: PgCluster, pki: Pki) -> Iterator[TlsControllerProcess]:
    yield from running_tls_controller(pg_cluster, pki)


def test_the_healthcheck_probes_serve_over_http(controller: ControllerProcess) -> None:
    assert controller.proc is not None
    out = probe(controller.proc.pid)
    assert (out.returncode, out.stderr) == (0, "")
    # Not a serve process: unhealthy, with the reason.
    out = probe(os.getpid())
    assert out.returncode == 1
    assert (
        out.stderr.startswith("healthcheck: process ") and "is not `controller serve`" in out.stderr
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_the_healthcheck_probes_serve_over_tls(tls_controller: TlsControllerProcess) -> None:
    """With ``--tls-cert`` the probe speaks HTTPS, trusting that certificate,
    and a not-ready answer (storage gone) makes it fail."""
    assert tls_controller.proc is not None
    pid = tls_controller.proc.pid
    out = probe(pid)
    assert (out.returncode, out.stderr) == (0, "")
    objects = tls_controller.data_dir / "objects"
    moved = tls_controller.data_dir / "objects-away"
    objects.rename(moved)
    objects.write_bytes(b"not a directory")
    try:
        out = probe(pid)
        assert out.returncode == 1
        port = tls_controller.port
        assert out.stderr.startswith(f"healthcheck: https://127.0.0.1:{port}/readyz answered 503")
        assert '"failing":["storage"]' in out.stderr
    finally:
        objects.unlink()
        moved.rename(objects)
    assert probe(pid).returncode == 0


def client_tools_step() -> str:
    """The runtime stage's RUN that installs the PostgreSQL client tools."""
    _, stages = dockerfile(DOCKERFILE.read_text())
    (step,) = [r for r in stages[-1].all("RUN") if "postgresql-client-" in r]
    return step


PGDG_SETUP = "/usr/share/postgresql-common/pgdg/apt.postgresql.org.sh"


def test_client_tools_come_from_debian_when_it_has_the_major(tmp_path: Path) -> None:
    """The runtime's apt step, run with stand-ins for apt-get, apt-cache, rm,
    useradd and the PostgreSQL project's setup script, on a Debian whose
    mirror has postgresql-client-15 only: PG_MAJOR=15 installs Debian's
    package and adds no repository; PG_MAJOR=17 adds the PostgreSQL project's
    repository (postgresql-common's script) before installing from it."""
    step = client_tools_step()
    assert PGDG_SETUP in step
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    madison = " postgresql-client-15 | 15.14-0+deb12u1 | http://deb.debian.org/debian bookworm/main"
    stubs = {
        "apt-get": 'echo "apt-get $*" >>"$LOG"',
        "apt-cache": f'[ "$*" = "madison postgresql-client-15" ] && echo "{madison}"; exit 0',
        "pgdg-setup": 'echo "pgdg-setup $*" >>"$LOG"',
        "rm": 'echo "rm $1" >>"$LOG"',
        "useradd": 'echo "useradd" >>"$LOG"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)

    # PATH holds only the stand-ins: nothing of the host's apt runs.
    sh = shutil.which("sh")
    assert sh is not None

    def steps(major: str) -> list[str]:
        log.write_text("")
        subprocess.run(
            [sh, "-ec", step.replace(PGDG_SETUP, str(bin_dir / "pgdg-setup"))],
            env={"PATH": str(bin_dir), "LOG": str(log), "PG_MAJOR": major},
            check=True, timeout=60,
        )  # fmt: skip
        return log.read_text().splitlines()

    install = "apt-get install -y --no-install-recommends"
    assert steps("15") == [
        "apt-get update",
        f"{install} libfuse3-3 ca-certificates",
        f"{install} postgresql-client-15",
        "rm -rf",
        "useradd",
    ]
    assert steps("17") == [
        "apt-get update",
        f"{install} libfuse3-3 ca-certificates",
        f"{install} postgresql-common",
        "pgdg-setup -y",
        f"{install} postgresql-client-17",
        "rm -rf",
        "useradd",
    ]


def print_wall_time(request: pytest.FixtureRequest, line: str) -> None:
    """``line`` on the terminal whatever the capture mode (``-s`` not needed)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n{line}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold cache: debootstrap and every layer built
def test_container_image_builds_and_runs_as_non_root(request: pytest.FixtureRequest) -> None:
    """The image built (on a local Debian base, the client tools of this
    host's PostgreSQL major from Debian) and run on the host network against
    a PostgreSQL server listening on TCP and the S3 test server: ready, its
    HEALTHCHECK healthy, a file written through the REST API read back byte
    for byte and stored in the bucket, a backup taken with the image's
    pg_dump, serve running as a non-root uid, and a clean stop on SIGTERM.
    Prints its wall time: the base rootfs, when not cached, and the build
    (its layers cached in the engine's storage for a day) included."""
    started = time.monotonic()
    found = container_engine()
    if isinstance(found, str):
        pytest.skip(found)
    engine, base = found
    # Asked for only now: without an engine no S3 server is started.
    s3_server: S3Server = request.getfixturevalue("s3_server")
    s3_bucket: str = request.getfixturevalue("s3_bucket")
    tag = f"localhost/fsa-controller-test:{uuid.uuid4().hex[:8]}"
    name = f"fsa-controller-test-{uuid.uuid4().hex[:8]}"
    try:
        _build_and_serve(engine, base, tag, name, s3_server, s3_bucket)
    finally:
        engine.run("rm", "--force", name)
        engine.run("rmi", "--force", tag)
        engine.prune_cache()
        seconds = time.monotonic() - started
        what = engine.name + (f" with {engine.runtime}" if engine.runtime else "")
        print_wall_time(request, f"container image test ({what}): {seconds:.1f} s wall time")


def _build_and_serve(
    engine: Engine, base: str, tag: str, name: str, s3_server: S3Server, s3_bucket: str
) -> None:
    major = server_major()
    build = engine.run(
        "build", "-f", str(DOCKERFILE), "-t", tag, *engine.build_options(),
        "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"PG_MAJOR={major}",
        str(REPO), timeout=1500,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]

    def run_in(*args: str) -> subprocess.CompletedProcess[str]:
        """A throwaway container of the image, without a network."""
        return engine.run("run", "--rm", "--network", "none", *engine.run_options(), *args)

    who = run_in("--entrypoint", "id", tag, "-u")
    assert who.returncode == 0 and who.stdout.strip() not in ("", "0"), who
    help_ = run_in(tag, "--help")
    assert "--metrics-listen" in help_.stdout
    # The compiled dependency loads against the runtime library, and the
    # client tools for backups are there, of the server's major version.
    tools = run_in("--entrypoint", "sh", tag, "-c",
                   "python -c 'import pyfuse3, controller.healthcheck' && pg_dump --version")  # fmt: skip
    assert tools.returncode == 0, tools.stderr
    assert tools.stdout.startswith(f"pg_dump (PostgreSQL) {major}."), tools.stdout

    s3_client(s3_server).create_bucket(Bucket=s3_bucket)
    port = free_port()
    with tcp_postgres() as server_url:
        database = create_database(server_url, "controller")
        started = engine.run(
            "run", "--detach", "--name", name, "--network", "host", *engine.run_options(),
            "--env", f"CONTROLLER_DATABASE_URL={database}",
            *(a for k, v in FAKE_CREDENTIALS.items() for a in ("--env", f"{k}={v}")),
            tag, "--listen", f"127.0.0.1:{port}", "--storage", "s3",
            "--s3-endpoint", s3_server.endpoint_url, "--s3-bucket", s3_bucket,
            "--s3-region", FAKE_CREDENTIALS["AWS_DEFAULT_REGION"],
        )  # fmt: skip
        assert started.returncode == 0, started.stderr

        def logs() -> str:
            out = engine.run("logs", name)
            return (out.stdout + out.stderr)[-4000:]

        url = f"http://127.0.0.1:{port}"
        ready = _wait_ready(url, lambda: engine.run("inspect", "--format", "{{.State.Running}}",
                                                    name).stdout.strip() == "true")  # fmt: skip
        assert ready is not None, logs()
        assert (ready.status_code, ready.json()) == (
            200,
            {"ok": True, "checks": {"database": "ok", "storage": "ok"}},
        ), ready.text

        healthy, said = engine.health(name)
        assert healthy, f"{said}\n{logs()}"
        assert engine.health_status(name) == "healthy"

        # The server is not root, seen from the host: PID 1 of the container
        # is `controller serve` with every uid the image's user.
        pid = engine.run("inspect", "--format", "{{.State.Pid}}", name).stdout.strip()
        status = Path(f"/proc/{pid}/status").read_text()
        (uids,) = re.findall(r"^Uid:\s+(.*)$", status, re.MULTILINE)
        assert set(uids.split()) == {"10001"}, uids
        assert is_serve(Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1])

        # A real file through the REST API, and its object in the bucket.
        boot = engine.run("exec", name, "controller", "admin", "bootstrap", "--company-name",
                          "image", "--email", "owner@image.example", "--json")  # fmt: skip
        assert boot.returncode == 0, boot.stderr
        tenant = json.loads(boot.stdout)
        folder = f"/api/companies/{tenant['company_id']}/work-folders/user/{tenant['user_id']}"
        payload = os.urandom(3 << 20) + b"end"
        with httpx.Client(base_url=url, timeout=120,
                          headers={"Authorization": f"Bearer {tenant['token']}"}) as http:  # fmt: skip
            put = http.put(f"{folder}/content", params={"path": "notes/payload.bin"},
                           content=payload, headers={"Content-Type": "application/octet-stream"})  # fmt: skip
            assert put.status_code == 201, put.text
            got = http.get(f"{folder}/content", params={"path": "notes/payload.bin"})
            assert got.status_code == 200, got.text
            assert got.content == payload
        key = object_key(tenant["company_id"], hashlib.sha256(payload).hexdigest())
        stored = s3_client(s3_server).get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        assert stored == payload

        # The image's pg_dump takes a backup of the server's database.
        backup = engine.run("exec", name, "controller", "admin", "backup", "--storage", "s3",
                            "--to", "/var/lib/controller/backup", "--json")  # fmt: skip
        assert backup.returncode == 0, backup.stderr
        listed = engine.run("exec", name, "ls", "/var/lib/controller/backup")
        assert {"db.dump", "backup.json"} <= set(listed.stdout.split()), listed

        # SIGTERM to PID 1 stops serve cleanly, within the engine's grace period.
        stopped = engine.run("stop", "--time", "20", name, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        code = engine.run("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", logs()


def test_the_image_test_hands_the_builder_the_hosts_pyfuse3_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wheel of the current version and label (not an older label's) is
    mounted where the Dockerfile's build.sh looks, under a name build.sh
    takes as already built; never on a host of another Debian release."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    script = (REPO / "packaging" / "pyfuse3" / "build.sh").read_text()
    (version,) = re.findall(r"^version=(\S+)$", script, re.MULTILINE)
    (label,) = re.findall(r"^label=(\S+)$", script, re.MULTILINE)
    wheels = tmp_path / "host-wheels"
    wheels.mkdir()
    current = wheels / f"pyfuse3-{version}+{label}-{tag}-{tag}-linux_x86_64.whl"
    current.write_bytes(b"not really a wheel")
    (wheels / f"pyfuse3-{version}+fsagent.0-{tag}-{tag}-linux_x86_64.whl").write_bytes(b"old")
    monkeypatch.setattr(container, "HOST_PYFUSE3_WHEELS", wheels)
    monkeypatch.setattr(container, "os_codename", lambda root: "bookworm")
    ((wheel, target),) = container.host_pyfuse3_wheels()
    assert (wheel, target) == (current, f"/tmp/wheels/{current.name}")
    _, stages = dockerfile(DOCKERFILE.read_text())
    (build,) = [r for r in stages[0].all("RUN") if "packaging/pyfuse3/build.sh" in r]
    assert f"--wheel-dir {Path(target).parent} " in build + " ", build
    # build.sh finds it there and builds nothing (no --install: nothing installed).
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    shutil.copy(wheel, mounted / Path(target).name)
    found = subprocess.run(
        [str(REPO / "packaging" / "pyfuse3" / "build.sh"), "--python", sys.executable,
         "--wheel-dir", str(mounted)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (found.returncode, found.stdout) == (0, f"{mounted / current.name}\n"), found.stderr
    # Another Debian release than the base's: no wheel is handed over.
    monkeypatch.setattr(container, "os_codename", lambda root: str(root))
    assert container.host_pyfuse3_wheels() == []


def _wait_ready(
    url: str, running: Callable[[], bool], timeout: float = 90
) -> httpx.Response | None:
    """``/readyz`` once it answers 200, or None when the container stops or
    the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(url + "/readyz", timeout=10)
            if r.status_code == 200:
                return r
        if not running():
            return None
        time.sleep(0.5)
    return None


def test_the_sandbox_image_has_git_and_enables_every_fsagent_unit() -> None:
    """Enabling the units is enough for repositories too: the base rootfs has
    git, install-fsagent.sh installs it where missing, and build-rootfs.sh
    enables every unit install-fsagent.sh installs."""
    base = (SANDBOX_IMAGE / "debootstrap-base.sh").read_text()
    (packages,) = re.findall(r"^packages=(\S+)$", base, re.MULTILINE)
    # nodejs: the runtime contract's node (fsagent launch and doctor require it).
    assert {"git", "fuse3", "python3-venv", "nodejs"} <= set(packages.split(","))
    install = (REPO / "packaging" / "install-fsagent.sh").read_text()
    (needed,) = re.findall(r"^for p in (.+); do$", install, re.MULTILINE)
    assert "git" in needed.split()
    (installed,) = re.findall(r"^    for unit in (.+); do$", install, re.MULTILINE)
    services = [u for u in installed.split() if not u.endswith("@.service")]
    assert "fsagent-repos.service" in services
    build = (SANDBOX_IMAGE / "build-rootfs.sh").read_text()
    (enabled,) = re.findall(r"^for unit in (.+); do$", build, re.MULTILINE)
    assert sorted(enabled.split()) == sorted(services)
    assert 'systemctl enable "${units[@]}"' in build
    for script in (SANDBOX_IMAGE / "debootstrap-base.sh", SANDBOX_IMAGE / "build-rootfs.sh",
                   SANDBOX_IMAGE / "source-files.sh"):  # fmt: skip
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_the_sandbox_installs_fsagent_without_the_controllers_dependencies() -> None:
    """The base dependencies are fsagent's; the controller's are its extra,
    which its image and unit install, and the tests get through theirs."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    base = requirement_names(project["dependencies"])
    extras = project["optional-dependencies"]
    controller = requirement_names(extras["controller"])
    assert {"psycopg", "psycopg-pool", "boto3", "starlette", "prometheus-client"} <= controller
    assert base.isdisjoint(controller), base & controller
    assert {"pyfuse3", "trio", "httpx", "lmdb", "xxhash", "zstandard"} <= base
    assert "fsagent-workfolders[controller]" in extras["test"]

    # Every pip install of the package: the sandbox's without an extra, the
    # controller's with its own, the development venv with the tests'.
    install = (REPO / "packaging" / "install-fsagent.sh").read_text()
    (sandbox,) = re.findall(r"^/opt/fsagent/venv/bin/pip install -q (\S+)$", install, re.M)
    assert sandbox == '"${package:-$src}"'
    assert "pip install --no-cache-dir '.[controller]'" in DOCKERFILE.read_text()
    assert "pip install '.[controller]'" in UNIT.read_text()
    assert "pip install -q -e '.[test]'" in (REPO / "Makefile").read_text()


def hidden_distributions() -> set[str]:
    """The controller extra's installed distributions, with what they require,
    that the base dependencies do not require."""

    def closure(requirements: list[str]) -> set[str]:
        found: set[str] = set()
        todo = [Requirement(r) for r in requirements]
        while todo:
            req = todo.pop()
            name = canonicalize_name(req.name)
            if name in found or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            found.add(name)
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                extras_wanted = [{"extra": e} for e in req.extras]
                for dep in importlib.metadata.requires(name) or []:
                    dreq = Requirement(dep)
                    if dreq.marker is None or any(
                        dreq.marker.evaluate(env) for env in [{"extra": ""}, *extras_wanted]
                    ):
                        todo.append(Requirement(str(dreq).split(";")[0]))
        return found

    project = tomllib.loads(PYPROJECT.read_text())["project"]
    controller = closure(project["optional-dependencies"]["controller"])
    return controller - closure(project["dependencies"])


# Run in a fresh interpreter: the controller's packages made unimportable,
# every module of fsagent and common imported, then `fsagent --help`.
FSAGENT_ALONE = """
import importlib, importlib.abc, pkgutil, sys

hidden = set(sys.argv[1:])
assert not hidden & {m.split(".")[0] for m in sys.modules}, "already imported"


class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None


sys.meta_path.insert(0, Hidden())
try:
    import psycopg  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("psycopg is still importable")
imported = []
for root in ("common", "fsagent"):
    package = importlib.import_module(root)
    for info in pkgutil.walk_packages(package.__path__, root + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
print(len(imported), "modules", flush=True)
from fsagent.cli import main

sys.exit(main(["--help"]))
"""


def test_fsagent_runs_without_the_controllers_packages() -> None:
    """What an install without the controller extra has is enough for every
    module of fsagent and common and for the command (their imports inside
    functions are .importlinter's sandbox-deps contract)."""
    hidden = hidden_distributions()
    assert {"psycopg", "psycopg-binary", "boto3", "botocore", "starlette"} <= hidden
    modules = {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if {canonicalize_name(d) for d in dists} & hidden
    }
    assert {"psycopg", "boto3", "botocore", "starlette", "prometheus_client"} <= modules
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", FSAGENT_ALONE, *sorted(modules)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    count, _, rest = run.stdout.partition(" modules\n")
    assert int(count) >= 30, run.stdout
    assert "usage: fsagent" in rest, run.stdout


# A fresh interpreter with the modules named after "--" unimportable runs the
# `controller` command's entry point with the arguments before it.
CONTROLLER_ALONE = """
import importlib.abc, sys

split = sys.argv.index("--")
argv, hidden = sys.argv[1:split], set(sys.argv[split + 1:])


class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in hidden or name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None


sys.meta_path.insert(0, Hidden())
from controller.launch import main

sys.exit(main(argv))
"""


def run_controller_alone(argv: list[str], hidden: set[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", CONTROLLER_ALONE, *argv, "--", *sorted(hidden)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_controller_command_without_its_extra_says_what_to_install() -> None:
    """The sandbox's install has the `controller` script but not its extra:
    one line naming the extra, exit 2, no traceback."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["scripts"]["controller"] == "controller.launch:main"
    hidden = {"psycopg", "psycopg_pool", "starlette", "boto3", "botocore", "prometheus_client"}
    run = run_controller_alone(["serve", "--help"], hidden)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stdout == ""
    assert "Traceback" not in run.stderr, run.stderr
    assert f"pip install '{project['name']}[controller]'" in run.stderr, run.stderr
    (line,) = run.stderr.splitlines()
    assert line.startswith("controller: the controller's dependencies are not installed")
    # With the extra the same entry point is the command.
    run = run_controller_alone(["--help"], set())
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: controller"), run.stdout
    installed = subprocess.run([str(VENV_CONTROLLER), "--help"], capture_output=True,
                               text=True, timeout=120)  # fmt: skip
    assert installed.returncode == 0 and installed.stdout.startswith("usage: controller")


def test_a_broken_controller_install_still_shows_its_traceback() -> None:
    """Only a missing dependency gets the one line: a module of the package
    itself missing is a broken install, and its traceback says where."""
    run = run_controller_alone(["--help"], {"controller.cli"})
    assert run.returncode == 1, run.stderr
    assert "Traceback" in run.stderr and "controller.cli" in run.stderr, run.stderr


# Every program the tests run, and the Debian package that provides it. A
# program of an Essential package (coreutils, dash, bash, findutils, ...) is
# always there; every other package must be one `install-deps.sh --test`
# installs, so `make test` on a fresh Debian machine skips nothing for want of it.
ESSENTIAL = {"sh", "bash", "dash", "cp", "chmod", "cat", "touch", "env", "find", "sleep", "tar"}
PROGRAM_PACKAGES = {
    "git": "git",
    "curl": "curl",  # the demo's printed lines (test_fsagent_bridge_local.py)
    "openssl": "openssl",
    "fusermount3": "fuse3",
    "mount": "mount",
    "umount": "mount",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "runuser": "util-linux",
    "systemd-analyze": "systemd",
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "pg_dump": "postgresql",  # its client tools come with the server package
    "pg_restore": "postgresql",
    "node": "nodejs",
    "npm": "npm",
    "chromium": "chromium",
    "podman": "podman",  # the container image test (tests/support/container.py)
}
RUN_INDIRECTLY = {"curl", "unshare", "nsenter", "runuser", "systemd-nspawn", "debootstrap",
                  "node", "chromium"}  # fmt: skip
"""Programs the tests start through a shell line, a variable or a fixed path,
which the scan of literal argument lists below cannot see."""
NOT_PACKAGED = {"docker", "/usr/bin/python3"}
"""Optional: the container image test uses docker only where podman is
missing; the owner tests' system python is only compared with the venv's."""


def programs_the_tests_run() -> set[str]:
    """First words of literal argument lists given to subprocess, and
    ``shutil.which`` names, in every test module and the support package."""
    import ast

    found = set(RUN_INDIRECTLY)
    for module in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if name in ("run", "Popen", "check_output", "check_call") and isinstance(
                first, (ast.List, ast.Tuple)
            ):
                word = first.elts[0] if first.elts else None
                if isinstance(word, ast.Constant) and isinstance(word.value, str):
                    found.add(word.value)
            elif name == "which" and isinstance(first, ast.Constant):
                found.add(str(first.value))
    return found


def test_install_deps_installs_every_program_the_tests_run() -> None:
    script = (REPO / "packaging" / "install-deps.sh").read_text()
    base = re.search(r"^pkgs=\((.*?)\)", script, re.MULTILINE | re.DOTALL)
    base_cmds = re.search(r"^cmds=\((.*?)\)", script, re.MULTILINE)
    test = re.search(r"^\s+--test\) (.*?) ;;", script, re.MULTILINE | re.DOTALL)
    assert base and base_cmds and test
    words = (base[1] + " " + base_cmds[1] + " " + test[1]).replace("pkgs+=(", " ")
    words = words.replace("cmds+=(", " ").replace(")", " ")
    # `pkg:command` entries install pkg when the command is missing.
    installed = {w.split(":")[0] for w in words.split()}
    programs = programs_the_tests_run()
    unknown = programs - ESSENTIAL - set(PROGRAM_PACKAGES) - NOT_PACKAGED
    assert not unknown, f"say which Debian package provides {sorted(unknown)}"
    missing = {p: PROGRAM_PACKAGES[p] for p in programs & set(PROGRAM_PACKAGES)}
    missing = {p: pkg for p, pkg in missing.items() if pkg not in installed}
    assert missing == {}, f"install-deps.sh --test does not install {missing}"
    assert {"curl", "git"} <= installed


def _install_deps_with(
    tmp_path: Path, installed: set[str] | None
) -> subprocess.CompletedProcess[str]:
    """packaging/install-deps.sh run as a non-root user against a package
    database that holds ``installed`` (None: every package)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    known = "" if installed is None else " ".join(sorted(installed))
    stubs = {
        "id": "#!/bin/sh\necho 1000\n",
        # dpkg-query -W -f=... PACKAGE
        "dpkg-query": (
            '#!/bin/sh\nfor p; do last="$p"; done\n'
            + (
                'printf "install ok installed"; exit 0\n'
                if installed is None
                else f'for k in {known}; do [ "$k" = "$last" ] && '
                'printf "install ok installed" && exit 0; done\nexit 1\n'
            )
        ),
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return subprocess.run(
        ["bash", str(REPO / "packaging" / "install-deps.sh")],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        timeout=60,
        check=False,
    )


def test_install_deps_installs_git_where_it_is_missing(tmp_path: Path) -> None:
    """The host needs git: fsagent clones, saves and restores repositories
    with it, and the tests and the demo make repositories with it."""
    everything_but_git = {
        "fuse3", "libfuse3-dev", "pkg-config", "gcc", "make", "python3", "python3-dev",
        "python3-venv", "postgresql", "tar", "ca-certificates",
    }  # fmt: skip
    missing = _install_deps_with(tmp_path, everything_but_git)
    assert missing.returncode == 1
    assert missing.stderr.strip() == ("missing Debian packages: git (run this script as root)"), (
        missing.stderr
    )
    complete = _install_deps_with(tmp_path, None)
    assert (complete.returncode, complete.stdout, complete.stderr) == (0, "", "")
