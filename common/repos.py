"""Repositories: the contract between fsagent's repository checkpoints and the controller.

A task owns its own clone of every workspace of its project that has a
repository URL, at ``$HOME/repos/<name>`` on the sandbox's own disk (not a
FUSE mount). A **repository checkpoint** is a complete, content-addressed
picture of one checkout: Git objects and packs, refs, packed-refs, HEAD, the
index, tracked working files and non-ignored untracked files, with exec bits
and in-checkout symbolic links. The controller treats every checkpoint as
hostile data and validates every member (:func:`member_problem` and
:func:`tree_problem` are the rule book; the controller calls them, fsagent may
call them to fail early).

A task binds its project's workspaces when a run of the task starts
(``controller admin start-run``); a workspace added later is bound at the
next run start. A workspace's checkout name is fixed the first time the task
binds it and never changes.

Routes (run token, under ``/bridge/v1``; ``{workspaceId}`` must be bound to
the run's task, otherwise 404):

``GET /bridge/v1/repos``
    ``{"reposDir": "repos", "repos": [RepoBinding...]}`` where RepoBinding is
    ``{"workspaceId", "name", "repoUrl", "ref": str|null, "primary": bool,
    "branch": str|null, "setupCommand": str|null, "current": Current|null}``.
    ``name`` is the checkout's directory name under ``repos/``, fixed the
    first time the task binds the workspace (:func:`checkout_name`, or the
    workspace's own name; on a collision within the task a suffix from the
    workspace id: ``app-1f3a9c2e``). ``branch`` is the task's branch, set only
    on the primary workspace. Current is ``{"checkpointId", "entries",
    "byteSize", "savedAt"}``; ``checkpointId`` is a UUID string. A removed
    workspace is not listed (its binding and saved checkpoint stay, and the
    routes below still answer for it).

``POST /bridge/v1/repos/{workspaceId}/missing``  ``{"digests": [hex...]}``
    At most :data:`MISSING_MAX` digests. Answer ``{"missing": [hex...]}``:
    those the task cannot reference yet (neither in one of the task's current
    repository checkpoints nor uploaded by this run and still pinned). Only
    those travel.

``PUT /bridge/v1/repos/{workspaceId}/uploads`` and ``.../uploads/batch``
    Exactly the folder upload bodies and answers of :mod:`common.bridge`
    (framed zstd, host-hashed, batch all or nothing). An uploaded object may
    then be referenced by this run's repository checkpoints of that task for
    :data:`REPO_UPLOAD_TTL_SECONDS` (the controller's ``--repo-upload-ttl``):
    a save that takes longer than that is refused with 422
    ``unknown_content`` and must upload again.

``POST /bridge/v1/repos/{workspaceId}/checkpoints``
    ``{"operationId", "leaseEpoch", "base": checkpointId|null,
    "members": [Member...], "removed": [path...], "config": [[key, value]...]}``
    With ``base`` null, ``members`` is the whole checkpoint and ``removed``
    is empty. With ``base`` set, ``members`` are the added or changed members
    and ``removed`` the paths gone since ``base`` (each must be in ``base``,
    else 400); ``base`` must be the current checkpoint, else 409
    ``base_mismatch`` (send the whole checkpoint). ``config`` replaces the
    base's config whole. The controller validates the resulting complete
    checkpoint: every member against :func:`member_problem`, the whole tree
    with :func:`tree_problem` (``.git`` shape, no member below a file or
    symlink, each symlink resolved through the checkout's other symlinks),
    at most :data:`MAX_REPO_ENTRIES` members, each file at most
    ``MAX_FILE_BYTES``, every digest referenceable by the task and of the
    declared ``byteSize``. ``config`` pairs are data (at most
    :data:`MAX_CONFIG_PAIRS`): only :func:`portable_config` survives.
    The current pointer advances in one transaction, only after the
    manifest object and every referenced object are stored. Answer (the
    receipt): ``{"operationId", "checkpointId", "entries", "byteSize",
    "savedAt"}``; the same operation id and body again returns it with
    ``"replayed": true``; another body under that id is 409
    ``idempotency_conflict``; an old lease or an ended run is 409
    ``stale_lease``; a refused member is 422 ``unsafe_repo_member`` with
    ``"path"`` (null when the refusal is about the whole checkpoint) and
    ``"rule"`` (a :data:`RULES` name), both at the top of the error body and
    in ``details``.

``GET /bridge/v1/repos/{workspaceId}/checkpoints/{checkpointId}/manifest``
    (``current`` names the current one; any other id than the current one is
    404) ``{"checkpointId", "members", "config"}``: the complete checkpoint,
    members sorted by path.

``POST /bridge/v1/repos/{workspaceId}/objects/batch``  ``{"digests": [hex...]}``
    At most :data:`FETCH_BATCH_MAX` digests, each referenced by that
    workspace's current checkpoint of the task (else 404, naming them).
    Answer ``application/octet-stream``: exactly the batch body of
    :func:`common.bridge.encode_batch` (header, then per member its size,
    SHA-256 and frames), members in request order. Members may be of any
    size (frames of at most ``CHUNK_MAX`` raw bytes each, streamed from
    storage): ask for large objects a few at a time. The client verifies
    every SHA-256 itself.

``POST /bridge/v1/repos/{workspaceId}/report``
    ``{"state": "saving"|"failed", "error"?: str}``: a visible save state
    (a refused checkpoint also records ``failed`` with its reason).

People (API token or session; the task folder's read rule):
``GET /api/companies/{companyId}/tasks/{taskId}/repos`` lists each bound
repository: ``{"workspaceId", "name", "repoUrl", "state", "lastSavedAt",
"byteSize", "fileCount", "entries", "error", "checkpointId", "removed"}``
(``state``: ``unsaved``, ``saving``, ``saved`` or ``failed``); ``GET
.../repos/{workspaceId}/archive`` streams the current checkpoint as a tar
(members under ``<name>/``, exec bits and symlinks kept).

Member: ``{"path", "kind": "file"|"symlink"|"dir", "digest": hex (file),
"byteSize" (file), "executable": bool (file), "target": str (symlink)}``,
exactly these fields per kind. Paths are relative to the checkout,
``/``-separated, in the :mod:`common.paths` rules.
"""

from __future__ import annotations

import posixpath
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from common.errors import InvalidPath
from common.limits import MAX_ENTRIES, MAX_FILE_BYTES
from common.paths import parent_of, validate_path
from common.text import char_problem

MAX_REPO_ENTRIES: Final = MAX_ENTRIES
"""Members of one checkpoint (one scan)."""

MISSING_MAX: Final = 10_000
FETCH_BATCH_MAX: Final = 1024

REPO_UPLOAD_TTL_SECONDS: Final = 3600
"""How long an uploaded object stays usable by a repository checkpoint."""

KINDS: Final = ("file", "symlink", "dir")

GIT_DIR: Final = ".git"

GIT_INCLUDED_TOP: Final = frozenset({"HEAD", "index", "packed-refs", "shallow", "ORIG_HEAD"})
"""Files directly in ``.git`` that a checkpoint carries."""

GIT_INCLUDED_TREES: Final = ("objects", "refs", "logs")
"""Directories under ``.git`` that a checkpoint carries (whole)."""

GIT_REFUSED: Final = (
    "objects/info/alternates",
    "objects/info/http-alternates",
    "commondir",
    "gitdir",
    "worktrees",
    "modules",
)
"""Administrative paths that point a repository outside itself."""

MAX_CHECKOUT_NAME: Final = 100
"""Characters of a checkout name before any collision suffix."""

MAX_SYMLINK_TARGET_BYTES: Final = 4095
MAX_SYMLINK_HOPS: Final = 40
"""Symbolic links followed while resolving one link (Linux's ELOOP bound)."""
MAX_RESOLVE_STEPS: Final = 1_000_000
"""Path components walked resolving every link of one checkpoint together: a
hostile manifest of long chained links costs bounded work."""

MAX_CONFIG_PAIRS: Final = 1000

RULES: Final = frozenset(
    {
        "member_malformed",
        "path_invalid",
        "kind_not_allowed",
        "duplicate_member",
        "file_too_large",
        "size_mismatch",
        "git_file",
        "git_case_alias",
        "nested_git_dir",
        "git_alternates",
        "git_commondir",
        "git_gitdir",
        "git_worktrees",
        "git_modules",
        "git_member_not_allowed",
        "git_head_missing",
        "parent_not_directory",
        "symlink_target_invalid",
        "symlink_absolute",
        "symlink_in_git_dir",
        "symlink_escapes_checkout",
        "symlink_into_git_dir",
        "symlink_loop",
        "symlink_too_complex",
        "too_many_members",
    }
)
"""Every ``rule`` an ``unsafe_repo_member`` refusal can name."""

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_MEMBER_FIELDS: Final = {
    "file": frozenset({"path", "kind", "digest", "byteSize", "executable"}),
    "symlink": frozenset({"path", "kind", "target"}),
    "dir": frozenset({"path", "kind"}),
}

# Code points HFS+ ignores in names, so ``.g\u200cit`` opens ``.git`` there
# (the list Git itself checks in is_hfs_dotgit).
_HFS_IGNORABLE = frozenset(
    "\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
    "\u206a\u206b\u206c\u206d\u206e\u206f\ufeff"
)


class RepoMember(NamedTuple):
    """One validated member (:func:`parse_member`)."""

    path: str
    kind: str
    digest: str | None = None
    byte_size: int = 0
    executable: bool = False
    target: str | None = None

    def as_json(self) -> dict[str, object]:
        """The wire form: exactly the fields of its kind."""
        if self.kind == "file":
            return {
                "path": self.path,
                "kind": "file",
                "digest": self.digest,
                "byteSize": self.byte_size,
                "executable": self.executable,
            }
        if self.kind == "symlink":
            return {"path": self.path, "kind": "symlink", "target": self.target}
        return {"path": self.path, "kind": "dir"}


def checkout_name(repo_url: str) -> str:
    """The checkout directory a repository URL suggests: its last path segment
    without ``.git`` (``https://h/o/app.git`` -> ``app``; ``/srv/x/`` -> ``x``)."""
    tail = re.split(r"[/:\\]", repo_url.rstrip("/"))[-1]
    if tail.endswith(".git"):
        tail = tail[:-4]
    tail = re.sub(r"[^A-Za-z0-9._-]", "-", tail).strip(".-")
    return tail[:MAX_CHECKOUT_NAME].rstrip(".-") or "repo"


_CHECKOUT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def checkout_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a checkout directory under ``repos/``, or None:
    1-:data:`MAX_CHECKOUT_NAME` letters, digits, ``.``, ``_`` and ``-``,
    starting with a letter or digit (a safe path segment everywhere, also in
    an environment variable and a tar archive)."""
    if not 1 <= len(name) <= MAX_CHECKOUT_NAME:
        return f"a checkout name has 1-{MAX_CHECKOUT_NAME} characters"
    if not _CHECKOUT_NAME.fullmatch(name):
        return (
            "a checkout name is letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    return None


def is_dotgit_name(segment: str) -> bool:
    """Whether a path segment names ``.git`` on some filesystem: any letter
    case (case-insensitive filesystems), HFS+-ignorable code points, NTFS's
    trailing dots and spaces, alternate streams (``.git::$INDEX_ALLOCATION``)
    and 8.3 short name (``git~1``)."""
    if segment.isascii():  # the common case: no HFS+-ignorable code point
        name = segment.lower()
    else:
        name = "".join(ch for ch in segment if ch not in _HFS_IGNORABLE).lower()
    if "git" not in name:
        return False
    name = name.split(":", 1)[0].rstrip(". ")
    return name in (GIT_DIR, "git~1")


def is_git_admin(path: str) -> bool:
    """Whether ``path`` is ``.git`` or inside it, under any spelling that
    opens ``.git`` somewhere (:func:`is_dotgit_name`)."""
    return is_dotgit_name(path.split("/", 1)[0])


def symlink_problem(path: str, target: str) -> str | None:
    """Why a symbolic link at ``path`` pointing at ``target`` is refused, or None.

    Resolution is lexical: a relative target, resolved from the link's own
    directory, must stay inside the checkout and out of ``.git``. (Links
    through other links are resolved by :func:`tree_problem`.)
    """
    if (
        not target
        or any(ord(ch) < 0x20 for ch in target)
        or len(target.encode("utf-8", "surrogatepass")) > MAX_SYMLINK_TARGET_BYTES
    ):
        return "symlink_target_invalid"
    if target.startswith("/"):
        return "symlink_absolute"
    if is_git_admin(path):
        return "symlink_in_git_dir"
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    if resolved == ".." or resolved.startswith("../") or resolved == ".":
        return "symlink_escapes_checkout"
    if is_git_admin(resolved):
        return "symlink_into_git_dir"
    return None


def ref_problem(name: str) -> str | None:
    """Why ``name`` is not a branch or ref name this product accepts, or None:
    Git's ref-name rules (``git check-ref-format``), never a leading ``-``
    (it would read as an option on a command line), and none of the
    characters :mod:`common.text` refuses."""
    if not 1 <= len(name) <= 255:
        return "a ref name has 1-255 characters"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F or ch in " ~^:?*[\\" for ch in name):
        return "a ref name has no control characters, spaces or any of ~^:?*[\\"
    if not name.isascii() and any(char_problem(ch) for ch in name):
        # Git takes them; a person reading the branch's name would be misled.
        return "a ref name has no C1 control, bidirectional control or invisible character"
    if name.startswith(("-", "/")) or name.endswith(("/", ".", ".lock")):
        return "a ref name does not start with - or /, nor end with /, . or .lock"
    if ".." in name or "@{" in name or "//" in name or name == "@":
        return "a ref name holds no '..', '@{' or '//' and is not '@'"
    if any(part.startswith(".") for part in name.split("/")):
        return "no part of a ref name starts with '.'"
    return None


def _git_problem(path: str, kind: str) -> str | None:
    """The ``.git`` rules for a member whose first segment is exactly ``.git``."""
    rel = path[len(GIT_DIR) + 1 :]
    if rel == "":
        return None if kind == "dir" else "git_file"
    # The refused names are compared in any case: on a case-insensitive
    # filesystem ``objects/info/ALTERNATES`` is the alternates file.
    folded = rel.lower()
    first = folded.split("/", 1)[0]
    if folded in ("objects/info/alternates", "objects/info/http-alternates"):
        return "git_alternates"
    if first in ("commondir", "gitdir", "worktrees", "modules"):
        return f"git_{first}"
    top, _, rest = rel.partition("/")
    if rest:
        return None if top in GIT_INCLUDED_TREES else "git_member_not_allowed"
    if top in GIT_INCLUDED_TOP and kind == "file":
        return None
    if top in GIT_INCLUDED_TREES and kind == "dir":
        return None
    return "git_member_not_allowed"


def member_problem(member: object) -> str | None:
    """Why one checkpoint member is refused (a :data:`RULES` name), or None.

    ``member`` is the decoded JSON object as received; nothing about it is
    assumed. The whole-checkpoint rules are :func:`tree_problem`'s.
    """
    if not isinstance(member, Mapping):
        return "member_malformed"
    path, kind = member.get("path"), member.get("kind")
    if not isinstance(path, str) or not isinstance(kind, str):
        return "member_malformed"
    try:
        validate_path(path)
    except InvalidPath:
        return "path_invalid"
    if kind not in KINDS:
        # Sockets, FIFOs and devices have no meaning in another sandbox.
        return "kind_not_allowed"
    if set(member) != _MEMBER_FIELDS[kind]:
        return "member_malformed"
    segments = path.split("/")
    if is_dotgit_name(segments[0]) and segments[0] != GIT_DIR:
        return "git_case_alias"
    if any(is_dotgit_name(segment) for segment in segments[1:]):
        # A nested repository's administrative files (its config, its hooks)
        # would act on whoever runs Git inside that directory later.
        return "nested_git_dir"
    if kind == "file":
        digest, size, executable = member["digest"], member["byteSize"], member["executable"]
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            return "member_malformed"
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return "member_malformed"
        if not isinstance(executable, bool):
            return "member_malformed"
        if size > MAX_FILE_BYTES:
            return "file_too_large"
    if kind == "symlink":
        target = member["target"]
        if not isinstance(target, str):
            return "member_malformed"
        problem = symlink_problem(path, target)
        if problem is not None:
            return problem
    if segments[0] == GIT_DIR:
        return _git_problem(path, kind)
    return None


def parse_member(member: Mapping[str, object]) -> RepoMember:
    """A member that :func:`member_problem` accepted, as a :class:`RepoMember`."""
    kind = str(member["kind"])
    path = str(member["path"])
    if kind == "file":
        size = member["byteSize"]
        assert isinstance(size, int)
        return RepoMember(path, kind, str(member["digest"]), size, bool(member["executable"]), None)
    if kind == "symlink":
        return RepoMember(path, kind, target=str(member["target"]))
    return RepoMember(path, kind)


def tree_problem(members: Mapping[str, RepoMember]) -> tuple[str | None, str] | None:
    """Why a complete checkpoint (path -> member, each already accepted by
    :func:`member_problem`) is refused: ``(path, rule)``, path None for the
    whole checkpoint; or None.

    - at most :data:`MAX_REPO_ENTRIES` members;
    - ``.git/HEAD`` is a file: the checkpoint is a repository;
    - no member lies below a file or a symlink: a restore (or a tar
      extraction) must never write through a link;
    - every symlink, resolved component by component through the
      checkpoint's other symlinks (at most :data:`MAX_SYMLINK_HOPS` links),
      stays inside the checkout and out of ``.git``. Lexical resolution alone
      is not enough: with ``s/b -> ..``, ``s/c -> b/../../x`` looks like
      ``x`` but leaves the checkout.
    """
    if len(members) > MAX_REPO_ENTRIES:
        return None, "too_many_members"
    head = members.get(GIT_DIR + "/HEAD")
    if head is None or head.kind != "file":
        return GIT_DIR + "/HEAD", "git_head_missing"
    directories: set[str] = set()
    for path in members:
        parent = parent_of(path)
        while parent is not None and parent not in directories:
            above = members.get(parent)
            if above is not None and above.kind != "dir":
                return path, "parent_not_directory"
            directories.add(parent)
            parent = parent_of(parent)
    budget = [MAX_RESOLVE_STEPS]
    for member in members.values():
        if member.kind == "symlink":
            problem = _resolve_problem(members, member, budget)
            if problem is not None:
                return member.path, problem
    return None


@dataclass
class TreeIndex:
    """What :func:`tree_problem` needs to judge a delta on a complete
    checkpoint without walking it whole (:func:`delta_tree_problem`): how
    many members lie below each directory path, and the symlinks. Built once
    per checkpoint (linear), then copied and updated by each delta."""

    below: dict[str, int] = field(default_factory=dict)
    """Directory path -> number of members strictly below it."""
    links: dict[str, RepoMember] = field(default_factory=dict)
    """Path -> member, for every symlink."""

    @classmethod
    def of(cls, members: Mapping[str, RepoMember]) -> TreeIndex:
        index = cls()
        below = index.below
        for path, member in members.items():
            parent = parent_of(path)
            while parent is not None:
                below[parent] = below.get(parent, 0) + 1
                parent = parent_of(parent)
            if member.kind == "symlink":
                index.links[path] = member
        return index

    def copy(self) -> TreeIndex:
        return TreeIndex(dict(self.below), dict(self.links))

    def added(self, path: str) -> None:
        """A path that was not in the checkpoint now is."""
        parent = parent_of(path)
        while parent is not None:
            self.below[parent] = self.below.get(parent, 0) + 1
            parent = parent_of(parent)

    def removed(self, path: str) -> None:
        """A path of the checkpoint is gone."""
        parent = parent_of(path)
        while parent is not None:
            left = self.below[parent] - 1
            if left:
                self.below[parent] = left
            else:
                del self.below[parent]
            parent = parent_of(parent)


def delta_tree_problem(
    members: Mapping[str, RepoMember],
    index: TreeIndex,
    changed: Iterable[RepoMember],
    links_changed: bool,
) -> tuple[str | None, str] | None:
    """:func:`tree_problem` of ``members``, a complete checkpoint made by a
    delta (``changed``: its added or changed members) on a checkpoint that
    passed it, with ``index`` already describing ``members``. The same
    verdict at the cost of the delta:

    - a member can only come to lie below a file or a symlink when it or
      that ancestor is one of the changed members (a removal frees space,
      never fills it): each changed member's ancestors are looked up, and a
      changed member that is not a directory must have nothing below it;
    - a symlink resolves through the checkpoint's symlinks only, so when no
      symlink was added, changed or removed (``links_changed``) every one
      resolves as it did; otherwise all of them are resolved again, with the
      whole checkpoint's budget.
    """
    if len(members) > MAX_REPO_ENTRIES:
        return None, "too_many_members"
    head = members.get(GIT_DIR + "/HEAD")
    if head is None or head.kind != "file":
        return GIT_DIR + "/HEAD", "git_head_missing"
    for member in changed:
        path = member.path
        parent = parent_of(path)
        while parent is not None:
            above = members.get(parent)
            if above is not None and above.kind != "dir":
                return path, "parent_not_directory"
            parent = parent_of(parent)
        if member.kind != "dir" and index.below.get(path):
            prefix = path + "/"
            # Refused: naming the member below costs one walk, on this path only.
            return next(p for p in members if p.startswith(prefix)), "parent_not_directory"
    if links_changed:
        budget = [MAX_RESOLVE_STEPS]
        for link in index.links.values():
            problem = _resolve_problem(members, link, budget)
            if problem is not None:
                return link.path, problem
    return None


def _resolve_problem(
    members: Mapping[str, RepoMember], link: RepoMember, budget: list[int]
) -> str | None:
    """Resolve ``link`` as the kernel would inside a checkout holding
    ``members``; why the result is refused, or None."""
    assert link.target is not None
    where = link.path.split("/")[:-1]
    pending = list(reversed(link.target.split("/")))
    hops = 1  # the link itself, as the kernel counts
    while pending:
        budget[0] -= 1
        if budget[0] < 0:
            return "symlink_too_complex"
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not where:
                return "symlink_escapes_checkout"
            where.pop()
            continue
        below = members.get("/".join([*where, part]))
        if below is not None and below.kind == "symlink":
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                return "symlink_loop"
            assert below.target is not None
            # Relative to the directory holding that link, which is ``where``.
            pending.extend(reversed(below.target.split("/")))
            continue
        where.append(part)
    if not where:
        return "symlink_escapes_checkout"
    if any(is_dotgit_name(part) for part in where):
        return "symlink_into_git_dir"
    return None


_SECTION_NAME = re.compile(r"^[A-Za-z0-9-]+$")
_REMOTE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

_PORTABLE_VALUES: Final = {
    ("core", "repositoryformatversion"): frozenset({"0", "1"}),
    ("extensions", "objectformat"): frozenset({"sha1", "sha256"}),
}
"""Keys without a subsection that a checkpoint may carry, with their values."""


def _split_key(key: str) -> tuple[str, str | None, str] | None:
    """``section[.subsection].name`` with section and name folded to lower
    case (Git compares them so; a subsection keeps its case)."""
    first, last = key.find("."), key.rfind(".")
    if first <= 0 or last == len(key) - 1:
        return None
    section, name = key[:first], key[last + 1 :]
    subsection = key[first + 1 : last] if last > first else None
    if not _SECTION_NAME.fullmatch(section) or not _SECTION_NAME.fullmatch(name):
        return None
    return section.lower(), subsection, name.lower()


def portable_config(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs of a checkout's ``.git/config`` that another sandbox may apply,
    sorted by key, the last value of a key winning; everything else is dropped.

    The pairs are data (as ``git config --list -z --no-includes`` prints
    them); nothing here reads a file, so ``include``/``includeIf`` can point
    nowhere and are dropped with every other unlisted key: ``core.fsmonitor``,
    ``core.hooksPath``, ``core.sshCommand``, ``core.attributesFile``,
    ``remote.*`` (``origin`` is recreated from the binding) and the rest.
    Kept: ``core.repositoryformatversion`` (0 or 1), ``extensions.objectformat``
    (sha1 or sha256), and ``branch.<name>.remote`` (a remote name or ``.``)
    and ``branch.<name>.merge`` (a ref) for a valid branch name.
    """
    kept: dict[str, str] = {}
    for key, value in pairs:
        if not unicodedata.is_normalized("NFC", key) or len(key) > 512 or len(value) > 1024:
            continue
        parts = _split_key(key)
        if parts is None:
            continue
        section, subsection, name = parts
        if subsection is None:
            allowed = _PORTABLE_VALUES.get((section, name))
            if allowed is not None and value.lower() in allowed:
                kept[f"{section}.{name}"] = value.lower()
            continue
        if section != "branch" or ref_problem(subsection) is not None:
            continue
        if name == "remote" and (value == "." or _REMOTE_NAME.fullmatch(value)):
            kept[f"branch.{subsection}.remote"] = value
        elif name == "merge" and value.startswith("refs/") and ref_problem(value) is None:
            kept[f"branch.{subsection}.merge"] = value
    return sorted(kept.items())
