"""``fsagent repos``: the task's repository checkouts in ``$HOME/repos``.

Commands::

    fsagent repos prepare  --home DIR --controller URL --token-file F [--retry-setup] [--json]
    fsagent repos watch    --home DIR --controller URL --token-file F [--interval S]
    fsagent repos checkpoint [NAME] --home DIR --controller URL --token-file F [--json]
    fsagent repos status   [--home DIR] [--state-root D] [--json]

``prepare`` warms, restores or clones each bound workspace
(:mod:`fsagent.repos.prepare`); ``fsagent up`` runs it before the agent
starts. ``watch`` checkpoints every prepared checkout every ``--interval``
seconds (the collections' 180 s) and once more at SIGTERM/SIGINT
(:mod:`fsagent.repos.save`); ``fsagent up`` starts it beside the mounts,
systemd as ``fsagent-repos.service``. ``checkpoint`` saves now.

At most one repository checkpoint is in flight on a sandbox: savers take an
exclusive ``flock`` on the state root's ``repos`` directory (a lock on a
directory that exists creates no file, so it works on a full disk) for the
duration of one checkpoint.

State (``<state root>/repos/<workspaceId>/``): ``metacache`` (the scan's
metadata cache) and ``status.json`` (state, last save, last error with its
stable code, problems), both optional. A save that did not happen stays in
the status file until a later one succeeds, also when it failed before any
checkout was looked at (the task's repositories could not be listed). The checkouts' own records are in ``<checkout>/.git/fsagent/``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import trio

from common.limits import CHECKPOINT_INTERVAL_SECONDS
from fsagent.bridge.base import BridgeClient, RepoList, RunInfo
from fsagent.bridge.client import client_from_args
from fsagent.errors import ControllerRefused, FsagentError, RepoPrepareFailed, RepoSaveFailed
from fsagent.repos.prepare import (
    BINDING_RECORD,
    PrepareResult,
    bound_checkout,
    prepare_repo,
    setup_state,
    task_identity,
)
from fsagent.repos.save import (
    RepoSaver,
    failure_code,
    failure_record,
    now_iso,
    read_json,
    write_json_quietly,
)
from fsagent.state.statedir import default_state_root

log = logging.getLogger("fsagent.repos")

FINAL_LOCK_WAIT: Final = 30.0
"""At stop, how long the final save waits for a Git lock to be released."""
SAVE_LOCK_WAIT: Final = 600.0


def repos_state_root(state_root: Path) -> Path:
    return state_root / "repos"


def repos_root(home: Path, reposdir: str = "repos") -> Path:
    return home / reposdir


@contextlib.asynccontextmanager
async def save_lock(state_root: Path, wait: float = SAVE_LOCK_WAIT) -> AsyncIterator[None]:
    """Hold the sandbox-wide repository save lock (see the module doc). When
    the directory cannot be made or opened (a full disk before the first
    save), saving goes on without it rather than not at all."""
    where = repos_state_root(state_root)
    fd: int | None = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        log.info("repository save lock unavailable (%s); saving without it", exc)
    try:
        if fd is not None:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    if time.monotonic() > deadline:
                        raise RepoSaveFailed(
                            f"another repository save held {where} for {wait:.0f}s"
                        ) from None
                    await trio.sleep(0.1)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


async def bound_repos(client: BridgeClient) -> RepoList:
    """The task's repositories; none from a controller that has no repository
    routes (404), so a sandbox still starts against it."""
    try:
        return await client.list_repos()
    except ControllerRefused as exc:
        if exc.status != 404:
            raise
        log.info("the controller lists no repositories (%s)", exc)
        return RepoList("repos", [])


# --- prepare ------------------------------------------------------------------


async def prepare_all(
    client: BridgeClient,
    home: Path,
    *,
    retry_setup: bool = False,
    setup_timeout: float | None = None,
) -> tuple[RunInfo, RepoList, list[PrepareResult]]:
    """Prepare every bound workspace, one after another."""
    run = await client.get_run()
    listing = await bound_repos(client)
    root = repos_root(home, listing.repos_dir)
    results = []
    for binding in listing.repos:
        result = await prepare_repo(
            client, run, binding, root, retry_setup=retry_setup, setup_timeout=setup_timeout
        )
        if not result.ok:
            log.warning("repository %s: %s: %s", binding.name, result.mode, result.message)
        results.append(result)
    return run, listing, results


def describe_prepare(result: PrepareResult) -> str:
    line = f"{result.name}: {result.mode} ({result.path}); setup {result.setup}"
    line += f": {result.message}" if result.message else ""
    return line + (_describe_warning(result.warning) if result.warning else "")


def _describe_warning(warning: dict[str, Any]) -> str:
    said = f" (git: {warning['git']})" if warning.get("git") else ""
    return f"; warning [{warning.get('code')}]: {warning.get('message')}{said}"


def cmd_prepare(args: argparse.Namespace) -> int:
    home = Path(args.home).absolute()

    async def main() -> list[PrepareResult]:
        client = client_from_args(args)
        try:
            _, _, results = await prepare_all(
                client, home, retry_setup=args.retry_setup, setup_timeout=args.setup_timeout
            )
            return results
        finally:
            await client.aclose()

    results = trio.run(main)
    if args.json:
        print(json.dumps({"repos": [r.to_json() for r in results]}, indent=2))
    else:
        for r in results:
            print(describe_prepare(r))
    bad = [r for r in results if not r.ok]
    if any(r.mode == "refused" for r in bad):
        return 3
    return RepoPrepareFailed.exit_code if bad else 0


# --- saving -------------------------------------------------------------------


def mark_status_files(
    state_root: Path,
    state: str,
    message: str,
    code: str,
    skip: Collection[str] = (),
    *,
    checkouts: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Show a save that did not happen in status files of the state root
    (written quietly: nothing to do on a full disk): each says ``state``
    (``failed`` or ``fenced``) with ``message`` and ``code`` as its last
    error, except the workspaces in ``skip``, whose savers write their own,
    and a status already ``fenced`` (that run can never save again).

    Without ``checkouts``, every status file of the state root (fencing: the
    run's token is refused, whatever the checkout). With ``checkouts``
    (workspace id -> ``name`` and ``checkout``: this run's prepared
    checkouts), only theirs, and one that has no status file yet gets one,
    so ``fsagent repos status`` never calls a checkout whose save failed
    ``never saved``."""
    saved_root = repos_state_root(state_root)
    found: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(OSError):
        for d in sorted(saved_root.iterdir()):
            status = read_json(d / "status.json")
            if status is not None and (checkouts is None or d.name in checkouts):
                found[d.name] = status
    for ws, names in (checkouts or {}).items():
        found.setdefault(ws, {"workspaceId": ws, **names})
    for ws, status in found.items():
        if ws in skip or status.get("state") == "fenced":
            continue
        status.update(state=state, lastAttempt=now_iso())
        status["lastError"] = failure_record(message, code)
        write_json_quietly(saved_root / ws / "status.json", status)


class RepoSavers:
    """One saver per prepared checkout of the run's task, made as checkouts appear."""

    def __init__(self, client: BridgeClient, run: RunInfo, home: Path, state_root: Path) -> None:
        self.client = client
        self.run = run
        self.home = home
        self.state_root = state_root
        self.savers: dict[str, RepoSaver] = {}
        self.fenced: str | None = None
        """Why this run may never save again (it ended, or a newer run holds
        the lease); None while saving."""

    def fence(self, message: str, code: str) -> None:
        """Stop every saver of this run for good, and say so in each status file
        of the state root (also the checkouts no saver was made for yet)."""
        if self.fenced is None:
            self.fenced = message
            log.warning("repository saves stopped: %s", message)
        for saver in self.savers.values():
            saver.fence(message, code)
        mark_status_files(self.state_root, "fenced", message, code, skip=set(self.savers))

    def fail_unreached(self, exc: FsagentError) -> None:
        """The save of every checkout failed before any saver was reached (the
        task's repositories could not be listed: the controller unreachable,
        say): each status file says ``failed`` with the reason, until a later
        save succeeds. Nothing is reported to the controller, which did not
        answer."""
        message, code = f"{type(exc).__name__}: {exc}", failure_code(exc)
        for saver in self.savers.values():
            if saver.fenced is None:
                saver.record_failure(message, code)
        mine = task_identity(self.run)
        checkouts = _status_names(
            (path, record)
            for path, record in _checkouts(self.home)
            if all(record.get(k) == v for k, v in mine.items())
        )
        mark_status_files(
            self.state_root, "failed", message, code, skip=set(self.savers), checkouts=checkouts
        )

    async def refresh(self) -> list[RepoSaver]:
        """The savers of the checkouts that exist and are this task's, in binding
        order. When the listing fails, every status file says so (and the run
        is fenced for good when the controller refused it for that)."""
        try:
            listing = await self.client.list_repos()
        except ControllerRefused as exc:
            if exc.fences_the_run:
                self.fence(f"{type(exc).__name__}: {exc}", failure_code(exc))
            else:
                self.fail_unreached(exc)
            raise
        except FsagentError as exc:
            self.fail_unreached(exc)
            raise
        root = repos_root(self.home, listing.repos_dir)
        out = []
        for binding in listing.repos:
            checkout = await trio.to_thread.run_sync(bound_checkout, self.run, binding, root)
            if checkout is None:
                continue
            saver = self.savers.get(binding.workspace_id)
            if saver is None:
                state_dir = repos_state_root(self.state_root) / binding.workspace_id
                saver = RepoSaver(self.client, self.run, binding, checkout, state_dir)
                self.savers[binding.workspace_id] = saver
            out.append(saver)
        return out

    async def save_all(self, *, lock_wait: float = 0.0, names: set[str] | None = None) -> int:
        """Checkpoint each checkout (one at a time); the number that failed.
        Once the run is fenced, raises RepoSaveFailed at once, sending nothing."""
        if self.fenced is not None:
            raise RepoSaveFailed(f"not saved, this run can no longer save: {self.fenced}")
        failed = 0
        chosen = [s for s in await self.refresh() if names is None or s.binding.name in names]
        for done, saver in enumerate(chosen, start=1):
            try:
                async with save_lock(self.state_root):
                    await saver.checkpoint(lock_wait=lock_wait)
            except RepoSaveFailed as exc:
                log.info("repository %s: %s", saver.binding.name, exc)
                failed += 1
            except Exception:
                # A bug must not stop the other checkouts' saves, nor the next ones.
                log.exception("repository %s: checkpoint failed unexpectedly", saver.binding.name)
                failed += 1
            if saver.fenced is not None:
                # The lease and the token are the run's, not the checkout's:
                # the other checkouts would be refused the same way.
                self.fence(saver.fenced, saver.fenced_code)
                return failed + len(chosen) - done
        return failed


async def watch(
    client: BridgeClient,
    home: Path,
    state_root: Path,
    interval: float,
    *,
    ready: trio.Event | None = None,
) -> int:
    """Checkpoint every ``interval`` seconds until SIGTERM/SIGINT, then a
    final save; the exit code (4 when the final save failed).

    A run that can no longer save (ended, or superseded by a newer lease:
    :attr:`fsagent.errors.ControllerRefused.fences_the_run`) stops saving and
    sending, its status files say ``fenced``, and it exits 4 at stop. When
    that is known at start, it still waits for the stop: exiting at once
    would have systemd restart it into the same refusal every few seconds."""
    savers: RepoSavers | None = None
    fenced: str | None = None
    try:
        savers = RepoSavers(client, await client.get_run(), home, state_root)
    except FsagentError as exc:
        message = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ControllerRefused) or not exc.fences_the_run:
            # Not one checkout can be saved: each says so (the run is not
            # known, so every prepared checkout in the home).
            checkouts = _status_names(_checkouts(home))
            mark_status_files(state_root, "failed", message, failure_code(exc), checkouts=checkouts)
            raise
        fenced = message
        log.warning("repository saves stopped: %s", fenced)
        mark_status_files(state_root, "fenced", fenced, failure_code(exc))
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        stop = trio.Event()

        async def on_signal() -> None:
            async for _ in signals:
                stop.set()
                return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signal)
            if ready is not None:
                ready.set()
            print(
                f"fsagent repos: saving the checkouts under {repos_root(home)} every "
                f"{interval:g}s and at stop",
                flush=True,
            )
            while not stop.is_set() and savers is not None and savers.fenced is None:
                with trio.move_on_after(interval):
                    await stop.wait()
                if stop.is_set():
                    break
                try:
                    await savers.save_all()
                except FsagentError as exc:  # the listing failed: try again next time
                    log.warning("repository checkpoints skipped: %s", exc)
            # Fenced: retrying every cadence could only be refused again.
            await stop.wait()
            nursery.cancel_scope.cancel()
    fenced = fenced or (savers.fenced if savers is not None else None)
    if fenced is not None or savers is None:
        log.warning("no final repository save: %s", fenced)
        return 4
    try:
        failed = await savers.save_all(lock_wait=FINAL_LOCK_WAIT)
    except FsagentError as exc:
        log.warning("final repository save failed: %s", exc)
        return 4
    return 4 if failed else 0


def cmd_watch(args: argparse.Namespace) -> int:
    home = Path(args.home).absolute()
    state_root = Path(args.state_root) if args.state_root else default_state_root()

    async def main() -> int:
        client = client_from_args(args)
        try:
            return await watch(client, home, state_root, args.interval)
        finally:
            await client.aclose()

    return trio.run(main)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    home = Path(args.home).absolute()
    state_root = Path(args.state_root) if args.state_root else default_state_root()

    async def main() -> list[dict[str, Any]]:
        client = client_from_args(args)
        try:
            run = await client.get_run()
            savers = RepoSavers(client, run, home, state_root)
            chosen = [
                s
                for s in await savers.refresh()
                if args.name is None or s.binding.name == args.name
            ]
            if args.name is not None and not chosen:
                raise FsagentError(f"no prepared checkout named {args.name}")
            out = []
            for saver in chosen:
                try:
                    async with save_lock(state_root):
                        outcome = await saver.checkpoint(lock_wait=args.lock_wait)
                    out.append({"name": saver.binding.name, "ok": True, **outcome.to_json()})
                except RepoSaveFailed as exc:
                    out.append({"name": saver.binding.name, "ok": False, "error": str(exc)})
            return out
        finally:
            await client.aclose()

    results = trio.run(main)
    if args.json:
        print(json.dumps({"repos": results}, indent=2))
    for r in results if not args.json else []:
        if not r["ok"]:
            print(f"{r['name']}: not saved: {r['error']}")
        elif r["committed"]:
            print(
                f"{r['name']}: saved as {r['checkpointId']} ({r['entries']} members, "
                f"{r['changed']} changed, {r['removed']} removed, {r['uploaded']} uploaded)"
            )
        else:
            print(f"{r['name']}: unchanged since {r['checkpointId']}")
    return 4 if any(not r["ok"] for r in results) else 0


# --- status -------------------------------------------------------------------


def _checkouts(home: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    root = repos_root(home)
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        record = read_json(path / BINDING_RECORD)
        if record is not None and not path.name.startswith("."):
            yield path, record


def _status_names(
    checkouts: Iterable[tuple[Path, dict[str, Any]]],
) -> dict[str, dict[str, Any]]:
    """Workspace id -> the ``name`` and ``checkout`` a new status file of it holds."""
    return {
        str(record.get("workspaceId")): {"name": record.get("name"), "checkout": str(path)}
        for path, record in checkouts
    }


def _restored_from(record: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint a restored checkout was built from (its binding record)."""
    if record.get("prepared") != "restore" or not record.get("checkpointId"):
        return None
    return {"checkpointId": record["checkpointId"], "at": record.get("at")}


def repo_status(home: Path, state_root: Path) -> list[dict[str, Any]]:
    """Every known repository: its checkout's records and its saver's status file.

    A restored checkout names the checkpoint it was built from
    (``restoredFrom``); until a save of it is attempted, its state is
    ``restored`` (a status file older than the restore belongs to a checkout
    that is gone). Only a checkout with neither is ``never saved``."""
    rows: dict[str, dict[str, Any]] = {}
    restored_at: dict[str, str] = {}
    for path, record in _checkouts(home):
        ws = str(record.get("workspaceId"))
        rows[ws] = {
            "workspaceId": ws,
            "name": record.get("name"),
            "checkout": str(path),
            "prepared": record.get("prepared"),
            "restoredFrom": _restored_from(record),
            "setup": setup_state(path),
            "warning": record.get("warning"),
        }
        if rows[ws]["restoredFrom"] is not None:
            restored_at[ws] = str(record.get("at") or "")
    saved_root = repos_state_root(state_root)
    if saved_root.is_dir():
        for d in sorted(saved_root.iterdir()):
            status = read_json(d / "status.json")
            if status is None:
                continue
            if d.name in restored_at and str(status.get("lastAttempt") or "") < restored_at[d.name]:
                continue  # about the checkout the restore replaced
            row = rows.setdefault(d.name, {"workspaceId": d.name, "name": status.get("name")})
            row.setdefault("checkout", status.get("checkout"))
            for key in ("state", "lastSave", "lastError", "lastAttempt", "problemCount", "cache"):
                row[key] = status.get(key)
            row["problems"] = status.get("problems", [])
    for ws, row in rows.items():
        row.setdefault("state", "restored" if ws in restored_at else "never saved")
        row.setdefault("lastSave", None)
        row.setdefault("lastError", None)
        row.setdefault("restoredFrom", None)
    return sorted(rows.values(), key=lambda r: str(r.get("name")))


def cmd_status(args: argparse.Namespace) -> int:
    home = Path(args.home).absolute() if args.home else Path.home()
    state_root = Path(args.state_root) if args.state_root else default_state_root()
    rows = repo_status(home, state_root)
    if args.json:
        print(json.dumps({"repos": rows}, indent=2))
        return 0
    if not rows:
        print("no repositories")
    for r in rows:
        print(f"{r.get('name')}: {r.get('state')} ({r.get('checkout')})")
        last = r.get("lastSave")
        if last:
            print(
                f"  last save: {last.get('at')} checkpoint {last.get('checkpointId')} "
                f"({last.get('entries')} members)"
            )
        restored = r.get("restoredFrom")
        if restored:
            print(
                f"  restored from checkpoint {restored.get('checkpointId')} at {restored.get('at')}"
            )
        err = r.get("lastError")
        if err:
            code = f" [{err['code']}]" if err.get("code") else ""
            print(f"  last error: {err.get('at')}{code} {err.get('message')}")
        setup = r.get("setup")
        if setup:
            print(f"  setup: {setup.get('state')} (exit {setup.get('exitCode', '-')})")
        warning = r.get("warning")
        if warning:
            print(f"  {_describe_warning(warning).removeprefix('; ')}")
        if r.get("problemCount"):
            print(f"  {r['problemCount']} path(s) not saved, e.g.:")
            for p in r.get("problems", [])[:5]:
                print(f"    {p['path']}: {p['reason']}")
    return 0


# --- parser -------------------------------------------------------------------


def add_parser(sub: Any, controller_opts: Any) -> None:
    r = sub.add_parser("repos", help="the task's repository checkouts in $HOME/repos")
    rsub = r.add_subparsers(dest="repos_cmd", required=True)

    def common(p: argparse.ArgumentParser, controller: bool = True) -> None:
        p.add_argument("--home", required=controller, help="the sandbox home ($HOME)")
        p.add_argument("--state-root", help="default ~/.local/state/fsagent")
        if controller:
            controller_opts(p)

    p = rsub.add_parser("prepare", help="warm, restore or clone every bound checkout")
    common(p)
    p.add_argument("--retry-setup", action="store_true", help="run a setup that failed again")
    p.add_argument("--setup-timeout", type=float, default=None, help="seconds (default: none)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prepare)

    w = rsub.add_parser("watch", help="checkpoint every checkout on a cadence and at stop")
    common(w)
    w.add_argument("--interval", type=float, default=CHECKPOINT_INTERVAL_SECONDS)
    w.set_defaults(func=cmd_watch)

    c = rsub.add_parser("checkpoint", help="checkpoint now (one checkout or all)")
    c.add_argument("name", nargs="?", help="checkout name (default: all)")
    common(c)
    c.add_argument(
        "--lock-wait", type=float, default=10.0, help="seconds to wait for a Git lock to go"
    )
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_checkpoint)

    s = rsub.add_parser("status", help="each repository's last save, error and setup")
    common(s, controller=False)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
