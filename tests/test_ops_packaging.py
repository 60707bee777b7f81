"""The controller's systemd unit and container image; what the sandbox image
scripts install and enable (booting one is tests/test_sandbox_boot.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.constants import REPO

UNIT = REPO / "packaging" / "systemd" / "controller.service"
DOCKERFILE = REPO / "packaging" / "controller.Dockerfile"
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


def container_engine() -> str | None:
    for engine in ("docker", "podman"):
        if shutil.which(engine) is None:
            continue
        probe = subprocess.run([engine, "info"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return engine
    return None


def test_dockerfile_is_slim_non_root_and_external_services() -> None:
    text = DOCKERFILE.read_text()
    assert "FROM python:3.11-slim" in text
    assert "\nUSER controller\n" in text
    assert "CONTROLLER_DATABASE_URL" in text
    assert "postgresql-client" in text  # pg_dump for admin backup, no server


@pytest.mark.slow
def test_container_image_builds_and_runs_as_non_root() -> None:
    engine = container_engine()
    if engine is None:
        pytest.skip("no container engine (docker or podman) with a reachable daemon")
    tag = f"fsa-controller-test:{uuid.uuid4().hex[:8]}"
    try:
        build = subprocess.run(
            [engine, "build", "-f", str(DOCKERFILE), "-t", tag, str(REPO)],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert build.returncode == 0, build.stderr[-3000:]
        who = subprocess.run(
            [engine, "run", "--rm", "--entrypoint", "id", tag, "-u"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert who.stdout.strip() != "0"
        help_ = subprocess.run(
            [engine, "run", "--rm", tag, "--help"], capture_output=True, text=True, timeout=120
        )
        assert "--metrics-listen" in help_.stdout
    finally:
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=120)


def test_the_sandbox_image_has_git_and_enables_every_fsagent_unit() -> None:
    """Enabling the units is enough for repositories too: the base rootfs has
    git, install-fsagent.sh installs it where missing, and build-rootfs.sh
    enables every unit install-fsagent.sh installs."""
    base = (SANDBOX_IMAGE / "debootstrap-base.sh").read_text()
    (packages,) = re.findall(r"^packages=(\S+)$", base, re.MULTILINE)
    assert {"git", "fuse3", "python3-venv"} <= set(packages.split(","))
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
    for script in (SANDBOX_IMAGE / "debootstrap-base.sh", SANDBOX_IMAGE / "build-rootfs.sh"):
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr


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
}
RUN_INDIRECTLY = {"curl", "unshare", "nsenter", "runuser", "systemd-nspawn", "debootstrap",
                  "node", "chromium"}  # fmt: skip
"""Programs the tests start through a shell line, a variable or a fixed path,
which the scan of literal argument lists below cannot see."""
NOT_PACKAGED = {"docker", "podman", "/usr/bin/python3"}
"""Optional: the container image test skips without an engine; the owner
tests' system python is only compared with the venv's."""


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
