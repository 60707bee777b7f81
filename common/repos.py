"""Repositories: the contract between fsagent's repository checkpoints and the controller.

A task owns its own clone of every workspace of its project that has a
repository URL, at ``$HOME/repos/<name>`` on the sandbox's own disk (not a
FUSE mount). A **repository checkpoint** is a complete, content-addressed
picture of one checkout: Git objects and packs, refs, packed-refs, HEAD, the
index, tracked working files and non-ignored untracked files, with exec bits
and in-checkout symbolic links. The controller treats every checkpoint as
hostile data and validates every member (:func:`member_problem` is the rule
book; the controller calls it, fsagent may call it to fail early).

Routes (run token, under ``/bridge/v1``; ``{workspaceId}`` must be bound to
the run's task, otherwise 404):

``GET /bridge/v1/repos``
    ``{"reposDir": "repos", "repos": [RepoBinding...]}`` where RepoBinding is
    ``{"workspaceId", "name", "repoUrl", "ref": str|null, "primary": bool,
    "branch": str|null, "setupCommand": str|null, "current": Current|null}``.
    ``name`` is the checkout's directory name under ``repos/``, fixed the
    first time the task binds the workspace (:func:`checkout_name`). ``branch``
    is the task's branch, set only on the primary workspace. Current is
    ``{"checkpointId", "entries", "byteSize", "savedAt"}``.

``POST /bridge/v1/repos/{workspaceId}/missing``  ``{"digests": [hex...]}``
    At most :data:`MISSING_MAX` digests. Answer ``{"missing": [hex...]}``:
    those the task cannot reference yet (neither in one of the task's current
    repository checkpoints nor uploaded by this run). Only those travel.

``PUT /bridge/v1/repos/{workspaceId}/uploads`` and ``.../uploads/batch``
    Exactly the folder upload bodies and answers of :mod:`common.bridge`
    (framed zstd, host-hashed, batch all or nothing). An uploaded object may
    then be referenced by this run's repository checkpoints of that task.

``POST /bridge/v1/repos/{workspaceId}/checkpoints``
    ``{"operationId", "leaseEpoch", "base": checkpointId|null,
    "members": [Member...], "removed": [path...], "config": [[key, value]...]}``
    With ``base`` null, ``members`` is the whole checkpoint and ``removed``
    is empty. With ``base`` set, ``members`` are the added or changed members
    and ``removed`` the paths gone since ``base``; ``base`` must be the
    current checkpoint, else 409 ``base_mismatch`` (send the whole
    checkpoint). The controller validates the resulting complete checkpoint:
    every member against :func:`member_problem`, the ``.git`` shape
    (:func:`tree_problem`), at most :data:`MAX_REPO_ENTRIES` members, each
    file at most ``MAX_FILE_BYTES``, every digest referenceable by the task.
    ``config`` pairs are data: only :func:`portable_config` survives.
    The current pointer advances in one transaction, only after the
    manifest object and every referenced object are stored. Answer (the
    receipt): ``{"operationId", "checkpointId", "entries", "byteSize",
    "savedAt"}``; the same operation id and body again returns it with
    ``"replayed": true``; another body under that id is 409
    ``idempotency_conflict``; an old lease is 409 ``stale_lease``; a refused
    member is 422 ``unsafe_repo_member`` with ``{"path", "rule"}``.

``GET /bridge/v1/repos/{workspaceId}/checkpoints/{checkpointId}/manifest``
    (``current`` names the current one) ``{"checkpointId", "members",
    "config"}``: the complete checkpoint, members sorted by path.

``POST /bridge/v1/repos/{workspaceId}/objects/batch``  ``{"digests": [hex...]}``
    At most :data:`FETCH_BATCH_MAX` digests, each referenced by that
    workspace's current checkpoint of the task. Answer
    ``application/octet-stream``: exactly the batch body of
    :func:`common.bridge.encode_batch` (header, then per member its size,
    SHA-256 and frames), members in request order. The client verifies every
    SHA-256 itself.

``POST /bridge/v1/repos/{workspaceId}/report``
    ``{"state": "saving"|"failed", "error"?: str}``: a visible save state.

People (API token or session; the task folder's read rule):
``GET /api/companies/{companyId}/tasks/{taskId}/repos`` lists each bound
repository: ``{"workspaceId", "name", "repoUrl", "state", "lastSavedAt",
"byteSize", "fileCount", "error", "checkpointId"}``; ``GET
.../repos/{workspaceId}/archive`` streams the current checkpoint as a tar.

Member: ``{"path", "kind": "file"|"symlink"|"dir", "digest": hex (file),
"byteSize" (file), "executable": bool (file), "target": str (symlink)}``.
Paths are relative to the checkout, ``/``-separated, in the
:mod:`common.paths` rules.
"""

from __future__ import annotations

import posixpath
import re
from typing import Final

from common.limits import MAX_ENTRIES

MAX_REPO_ENTRIES: Final = MAX_ENTRIES
"""Members of one checkpoint (one scan)."""

MISSING_MAX: Final = 10_000
FETCH_BATCH_MAX: Final = 1024

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


def checkout_name(repo_url: str) -> str:
    """The checkout directory a repository URL suggests: its last path segment
    without ``.git`` (``https://h/o/app.git`` -> ``app``; ``/srv/x/`` -> ``x``)."""
    tail = re.split(r"[/:\\]", repo_url.rstrip("/"))[-1]
    if tail.endswith(".git"):
        tail = tail[:-4]
    tail = re.sub(r"[^A-Za-z0-9._-]", "-", tail).strip(".-")
    return tail or "repo"


def is_git_admin(path: str) -> bool:
    """Whether ``path`` is ``.git`` or inside it, under any letter case
    (case-insensitive filesystems alias ``.GIT`` to ``.git``)."""
    return path.split("/", 1)[0].lower() == GIT_DIR


def symlink_problem(path: str, target: str) -> str | None:
    """Why a symbolic link at ``path`` pointing at ``target`` is refused, or None.

    Resolution is lexical: a relative target, resolved from the link's own
    directory, must stay inside the checkout and out of ``.git``.
    """
    if not target or "\x00" in target:
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
