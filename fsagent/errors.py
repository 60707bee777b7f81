"""fsagent's own failures, each with the exit code the CLI reports.

Exit codes (also listed by ``fsagent --help``):

==  =====================================================================
0   success
1   unexpected error (a traceback is printed)
2   usage error (argparse)
3   state dir problem: corrupt, foreign, in use, or bound to another run
4   controller unreachable, or it refused the run token / folder; a failed
    save (not the agent folder's refusal over a storage limit, by ``flush``
    or at stop, which is a warning, AGENT_FILES_LIMIT_EXCEEDED: exit 0)
5   the mount itself failed (no /dev/fuse, mountpoint busy, ...)
6   ``fsagent doctor`` found something missing
8   ``fsagent repos prepare``: a checkout could not be cloned or restored
==  =====================================================================
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar

from common.errors import AppError, StaleLease, WorkFolderError

FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errors of a disk (or a quota) with no room left."""

EXIT_SAVE_FAILED = 4
"""Exit code of a failed save (the final one, or ``fsagent flush``): the state
dir keeps every change."""


class FsagentError(AppError):
    """A failure the CLI reports as one line and a documented exit code."""

    exit_code: ClassVar[int] = 1


class StateError(FsagentError):
    exit_code = 3


class StateCorrupt(StateError):
    """The state dir claims to be fsagent's but cannot be read."""


class StateForeign(StateError):
    """The directory holds something that is not an fsagent state dir."""


class StateInUse(StateError):
    """Another fsagent process holds the state dir."""


class StateBindingMismatch(StateError):
    """The state belongs to another company/owner/task/agent/user/project.

    Reusing it would mix one binding's unsaved work into another's folder, so
    the state is kept untouched and the mount refused.
    """


class StateModeMismatch(StateError):
    """The state dir belongs to a collection served in the other mode (FUSE or
    a plain directory): its unsaved changes cannot be served this way."""


class ControllerError(FsagentError):
    exit_code = 4


class ControllerUnavailable(ControllerError):
    """Transient failures persisted past the retry deadline."""


class ControllerRefused(ControllerError):
    """A permanent refusal (401/403/404/409/422): retrying cannot help."""

    def __init__(
        self,
        message: str,
        status: int,
        code: str | None = None,
        details: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.details = details or []
        """The answer's ``details`` (e.g. the storage limit and path of
        ``agent_files_limit_exceeded``), empty when it had none."""
        self.recorded = False
        """The controller keeps this refusal as a save receipt: it refused a
        checkpoint commit (fsagent.checkpoint.ship sets it). A refusal of an upload, or
        one decided here, has no receipt unless fsagent reports it."""

    def means(self, error: type[WorkFolderError]) -> bool:
        """Whether the controller refused with ``error``'s code (common.errors)."""
        return self.code == error.code

    @property
    def fences_the_run(self) -> bool:
        """Whether this run may never write again: a newer run holds the lease
        (409 ``stale_lease``), or the run token stopped working (401) because
        the run ended or was superseded. The token is read once per process,
        and an ended run never becomes active again, so retrying only adds load."""
        return self.status == 401 or self.means(StaleLease)


class ObjectUnavailable(ControllerError):
    """An object could not be fetched, or its bytes did not match the digest."""


class SaveFailed(FsagentError):
    """A checkpoint could not be saved; the state dir keeps every change.

    ``refused``: the controller refused it (trying again cannot help), rather
    than it failing on the way (network, 5xx, an I/O error here).
    ``over_limit``: refused for an agent folder's storage limit
    (``agent_files_limit_exceeded``), which the agent folder contract makes a
    recorded refusal and a warning of the run, not a failed save; ``details``
    then name the limit (``limit``, ``max``, ``value``, ``path`` for an
    oversized file), as the controller's answer did.
    ``recorded``: the controller kept the refusal as the save's receipt
    (:attr:`ControllerRefused.recorded`); any other failure is reported.
    """

    exit_code = 4

    def __init__(
        self,
        message: str,
        *,
        refused: bool = False,
        over_limit: bool = False,
        details: list[dict[str, Any]] | None = None,
        recorded: bool = False,
    ) -> None:
        super().__init__(message)
        self.refused = refused
        self.over_limit = over_limit
        self.details = details or []
        self.recorded = recorded


class MountFailed(FsagentError):
    exit_code = 5


class DoctorFailed(FsagentError):
    exit_code = 6


class MemberChanged(FsagentError):
    """A scanned file is no longer what the scan read (it changed before its
    upload): the checkpoint must scan again."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


class RepoSaveFailed(SaveFailed):
    """A repository checkpoint was not saved; the checkout is left as it is."""


class GitLockHeld(RepoSaveFailed):
    """A Git lock file is present: Git is changing the repository, so a
    checkpoint now could be torn. Refused; the next attempt tries again."""


class TreeUnstable(RepoSaveFailed):
    """The checkout kept changing while it was scanned, past the retries."""


class CheckoutUnsupported(RepoSaveFailed):
    """The checkout's layout cannot be saved (a ``.git`` file of a linked
    worktree or submodule, alternates, too many members)."""


class GitCommandFailed(RepoSaveFailed):
    """A Git command fsagent runs to read a checkout failed (a damaged index,
    a directory that is no repository): its message is Git's."""


class RepoBindingMismatch(StateError):
    """The directory at a checkout's path belongs to another task or
    workspace, or to nobody fsagent knows: it is never overwritten."""


class RepoPrepareFailed(FsagentError):
    """A checkout could not be cloned or restored (nothing was published)."""

    exit_code = 8
