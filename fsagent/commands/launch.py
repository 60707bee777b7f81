"""``fsagent launch``: run an agent command under the sandbox runtime contract.

``fsagent launch [--require CMD[=INSTALL_COMMAND]]... [--shell sh|bash] -- COMMAND...``

1. The environment is the sandbox's own (its ``PATH`` untouched) plus the env
   file's variables (``fsagent up`` writes them; ``PATH`` in it is ignored) and
   ``HOME``; the working directory is ``$HOME``.
2. ``node`` and every ``--require`` CLI are probed with
   ``sh -c 'command -v CMD'``. ``node`` is always required: the contract says
   it must be on the PATH, so its absence is fatal like any other required
   CLI's (``--require node=INSTALL`` gives it an install command).
3. An absent CLI with an install command gets that command run once
   (its output goes to stderr). A failed install is logged and is not fatal by
   itself; the probe after it decides.
4. A CLI still absent ends the launch before COMMAND starts: one line on
   stderr naming every missing CLI, exit :data:`EXIT_CONTRACT_UNMET`.
5. COMMAND replaces this process as ``sh -c SCRIPT`` (``bash -c`` only with
   ``--shell bash``), so its exit status and signals are the launch's. One
   word is the script itself; several are joined, each quoted, into one.

Firm rule: nothing here writes a login profile or an rc file, or sources nvm
or anything else into the shell; the owner supplies a ready ``PATH``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsagent.errors import FsagentError
from fsagent.state.store import default_state_root

log = logging.getLogger("fsagent.launch")

CLI_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}")
"""A CLI name probed with ``command -v``: a plain command word, nothing for the shell to expand."""

SHELLS = ("sh", "bash")
PROBE_TIMEOUT = 30.0


class ContractUnmet(FsagentError):
    """The sandbox lacks something the runtime contract requires (a CLI, the env file)."""

    exit_code = 7


EXIT_CONTRACT_UNMET = ContractUnmet.exit_code


@dataclass(frozen=True, slots=True)
class Requirement:
    name: str
    install: str | None = None


def parse_requirement(value: str) -> Requirement:
    """``CMD`` or ``CMD=INSTALL_COMMAND``; argparse reports a bad one as a usage error."""
    name, sep, install = value.partition("=")
    if not CLI_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{name!r} is not a command name")
    if sep and not install.strip():
        raise argparse.ArgumentTypeError(f"empty install command for {name}")
    return Requirement(name, install if sep else None)


def requirements(given: list[Requirement], shell: str) -> list[Requirement]:
    """``node``, the shell, then the given CLIs; one entry per name (an install command wins)."""
    merged: dict[str, Requirement] = {"node": Requirement("node")}
    if shell != "sh":
        merged[shell] = Requirement(shell)
    for req in given:
        if req.name not in merged or req.install is not None:
            merged[req.name] = req
    return list(merged.values())


def launch_env(env_file: Path, home: Path) -> dict[str, str]:
    """The sandbox's environment with the env file's variables and ``HOME`` on top."""
    from fsagent.commands.envfile import read_env_file

    try:
        extra = read_env_file(env_file)
    except FileNotFoundError:
        raise ContractUnmet(
            f"no env file at {env_file} (is fsagent up running? else pass --env-file)"
        ) from None
    except OSError as exc:
        raise ContractUnmet(f"cannot read env file {env_file}: {exc.strerror}") from None
    return sandbox_env(extra, home)


def sandbox_env(extra: dict[str, str], home: Path) -> dict[str, str]:
    """``os.environ`` with the env file's variables (``extra``) and ``HOME`` on
    top: what launched commands and every probe see (``fsagent doctor`` too)."""
    # The sandbox's own PATH resolves every CLI: a PATH in the env file is ignored.
    extra = {k: v for k, v in extra.items() if k != "PATH"}
    return {**os.environ, **extra, "HOME": str(home)}


def probe(name: str, env: dict[str, str], cwd: Path) -> str | None:
    """Where ``sh -c 'command -v NAME'`` finds ``name``, or None."""
    try:
        done = subprocess.run(
            ["sh", "-c", f"command -v {name}"],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            check=False,
        )
    except FileNotFoundError:
        raise ContractUnmet("sh is not on PATH (every probe and command runs with sh -c)") from None
    except subprocess.TimeoutExpired:
        return None
    found = done.stdout.strip()
    return found if done.returncode == 0 and found else None


def run_install(req: Requirement, shell: str, env: dict[str, str], cwd: Path) -> bool:
    """Run ``req``'s install command once, its output on stderr; whether it exited 0."""
    assert req.install is not None
    print(
        f"fsagent launch: {req.name} is not on PATH; running its install command",
        file=sys.stderr,
        flush=True,
    )
    try:
        code = subprocess.run(
            [shell, "-c", req.install],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            check=False,
        ).returncode
    except OSError as exc:
        log.warning("install command for %s could not start: %s", req.name, exc.strerror)
        return False
    if code != 0:
        log.warning("install command for %s failed with exit %d: %s", req.name, code, req.install)
    return code == 0


def ensure_clis(
    reqs: list[Requirement], shell: str, env: dict[str, str], cwd: Path
) -> dict[str, str]:
    """Probe each CLI, install what is absent and has an install command, probe again.

    Returns where each was found; raises :class:`ContractUnmet` naming every CLI
    still absent."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for req in reqs:
        where = probe(req.name, env, cwd)
        if where is None and req.install is not None:
            run_install(req, shell, env, cwd)
            where = probe(req.name, env, cwd)
        if where is None:
            missing.append(req.name)
        else:
            found[req.name] = where
    if missing:
        what = "CLI" if len(missing) == 1 else "CLIs"
        raise ContractUnmet(f"required {what} not on PATH: {', '.join(missing)}")
    return found


def script_of(command: list[str]) -> str:
    """One word is the script; several are one command line, each word quoted."""
    return command[0] if len(command) == 1 else shlex.join(command)


def cmd_launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise FsagentError("nothing to launch: give the command after --")
    home = Path(args.home or os.path.expanduser("~")).absolute()
    if not home.is_dir():
        raise ContractUnmet(f"home directory {home} does not exist")
    env_file = Path(args.env_file) if args.env_file else default_state_root() / "env"
    env = launch_env(env_file, home)
    found = ensure_clis(requirements(args.require, args.shell), args.shell, env, home)
    log.info("launching in %s with %s", home, ", ".join(f"{k}={v}" for k, v in found.items()))
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(home)
    os.execvpe(args.shell, [args.shell, "-c", script_of(command)], env)


def add_parser(sub: Any) -> None:
    la = sub.add_parser(
        "launch",
        help="probe node and the required CLIs, then run COMMAND in $HOME with the env file",
    )
    la.add_argument(
        "--require",
        action="append",
        default=[],
        type=parse_requirement,
        metavar="CMD[=INSTALL_COMMAND]",
        help="a CLI that must be on PATH; INSTALL_COMMAND is run once if it is not",
    )
    la.add_argument(
        "--shell", choices=SHELLS, default="sh", help="run commands with sh -c (default) or bash -c"
    )
    la.add_argument("--home", help="the agent's home (default $HOME)")
    la.add_argument("--env-file", help="default ~/.local/state/fsagent/env")
    la.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    la.set_defaults(func=cmd_launch)
