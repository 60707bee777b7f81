"""``fsagent launch`` (the runtime contract: probes, install commands, shells, no
profile writes) and ``fsagent doctor`` on a healthy and on a broken sandbox.

Each test builds its own sandbox PATH: a directory with links to the few tools
the commands use and, when the test wants it, a stand-in ``node`` and CLIs. So
"absent" means absent, whatever the machine has installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsagent.commands.launch import EXIT_CONTRACT_UNMET
from tests.support.constants import REPO

TOOLS = ("sh", "bash", "chmod", "cat", "touch", "env", "tar")
PROFILE_FILES = (
    ".profile",
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".zshrc",
    ".zprofile",
    ".zshenv",
    ".zlogin",
    ".config/fish/config.fish",
    ".config/fish/conf.d/nvm.fish",
    ".nvm/nvm.sh",
)


class Sandbox:
    """A home, an env file and a PATH of chosen tools under one temp dir."""

    def __init__(self, root: Path, node: bool = True) -> None:
        self.home = root / "home"
        self.home.mkdir()
        self.bin = root / "bin"
        self.bin.mkdir()
        for tool in TOOLS:
            found = shutil.which(tool)
            assert found, tool
            os.symlink(found, self.bin / tool)
        if node:
            self.add_cli("node", "echo v20.0.0")
        self.env_file = root / "env"
        self.units_config = root / "fsagent.env"
        self.env_file.write_text(
            f"AGENT_HOME={self.home}/agent\nPAPERCLIP_TASK_DIR={self.home}/task\n"
            "PAPERCLIP_API_URL=http://127.0.0.1:9\nPATH=/nonexistent\n"
        )

    def add_cli(self, name: str, body: str = "echo ran") -> Path:
        path = self.bin / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
        return path

    def launch(
        self, *args: str, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": str(self.bin),
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            **(extra_env or {}),
        }
        return subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "launch", "--env-file", str(self.env_file), *args],
            capture_output=True, text=True, cwd=REPO, env=env, check=False, timeout=120,
        )  # fmt: skip


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def test_present_cli_runs_command_in_home_with_env_file_and_own_path(sandbox: Sandbox) -> None:
    sandbox.add_cli("fsa-agent-cli", "echo agent says hi")
    res = sandbox.launch(
        "--require", "fsa-agent-cli", "--",
        'pwd; echo "task=$PAPERCLIP_TASK_DIR path=$PATH"; fsa-agent-cli; exit 3',
    )  # fmt: skip
    # The command's own exit status is the launch's.
    assert res.returncode == 3, res.stderr
    assert res.stdout.splitlines() == [
        str(sandbox.home),
        f"task={sandbox.home}/task path={sandbox.bin}",  # PATH from the env file is ignored
        "agent says hi",
    ]
    assert res.stderr == ""


def test_several_words_are_one_quoted_command_line(sandbox: Sandbox) -> None:
    res = sandbox.launch("--", "sh", "-c", 'echo "[$1]"', "x", "two words; echo injected")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "[two words; echo injected]\n"


def test_missing_cli_without_install_command_fails_loudly(sandbox: Sandbox) -> None:
    marker = sandbox.home / "ran"
    res = sandbox.launch("--require", "fsa-missing-cli", "--", f"touch {marker}")
    assert res.returncode == EXIT_CONTRACT_UNMET == 7
    assert res.stderr.splitlines() == ["fsagent: required CLI not on PATH: fsa-missing-cli"]
    assert res.stdout == ""
    assert not marker.exists()


def test_missing_node_is_fatal_and_named(tmp_path: Path) -> None:
    box = Sandbox(tmp_path, node=False)
    res = box.launch("--", "true")
    assert res.returncode == 7
    assert res.stderr.splitlines() == ["fsagent: required CLI not on PATH: node"]


def test_failed_install_is_logged_then_the_launch_fails_loudly(sandbox: Sandbox) -> None:
    log = sandbox.home / "install.log"
    marker = sandbox.home / "ran"
    install = f"echo attempt >> {log}; echo 'no network' >&2; exit 3"
    res = sandbox.launch("--require", f"fsa-cli={install}", "--", f"touch {marker}")
    assert res.returncode == 7
    assert log.read_text() == "attempt\n"  # run exactly once
    lines = res.stderr.splitlines()
    assert lines[0] == "fsagent launch: fsa-cli is not on PATH; running its install command"
    assert lines[1] == "no network"
    assert "WARNING" in lines[2] and "install command for fsa-cli failed with exit 3" in lines[2]
    assert lines[3:] == ["fsagent: required CLI not on PATH: fsa-cli"]
    assert res.stdout == "" and not marker.exists()


def test_install_that_succeeds_then_launches(sandbox: Sandbox) -> None:
    log = sandbox.home / "install.log"
    cli = sandbox.bin / "fsa-cli"
    install = (
        f"echo attempt >> {log}; echo installing; "
        f"printf '#!/bin/sh\\necho installed cli\\n' > {cli}; chmod 755 {cli}"
    )
    res = sandbox.launch("--require", f"fsa-cli={install}", "--", "fsa-cli")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "installed cli\n"  # the install's output went to stderr
    assert "installing" in res.stderr.splitlines()
    assert log.read_text() == "attempt\n"
    # Present now: the install command is not run again.
    again = sandbox.launch("--require", f"fsa-cli={install}", "--", "fsa-cli")
    assert again.returncode == 0 and again.stderr == ""
    assert log.read_text() == "attempt\n"


def test_shell_is_sh_unless_bash_is_asked_for(sandbox: Sandbox) -> None:
    script = 'echo "bash=${BASH_VERSION:-none}"'
    as_sh = sandbox.launch("--", script)
    assert as_sh.returncode == 0 and as_sh.stdout == "bash=none\n", as_sh.stderr
    as_bash = sandbox.launch("--shell", "bash", "--", script)
    assert as_bash.returncode == 0, as_bash.stderr
    assert as_bash.stdout.startswith("bash=") and as_bash.stdout != "bash=none\n"
    # bash is then a required CLI like any other.
    os.unlink(sandbox.bin / "bash")
    missing = sandbox.launch("--shell", "bash", "--", script)
    assert missing.returncode == 7
    assert missing.stderr.splitlines() == ["fsagent: required CLI not on PATH: bash"]


def test_bad_requirement_and_missing_env_file_are_one_line_errors(sandbox: Sandbox) -> None:
    bad = sandbox.launch("--require", "x;rm -rf /", "--", "true")
    assert bad.returncode == 2 and "is not a command name" in bad.stderr
    sandbox.env_file.unlink()
    res = sandbox.launch("--", "true")
    assert res.returncode == 7
    assert res.stderr.splitlines() == [
        f"fsagent: no env file at {sandbox.env_file} (is fsagent up running? else pass --env-file)"
    ]
    none = sandbox.launch()
    assert none.returncode == 1 and "nothing to launch" in none.stderr


def profile_hashes(home: Path) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PROFILE_FILES:
        p = home / name
        out[name] = hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None
    fish = home / ".config" / "fish"
    if fish.exists():  # anything new anywhere under fish's config counts too
        for p in sorted(fish.rglob("*")):
            if p.is_file():
                out[str(p.relative_to(home))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_no_profile_or_rc_file_appears_or_changes(sandbox: Sandbox) -> None:
    # nvm as it is usually installed: a script the profiles source. Sourcing
    # it (or any profile) leaves a mark.
    sourced = sandbox.home / "nvm-was-sourced"
    (sandbox.home / ".nvm").mkdir()
    (sandbox.home / ".nvm" / "nvm.sh").write_text(f"export NVM_DIR=$HOME/.nvm\ntouch {sourced}\n")
    load_nvm = '[ -s "$HOME/.nvm/nvm.sh" ] && . "$HOME/.nvm/nvm.sh"\n'
    (sandbox.home / ".profile").write_text("export FROM_PROFILE=1\n" + load_nvm)
    (sandbox.home / ".bashrc").write_text("export FROM_BASHRC=1\n" + load_nvm)
    (sandbox.home / ".config" / "fish").mkdir(parents=True)
    (sandbox.home / ".config" / "fish" / "config.fish").write_text("set -x FROM_FISH 1\n")
    before = profile_hashes(sandbox.home)
    assert [k for k, v in before.items() if v is None]  # absent ones are in the set
    cli = sandbox.bin / "fsa-cli"
    install = f"printf '#!/bin/sh\\necho ok\\n' > {cli}; chmod 755 {cli}"
    script = 'fsa-cli; echo "profile=${FROM_PROFILE:-} bashrc=${FROM_BASHRC:-} nvm=${NVM_DIR:-}"'
    for shell in ("sh", "bash"):
        res = sandbox.launch("--shell", shell, "--require", f"fsa-cli={install}", "--", script)
        assert res.returncode == 0, res.stderr
        # Neither profile was read: the shell is not a login or interactive one.
        assert res.stdout == "ok\nprofile= bashrc= nvm=\n"
        cli.unlink()
    missing = sandbox.launch("--require", "fsa-absent", "--", "true")
    assert missing.returncode == 7
    failed = sandbox.launch("--require", "fsa-absent=exit 1", "--", "true")
    assert failed.returncode == 7
    assert profile_hashes(sandbox.home) == before
    assert not sourced.exists()


# --- doctor -----------------------------------------------------------------------


ROW = re.compile(r"(ok|FAIL|skip) +(\S+(?: \S+)?) {2,}(.*)")
"""One line of doctor's output: status, check name (at most two words), detail."""


def doctor(
    box: Sandbox,
    *args: str,
    path: str | None = None,
    tmpdir: str | None = None,
    wrap: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Doctor in the box (run by ``wrap``, if given); the units' configuration
    is the box's (none unless a test writes it), so the machine's /etc/fsagent
    never matters."""
    env = {"PATH": path or f"{box.bin}:/usr/bin:/bin", "HOME": str(box.home), "LANG": "C.UTF-8",
           "TMPDIR": tmpdir or os.environ.get("TMPDIR", "/tmp")}  # fmt: skip
    return subprocess.run(
        [*wrap, sys.executable, "-m", "fsagent.cli", "doctor", "--home", str(box.home),
         "--env-file", str(box.env_file), "--config", str(box.units_config), *args],
        capture_output=True, text=True, cwd=REPO, env=env, check=False, timeout=120,
    )  # fmt: skip


def doctor_checks(res: subprocess.CompletedProcess[str]) -> dict[str, dict[str, str]]:
    assert "Traceback" not in res.stderr, res.stderr
    return {c["name"]: c for c in json.loads(res.stdout)["checks"]}


@pytest.mark.fuse
def test_doctor_healthy_sandbox_without_controller(sandbox: Sandbox) -> None:
    sandbox.add_cli("fsa-cli")
    sandbox.env_file.write_text(f"AGENT_HOME={sandbox.home}/agent\n")
    res = doctor(sandbox, "--require", "fsa-cli", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] is True
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {
        "node": "ok", "fsa-cli": "ok", "sh": "ok", "tar": "ok", "fusermount3": "ok",
        "/dev/fuse": "ok", "mode": "ok", "home": "ok", "cache": "ok", "tmp": "ok",
        "controller": "skip", "bridge": "skip",
    }  # fmt: skip
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["node"]["detail"] == str(sandbox.bin / "node")
    assert checks["mode"]["detail"] == "fuse (/dev/fuse opens and a test mount works)"
    text = doctor(sandbox, "--require", "fsa-cli")
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    assert len(lines) == len(status) and lines[0].split() == [
        "ok",
        "node",
        str(sandbox.bin / "node"),
    ]


NO_FUSE = ("/usr/bin/unshare", "-m", "--propagation", "private", "/bin/sh", "-c",
           '/bin/mount --bind /dev/null /dev/fuse && exec "$0" "$@"')  # fmt: skip
"""Where /dev/fuse is /dev/null: it opens, and no FUSE mount can be made, as
in a container without FUSE (absolute paths: the box's PATH has no mount)."""


@pytest.mark.fuse
def test_doctor_without_fuse_shows_dir_mode_and_why(tmp_path: Path) -> None:
    """In a sandbox where FUSE does not work, doctor says the collections are
    plain directories and why (the test mount failed), and shows the FUSE
    checks as not needed, whatever they find: no fusermount3 is no failure.
    ``--mode fuse`` there fails the mode check, as the mounts would fail."""
    box = Sandbox(tmp_path)  # its PATH has no fusermount3
    box.env_file.write_text(f"AGENT_HOME={box.home}/agent\n")  # no local endpoint to check
    res = doctor(box, "--json", path=str(box.bin), wrap=NO_FUSE)
    assert res.returncode == 0, res.stdout + res.stderr
    checks = doctor_checks(res)
    assert checks["mode"]["status"] == "ok", checks["mode"]
    assert re.fullmatch(r"dir \(a test FUSE mount failed \(.+\)\)", checks["mode"]["detail"])
    assert checks["fusermount3"] == {
        "name": "fusermount3", "status": "skip", "detail": "not on PATH (not needed: dir mode)",
    }  # fmt: skip
    assert checks["/dev/fuse"] == {
        "name": "/dev/fuse", "status": "skip", "detail": "present (not needed: dir mode)",
    }  # fmt: skip
    text = doctor(box, path=str(box.bin), wrap=NO_FUSE)
    assert text.returncode == 0, text.stdout + text.stderr
    rows = {m[2]: (m[1], m[3]) for m in map(ROW.fullmatch, text.stdout.splitlines()) if m}
    assert rows["mode"] == ("ok", checks["mode"]["detail"]), text.stdout
    assert rows["fusermount3"] == ("skip", "not on PATH (not needed: dir mode)")

    res = doctor(box, "--json", "--mode", "fuse", path=str(box.bin), wrap=NO_FUSE)
    assert res.returncode == 6, res.stdout + res.stderr
    checks = doctor_checks(res)
    assert checks["mode"]["status"] == "fail"
    assert checks["mode"]["detail"].startswith("fuse (--mode fuse), but a test FUSE mount failed (")
    assert checks["mode"]["detail"].endswith(
        ": the mounts would fail (--mode auto serves plain directories here)"
    )
    assert checks["fusermount3"] == {
        "name": "fusermount3",
        "status": "fail",
        "detail": "not on PATH",
    }
    assert res.stderr.splitlines() == ["fsagent: 2 check(s) failed: fusermount3, mode"], res.stderr

    # Where FUSE works: --mode dir needs neither; --mode fuse passes its test mount.
    checks = doctor_checks(doctor(box, "--json", "--mode", "dir", path=str(box.bin)))
    assert checks["mode"] == {"name": "mode", "status": "ok", "detail": "dir (--mode dir)"}
    assert checks["fusermount3"]["status"] == checks["/dev/fuse"]["status"] == "skip"
    res = doctor(box, "--json", "--mode", "fuse")
    assert res.returncode == 0, res.stdout + res.stderr
    checks = doctor_checks(res)
    assert checks["mode"] == {"name": "mode", "status": "ok", "detail": "fuse (--mode fuse)"}
    assert checks["fusermount3"]["status"] == checks["/dev/fuse"]["status"] == "ok"


def test_doctor_names_exactly_what_is_broken(tmp_path: Path) -> None:
    box = Sandbox(tmp_path, node=False)
    for tool in ("tar",):
        os.unlink(box.bin / tool)
    box.env_file.write_text(
        f"PAPERCLIP_API_URL=http://127.0.0.1:9\nPAPERCLIP_API_SOCKET={tmp_path}/none.sock\n"
    )
    readonly_home = tmp_path / "ro-home"
    readonly_home.mkdir(mode=0o555)
    res = doctor(
        box, "--home", str(readonly_home), "--require", "fsa-missing",
        "--controller", "http://127.0.0.1:9", "--token-file", str(tmp_path / "no-token"),
        path=str(box.bin),
    )  # fmt: skip
    assert res.returncode == 6, res.stdout + res.stderr
    rows = [ROW.fullmatch(line).groups() for line in res.stdout.splitlines()]  # type: ignore[union-attr]
    failed = {name: detail for status, name, detail in rows if status == "FAIL"}
    expected = {
        "node",
        "fsa-missing",
        "tar",
        "fusermount3",
        "controller",
        "bridge tcp",
        "bridge socket",
    }
    if os.getuid() != 0:  # root may write anywhere
        expected |= {"home", "cache"}
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        expected.add("/dev/fuse")
    assert set(failed) == expected, res.stdout
    assert failed["node"] == "not on PATH"
    assert failed["controller"].startswith(
        "http://127.0.0.1:9 is not usable: cannot read token file"
    )
    assert failed["bridge tcp"] == "http://127.0.0.1:9 does not answer (ConnectError)"
    assert failed["bridge socket"] == f"{tmp_path}/none.sock does not answer (ConnectError)"
    assert {name for status, name, _ in rows if status == "ok"} >= {"sh", "tmp"}
    assert res.stderr.splitlines() == [
        f"fsagent: {len(expected)} check(s) failed: "
        + ", ".join(n for _, n, _ in rows if n in failed)
    ]


def test_doctor_fails_an_unusable_tmpdir_instead_of_skipping_to_another(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    res = doctor(box, "--json", tmpdir=str(not_a_dir))
    assert res.returncode == 6, res.stdout + res.stderr
    checks = doctor_checks(res)
    assert checks["tmp"] == {
        "name": "tmp", "status": "fail", "detail": f"{not_a_dir} is not writable (Not a directory)",
    }  # fmt: skip
    assert res.stderr.startswith("fsagent: ") and "tmp" in res.stderr.splitlines()[-1]

    # The env file's TMPDIR is what launch passes on, so it is the one checked
    # (its PATH is ignored, as by launch: node is still found on the sandbox's).
    missing = tmp_path / "no-such-dir"
    box.env_file.write_text(f"TMPDIR={missing}\nPATH=/nonexistent\n")
    checks = doctor_checks(doctor(box, "--json"))
    assert checks["tmp"]["status"] == "fail", checks["tmp"]
    assert checks["tmp"]["detail"] == f"{missing} is not writable (No such file or directory)"
    assert checks["node"] == {"name": "node", "status": "ok", "detail": str(box.bin / "node")}

    usable = tmp_path / "tmp"
    usable.mkdir()
    box.env_file.write_text(f"TMPDIR={usable}\n")
    checks = doctor_checks(doctor(box, "--json", tmpdir=str(not_a_dir)))
    assert checks["tmp"] == {"name": "tmp", "status": "ok", "detail": f"{usable} is writable"}
    assert list(usable.iterdir()) == []  # the probe file is gone again


def test_doctor_fails_sh_and_bash_when_they_are_not_on_path(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    res = doctor(box, "--shell", "bash", "--json", path=str(box.bin))
    names = [c["name"] for c in json.loads(res.stdout)["checks"]]
    assert names[:4] == ["node", "bash", "sh", "tar"], names
    checks = doctor_checks(res)
    assert checks["bash"] == {"name": "bash", "status": "ok", "detail": str(box.bin / "bash")}
    assert checks["sh"] == {"name": "sh", "status": "ok", "detail": str(box.bin / "sh")}
    assert "bash" not in doctor_checks(doctor(box, "--json", path=str(box.bin)))

    os.unlink(box.bin / "bash")
    res = doctor(box, "--shell", "bash", "--json", path=str(box.bin))
    assert res.returncode == 6
    checks = doctor_checks(res)
    assert checks["bash"]["status"] == "fail" and checks["bash"]["detail"] == "not on PATH"
    assert checks["node"]["status"] == "ok"

    os.unlink(box.bin / "sh")
    res = doctor(box, "--json", path=str(box.bin))
    assert res.returncode == 6
    checks = doctor_checks(res)
    assert checks["sh"] == {
        "name": "sh", "status": "fail",
        "detail": "not on PATH (every probe and command runs with sh -c)",
    }  # fmt: skip
    assert checks["node"]["detail"] == "cannot probe: sh is not on PATH"


def test_doctor_takes_the_controller_from_the_units_configuration(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    checks = doctor_checks(doctor(box, "--json"))
    assert checks["controller"] == {
        "name": "controller", "status": "skip",
        "detail": f"no --controller given, and none in {box.units_config}",
    }  # fmt: skip
    box.units_config.write_text(
        f'FSAGENT_CONTROLLER="http://127.0.0.1:9"\nFSAGENT_TOKEN_FILE="{tmp_path}/no-token"\n'
    )
    checks = doctor_checks(doctor(box, "--json"))
    assert checks["controller"]["status"] == "fail"
    assert checks["controller"]["detail"].startswith(
        "http://127.0.0.1:9 is not usable: cannot read token file"
    ), checks["controller"]
    assert f"{tmp_path}/no-token" in checks["controller"]["detail"]
    # The flags win over the configuration.
    flagged = doctor_checks(doctor(box, "--json", "--controller", "http://127.0.0.1:7",
                                   "--token-file", str(tmp_path / "other")))  # fmt: skip
    assert flagged["controller"]["detail"].startswith("http://127.0.0.1:7 is not usable")
