"""What a repository checkpoint of a checkout holds, read with Git and the scan engine.

Members (:func:`list_members`):

* the working tree: ``git ls-files -z --cached --others --exclude-standard``,
  i.e. tracked files and untracked files that are not ignored. A tracked
  file missing from the worktree is simply absent; a tracked gitlink
  (submodule) and an untracked nested repository are left out and reported.
* ``.git``: the directory itself, the top-level files of
  :data:`common.repos.GIT_INCLUDED_TOP` (``HEAD``, ``index``,
  ``packed-refs``, ``shallow``, ``ORIG_HEAD``) and everything under
  :data:`common.repos.GIT_INCLUDED_TREES` (``objects`` with its packs,
  ``refs``, ``logs``), without lock files and Git's temporary objects.

Everything else in ``.git`` stays out: ``config`` (its portable keys travel
as data, :func:`portable_config_pairs`; ``origin`` is recreated from the
binding at restore), hooks, ``info``, credentials, ``FETCH_HEAD`` and other
runtime state. Dependencies and build output are ignored files, so they
stay out too (a restore reruns the project's setup command).

Refusals before any scan: a ``.git`` that is not a directory (a linked
worktree or submodule points elsewhere), an alternates file (objects live
in another repository), and any Git lock (:func:`held_locks`): Git is
changing the repository right now.

Git runs with ``GIT_OPTIONAL_LOCKS=0`` and never writes: listing the members
takes no lock and needs no disk space.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any, Final

from common.errors import InvalidPath
from common.limits import MAX_FILE_BYTES
from common.paths import validate_path
from common.repos import (
    GIT_DIR,
    GIT_INCLUDED_TOP,
    GIT_INCLUDED_TREES,
    GIT_REFUSED,
    KINDS,
    is_git_admin,
    symlink_problem,
)
from fsagent.errors import CheckoutUnsupported
from fsagent.scan import Member, Problem, ScanResult

LOCK_SUFFIX: Final = ".lock"
GIT_TEMPORARY_PREFIXES: Final = ("tmp_", "incoming-")
"""Objects Git is still writing (``tmp_obj_*``, ``tmp_pack_*``, ``tmp_idx_*``)
and push quarantine directories: not part of the repository yet."""

PORTABLE_CONFIG_KEYS: Final = frozenset({"core.repositoryformatversion", "extensions.objectformat"})
"""Configuration worth carrying to a restored checkout, besides branch tracking.
Everything else (remotes and their URLs, credentials, hooks paths, includes,
filters and other commands) stays in the sandbox."""
_REMOTE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def git_env() -> dict[str, str]:
    """The environment for fsagent's own Git commands: no optional locks (so
    reading never contends with the agent's Git), no prompts, no pager."""
    env = dict(os.environ)
    env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", GIT_PAGER="cat", LC_ALL="C")
    return env


def git(checkout: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run ``git -C checkout args`` and capture its output. ``safe.directory``
    names the checkout, since fsagent may run as another user than its owner."""
    return subprocess.run(
        ["git", "-c", f"safe.directory={checkout}", "-C", str(checkout), *args],
        capture_output=True,
        env=git_env(),
        check=check,
    )


def check_layout(checkout: Path) -> None:
    """Refuse a checkout this checkpoint format cannot hold."""
    git_dir = checkout / GIT_DIR
    try:
        st = os.lstat(git_dir)
    except FileNotFoundError:
        raise CheckoutUnsupported(f"{checkout}: no .git directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckoutUnsupported(
            f"{checkout}: .git is not a directory (a linked worktree or a submodule "
            "keeps its repository elsewhere; not supported)"
        )
    for name in ("objects/info/alternates", "objects/info/http-alternates", "commondir"):
        if os.path.lexists(git_dir / name):
            raise CheckoutUnsupported(
                f"{checkout}: .git/{name} points at objects outside the checkout (not supported)"
            )


def held_locks(checkout: Path) -> list[str]:
    """Git lock files present now (``index.lock``, ``HEAD.lock``,
    ``packed-refs.lock``, ``shallow.lock``, ref and reflog locks,
    commit-graph and multi-pack-index locks), relative to the checkout."""
    git_dir = checkout / GIT_DIR
    found: list[str] = []

    def look(rel: str, recurse: bool) -> None:
        try:
            it = os.scandir(git_dir / rel if rel else git_dir)
        except (FileNotFoundError, NotADirectoryError):
            return
        with it:
            for entry in it:
                path = f"{rel}/{entry.name}" if rel else entry.name
                if entry.name.endswith(LOCK_SUFFIX):
                    found.append(f"{GIT_DIR}/{path}")
                elif recurse and entry.is_dir(follow_symlinks=False):
                    look(path, True)

    look("", False)
    look("refs", True)
    look("logs", True)
    look("objects/info", False)
    look("objects/pack", False)
    return sorted(found)


def _git_prune(path: str, is_dir: bool) -> bool:
    name = path.rpartition("/")[2]
    return name.endswith(LOCK_SUFFIX) or name.startswith(GIT_TEMPORARY_PREFIXES)


def git_dir_members(checkout: Path) -> list[str]:
    """The ``.git`` paths a checkpoint carries (directories included)."""
    from fsagent.scan import walk_tree

    git_dir = checkout / GIT_DIR
    out = [GIT_DIR]
    for name in sorted(GIT_INCLUDED_TOP):
        if os.path.lexists(git_dir / name):
            out.append(f"{GIT_DIR}/{name}")
    for tree in GIT_INCLUDED_TREES:
        if os.path.isdir(git_dir / tree) and not os.path.islink(git_dir / tree):
            out.append(f"{GIT_DIR}/{tree}")
            out.extend(f"{GIT_DIR}/{tree}/{p}" for p in walk_tree(git_dir / tree, _git_prune))
    return out


def worktree_paths(checkout: Path) -> tuple[list[str], list[Problem]]:
    """Tracked and non-ignored untracked paths; nested repositories reported."""
    listed = git(
        checkout, "ls-files", "-z", "--cached", "--others", "--exclude-standard"
    ).stdout.split(b"\0")
    paths: list[str] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for raw in listed:
        if not raw:
            continue
        path = os.fsdecode(raw)
        if path.endswith("/"):  # an untracked directory holding its own repository
            problems.append(Problem(path.rstrip("/"), "nested_repository"))
            continue
        if path.split("/", 1)[0] == GIT_DIR or path in seen:
            continue  # listed twice (unmerged stages), or Git's own: taken from .git
        seen.add(path)
        paths.append(path)
    return paths, problems


def list_members(checkout: Path) -> list[str]:
    """Every path a checkpoint of ``checkout`` may hold (working tree, then ``.git``)."""
    paths, _ = worktree_paths(checkout)
    return paths + git_dir_members(checkout)


def member_path_problem(path: str) -> str | None:
    """The name rules of a checkpoint member (the controller applies the same)."""
    try:
        validate_path(path)
    except InvalidPath as exc:
        return f"invalid_path:{exc.reason}"
    if is_git_admin(path) and path.split("/", 1)[0] != GIT_DIR:
        return "git_dir_case_alias"
    return None


def link_problem(path: str, target: str) -> str | None:
    return symlink_problem(path, target)


MAX_MEMBER_BYTES: Final = MAX_FILE_BYTES


def checkpoint_members(
    result: ScanResult, listing_problems: list[Problem]
) -> tuple[list[Member], list[Problem]]:
    """A scan of a checkout made into checkpoint members: directories only in
    ``.git`` (one in the working tree is a gitlink, i.e. a submodule). The
    problems are the scan's and the listing's (nested repositories)."""
    members: list[Member] = []
    problems = list(result.problems) + listing_problems
    for member in result.members:
        if member.kind == "dir" and not (
            member.path == GIT_DIR or member.path.startswith(GIT_DIR + "/")
        ):
            problems.append(Problem(member.path, "nested_repository"))
            continue
        members.append(member)
    problems.sort(key=lambda p: p.path)
    return members, problems


def portable_config_pairs(checkout: Path) -> list[tuple[str, str]]:
    """The checkout's portable configuration, parsed as data without includes:
    :data:`PORTABLE_CONFIG_KEYS` and ``branch.<name>.remote`` / ``.merge``."""
    proc = git(
        checkout,
        "config",
        "--file",
        str(checkout / GIT_DIR / "config"),
        "--no-includes",
        "--list",
        "-z",
        check=False,
    )
    if proc.returncode != 0:
        return []  # no config file (or unreadable): carry nothing
    return portable_pairs(_parse_config_z(proc.stdout))


def _parse_config_z(out: bytes) -> list[tuple[str, str]]:
    pairs = []
    for item in out.split(b"\0"):
        if not item:
            continue
        key, _, value = item.partition(b"\n")
        pairs.append((key.decode("utf-8", "replace"), value.decode("utf-8", "replace")))
    return pairs


def portable_pairs(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Keep only portable keys (see :func:`portable_config_pairs`)."""
    out = []
    for key, value in pairs:
        low = key.lower()
        section, _, rest = low.partition(".")
        field = rest.rsplit(".", 1)[-1]
        if section == "branch" and field in ("remote", "merge"):
            # A remote given as a URL (possibly with a credential in it) stays here.
            if field == "remote" and not _REMOTE_NAME.fullmatch(value):
                continue
            out.append((key, value))
        elif low in PORTABLE_CONFIG_KEYS:
            out.append((key, value))
    return out


def wire_member_problem(member: Any) -> tuple[str, str] | None:
    """(path, rule) when a checkpoint member in wire form is refused: the
    controller's rules (:mod:`common.repos`), applied again by a restore
    before it writes anything."""
    if not isinstance(member, dict):
        return "?", "member_not_an_object"
    path = member.get("path")
    try:
        validate_path(path)
    except InvalidPath as exc:
        return str(path), f"invalid_path:{exc.reason}"
    assert isinstance(path, str)
    kind = member.get("kind")
    if kind not in KINDS:
        return path, "kind_not_allowed"
    top = path.split("/", 1)[0]
    if is_git_admin(path) and top != GIT_DIR:
        return path, "git_dir_case_alias"
    if top == GIT_DIR and path != GIT_DIR:
        inner = path[len(GIT_DIR) + 1 :]
        if any(inner == r or inner.startswith(r + "/") for r in GIT_REFUSED):
            return path, "git_admin_refused"
        if inner not in GIT_INCLUDED_TOP and inner.split("/", 1)[0] not in GIT_INCLUDED_TREES:
            return path, "git_path_not_carried"
    if path == GIT_DIR and kind != "dir":
        return path, "git_dir_not_a_directory"
    if kind == "symlink":
        why = symlink_problem(path, str(member.get("target") or ""))
        if why is not None:
            return path, why
    if kind == "file":
        digest = member.get("digest")
        size = member.get("byteSize")
        if not isinstance(digest, str) or len(digest) != 64:
            return path, "digest_invalid"
        if not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
            return path, "file_too_large"
    return None
