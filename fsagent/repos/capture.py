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

import bisect
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
    RepoMember,
    member_problem,
    parse_member,
    portable_config,
    symlink_problem,
    tree_problem,
)
from fsagent.errors import CheckoutUnsupported, GitCommandFailed
from fsagent.scan.engine import (
    RACY_MARGIN_NS,
    Member,
    Problem,
    ScanResult,
    member_kind,
    member_path,
)
from fsagent.scan.listing import ListingWitness, parse_config_list

LOCK_SUFFIX: Final = ".lock"
GIT_TEMPORARY_PREFIXES: Final = ("tmp_", "incoming-")
"""Objects Git is still writing (``tmp_obj_*``, ``tmp_pack_*``, ``tmp_idx_*``)
and push quarantine directories: not part of the repository yet."""


def git_env() -> dict[str, str]:
    """The environment for fsagent's own Git commands: no optional locks (so
    reading never contends with the agent's Git), no prompts, no pager."""
    env = dict(os.environ)
    env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", GIT_PAGER="cat", LC_ALL="C")
    return env


def git(checkout: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run ``git -C checkout args`` and capture its output. ``safe.directory``
    names the checkout, since fsagent may run as another user than its owner.
    With ``check``, a failure raises :class:`GitCommandFailed` with Git's message."""
    proc = subprocess.run(
        ["git", "-c", f"safe.directory={checkout}", "-C", str(checkout), *args],
        capture_output=True,
        env=git_env(),
        check=False,
    )
    if check and proc.returncode != 0:
        message = proc.stderr.decode(errors="replace").strip() or f"exit {proc.returncode}"
        raise GitCommandFailed(f"{checkout}: git {args[0]}: {message}")
    return proc


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
    from fsagent.scan.engine import walk_tree

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


def _ls_files(checkout: Path) -> bytes:
    return git(checkout, "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout


def worktree_paths(checkout: Path) -> tuple[list[str], list[Problem]]:
    """Tracked and non-ignored untracked paths; nested repositories reported."""
    return _worktree_paths(_ls_files(checkout))


def _worktree_paths(out: bytes) -> tuple[list[str], list[Problem]]:
    # One decode of the whole answer (as os.fsdecode would, name by name).
    text = out.decode("utf-8", "surrogateescape")
    listed = text.split("\0")
    if listed[-1] == "":
        listed.pop()  # the answer ends with a NUL
    git_prefix = GIT_DIR + "/"
    if (
        "/\0" not in text  # no nested repository (listed as "dir/")
        and "\0\0" not in text  # no empty name
        and not text.startswith(("\0", git_prefix))
        and "\0" + git_prefix not in text
        and len(set(listed)) == len(listed)  # no unmerged path (one line per stage)
    ):
        return listed, []
    paths: list[str] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for path in listed:
        if not path or path in seen:
            continue  # the end, or listed twice (the stages of an unmerged path)
        if path[-1] == "/":  # an untracked directory holding its own repository
            problems.append(Problem(path.rstrip("/"), "nested_repository"))
            continue
        if path.startswith(git_prefix):
            continue  # Git's own: taken from .git
        seen.add(path)
        paths.append(path)
    return paths, problems


class WorktreeLister:
    """:func:`worktree_paths` of one checkout, again and again.

    Git runs only when something its listing depends on changed since it last
    ran (:class:`fsagent.scan.listing.ListingWitness`, observed before each run),
    or with ``full``; otherwise the last answer is the answer. The same
    answer from Git gives the same list (the same objects), so a scan
    recognizes an unchanged listing at once and nothing is parsed twice."""

    def __init__(self, checkout: Path, racy_margin_ns: int = RACY_MARGIN_NS) -> None:
        self.checkout = checkout
        self.witness = ListingWitness(os.fspath(checkout), self._config, racy_margin_ns)
        self.ran = 0
        """How many times Git listed the checkout."""
        self._out: bytes | None = None
        self._answer: tuple[list[str], list[Problem]] = ([], [])
        self._valid = False
        """Whether :attr:`_answer` is Git's answer after the witness's last observation."""

    def _config(self) -> list[tuple[str, str, str]] | None:
        proc = git(
            self.checkout, "config", "-z", "--list", "--show-origin", "--show-scope", check=False
        )
        if proc.returncode != 0:
            return None  # Git will say what is wrong when it lists
        try:
            return parse_config_list(proc.stdout)
        except ValueError:
            return None

    def __call__(self, full: bool = False) -> tuple[list[str], list[Problem]]:
        unchanged = self.witness.unchanged(git_env())
        if unchanged and self._valid and not full:
            return self._answer
        self._valid = False
        out = _ls_files(self.checkout)
        self.ran += 1
        if out != self._out:
            self._answer = _worktree_paths(out)
            self._out = out
        self._valid = True
        return self._answer


def list_members(checkout: Path) -> list[str]:
    """Every path a checkpoint of ``checkout`` may hold (working tree, then ``.git``)."""
    paths, _ = worktree_paths(checkout)
    return paths + git_dir_members(checkout)


def member_path_problem(path: str) -> str | None:
    """The name rules of a checkpoint member (:func:`common.repos.member_problem`,
    the controller's own). Outside ``.git`` a name's rules do not depend on
    its kind; inside, the listing only names what a checkpoint carries."""
    if path.startswith(GIT_DIR + "/") or path == GIT_DIR:
        try:
            validate_path(path)
        except InvalidPath:
            return "path_invalid"
        return None
    return member_problem({"path": path, "kind": "dir"})


def link_problem(path: str, target: str) -> str | None:
    return symlink_problem(path, target)


class MemberNames:
    """:func:`member_path_problem` remembered per path: the same names come
    back at every scan, and checking a name costs more than an lstat."""

    LIMIT: Final = 400_000

    def __init__(self) -> None:
        self._seen: dict[str, str | None] = {}

    def __call__(self, path: str) -> str | None:
        try:
            return self._seen[path]
        except KeyError:
            if len(self._seen) >= self.LIMIT:
                self._seen.clear()  # paths come and go; start over rather than grow
            problem = self._seen[path] = member_path_problem(path)
            return problem


_OBJECT_NAME: Final = re.compile(r"[0-9a-f]{2}/[0-9a-f]{38}(?:[0-9a-f]{24})?")
_PACK_NAME: Final = re.compile(r"pack/pack-[0-9a-f]{40}(?:[0-9a-f]{24})?\.(?:pack|idx|rev|bitmap)")
GIT_OBJECTS: Final = f"{GIT_DIR}/objects/"


def git_immutable(path: str) -> bool:
    """Whether ``path`` is a Git object or pack file, whose name is its content's
    hash: Git never rewrites one in place (:func:`fsagent.scan.engine.scan_tree`'s
    ``immutable``)."""
    if not path.startswith(GIT_OBJECTS):
        return False
    rest = path[len(GIT_OBJECTS) :]
    return bool(_OBJECT_NAME.fullmatch(rest) or _PACK_NAME.fullmatch(rest))


MAX_MEMBER_BYTES: Final = MAX_FILE_BYTES


def checkpoint_members(
    result: ScanResult, listing_problems: list[Problem]
) -> tuple[list[Member], list[Problem]]:
    """A scan of a checkout made into checkpoint members: directories only in
    ``.git`` (one in the working tree is a gitlink, i.e. a submodule). The
    problems are the scan's and the listing's (nested repositories)."""
    members = result.members
    problems = list(result.problems) + listing_problems
    kinds = list(map(member_kind, members))
    # Directories are members in .git only: count those there (one run of the
    # sorted members) before looking for others one by one.
    lo = bisect.bisect_left(members, GIT_DIR + "/", key=member_path)
    hi = bisect.bisect_left(members, GIT_DIR + "0", key=member_path)  # "0" follows "/"
    top = bisect.bisect_left(members, GIT_DIR, key=member_path)
    in_git = kinds[lo:hi].count("dir") + (
        top < len(members) and members[top].path == GIT_DIR and members[top].kind == "dir"
    )
    if kinds.count("dir") != in_git:
        kept: list[Member] = []
        for member in members:
            if member.kind == "dir" and not (
                member.path == GIT_DIR or member.path.startswith(GIT_DIR + "/")
            ):
                problems.append(Problem(member.path, "nested_repository"))
                continue
            kept.append(member)
        members = kept
    else:
        members = list(members)
    refused = link_tree_problems(members) if "symlink" in kinds else []
    if refused:
        gone = {p.path for p in refused}
        members = [m for m in members if m.path not in gone]
        problems += refused
    problems.sort(key=lambda p: p.path)
    return members, problems


def portable_config_pairs(checkout: Path) -> list[tuple[str, str]]:
    """The checkout's portable configuration, parsed as data without includes
    (:func:`portable_pairs`)."""
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
    """Keep only portable keys (:func:`common.repos.portable_config`, the
    controller's own filter): sorted by key, the last value of a key winning,
    so a checkpoint's config compares equal to the one it saved."""
    return portable_config(pairs)


def checkpoint_problem(members: list[dict[str, Any]]) -> tuple[str | None, str] | None:
    """(path, rule) when a complete checkpoint in wire form breaks one of
    :mod:`common.repos`'s rules (each member, then the whole tree), as the
    controller checks it; a restore checks again before it writes anything."""
    parsed: dict[str, RepoMember] = {}
    for member in members:
        rule = member_problem(member)
        if rule is not None:
            path = member.get("path") if isinstance(member, dict) else None
            return (path if isinstance(path, str) else None), rule
        repo_member = parse_member(member)
        if repo_member.path in parsed:
            return repo_member.path, "duplicate_member"
        parsed[repo_member.path] = repo_member
    return tree_problem(parsed)


def link_tree_problems(members: list[Member]) -> list[Problem]:
    """The symbolic links the controller would refuse once resolved through
    the checkout's other links (:func:`common.repos.tree_problem`), e.g.
    ``s/b -> ..`` with ``s/c -> b/../../x``: each one dropped is a problem.
    Only the links take part (a path through a file cannot resolve), so this
    costs nothing in a checkout without links."""
    links = {
        m.path: RepoMember(m.path, "symlink", target=m.target)
        for m in members
        if m.kind == "symlink"
    }
    if not links:
        return []
    head = RepoMember(f"{GIT_DIR}/HEAD", "file", "0" * 64, 0, False)
    problems: list[Problem] = []
    while links:
        found = tree_problem({**links, head.path: head})
        if found is None or found[0] is None or found[0] not in links:
            break
        path, rule = found[0], found[1]
        problems.append(Problem(path, rule))
        del links[path]
    return problems
