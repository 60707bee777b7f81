"""``fsagent doctor``: check the sandbox runtime contract, one line per check.

Checks, in order: ``node``, ``bash`` with ``--shell bash``, and each
``--require`` CLI (probed exactly as ``fsagent launch`` probes them: ``sh -c
'command -v CMD'`` in the environment launch gives its command, the sandbox's
own with the env file's variables but not its ``PATH``), ``sh``, ``tar``,
``fusermount3``, ``/dev/fuse`` (a ``skip``, with what was found,
where the collections are plain directories), the ``mode`` (what ``--mode``,
default auto, resolves to here and why, decided as ``fsagent up`` decides:
the modes the state dirs record, else a test FUSE mount; and the mode of
each collection already served; ``--mode fuse`` where the test mount
fails is a ``FAIL``), a writable home, cache
(``$XDG_CACHE_HOME`` or ``~/.cache``) and tmp (``$TMPDIR``, else ``/tmp``: a
file is made there and removed), the controller (reachable, and the run token
accepted; ``--controller`` and ``--token-file``, else ``FSAGENT_CONTROLLER``
and ``FSAGENT_TOKEN_FILE`` from the units' configuration, ``--config``), and
the local API endpoint
(``GET /healthz`` over ``PAPERCLIP_API_URL`` and over
``PAPERCLIP_API_SOCKET``, taken from the env file; skipped when the env file
names no endpoint).

Each line is ``ok``, ``FAIL`` or ``skip``, the check's name and what was found.
Any ``FAIL`` makes the exit status 6. ``--json`` prints
``{"ok": bool, "checks": [{"name", "status", "detail"}]}`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from common.limits import SCOPES
from fsagent.bridge import tls
from fsagent.bridge.client import open_client, read_token
from fsagent.commands.launch import (
    SHELLS,
    ContractUnmet,
    parse_requirement,
    probe,
    requirements,
    sandbox_env,
)
from fsagent.errors import ControllerRefused, DoctorFailed, FsagentError
from fsagent.fuse.probe import MODES, decide_all, default_mode, probe_fuse, recorded_mode
from fsagent.state.store import default_state_root

BRIDGE_TIMEOUT = 5.0
UNITS_CONFIG = Path("/etc/fsagent/fsagent.env")
"""The systemd units' configuration (packaging/install-fsagent.sh writes it)."""
CONTROLLER_RETRY_DEADLINE = 5.0


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # "ok" | "fail" | "skip"
    detail: str


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def fail(name: str, detail: str) -> Check:
    return Check(name, "fail", detail)


def check_cli(name: str, env: dict[str, str], home: Path) -> Check:
    try:
        where = probe(name, env, home if home.is_dir() else Path("/"))
    except ContractUnmet:
        if name == "sh":
            return fail(name, "not on PATH (every probe and command runs with sh -c)")
        return fail(name, "cannot probe: sh is not on PATH")
    return ok(name, where) if where else fail(name, "not on PATH")


def check_writable(name: str, path: Path) -> Check:
    """Writable, or creatable: the nearest existing ancestor is writable and searchable."""
    probe_dir = path
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if os.access(probe_dir, os.W_OK | os.X_OK):
        return ok(name, f"{path} is writable")
    return fail(name, f"{path} is not writable")


def check_tmp(env: dict[str, str]) -> Check:
    """The directory launched commands get for temporary files: ``$TMPDIR``
    (launch passes it on), else ``/tmp``. A file is really made there: unlike
    :func:`tempfile.gettempdir`, which skips to the next candidate, an
    unusable ``$TMPDIR`` is a failure, since the agent's tools would use it."""
    where = Path(env.get("TMPDIR") or "/tmp")
    try:
        fd, name = tempfile.mkstemp(prefix=".fsagent-doctor-", dir=where)
    except OSError as exc:
        return fail("tmp", f"{where} is not writable ({exc.strerror})")
    os.close(fd)
    os.unlink(name)
    return ok("tmp", f"{where} is writable")


def check_fuse() -> Check:
    if not os.path.exists("/dev/fuse"):
        return fail("/dev/fuse", "missing (the sandbox needs the FUSE device)")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return fail("/dev/fuse", "not readable and writable by this user")
    return ok("/dev/fuse", "present")


def check_mode(requested: str, state_root: Path) -> tuple[Check, bool]:
    """The mode ``fsagent up`` would use here and why (as ``up`` decides it,
    following the modes the state dirs under ``state_root`` record), the mode
    of each collection already served; and whether all four are plain
    directories, so that the FUSE checks do not apply."""
    try:
        modes = decide_all(requested, {scope: state_root / scope for scope in SCOPES})
    except FsagentError as exc:
        return fail("mode", str(exc)), False
    if requested == "fuse":
        # up and mount take --mode fuse as given and fail where FUSE does not
        # work: the test mount auto makes says so here, before they do.
        found = probe_fuse()
        if found.mode != "fuse":
            return fail(
                "mode",
                f"fuse (--mode fuse), but {found.reason}: the mounts would fail "
                "(--mode auto serves plain directories here)",
            ), False
    in_use = {}
    for scope in SCOPES:
        recorded = recorded_mode(state_root / scope)
        if recorded is not None:
            in_use[scope] = recorded
    if len({d.mode for d in modes.values()}) == 1:
        # The reason of a collection without a record is the probe's own.
        shown = next((modes[s] for s in SCOPES if s not in in_use), modes[SCOPES[0]])
        detail = f"{shown.mode} ({shown.reason})"
    else:
        detail = "; ".join(f"{s}={modes[s].mode} ({modes[s].reason})" for s in SCOPES)
    if in_use:
        detail += f"; in use: {', '.join(f'{s}={m}' for s, m in in_use.items())}"
    return ok("mode", detail), all(d.mode == "dir" for d in modes.values())


def not_needed(check: Check) -> Check:
    """A FUSE check where every collection is a plain directory: shown, with
    what it found, as a skip (whatever it found, nothing here uses it)."""
    return Check(check.name, "skip", f"{check.detail} (not needed: dir mode)")


def controller_address(args: argparse.Namespace) -> tuple[str | None, str | None, str]:
    """The controller and token file to check: the flags, else what the units'
    configuration names (``FSAGENT_CONTROLLER``, ``FSAGENT_TOKEN_FILE``), and
    where they came from."""
    from fsagent.commands.envfile import read_env_file

    if args.controller:
        return args.controller, args.token_file, "--controller"
    config = Path(args.config) if args.config else UNITS_CONFIG
    try:
        units = read_env_file(config)
    except OSError:
        units = {}
    controller = units.get("FSAGENT_CONTROLLER") or None
    return controller, args.token_file or units.get("FSAGENT_TOKEN_FILE") or None, str(config)


def check_controller(
    controller: str | None,
    token_file: str | None,
    transport: tls.TransportOptions,
    source: str = "--controller",
) -> Check:
    if not controller:
        return Check("controller", "skip", f"no --controller given, and none in {source}")
    try:
        token = read_token(token_file)
        client = open_client(
            controller, token, retry_deadline=CONTROLLER_RETRY_DEADLINE, tls=transport
        )

        async def get_run() -> Any:
            try:
                return await client.get_run()
            finally:
                await client.aclose()

        run = trio.run(get_run)
    except ControllerRefused as exc:
        return fail("controller", f"{controller} refused the run token ({exc.status} {exc.code})")
    except (FsagentError, ValueError) as exc:
        return fail("controller", f"{controller} is not usable: {exc}")
    state = "active" if run.active else "ended"
    return ok("controller", f"{controller} reachable, run {run.run_id} {state}")


def check_bridge(env: dict[str, str], env_file: Path) -> Iterator[Check]:
    url, sock = env.get("PAPERCLIP_API_URL"), env.get("PAPERCLIP_API_SOCKET")
    if not url and not sock:
        named = "names no local endpoint" if env_file.exists() else "does not exist"
        yield Check("bridge", "skip", f"the env file {env_file} {named}")
        return
    for name, where in (("bridge tcp", url), ("bridge socket", sock)):
        if not where:
            yield fail(name, "not named in the env file")
            continue
        transport = httpx.HTTPTransport(uds=sock) if name == "bridge socket" else None
        base = url if name == "bridge tcp" else "http://bridge"
        try:
            with httpx.Client(transport=transport, timeout=BRIDGE_TIMEOUT) as client:
                res = client.get(f"{base}/healthz")
        except httpx.HTTPError as exc:
            yield fail(name, f"{where} does not answer ({exc.__class__.__name__})")
            continue
        if res.status_code == 200:
            yield ok(name, f"{where} answers")
        else:
            yield fail(name, f"{where} answered {res.status_code}")


def run_checks(args: argparse.Namespace) -> list[Check]:
    from fsagent.commands.envfile import read_env_file

    home = Path(args.home or os.path.expanduser("~"))
    env_file = Path(args.env_file) if args.env_file else default_state_root() / "env"
    try:
        file_env = read_env_file(env_file)
    except OSError:
        file_env = {}  # launch would stop here (exit 7); the bridge check says so
    # What `fsagent launch` gives its probes and command.
    env = sandbox_env(file_env, home)
    checks = [check_cli(r.name, env, home) for r in requirements(args.require, args.shell)]
    checks += [check_cli(tool, env, home) for tool in ("sh", "tar")]
    mode, plain = check_mode(args.mode, default_state_root())
    fuse_checks = [check_cli("fusermount3", env, home), check_fuse()]
    if plain:
        fuse_checks = [not_needed(c) for c in fuse_checks]
    checks += [*fuse_checks, mode]
    cache = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
    controller, token_file, source = controller_address(args)
    checks += [
        check_writable("home", home),
        check_writable("cache", cache),
        check_tmp(env),
        check_controller(controller, token_file, tls.options_from(args), source),
    ]
    checks += check_bridge(file_env, env_file)
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    failed = [c for c in checks if c.status == "fail"]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            label = {"ok": "ok", "fail": "FAIL", "skip": "skip"}[c.status]
            print(f"{label:<4}  {c.name:<{width}}  {c.detail}")
    if failed:
        raise DoctorFailed(f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}")
    return 0


def add_parser(sub: Any, controller_opts: Any) -> None:
    d = sub.add_parser("doctor", help="check the sandbox runtime contract")
    d.add_argument("--home", help="the agent's home (default $HOME)")
    d.add_argument(
        "--require",
        action="append",
        default=[],
        type=parse_requirement,
        metavar="CMD",
        help="a CLI the runs use (an =INSTALL_COMMAND part is ignored: doctor installs nothing)",
    )
    d.add_argument("--env-file", help="default ~/.local/state/fsagent/env")
    d.add_argument(
        "--shell", choices=SHELLS, default="sh", help="the shell launch uses (bash is probed too)"
    )
    d.add_argument(
        "--config",
        help=f"the units' configuration (default {UNITS_CONFIG}): its FSAGENT_CONTROLLER and "
        "FSAGENT_TOKEN_FILE are checked when --controller is not given",
    )
    d.add_argument(
        "--mode",
        choices=MODES,
        default=default_mode(),
        help="the mode the collections are served in (default auto, or $FSAGENT_MODE): "
        "with dir, fusermount3 and /dev/fuse are not needed",
    )
    d.add_argument("--json", action="store_true")
    controller_opts(d, required=False)
    d.set_defaults(func=cmd_doctor)
