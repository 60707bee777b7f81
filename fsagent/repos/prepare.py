"""``fsagent repos prepare``: make each bound workspace's checkout ready in
``$HOME/repos/<name>`` before the agent starts.

Per binding, one of (:func:`prepare_repo`):

* **warm**: the checkout exists and its local binding record
  (``.git/fsagent/binding.json``) names this company, task and workspace.
  Nothing is touched: no reset, no clean, no fetch; a setup that completed
  is not run again (a setup that was interrupted is).
* **restore**: no checkout and a saved checkpoint. The manifest and objects
  are fetched in batches, every SHA-256 verified, and the tree built in a
  temporary directory beside the target (same filesystem): directories,
  files with their exec bits, in-checkout symbolic links, then a fresh
  ``.git/config`` (the carried portable keys, ``origin`` from the binding's
  URL). One rename publishes it. Setup then runs again, since dependencies
  and build output are never saved.
* **clone**: nothing saved. ``git clone`` with the sandbox's own Git
  credentials (``--branch`` the starting ref when one is set) into a
  temporary directory, then one rename. The primary workspace honours the
  task's branch: checked out if the remote has it, else created from the
  starting point. Setup runs once. A remote whose HEAD names a branch it
  does not have gives a clone with nothing checked out (Git only warns):
  the clone is kept (every branch is in it) and the result carries a
  warning, code :data:`REMOTE_HEAD_MISSING`, with Git's own message; the
  binding record keeps it for ``fsagent repos status``. The starting ref
  policy names no fallback branch, so none is guessed.

A directory at the path that is not this binding's checkout (another task's
or workspace's, or anything without a record) is refused
(:class:`fsagent.errors.RepoBindingMismatch`) and left untouched. An empty
directory counts as no checkout. A binding removed from the task leaves its
checkout alone (prepare only looks at bound workspaces).

**Setup** (the project's setup command) runs as ``sh -c COMMAND`` in the
checkout, its output appended to ``.git/fsagent/setup.log``; its state is
``.git/fsagent/setup.json``: ``running`` while it runs, then ``done`` or
``failed`` with the exit status. A failed setup is reported (``fsagent repos
status``, exit code 8) and **not** retried on warm starts: it may have done
half its work, and the agent, which sees the log, is better placed to fix
and rerun it; ``fsagent repos prepare --retry-setup`` runs it again. These
records live inside ``.git`` but outside what a checkpoint carries, so a
restored checkout starts without them (and reruns setup).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from common.repos import FETCH_BATCH_MAX, GIT_DIR, checkout_name_problem
from fsagent.bridge.base import BadBatch, BridgeClient, RepoBinding, RunInfo
from fsagent.checkpoint.ship import raise_first_failure
from fsagent.errors import (
    FsagentError,
    ObjectUnavailable,
    RepoBindingMismatch,
    RepoPrepareFailed,
)
from fsagent.repos.capture import checkpoint_problem, git, git_env
from fsagent.repos.save import now_iso, read_json

log = logging.getLogger("fsagent.repoprepare")

RECORD_DIR: Final = f"{GIT_DIR}/fsagent"
"""Local records of a checkout, inside ``.git`` but never in a checkpoint."""
BINDING_RECORD: Final = f"{RECORD_DIR}/binding.json"
SETUP_RECORD: Final = f"{RECORD_DIR}/setup.json"
SETUP_LOG: Final = f"{RECORD_DIR}/setup.log"
FETCH_CONCURRENCY: Final = 4
"""Batch fetches in flight during a restore."""
FETCH_BATCH_BYTES: Final = 32 << 20
REMOTE_HEAD_MISSING: Final = "remote_head_missing"
"""The warning of a clone whose remote HEAD names a branch the remote does not
have: nothing is checked out."""


@dataclass
class PrepareResult:
    name: str
    workspace_id: str
    path: str
    mode: str
    """``warm``, ``restore``, ``clone``, ``refused`` or ``failed``."""
    setup: str
    """``done``, ``failed``, ``skipped`` (warm, already done), ``none`` (no command)."""
    message: str | None = None
    seconds: float = 0.0
    warning: dict[str, str] | None = None
    """``{"code", "message", "git"}`` of a checkout that is prepared but not as
    asked (:data:`REMOTE_HEAD_MISSING`); None when there is nothing to say."""

    @property
    def ok(self) -> bool:
        return self.mode in ("warm", "restore", "clone") and self.setup != "failed"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "workspaceId": self.workspace_id,
            "path": self.path,
            "mode": self.mode,
            "setup": self.setup,
            "message": self.message,
            "warning": self.warning,
            "seconds": round(self.seconds, 3),
        }


def task_identity(run: RunInfo) -> dict[str, str | None]:
    return {"companyId": run.company_id, "taskId": run.bindings.get("task")}


def binding_record(run: RunInfo, binding: RepoBinding, mode: str) -> dict[str, Any]:
    return {
        "version": 1,
        **task_identity(run),
        "workspaceId": binding.workspace_id,
        "name": binding.name,
        "repoUrl": binding.repo_url,
        "prepared": mode,
        "at": now_iso(),
    }


def record_matches(record: dict[str, Any] | None, run: RunInfo, binding: RepoBinding) -> bool:
    if record is None:
        return False
    wanted = {**task_identity(run), "workspaceId": binding.workspace_id}
    return all(record.get(k) == v for k, v in wanted.items())


def checkout_path(repos_root: Path, binding: RepoBinding) -> Path:
    """``repos_root/<name>``; a name that is not one plain path segment is refused."""
    problem = checkout_name_problem(binding.name)
    if problem is not None:
        raise RepoPrepareFailed(f"checkout name {binding.name!r} refused: {problem}")
    return repos_root / binding.name


def bound_checkout(run: RunInfo, binding: RepoBinding, repos_root: Path) -> Path | None:
    """The checkout of ``binding`` if it exists and is this binding's; else None."""
    try:
        target = checkout_path(repos_root, binding)
    except RepoPrepareFailed:
        return None
    if target.is_symlink() or not target.is_dir():
        return None
    return target if record_matches(read_json(target / BINDING_RECORD), run, binding) else None


# --- prepare ------------------------------------------------------------------


async def prepare_repo(
    client: BridgeClient,
    run: RunInfo,
    binding: RepoBinding,
    repos_root: Path,
    *,
    retry_setup: bool = False,
    setup_timeout: float | None = None,
) -> PrepareResult:
    """Warm, restore or clone one binding's checkout (see the module doc).
    Never raises for the binding's own problems: they are in the result."""
    started = time.monotonic()
    result = PrepareResult(binding.name, binding.workspace_id, "", "failed", "none")
    try:
        target = checkout_path(repos_root, binding)
        result.path = str(target)
        mode = await trio.to_thread.run_sync(_existing_mode, run, binding, target)
        if mode is None:
            await trio.Path(repos_root).mkdir(parents=True, exist_ok=True)
            if binding.current is not None:
                await restore_checkout(client, run, binding, target)
                mode = "restore"
            else:
                result.warning = await trio.to_thread.run_sync(clone_checkout, run, binding, target)
                mode = "clone"
        result.mode = mode
        result.setup = await trio.to_thread.run_sync(
            run_setup, binding, target, mode == "warm", retry_setup, setup_timeout
        )
        if result.setup == "failed":
            result.message = f"setup failed; see {target / SETUP_LOG}"
    except RepoBindingMismatch as exc:
        result.mode, result.message = "refused", str(exc)
    except (FsagentError, OSError, subprocess.SubprocessError) as exc:
        result.mode, result.message = "failed", f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - started
    return result


def _existing_mode(run: RunInfo, binding: RepoBinding, target: Path) -> str | None:
    """``warm`` for this binding's checkout, None when there is none; refuses anything else."""
    if not os.path.lexists(target):
        return None
    if target.is_dir() and not target.is_symlink():
        if record_matches(read_json(target / BINDING_RECORD), run, binding):
            return "warm"
        if not any(target.iterdir()):
            target.rmdir()  # an empty directory holds nothing to keep
            return None
        record = read_json(target / BINDING_RECORD)
        if record is not None:
            raise RepoBindingMismatch(
                f"{target} is the checkout of task {record.get('taskId')} workspace "
                f"{record.get('workspaceId')}, not of this task's workspace "
                f"{binding.workspace_id}; left untouched"
            )
    raise RepoBindingMismatch(
        f"{target} exists and is not a checkout fsagent prepared for this task; left untouched"
    )


def _temporary_beside(target: Path, what: str) -> Path:
    """A fresh directory next to ``target`` (same filesystem, so publishing is one rename)."""
    tmp = target.with_name(f".{target.name}.{what}-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, target: Path) -> None:
    if os.path.lexists(target):
        raise RepoBindingMismatch(f"{target} appeared while it was prepared; left untouched")
    os.rename(tmp, target)


def _write_record(checkout: Path, rel: str, data: dict[str, Any]) -> None:
    path = checkout / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# --- clone --------------------------------------------------------------------


def clone_checkout(run: RunInfo, binding: RepoBinding, target: Path) -> dict[str, str] | None:
    """``git clone`` into a temporary directory beside ``target``, check out the
    task's branch (primary workspace), record the binding, publish. The
    warning of a clone with nothing checked out (:func:`unborn_head_warning`),
    also kept in the binding record; else None."""
    tmp = _temporary_beside(target, "clone")
    try:
        args = ["git", "clone", "--quiet"]
        if binding.ref:
            args += ["--branch", binding.ref]
        args += ["--", binding.repo_url, str(tmp)]
        env = git_env()
        del env["LC_ALL"]  # messages in the user's language; nothing parses them
        proc = subprocess.run(args, capture_output=True, env=env, check=False)
        if proc.returncode != 0:
            raise RepoPrepareFailed(
                f"git clone {binding.repo_url} failed: {proc.stderr.decode(errors='replace').strip()}"
            )
        cloned_head = git(tmp, "symbolic-ref", "--quiet", "HEAD", check=False)
        if binding.primary and binding.branch:
            _check_out_task_branch(tmp, binding.branch)
        warning = unborn_head_warning(
            tmp, cloned_head.stdout.decode(errors="replace").strip(), proc.stderr
        )
        record = binding_record(run, binding, "clone")
        if warning is not None:
            record["warning"] = warning
            log.warning("%s: %s", binding.name, warning["message"])
        _write_record(tmp, BINDING_RECORD, record)
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return warning


def unborn_head_warning(checkout: Path, cloned_head: str, stderr: bytes) -> dict[str, str] | None:
    """A fresh clone whose HEAD names no commit while the remote has branches:
    the remote's HEAD (``cloned_head``, what the clone's HEAD named before any
    task branch) points at a branch it does not have, and Git, which only
    warns, checked nothing out. The warning names that branch and the
    remote's, and keeps Git's message. An empty remote (no branches at all)
    is an ordinary empty clone: None."""
    if git(checkout, "rev-parse", "--verify", "--quiet", "HEAD", check=False).returncode == 0:
        return None
    listed = git(checkout, "for-each-ref", "--format=%(refname:short)", "refs/remotes/origin")
    branches = [
        b.removeprefix("origin/")
        for b in listed.stdout.decode(errors="replace").split()
        if b not in ("origin", "origin/HEAD")
    ]
    if not branches:
        return None
    head = cloned_head.removeprefix("refs/heads/") or "(none)"
    shown = ", ".join(branches[:5]) + (
        f" and {len(branches) - 5} more" if len(branches) > 5 else ""
    )
    said = stderr.decode(errors="replace").strip()
    return {
        "code": REMOTE_HEAD_MISSING,
        "message": (
            f"the remote's HEAD names branch {head}, which the remote does not have:"
            f" nothing is checked out (the remote has {shown};"
            f" e.g. git checkout {branches[0]})"
        ),
        "git": said,
    }


def _check_out_task_branch(checkout: Path, branch: str) -> None:
    if git(checkout, "check-ref-format", "--branch", branch, check=False).returncode != 0:
        raise RepoPrepareFailed(f"task branch {branch!r} is not a valid branch name")
    remote = f"refs/remotes/origin/{branch}"
    exists = git(checkout, "rev-parse", "--verify", "--quiet", remote, check=False).returncode == 0
    current = git(checkout, "symbolic-ref", "--quiet", "--short", "HEAD", check=False)
    if current.returncode == 0 and current.stdout.decode().strip() == branch:
        return  # the starting ref is the task's branch already
    args = ["checkout", "--quiet", "-b", branch] + (
        ["--track", f"origin/{branch}"] if exists else []
    )
    proc = git(checkout, *args, check=False)
    if proc.returncode != 0:
        raise RepoPrepareFailed(
            f"checking out task branch {branch}: {proc.stderr.decode(errors='replace').strip()}"
        )


# --- restore ------------------------------------------------------------------


async def restore_checkout(
    client: BridgeClient, run: RunInfo, binding: RepoBinding, target: Path
) -> str:
    """Build the current checkpoint beside ``target``, verified, then publish it
    with one rename; returns the checkpoint id."""
    manifest = await client.repo_manifest(binding.workspace_id, "current")
    members = manifest.members
    problem = await trio.to_thread.run_sync(checkpoint_problem, members)
    if problem is not None:
        where = "the checkpoint" if problem[0] is None else f"checkpoint member {problem[0]}"
        raise RepoPrepareFailed(f"{where} refused: {problem[1]}")
    tmp = await trio.to_thread.run_sync(_temporary_beside, target, "restore")
    try:
        await trio.to_thread.run_sync(_make_directories, tmp, members)
        await _fetch_files(client, binding.workspace_id, tmp, members)
        await trio.to_thread.run_sync(_make_links, tmp, members)
        await trio.to_thread.run_sync(_write_config, tmp, manifest.config, binding.repo_url)
        record = binding_record(run, binding, "restore")
        record["checkpointId"] = manifest.checkpoint_id
        await trio.to_thread.run_sync(_write_record, tmp, BINDING_RECORD, record)
        await trio.to_thread.run_sync(_publish, tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("restored %s from checkpoint %s", target, manifest.checkpoint_id)
    return manifest.checkpoint_id


def _make_directories(root: Path, members: list[dict[str, Any]]) -> None:
    dirs: set[str] = set()
    for member in members:
        path = str(member["path"])
        if member["kind"] == "dir":
            dirs.add(path)
        head = path.rpartition("/")[0]
        while head and head not in dirs:
            dirs.add(head)
            head = head.rpartition("/")[0]
    for d in sorted(dirs):
        # Created one level at a time under a fresh directory: every parent
        # was made here, so no component can be a link placed by someone else.
        os.mkdir(root / d)


def _file_mode(executable: bool) -> int:
    return (0o777 if executable else 0o666) & ~_umask()


async def _fetch_files(
    client: BridgeClient, workspace_id: str, root: Path, members: list[dict[str, Any]]
) -> None:
    """Fetch every file's object once (batches in parallel), written straight
    into its first path; other paths with the same content are copies."""
    paths_by_digest: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for member in members:
        if member["kind"] == "file":
            paths_by_digest[str(member["digest"])].append(member)
    limiter = trio.CapacityLimiter(FETCH_CONCURRENCY)

    async def fetch(chunk: list[str]) -> None:
        async with limiter:
            firsts = [paths_by_digest[d][0] for d in chunk]
            try:
                got = await client.fetch_repo_objects(
                    workspace_id, chunk, lambda i: root / str(firsts[i]["path"])
                )
            except BadBatch as exc:
                if exc.digest not in paths_by_digest:
                    raise
                where = paths_by_digest[exc.digest][0]["path"]
                raise ObjectUnavailable(
                    f"object {exc.digest[:12]} for {where} did not match its digest: {exc}"
                ) from exc
        for digest, first, (sha, size) in zip(chunk, firsts, got, strict=True):
            if sha != digest or size != int(first["byteSize"]):
                raise ObjectUnavailable(
                    f"object {digest[:12]} for {first['path']} did not match its digest"
                )
        await trio.to_thread.run_sync(_place_copies, root, [paths_by_digest[d] for d in chunk])

    try:
        async with trio.open_nursery() as nursery:
            for chunk in fetch_batches(paths_by_digest):
                nursery.start_soon(fetch, chunk)
    except BaseExceptionGroup as group:
        raise_first_failure(group)


def fetch_batches(paths_by_digest: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """Digests grouped for batch fetches: at most :data:`FETCH_BATCH_MAX` objects
    and :data:`FETCH_BATCH_BYTES` per batch (a larger object goes alone), so
    several batches stream at once and large objects come a few at a time."""
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for digest in sorted(paths_by_digest):
        nbytes = int(paths_by_digest[digest][0]["byteSize"])
        if current and (len(current) >= FETCH_BATCH_MAX or size + nbytes > FETCH_BATCH_BYTES):
            out.append(current)
            current, size = [], 0
        current.append(digest)
        size += nbytes
    if current:
        out.append(current)
    return out


def _place_copies(root: Path, groups: list[list[dict[str, Any]]]) -> None:
    for group in groups:
        first = root / str(group[0]["path"])
        for other in group[1:]:
            shutil.copyfile(first, root / str(other["path"]), follow_symlinks=False)
        for member in group:
            os.chmod(root / str(member["path"]), _file_mode(bool(member.get("executable"))))


def _make_links(root: Path, members: list[dict[str, Any]]) -> None:
    for member in members:
        if member["kind"] == "symlink":
            os.symlink(str(member["target"]), root / str(member["path"]))


def _write_config(checkout: Path, carried: list[tuple[str, str]], repo_url: str) -> None:
    """A fresh ``.git/config``: Git's defaults for a non-bare repository, the
    carried portable keys, and ``origin`` from the binding's URL."""
    config = checkout / GIT_DIR / "config"
    config.write_text("")
    keys = {k.lower() for k, _ in carried}
    defaults = [
        ("core.repositoryformatversion", "0"),
        ("core.filemode", "true"),
        ("core.bare", "false"),
        ("core.logallrefupdates", "true"),
    ]
    pairs = [(k, v) for k, v in defaults if k not in keys] + list(carried)
    pairs += [
        ("remote.origin.url", repo_url),
        ("remote.origin.fetch", "+refs/heads/*:refs/remotes/origin/*"),
    ]
    for key, value in pairs:
        proc = subprocess.run(
            ["git", "config", "--file", str(config), "--add", key, value],
            capture_output=True,
            env=git_env(),
            check=False,
        )
        if proc.returncode != 0:
            raise RepoPrepareFailed(
                f"writing {key} to .git/config: {proc.stderr.decode(errors='replace').strip()}"
            )
    os.chmod(config, 0o644 & ~_umask())


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


# --- setup --------------------------------------------------------------------


def run_setup(
    binding: RepoBinding,
    checkout: Path,
    warm: bool,
    retry_failed: bool,
    timeout: float | None,
) -> str:
    """Run the setup command unless a warm checkout completed it (or, without
    ``retry_failed``, already failed it); returns the setup state."""
    if not binding.setup_command:
        return "none"
    record = read_json(checkout / SETUP_RECORD) or {}
    state = record.get("state")
    if warm and state == "done":
        return "skipped"
    if warm and state == "failed" and not retry_failed:
        return "failed"
    _write_record(
        checkout,
        SETUP_RECORD,
        {"state": "running", "command": binding.setup_command, "startedAt": now_iso()},
    )
    started = time.monotonic()
    log_path = checkout / SETUP_LOG
    with open(log_path, "ab") as out:
        out.write(f"--- {now_iso()} sh -c {binding.setup_command!r}\n".encode())
        out.flush()
        try:
            code = subprocess.run(
                ["sh", "-c", binding.setup_command],
                cwd=checkout,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
            out.write(f"--- timed out after {timeout}s\n".encode())
    state = "done" if code == 0 else "failed"
    _write_record(
        checkout,
        SETUP_RECORD,
        {
            "state": state,
            "command": binding.setup_command,
            "exitCode": code,
            "at": now_iso(),
            "seconds": round(time.monotonic() - started, 3),
        },
    )
    if state == "failed":
        log.warning("%s: setup exited with %s; see %s", binding.name, code, log_path)
    return state


def setup_state(checkout: Path) -> dict[str, Any] | None:
    return read_json(checkout / SETUP_RECORD)
