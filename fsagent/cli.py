"""``fsagent``: mount work folders in a sandbox, report their state, check the runtime.

Commands::

    fsagent mount SCOPE MOUNTPOINT --controller URL --token-file F [--state-dir D]
                  [--foreground] [--allow-other] [--prefetch N] [--checkpoint-interval S]
                  [--spin-us N] [--mode auto|fuse|dir] [--ready-file F | --ready-fd N]
    fsagent up --home DIR --controller URL --token-file F [--state-root D] [--env-file F]
               [--mode auto|fuse|dir] [--restart-delay S]
    fsagent flush [SCOPE] [--state-dir D] [--final] [--json]
    fsagent status [--state-dir D ...] [--json]
    fsagent changes --state-dir D [--json]
    fsagent bridge --controller URL --token-file F [--socket S] [--port N] [--env-file F]
    fsagent launch [--require CMD[=INSTALL_COMMAND]]... [--shell sh|bash] [--home DIR]
                   [--env-file F] -- COMMAND...
    fsagent doctor [--home DIR] [--require CMD]... [--shell sh|bash] [--env-file F]
                   [--controller URL --token-file F | --config F] [--json]
    fsagent repos prepare|watch|checkpoint [NAME] --home DIR --controller URL --token-file F
    fsagent repos status [--home DIR] [--json]

``--mode``: ``fuse`` mounts, ``dir`` serves a plain directory checkpointed by
scanning (where FUSE is unavailable), ``auto`` (default) decides with a test
mount (fsagent.fuse.probe).

``--controller`` takes the controller's base URL, or ``dir:PATH`` to serve a
run from a local directory (tests, benchmarks; see DirectoryBridgeClient).

Exit codes: 0 ok, 1 unexpected error, 2 usage, 3 state dir corrupt/foreign/
in use/bound elsewhere/served in the other mode, 4 controller unreachable or
refusing (including a failed save: the state dir keeps every change; not
the agent folder's save refused over a storage limit, by flush or at stop, a
warning), 5 mount
failed (or a dir-mode directory cannot be used), 6 doctor found problems, 7
the sandbox does not meet the runtime contract (launch: a required CLI or the
env file is missing), 8 ``repos prepare`` could not clone or restore a
checkout (or its setup failed). ``launch`` otherwise exits with
COMMAND's own status. A plain ``http://`` controller URL that is not a loopback
address is refused with exit 2 unless ``--insecure-http`` is given.
"""

from __future__ import annotations

import sys

from fsagent import earlystop

earlystop.install(sys.argv)  # before the imports below: see fsagent.earlystop

import argparse
import importlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import logs
from common.limits import CHECKPOINT_INTERVAL_SECONDS, SCOPES
from fsagent import SPIN_US
from fsagent.bridge import tls
from fsagent.control import protocol as control
from fsagent.errors import EXIT_SAVE_FAILED, FsagentError
from fsagent.fuse.probe import MODES, default_mode
from fsagent.state.statedir import MARKER, default_state_root

if TYPE_CHECKING:
    from fsagent.state.store import Change, Store

log = logging.getLogger("fsagent")

# Start-up cost: trio, httpx and the FUSE bindings take most of half a second
# to import on a loaded sandbox, longer than a flush of a few files takes.
# ``flush``, ``status`` and ``changes`` need none of them, so the commands
# that do are imported only when they run (and their parsers only when
# asked for: OWN_PARSERS).

OWN_PARSERS = {"doctor": "fsagent.commands.doctor", "bridge": "fsagent.localapi.endpoint",
               "launch": "fsagent.commands.launch", "repos": "fsagent.repos.checkouts"}  # fmt: skip
"""Commands whose arguments their own module defines (``add_parser``)."""


def cmd_mount(args: argparse.Namespace) -> int:
    from fsagent.commands.daemon import cmd_mount as run

    return run(args)


def cmd_up(args: argparse.Namespace) -> int:
    from fsagent.commands.up import cmd_up as run

    return run(args)


def _open_store(state_dir: Path) -> Store:
    from fsagent.state.store import Store

    return Store.open(state_dir, readonly=True)


# --- status / changes ----------------------------------------------------------


def _state_dirs(args: argparse.Namespace) -> list[Path]:
    if args.state_dir:
        return [Path(d) for d in args.state_dir]
    root = default_state_root()
    return [
        root / s for s in SCOPES if (root / s / MARKER).exists() or _unbound(root / s) is not None
    ]


def _unbound(state_dir: Path) -> dict[str, Any] | None:
    """What the daemon of an unbound plain-directory collection serves, from
    the record it keeps beside the state dir while it runs (fsagent.dirmode.serve)."""
    record = state_dir.with_name(state_dir.name + ".unbound")
    try:
        info: dict[str, Any] = json.loads(record.read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info


def unbound_status(state_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """An unbound collection's row: nothing to save, served read-only, and
    the warning when root's writes are not stopped."""
    return {
        "stateDir": str(state_dir), "scope": info.get("scope"), "companyId": None,
        "ownerId": None, "unbound": True,
        "mode": {"mode": "dir", "reason": info.get("reason"), "path": info.get("path")},
        "unsavedChanges": 0, "unsavedFiles": 0, "unsavedBytes": 0, "baseline": 0,
        "state": "serving", "mountpoint": info.get("path"), "pid": info.get("pid"),
        "lastSave": None, "lastError": None, "pendingCheckpoint": None, "scan": None,
        "live": None, "warning": info.get("warning"),
    }  # fmt: skip


def _daemon(state_dir: Path) -> dict[str, Any] | None:
    try:
        info: dict[str, Any] = json.loads((state_dir / "daemon.json").read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return info


def change_set(state_dir: Path) -> tuple[list[Change], dict[str, Any] | None]:
    """A state dir's change set since the baseline, read-only, and what serves
    it: ``{"mode", "reason", "path"}`` (None before a daemon of this version
    served it). A plain-directory collection's change set comes from a scan
    of its directory, whose refusals are under ``mode["scan"]``."""
    store = _open_store(state_dir)
    try:
        mode = store.dir.mode_record()
        if mode is None or mode.get("mode") != "dir":
            return store.changes_since_baseline(), mode
    finally:
        store.close()
    from fsagent.dirmode.fs import open_root
    from fsagent.dirmode.scan import report
    from fsagent.dirmode.store import DirStore

    dir_store = DirStore.open(state_dir, readonly=True)
    try:
        try:
            root_fd = open_root(Path(mode["path"]))
        except OSError as exc:
            return [], {**mode, "scan": {"error": f"{mode['path']}: {exc.strerror}"}}
        try:
            dir_store.attach(root_fd)
            scan = dir_store.rescan(record=False)
            return dir_store.changes_since_baseline(), {**mode, "scan": report(scan)}
        finally:
            os.close(root_fd)
    finally:
        dir_store.close()


def collection_status(state_dir: Path) -> dict[str, Any]:
    if not (state_dir / MARKER).exists():
        unbound = _unbound(state_dir)
        if unbound is not None:
            return unbound_status(state_dir, unbound)
    changes, mode = change_set(state_dir)
    store = _open_store(state_dir)
    try:
        binding = store.dir.binding()
        baseline = store.journal.baseline()
        saves = store.journal.save_status()
        pending = store.journal.pending_checkpoint()
    finally:
        store.close()
    daemon = _daemon(state_dir)
    files = [c for c in changes if c.action in ("upload", "reference")]
    served = mode["mode"] if mode else "fuse"
    scan = (mode or {}).pop("scan", None)
    return {
        "stateDir": str(state_dir),
        "scope": binding.scope if binding else None,
        "companyId": binding.company_id if binding else None,
        "ownerId": binding.owner_id if binding else None,
        "mode": mode,
        "unsavedChanges": len(changes),
        "unsavedFiles": len(files),
        "unsavedBytes": sum(c.size or 0 for c in files if c.action == "upload"),
        "baseline": baseline.high_water,
        "state": ("mounted" if served == "fuse" else "serving") if daemon else "stopped",
        "mountpoint": daemon["mountpoint"] if daemon else None,
        "pid": daemon["pid"] if daemon else None,
        "lastSave": saves.get("lastSave"),
        "lastError": saves.get("lastError"),
        "pendingCheckpoint": pending.get("operationId") if pending else None,
        "scan": scan,
        "live": _live_stats(state_dir) if daemon else None,
        "unbound": False,
        "warning": None,
    }


def _live_stats(state_dir: Path) -> dict[str, Any] | None:
    """The running daemon's FUSE figures, queue depth and last checkpoint; None if it
    does not answer within a second (busy or an unbound, read-only mount)."""
    try:
        reply = control.request(state_dir / "control.sock", {"cmd": "stats"}, 1.0)
    except (OSError, ValueError):
        return None
    reply.pop("ok", None)
    return reply


def cmd_status(args: argparse.Namespace) -> int:
    dirs = _state_dirs(args)
    rows = [collection_status(d) for d in dirs]
    if args.json:
        print(json.dumps({"collections": rows}, indent=2))
        return 0
    if not rows:
        print(f"no fsagent state under {default_state_root()}")
    for r in rows:
        where = f" at {r['mountpoint']} (pid {r['pid']})" if r["mountpoint"] else ""
        if r["unbound"]:
            print(
                f"{r['scope'] or '?'}: unbound (nothing is saved), read-only, {r['state']}{where}"
            )
        else:
            print(
                f"{r['scope'] or '?'}: owner {r['ownerId'] or '-'}, {r['unsavedChanges']} "
                f"unsaved change(s), {r['state']}{where}"
            )
        if r["mode"]:
            print(f"  mode: {r['mode']['mode']} ({r['mode']['reason']})")
        if r["warning"]:
            print(f"  warning: {r['warning']}")
        _print_scan(r["scan"])
        if r["lastSave"]:
            saved_at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["lastSave"]["at"]))
            print(f"  last save: {saved_at} ({r['lastSave']['entries']} change(s))")
        if r["lastError"]:
            print(f"  last error: {r['lastError']['message']}")
    return 0


def _print_scan(scan: dict[str, Any] | None, limit: int = 20) -> None:
    """A plain-directory collection's refused paths, by name, and what waits."""
    if not scan:
        return
    if "error" in scan:
        print(f"  directory: {scan['error']}")
        return
    if scan["refusedCount"]:
        print(f"  refused (never saved, never followed): {scan['refusedCount']} path(s)")
        for item in scan["refused"][:limit]:
            print(f"    {item['path']}: {item['reason']}")
        if scan["refusedCount"] > limit:
            print(f"    ... {scan['refusedCount'] - limit} more (fsagent status --json)")
    if scan["retryingCount"]:
        print(f"  changing while read, saved later: {', '.join(scan['retrying'][:limit])}")


def cmd_release(args: argparse.Namespace) -> int:
    """Give back mountpoint directories fsagent guarded (fsagent.mountguard):
    their immutable flag cleared and the owner's write bit back. A directory
    something is still mounted on is refused: its guard is what keeps a
    write from vanishing under the mount."""
    from fsagent.mountguard import release

    for name in args.directories:
        path = Path(name)
        if os.path.ismount(path):
            raise FsagentError(f"{path} is still mounted; stop its daemon first")
        try:
            release(path)
        except OSError as exc:
            raise FsagentError(f"cannot release {path}: {exc.strerror}") from None
    return 0


def cmd_changes(args: argparse.Namespace) -> int:
    changes, _ = change_set(Path(args.state_dir))
    if args.json:
        out = [
            {
                "path": c.path,
                "action": c.action,
                "seq": c.seq,
                "inode": c.inode,
                "digest": c.digest,
                "size": c.size,
                "executable": c.executable,
                "generation": c.generation,
                "baseVersion": c.base.version if c.base else None,
            }
            for c in changes
        ]
        print(json.dumps({"changes": out}, indent=2))
    else:
        for c in changes:
            print(f"{c.action:9} {c.path}")
    return 0


# --- flush ---------------------------------------------------------------------


def cmd_flush(args: argparse.Namespace) -> int:
    """Ask the running daemon for a checkpoint now (or the final one) and print the receipt."""
    state_dir = Path(args.state_dir) if args.state_dir else default_state_root() / args.scope
    sock_path = state_dir / "control.sock"
    if _daemon(state_dir) is None or not sock_path.exists():
        raise FsagentError(f"no running fsagent daemon for {state_dir}")
    reply = control.request(sock_path, {"cmd": "flush", "final": args.final}, args.timeout)
    print(json.dumps(reply) if args.json else _describe_flush(reply))
    return 0 if reply.get("ok") else EXIT_SAVE_FAILED


def _describe_flush(reply: dict[str, Any]) -> str:
    if not reply.get("ok"):
        return f"save failed: {reply.get('error')}"
    if reply.get("final") and reply.get("warning"):
        return f"final save refused, a warning of the run: {reply['warning']}; unmounting"
    if reply.get("code") == control.LIMIT_CODE:
        # Not a failed save (exit 0, as at stop): the agent removes or shrinks
        # files and the next save takes the folder's changes.
        limits = ", ".join(
            f"{d.get('limit')} {d.get('value')} > {d.get('max')}"
            + (f" ({d['path']})" if d.get("path") else "")
            for d in reply.get("details") or []
        )
        return (
            f"not saved ({control.LIMIT_CODE}{': ' + limits if limits else ''}),"
            f" a warning of the run: {reply.get('warning')}; remove or shrink files"
            " and flush again"
        )
    if reply.get("final"):
        return "final save done; unmounting"
    result = reply.get("result") or {}
    receipt = result.get("receipt") or {}
    if not result.get("operationId"):
        return "nothing to save"
    return (
        f"saved {result.get('entries')} change(s) as {result.get('operationId')}"
        f" at {receipt.get('savedAt')}"
        + (
            f"; {result['skippedTorn']} file(s) still being written stay dirty"
            if result.get("skippedTorn")
            else ""
        )
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (``command`` given) one whose subcommands defined in
    other modules are left out unless ``command`` is one of them."""
    parser = argparse.ArgumentParser(
        prog="fsagent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="cmd", required=True)

    def controller_opts(p: argparse.ArgumentParser, required: bool = True) -> None:
        p.add_argument("--controller", required=required, help="controller URL or dir:PATH")
        p.add_argument("--token-file", help="file holding the run token")
        p.add_argument(
            "--retry-deadline",
            type=float,
            default=60.0,
            help="seconds to keep retrying transient controller errors",
        )
        tls.add_arguments(p)
        logs.add_argument(p)
        p.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO"
        )

    def mode_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--mode",
            choices=MODES,
            default=default_mode(),
            help="fuse: a FUSE mount; dir: a plain directory checkpointed by scanning; "
            "auto (default, or $FSAGENT_MODE): fuse when /dev/fuse opens and a test mount "
            "works, else dir",
        )
        # Set by `fsagent up`, which decides once for all four collections.
        p.add_argument("--mode-reason", help=argparse.SUPPRESS)

    m = sub.add_parser("mount", help="mount one collection")
    m.add_argument("scope", help="task, agent, user or project")
    m.add_argument("mountpoint")
    controller_opts(m)
    m.add_argument("--state-dir", help="default ~/.local/state/fsagent/SCOPE")
    m.add_argument("--foreground", action="store_true", help="stay attached (systemd, tests)")
    m.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users (the agent) use the mount; needs user_allow_other "
        "in /etc/fuse.conf when not root",
    )
    m.add_argument(
        "--prefetch",
        type=int,
        default=4,
        help="background object fetches in parallel (0 = fetch on open only)",
    )
    m.add_argument(
        "--checkpoint-interval",
        type=float,
        default=CHECKPOINT_INTERVAL_SECONDS,
        help="seconds between checkpoints (default %(default)s)",
    )
    m.add_argument(
        "--spin-us",
        type=int,
        default=SPIN_US,
        help="after a request keep polling for the next one up to this long before "
        "sleeping (adapts to the request rate; 0 = off); saves a vCPU wake-up per "
        "request on virtual machines",
    )
    mode_option(m)
    m.add_argument(
        "--ready-file",
        help="write {pid, mode, path} as JSON to this file once the collection is served "
        "(dir mode; a FUSE mount is ready once mounted)",
    )
    m.add_argument(
        "--ready-fd",
        type=control.inherited_fd,
        help="instead of --ready-file, write that record as one JSON line to this inherited "
        "file descriptor and close it (how fsagent up hears of it: no disk space needed)",
    )
    # Set by `fsagent up` and a detaching `mount` on a terminal: they show the
    # hydration progress written there (fsagent.dirmode.progress).
    m.add_argument("--progress-file", help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    f = sub.add_parser("flush", help="save now (or, with --final, save and unmount)")
    f.add_argument("scope", nargs="?", default="task", help="collection (default task)")
    f.add_argument("--state-dir", help="default ~/.local/state/fsagent/SCOPE")
    f.add_argument("--final", action="store_true", help="final save, then unmount")
    f.add_argument("--timeout", type=float, default=600.0)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_flush)

    u = sub.add_parser("up", help="mount all four collections under --home and write the env file")
    u.add_argument("--home", required=True)
    controller_opts(u)
    u.add_argument("--state-root", help="default ~/.local/state/fsagent")
    u.add_argument("--env-file", help="default STATE_ROOT/env")
    u.add_argument("--allow-other", action="store_true")
    u.add_argument("--prefetch", type=int, default=4)
    u.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds each process gets to serve after it starts or restarts (default %(default)s)",
    )
    u.add_argument("--checkpoint-interval", type=float, default=CHECKPOINT_INTERVAL_SECONDS)
    u.add_argument(
        "--restart-delay",
        type=float,
        default=1.0,  # fsagent.commands.up.RESTART_FIRST_DELAY (not imported here: startup time)
        help="seconds before restarting a process that died, doubling on each restart "
        "up to 30 (default %(default)g)",
    )
    u.add_argument("--spin-us", type=int, default=SPIN_US)
    u.add_argument(
        "--bridge-port", type=int, default=0, help="local API endpoint port (default: any free one)"
    )
    u.add_argument(
        "--bridge-socket", help="local API endpoint socket (default STATE_ROOT/run/api.sock)"
    )
    mode_option(u)
    u.set_defaults(func=cmd_up)

    s = sub.add_parser("status", help="bound owner, unsaved changes and state per collection")
    s.add_argument("--state-dir", action="append")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    r = sub.add_parser(
        "release", help="give back stopped mountpoints' directories (writable, not immutable)"
    )
    r.add_argument("directories", nargs="+")
    r.set_defaults(func=cmd_release)

    c = sub.add_parser("changes", help="list the change set since the baseline")
    c.add_argument("--state-dir", required=True)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_changes)

    for name, module in OWN_PARSERS.items():
        if command is None or command == name:
            add = importlib.import_module(module).add_parser
            if name in ("doctor", "repos"):
                add(sub, controller_opts)
            else:
                add(sub)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names, when it is a known one (only ``-v`` may come first)."""
    for arg in argv:
        if arg in ("-v", "--verbose"):
            continue
        known = {"mount", "flush", "up", "status", "changes", "release", *OWN_PARSERS}
        return arg if arg in known else None
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser(_command_of(argv)).parse_args(argv)
    args.argv = list(argv)
    logs.configure(
        getattr(args, "log_format", None), logging.INFO if args.verbose else logging.WARNING
    )
    try:
        code: int = args.func(args)
        return code
    except FsagentError as exc:
        print(f"fsagent: {exc}", file=sys.stderr)
        return exc.exit_code
    except BaseExceptionGroup as group:
        # trio nurseries wrap errors in groups; report a lone fsagent error plainly.
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], FsagentError):
            err = group.exceptions[0]
            print(f"fsagent: {err}", file=sys.stderr)
            return err.exit_code
        raise


if __name__ == "__main__":
    sys.exit(main())
