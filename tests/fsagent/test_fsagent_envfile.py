"""The agent's env file (fsagent/commands/envfile.py) reads back as written by every
reader it has: POSIX sh (``set -a; . FILE``, dash and bash), fsagent's own
reader, the sandbox image's /etc/profile.d/fsagent.sh (which decodes it
without running it) and systemd, whose documented ``EnvironmentFile=`` rules
the reader implements and whose own parser (the environment.d generator, the
same code) is asked where it is installed. Paths with spaces, quotes,
backslashes, ``$`` and backquotes included; the packaging scripts' bash
quoting writes the same bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Container, Iterator
from pathlib import Path

import pytest

from fsagent.commands.envfile import (
    UnwritableEnv,
    format_env,
    parse_env,
    quote_value,
    read_env_file,
    write_env_file,
)
from tests.support.constants import REPO
from tests.support.tmp import private_tmpdir

HOME = '/home/agent\'s "dir" x'
VALUES = {
    "AGENT_HOME": f"{HOME}/agent",
    "PAPERCLIP_TASK_DIR": f"{HOME}/task",
    "SPECIAL": "a\\b \\\\ $HOME ${X} `id` $(id) #not a comment ;nor this *?[a] ~ & | < > \\",
    "BLANKS": "  leading and trailing  ",
    "TAB_CR": "tab\there\rcarriage",
    "EMPTY": "",
    "QUOTES": "'single' \"double\" '\"'",
    "UNICODE": "/home/zoë/ünïcödé ✓",
    "BACKSLASH_N": "not\\na newline",
}
GENERATOR = Path("/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator")
PROFILE = REPO / "packaging" / "sandbox-image" / "profile-fsagent.sh"
ENV_QUOTE = REPO / "packaging" / "env-quote.sh"


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = private_tmpdir("fsa-env-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def env0(out: bytes) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in out.decode().split("\0") if item)
    return {k: v for k, v in pairs}


def sourced(shell: list[str], env_file: Path) -> dict[str, str]:
    """What ``set -a; . FILE`` exports in ``shell``."""
    out = subprocess.run(
        [*shell, "-c", 'set -a; . "$1"; set +a; exec env -0', "sh", str(env_file)],
        capture_output=True, check=True, env={"PATH": os.environ["PATH"]},
    ).stdout  # fmt: skip
    return env0(out)


def bash_quote(function: str, value: str) -> str:
    out = subprocess.run(
        ["bash", "-c", f'. "$1" && {function} "$2"', "bash", str(ENV_QUOTE), value],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    return out.decode()


def profile_login(workdir: Path, env_file: Path, shell: str = "dash") -> dict[str, str]:
    """What /etc/profile.d/fsagent.sh, as build-rootfs.sh writes it for
    ``env_file``, exports in a login shell's ``.``."""
    script = workdir / "fsagent.sh"
    header = f"fsagent_run_env={bash_quote('sh_quote', str(env_file))}\n"
    script.write_text(header + PROFILE.read_text())
    out = subprocess.run(
        [shell, "-c", '. "$1"; set | grep -c "^fsagent_" >&2 || true; exec env -0', "sh",
         str(script)],
        capture_output=True, check=True, env={"PATH": os.environ["PATH"]}, cwd=workdir,
    )  # fmt: skip
    assert out.stderr.strip() == b"0", out.stderr  # no helper variable or function is left
    return env0(out.stdout)


def mine(found: dict[str, str], names: Container[str]) -> dict[str, str]:
    """Only the variables named (a shell adds its own, PWD and the like)."""
    return {k: v for k, v in found.items() if k in names}


def test_every_reader_reads_back_what_was_written(workdir: Path) -> None:
    env_file = workdir / "dir with spaces 'and quotes'" / "env"
    write_env_file(env_file, VALUES)
    assert read_env_file(env_file) == VALUES
    for shell in (["dash"], ["bash", "--posix"], ["bash"]):
        assert mine(sourced(shell, env_file), VALUES) == VALUES, shell
    for shell in ("dash", "bash"):
        assert mine(profile_login(workdir, env_file, shell), VALUES) == VALUES, shell
    # The packaging scripts' quoting writes the same bytes.
    for name, value in VALUES.items():
        assert bash_quote("env_quote", value) == quote_value(name, value), name


def test_the_profile_script_decodes_and_never_runs_the_file(workdir: Path) -> None:
    """A root login shell reads the agent's env file through this script: no
    line of it may run, whatever the agent wrote there."""
    marker = workdir / "ran"
    env_file = workdir / "env"
    env_file.write_text(
        f'A="$(touch {marker})"\n'
        f"B=$(touch {marker})\n"
        f"touch {marker}\n"
        f"C=`touch {marker}`; touch {marker}\n"
        "not a name=1\n"
        "1BAD=x\n"
        "PLAIN=old style value\n"
        'D="ends with a backslash\\\\"\n'
        "E=no final newline"
    )
    got = profile_login(workdir, env_file)
    assert not marker.exists()
    assert mine(got, {"A", "B", "C", "D", "PLAIN", "E"}) == {
        "A": f"$(touch {marker})",
        "B": f"$(touch {marker})",
        "C": f"`touch {marker}`; touch {marker}",
        "PLAIN": "old style value",
        "D": "ends with a backslash\\",
        "E": "no final newline",
    }
    assert "1BAD" not in got


# systemd.exec(5), "EnvironmentFile=": text and the values systemd reads from it.
SYSTEMD_CASES = [
    ("A=plain value   \n", {"A": "plain value"}),
    ("  B =  spaced\t\n", {"B": "spaced"}),
    ('C=a\\ b\\\\c\\"d\n', {"C": 'a b\\c"d'}),
    ("D=first \\\nsecond\n", {"D": "first second"}),
    ("E='single \\ \"kept\" # ;'\n", {"E": 'single \\ "kept" # ;'}),
    ('F="dq \\" \\\\ \\` \\q"\n', {"F": 'dq " \\ ` \\q'}),
    ('G="multi\nline"\n', {"G": "multi\nline"}),
    ('H="joined" "words"\n', {"H": "joinedwords"}),
    ("# comment=1\n; also=2\n\nI=x # not a comment\n", {"I": "x # not a comment"}),
    ("J=1\nJ=2\n", {"J": "2"}),
    ("K\nL=\nM=last", {"L": "", "M": "last"}),
    ('N="unterminated', {"N": "unterminated"}),
    ("O=a\rP=b\n", {"O": "a", "P": "b"}),
]


@pytest.mark.parametrize(("text", "expected"), SYSTEMD_CASES)
def test_the_reader_follows_systemds_documented_rules(text: str, expected: dict[str, str]) -> None:
    assert parse_env(text) == expected


_C_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}


def generator_values(out: str) -> dict[str, str]:
    """The generator's output: ``KEY=VALUE`` lines, a value double-quoted with
    backslash escapes (C escapes for control characters) when it needs any."""
    found = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            chars, plain, escaped = value[1:-1], [], False
            for c in chars:
                if escaped:
                    plain.append(_C_ESCAPES.get(c, c))
                    escaped = False
                elif c == "\\":
                    escaped = True
                else:
                    plain.append(c)
            value = "".join(plain)
        found[key] = value
    return found


def systemd_reads(workdir: Path, text: str) -> dict[str, str]:
    """The variables systemd's own parser reads from ``text``: the user
    environment generator tokenizes with EnvironmentFile='s code (then it
    expands ``$VAR`` and drops empty values, which EnvironmentFile= does not)."""
    conf = workdir / "xdg" / "environment.d"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "50-fsagent.conf").write_text(text)
    out = subprocess.run(
        [str(GENERATOR)], capture_output=True, check=True,
        env={"XDG_CONFIG_HOME": str(workdir / "xdg")},
    ).stdout  # fmt: skip
    return generator_values(out.decode())


@pytest.mark.skipif(not GENERATOR.exists(), reason="systemd's environment.d generator is absent")
def test_systemd_itself_reads_the_file_as_written(workdir: Path) -> None:
    # Values with a $ or none at all are the documented-rules test's (above):
    # the generator treats them otherwise than EnvironmentFile=.
    plain = {k: v for k, v in VALUES.items() if "$" not in v and v}
    assert len(plain) == len(VALUES) - 2
    assert mine(systemd_reads(workdir, format_env(plain)), plain) == plain
    for text, expected in SYSTEMD_CASES:
        comparable = {k: v for k, v in expected.items() if v}
        assert mine(systemd_reads(workdir, text), comparable) == comparable, text


@pytest.mark.parametrize(
    ("name", "value"),
    [("X", "two\nlines"), ("X", "nul\0byte"), ("X", "not \udce9 utf-8"), ("1X", "v"), ("A B", "v")],
)
def test_what_no_reader_could_read_back_is_refused(workdir: Path, name: str, value: str) -> None:
    env_file = workdir / "env"
    write_env_file(env_file, {"KEPT": "1"})
    with pytest.raises(UnwritableEnv) as exc:
        write_env_file(env_file, {"KEPT": "1", name: value})
    assert exc.value.exit_code == 2
    assert read_env_file(env_file) == {"KEPT": "1"}  # the old file stays whole
    if "\n" in value:
        done = subprocess.run(
            ["bash", "-c", '. "$1" && q="$(env_quote "$2")"', "bash", str(ENV_QUOTE), value],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 1 and "newline" in done.stderr
