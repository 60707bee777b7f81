"""The root of the project's errors, and the controller's hierarchy.

:class:`AppError` is the root of every error raised on purpose, on both sides:
the controller's :class:`WorkFolderError` (an HTTP status and a stable code)
and fsagent's :class:`fsagent.errors.FsagentError` (a CLI exit code). fsagent
learns a controller refusal's meaning from its ``code``, compared with the
classes here (:meth:`fsagent.errors.ControllerRefused.means`), so no class is
defined on both sides.

Every controller error carries a stable ``code`` (listed in README, "Error codes") and the
HTTP status the controller answers with. The API body is always
``{"error": <message>, "code": <code>, "details"?: [...]}``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class AppError(Exception):
    """Root of every error the project raises on purpose (either side)."""


class WorkFolderError(AppError):
    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500
    message: ClassVar[str] = "Internal error"

    def __init__(self, message: str | None = None, *, details: list[Any] | None = None) -> None:
        super().__init__(message or self.message)
        self.details = details

    @property
    def text(self) -> str:
        return str(self.args[0])

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.text, "code": self.code}
        if self.details is not None:
            body["details"] = self.details
        return body


class ValidationError(WorkFolderError):
    code = "validation_error"
    status = 400
    message = "Validation error"

    def __init__(self, details: list[dict[str, Any]]) -> None:
        super().__init__("Validation error", details=details)

    @classmethod
    def single(cls, field: str, code: str, message: str) -> ValidationError:
        return cls([{"field": field, "code": code, "message": message}])


class InvalidPath(ValidationError):
    """A path broke one of the rules in :mod:`common.paths`."""

    code = "invalid_path"

    def __init__(self, reason: str, message: str, field: str = "path") -> None:
        super().__init__([{"field": field, "code": reason, "message": message}])
        self.reason = reason


class InvalidText(ValidationError):
    """A free-text field (an operation id, a reported error, a name or a
    title) broke :mod:`common.text`'s rule; ``details[0]`` names the field."""

    code = "invalid_text"

    def __init__(self, field: str, reason: str, message: str) -> None:
        super().__init__([{"field": field, "code": reason, "message": message}])
        self.reason = reason


class Unauthenticated(WorkFolderError):
    code = "unauthenticated"
    status = 401
    message = "Missing or invalid token"


class NotFound(WorkFolderError):
    """Also the answer to every authorization denial, so nothing can be probed."""

    code = "not_found"
    status = 404
    message = "Work folder not found"


class FileNotFound(NotFound):
    code = "file_not_found"
    message = "File not found"


class RunNotFound(NotFound):
    code = "run_not_found"
    message = "Run not found"


# --- the company admin API (controller/orgs.py, controller/runs.py) ---------


class CompanyNotFound(NotFound):
    """No such company, or the caller may not administer it: owners, admins
    and the company's operator tokens see it; everyone else sees nothing."""

    code = "company_not_found"
    message = "Company not found"


class UserNotFound(NotFound):
    code = "user_not_found"
    message = "User not found"


class MemberNotFound(NotFound):
    code = "member_not_found"
    message = "The user is not a member of this company"


class AgentNotFound(NotFound):
    code = "agent_not_found"
    message = "Agent not found"


class ProjectNotFound(NotFound):
    code = "project_not_found"
    message = "Project not found"


class TaskNotFound(NotFound):
    code = "task_not_found"
    message = "Task not found"


class WorkspaceNotFound(NotFound):
    code = "workspace_not_found"
    message = "Workspace not found"


class TokenNotFound(NotFound):
    code = "token_not_found"
    message = "Token not found"


class InvitationNotFound(NotFound):
    code = "invitation_not_found"
    message = "Invitation not found"


class InvitationExpired(WorkFolderError):
    """One's own invitation, past its answer time (controller.invitations)."""

    code = "invitation_expired"
    status = 410
    message = "The invitation has expired; the company may invite you again"


class OwnerRequired(WorkFolderError):
    """Only an owner gives, changes or takes away the owner role."""

    code = "owner_required"
    status = 403
    message = "Only an owner may give, change or take away the owner role"


class TokenShared(WorkFolderError):
    """A person's API token serves them in every company they belong to: one
    company's owners and admins revoke it only while it serves that company alone."""

    code = "token_shared"
    status = 403
    message = (
        "This API token also serves its user in another company; remove the member from this"
        " company instead, or have the host's operator revoke it (controller admin revoke-token)"
    )


class IsADirectory(WorkFolderError):
    code = "is_directory"
    status = 400
    message = "Path is a directory"


class CsrfFailed(WorkFolderError):
    code = "csrf_failed"
    status = 403
    message = "Missing or wrong X-CSRF-Token for a cookie-authenticated write"


class MembershipRevoked(WorkFolderError):
    code = "membership_revoked"
    status = 403
    message = "The run's responsible user is no longer a member; the user folder was not saved"


class ResyncRequired(WorkFolderError):
    code = "resync_required"
    status = 410
    message = "Changes since that version are no longer complete; list from since=0"


class BadFrame(ValidationError):
    """A corrupt upload frame (bridge uploads)."""

    code = "bad_frame"

    def __init__(self, reason: str = "Corrupt upload frame") -> None:
        super().__init__([{"field": "body", "code": "bad_frame", "message": reason}])


class UnknownContent(WorkFolderError):
    code = "unknown_content"
    status = 422
    message = "Checkpoint references content that is not visible to this folder"


class UnsafeRepoMember(WorkFolderError):
    """A repository checkpoint member (or the whole checkpoint: ``path`` None)
    broke one of :mod:`common.repos`'s rules; nothing was published."""

    code = "unsafe_repo_member"
    status = 422
    message = "A repository checkpoint member is refused"

    def __init__(self, path: str | None, rule: str) -> None:
        where = "the checkpoint" if path is None else repr(path)
        super().__init__(f"{where} is refused: {rule}", details=[{"path": path, "rule": rule}])
        self.path = path
        self.rule = rule

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "path": self.path, "rule": self.rule}


class DigestMismatch(WorkFolderError):
    code = "digest_mismatch"
    status = 422
    message = "Uploaded bytes do not match the declared digest or length"


class Conflict(WorkFolderError):
    code = "conflict"
    status = 409
    message = "Conflict"


class KindConflict(Conflict):
    code = "kind_conflict"
    message = "Path already exists with another kind"


class ParentIsFile(Conflict):
    code = "parent_is_file"
    message = "A parent path is a file"


class RestoreCollision(Conflict):
    code = "restore_collision"
    message = "Cannot restore: a file or folder already exists at that path"


class MoveTargetExists(Conflict):
    code = "target_exists"
    message = "A file or folder already exists at the move's target"


class MoveIntoItself(Conflict):
    code = "move_into_itself"
    message = "A folder cannot be moved into itself or below itself"


class IdempotencyConflict(Conflict):
    code = "idempotency_conflict"
    message = "Idempotency key was already used for a different request"


class EmailTaken(Conflict):
    code = "email_taken"
    message = "A user with this email already exists"


class AlreadyMember(Conflict):
    code = "already_member"
    message = "The user is already a member of this company"


class LastOwner(Conflict):
    code = "last_owner"
    message = "A company keeps at least one owner"


class RunNotActive(Conflict):
    code = "run_not_active"
    message = "Run is not running"


class StaleLease(Conflict):
    code = "stale_lease"
    message = "Lease epoch is older than the current lease"


class BaseMismatch(Conflict):
    """A delta repository checkpoint named a base that is not the current one."""

    code = "base_mismatch"
    message = "The checkpoint's base is not the current checkpoint; send the whole checkpoint"


class StaleSave(Conflict):
    """An editor's save whose ``X-Base-Digest`` (the version it read) is no
    longer the file at its path: nothing was written, the draft is the
    editor's to keep (a stale browser save is 409, never a silent overwrite)."""

    code = "stale_save"
    message = "The file changed since the editor read it: nothing was saved"


class PreconditionFailed(WorkFolderError):
    """``If-None-Match: *`` met an existing file, or ``If-Match`` a different digest."""

    code = "precondition_failed"
    status = 412
    message = "The file changed: the request's If-Match or If-None-Match condition does not hold"


class PayloadTooLarge(WorkFolderError):
    code = "payload_too_large"
    status = 413
    message = "Payload too large"


class RangeNotSatisfiable(WorkFolderError):
    code = "range_not_satisfiable"
    status = 416
    message = "Requested range not satisfiable"


class StorageUnavailable(WorkFolderError):
    code = "storage_unavailable"
    status = 503
    message = "Object storage is unavailable"


class DatabaseUnavailable(WorkFolderError):
    code = "database_unavailable"
    status = 503
    message = "Database is unavailable"


# --- transport limits (controller/api/limits.py, controller/api/protocol.py) --


class RequestTimeout(WorkFolderError):
    """The request head or body did not arrive in time (or arrived too slowly)."""

    code = "request_timeout"
    status = 408
    message = "The request did not arrive in time"


class TooManyRequests(WorkFolderError):
    """Too many requests in flight for one token; answered with ``Retry-After``."""

    code = "too_many_requests"
    status = 429
    message = "Too many concurrent requests for this token; retry later"


class RequestHeadTooLarge(WorkFolderError):
    code = "request_head_too_large"
    status = 431
    message = "Request line and headers are too large"


class ServerBusy(WorkFolderError):
    """The process holds as many request body bytes in memory as it may
    (``--max-buffered-body-bytes``); answered with ``Retry-After``."""

    code = "server_busy"
    status = 503
    message = "The controller is buffering as many request bodies as it may; retry later"


class TooManyConnections(WorkFolderError):
    code = "too_many_connections"
    status = 503
    message = "The controller has too many open connections; retry later"


# --- authority and quotas (controller/auth.py, controller/quotas.py) --------


class WriteNotAllowed(WorkFolderError):
    """The caller may read but not write here (a viewer, or a run acting for one)."""

    code = "write_not_allowed"
    status = 403
    message = "This principal may not write this folder"


class PurgeForbidden(WorkFolderError):
    code = "purge_forbidden"
    status = 403
    message = "Run tokens cannot purge trash; a person must do it"


class QuotaExceeded(WorkFolderError):
    code = "quota_exceeded"
    status = 413
    message = "A controller quota was exceeded"


class FolderEntryLimit(QuotaExceeded):
    code = "folder_entry_limit"
    message = "The folder would hold more entries than the controller allows"


class CheckpointRowLimit(QuotaExceeded):
    code = "checkpoint_row_limit"
    message = "The checkpoint would create more rows (parent directories included) than allowed"


class StorageQuotaExceeded(QuotaExceeded):
    code = "storage_quota_exceeded"
    message = "The company's storage quota is used up"


class UploadQuotaExceeded(QuotaExceeded):
    """Too many uploaded bytes wait for a checkpoint; commit them or wait for expiry."""

    code = "upload_quota_exceeded"
    status = 429
    message = "Too many uploaded bytes are not yet committed by a checkpoint"


class UploadOverAllowance(QuotaExceeded):
    """One upload request whose new bytes alone exceed the run's allowance of
    uncommitted upload bytes: waiting for commits cannot make it fit, so it is
    no 429 (``details``: ``[{"limit", "size"}]``)."""

    code = "upload_over_allowance"
    message = "The upload alone is larger than the run's allowance of uncommitted upload bytes"


# --- the agent folder contract (controller/agentfiles.py) --------------------


class AgentFilesLimitExceeded(WorkFolderError):
    """A save would take an agent folder past one of its storage limits.

    ``details``: ``[{"limit": "entries"|"fileBytes"|"totalBytes", "max", "value",
    "path"?}]`` (``path`` for an oversized file). A sync-validation limit, not
    a live quota: nothing of the refused save is written.
    """

    code = "agent_files_limit_exceeded"
    status = 422
    message = "The save would take the agent folder past a storage limit; nothing was saved"


class EntryProtected(Conflict):
    """The agent's instruction entry (or a directory holding it) may not be
    deleted, moved away or replaced by a directory."""

    code = "entry_protected"
    message = "The agent's instruction entry cannot be deleted or moved"


class EntryNotUtf8(WorkFolderError):
    code = "entry_not_utf8"
    status = 422
    message = "The agent's instruction entry must be valid UTF-8"


class EntryTooLarge(WorkFolderError):
    code = "entry_too_large"
    status = 422
    message = "The agent's instruction entry is limited to 1 MiB"


class AttachmentNotFound(NotFound):
    code = "attachment_not_found"
    message = "Attachment not found"


# --- the API bridge (controller/api/apibridge.py) ----------------------------


class BridgeRouteDenied(WorkFolderError):
    """A method and route outside the API bridge's allowlist (a boundary control)."""

    code = "bridge_route_denied"
    status = 403
    message = "This route is not open to sandbox code through the API bridge"


class BridgeTimeout(WorkFolderError):
    """A bridged call's answer did not start in time (a resource limit)."""

    code = "bridge_timeout"
    status = 504
    message = "The bridged request took longer than the controller allows"


class BridgeResponseTooLarge(WorkFolderError):
    """A bridged call's answer is over the response limit (a resource limit)."""

    code = "bridge_response_too_large"
    status = 502
    message = "The answer is larger than the API bridge forwards"
