"""The OpenAPI document served at /openapi.json."""

from __future__ import annotations

from typing import Any

from common.bridge import MANIFEST_PAGE_MAX, PREFIX
from common.limits import MAX_PAGE_LIMIT
from common.repos import FETCH_BATCH_MAX, MISSING_MAX
from controller.invitations import INVITATION_TTL

_ERROR = {"$ref": "#/components/schemas/Error"}


def _resp(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"description": description}
    if schema is not None:
        body["content"] = {"application/json": {"schema": schema}}
    return body


_ERRORS = {
    "400": _resp("Validation error", _ERROR),
    "401": _resp("Missing or invalid token", _ERROR),
    "404": _resp("Work folder not found (also every authorization denial)", _ERROR),
    # Transport limits (controller/api/limits.py), on every route.
    "408": _resp("Request body stalled or too slow (request_timeout)", _ERROR),
    "429": _resp("Too many requests in flight for this token; see Retry-After", _ERROR),
}

_FOLDER_PARAMS = [
    {
        "name": "companyId",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "format": "uuid"},
    },
    {
        "name": "scope",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "enum": ["task", "agent", "user", "project"]},
    },
    {
        "name": "ownerId",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
    },
]

_PATH_Q = {
    "name": "path",
    "in": "query",
    "required": True,
    "schema": {"type": "string", "maxLength": 1024},
}


_PUBLIC: list[dict[str, Any]] = []
"""``security`` of a route that answers without credentials."""

_SCOPE_P = {
    "name": "scope",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "enum": ["task", "agent", "user", "project"]},
}

_JSON_OBJECT_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {"type": "object"}}},
}


def _op(summary: str, *codes: str, **extra: Any) -> dict[str, Any]:
    responses = {code: _resp(summary) for code in codes}
    return {"summary": summary, "responses": {**responses, **_ERRORS}, **extra}


def _bridge_paths() -> dict[str, Any]:
    """fsagent's routes, authenticated with a run token (contract in common/bridge.py)."""
    folder = PREFIX + "/folders/{scope}"
    return {
        PREFIX + "/run": {"get": _op("The run this token belongs to and its bindings", "200")},
        PREFIX + "/run/report": {
            "post": _op("Report the run's save state", "200", requestBody=_JSON_OBJECT_BODY)
        },
        PREFIX + "/run/refresh-applied": {"post": _op("The requested refresh was taken", "200")},
        folder + "/manifest": {
            "parameters": [_SCOPE_P],
            "get": _op(
                "Entries of a bound folder changed after a version",
                "200",
                "410",
                parameters=[
                    {
                        "name": "since",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 0},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": MANIFEST_PAGE_MAX},
                    },
                ],
            ),
        },
        folder + "/objects/{digest}": {
            "parameters": [
                _SCOPE_P,
                {"name": "digest", "in": "path", "required": True, "schema": {"type": "string"}},
            ],
            "get": _op("An object the folder references; supports Range", "200", "206", "416"),
        },
        folder + "/uploads": {
            "parameters": [_SCOPE_P],
            "put": _op(
                "Upload framed zstd content; the controller computes its SHA-256",
                "200",
                "413",
                requestBody={
                    "required": True,
                    "content": {
                        "application/octet-stream": {
                            "schema": {"type": "string", "format": "binary"}
                        }
                    },
                },
            ),
        },
        folder + "/uploads/batch": {
            "parameters": [_SCOPE_P],
            "put": _op(
                "Upload many small objects in one framed body; one digest per member",
                "200",
                "413",
                "422",
                requestBody={
                    "required": True,
                    "content": {
                        "application/octet-stream": {
                            "schema": {"type": "string", "format": "binary"}
                        }
                    },
                },
            ),
        },
        folder + "/checkpoints": {
            "parameters": [_SCOPE_P],
            "post": _op(
                "Apply a checkpoint all or nothing (localRefusals: the sandbox's own"
                " refusals, listed in the save receipt only; finalSave: a part of"
                " the final save, whose refusal is then final; common/bridge.py)",
                "200",
                "403",
                "409",
                "410",
                "422",
                requestBody=_JSON_OBJECT_BODY,
            ),
        },
    }


def _digests_body(limit: int) -> dict[str, Any]:
    return {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["digests"],
                    "properties": {
                        "digests": {
                            "type": "array",
                            "maxItems": limit,
                            "items": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                        }
                    },
                }
            }
        },
    }


def _repo_paths() -> dict[str, Any]:
    """The repository routes: fsagent's (run token) and people's (contract in
    common/repos.py)."""
    ws = {
        "name": "workspaceId",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "format": "uuid"},
    }
    base = PREFIX + "/repos/{workspaceId}"
    binary = {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
    company = {
        "name": "companyId",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "format": "uuid"},
    }
    task = {**company, "name": "taskId"}
    people = "/api/companies/{companyId}/tasks/{taskId}/repos"
    return {
        PREFIX + "/repos": {
            "get": _op("The run's task's repositories and their current checkpoints", "200")
        },
        base + "/missing": {
            "parameters": [ws],
            "post": _op(
                "Which digests the task cannot reference yet",
                "200",
                requestBody=_digests_body(MISSING_MAX),
            ),
        },
        base + "/uploads": {
            "parameters": [ws],
            "put": _op(
                "Upload framed zstd content for a repository checkpoint",
                "200",
                "413",
                "422",
                requestBody=binary,
            ),
        },
        base + "/uploads/batch": {
            "parameters": [ws],
            "put": _op(
                "Upload many small objects for a repository checkpoint",
                "200",
                "413",
                "422",
                requestBody=binary,
            ),
        },
        base + "/checkpoints": {
            "parameters": [ws],
            "post": _op(
                "Commit a repository checkpoint (whole, or a delta on the current one)",
                "200",
                "409",
                "413",
                "422",
                requestBody=_JSON_OBJECT_BODY,
            ),
        },
        base + "/checkpoints/{checkpointId}/manifest": {
            "parameters": [
                ws,
                {
                    "name": "checkpointId",
                    "in": "path",
                    "required": True,
                    "description": "the current checkpoint's id, or `current`",
                    "schema": {"type": "string"},
                },
            ],
            "get": _op("The current checkpoint's complete member list and config", "200"),
        },
        base + "/objects/batch": {
            "parameters": [ws],
            "post": _op(
                "Objects of the current checkpoint, as one batch body",
                "200",
                requestBody=_digests_body(FETCH_BATCH_MAX),
            ),
        },
        base + "/report": {
            "parameters": [ws],
            "post": _op("Report the repository's save state", "200", requestBody=_JSON_OBJECT_BODY),
        },
        people: {
            "parameters": [company, task],
            "get": {
                "summary": "The task's repositories: last save, size, files, state, error",
                "responses": {
                    "200": _resp("The task's repositories", _ref("TaskRepos")),
                    **_ERRORS,
                },
            },
        },
        people + "/{workspaceId}/archive": {
            "parameters": [company, task, ws],
            "get": {
                "summary": "The repository's current checkpoint as a streamed tar",
                "responses": {
                    "200": {"description": "A tar archive", "content": {"application/x-tar": {}}},
                    **_ERRORS,
                },
            },
        },
    }


def _api_bridge_paths() -> dict[str, Any]:
    """Sandbox code's way to the API (controller/api/apibridge.py), and its audit."""
    path_p = {"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}

    def forwarded(method: str) -> dict[str, Any]:
        return _op(
            f"{method} /api/{{path}} with the run's authority, when the allowlist has it",
            "200",
            "403",
            "413",
            "502",
            "504",
            description=(
                "Run token only. Forwards allowlisted (method, route template) pairs"
                " (README, 'API bridge'); anything else is 403 bridge_route_denied."
                " Only allowlisted request headers are forwarded; Set-Cookie never"
                " comes back. Each request is audited."
            ),
        )

    run_p = {
        "name": "runId",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "format": "uuid"},
    }
    company_p = {**run_p, "name": "companyId"}
    return {
        PREFIX + "/api/{path}": {
            "parameters": [path_p],
            **{m.lower(): forwarded(m) for m in ("GET", "PUT", "POST", "PATCH", "DELETE")},
        },
        "/api/companies/{companyId}/runs/{runId}/audit": {
            "parameters": [company_p, run_p],
            "get": _op(
                "The run's API bridge audit trail, oldest first (owners, admins, operator tokens)",
                "200",
                parameters=[
                    {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                    },
                ],
            ),
        },
    }


def _json_body(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "required": list(required),
        "properties": properties,
        "additionalProperties": False,
    }
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_UUID = {"type": "string", "format": "uuid"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 256}
_ROLE = {"type": "string", "enum": ["owner", "admin", "member", "viewer"]}
_ADMIN_DENIALS = {
    "404": _resp(
        "No such company, or the caller is not its owner, admin or operator token"
        " (company_not_found); or no such record",
        _ERROR,
    )
}
_OPERATOR_OK = (
    "Owners and admins of the company, or one of its operator tokens"
    " (`controller admin create-operator-token`)."
)
_PEOPLE_ONLY = "Owners and admins of the company only; an operator token is refused (401)."


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(properties: dict[str, Any], *optional: str) -> dict[str, Any]:
    """An answer object: every property but ``optional`` is always there."""
    return {
        "type": "object",
        "required": [p for p in properties if p not in optional],
        "properties": properties,
    }


_TIME = {"type": "string", "format": "date-time"}
_MAYBE_TIME = {"type": ["string", "null"], "format": "date-time"}
_MAYBE_TEXT = {"type": ["string", "null"]}
_MAYBE_BOOL = {"type": ["boolean", "null"]}
_SAVE_STATE = {"type": "string", "enum": ["starting", "saving", "saved", "failed"]}


def _files_page_schemas() -> dict[str, Any]:
    """Answers of the routes the Files page reads (controller/api/serialize.py)."""
    owner = {"id": {"type": "string", "format": "uuid"}}
    # hasFiles and activeRun: for people only (a run's directory has names and
    # ids); hasFiles is null for an agent whose folder the person may not open.
    activity = {"hasFiles": _MAYBE_BOOL, "activeRun": {"type": "boolean"}}
    return {
        "Warning": {
            "type": "object",
            "required": ["scope", "code", "message"],
            "additionalProperties": True,
            "description": "A run's current warning: a diagnostic, never an error on the"
            " folder's files; limit warnings add limit, max, value and path, others"
            " fields of their own",
            "properties": {
                "scope": {"type": "string", "enum": ["task", "agent", "user", "project"]},
                "code": {"type": "string"},
                "message": {"type": "string"},
                "limit": {"type": "string", "enum": ["entries", "fileBytes", "totalBytes"]},
                "max": {"type": "integer"},
                "value": {"type": "integer"},
                "path": {"type": "string"},
            },
        },
        "SyncRun": _object(
            {
                "runId": {"type": "string", "format": "uuid"},
                "agentId": {"type": "string", "format": "uuid"},
                "agentName": {"type": "string"},
                "state": {
                    **_SAVE_STATE,
                    "description": "the run's: failed while a save of any of its folders"
                    " (not a storage limit's refusal) or repositories stands failed",
                },
                "lastSavedAt": {**_MAYBE_TIME, "description": "last save of any folder"},
                "folderSavedAt": {**_MAYBE_TIME, "description": "last save of this folder"},
                "error": _MAYBE_TEXT,
                "folderState": {
                    **_SAVE_STATE,
                    "description": "the run's save state of this folder: a failed save"
                    " of it stands until a later save of it succeeds; ended without"
                    " saving it is failed",
                },
                "folderCode": {
                    **_MAYBE_TEXT,
                    "description": "the stable code of this folder's failed save"
                    " (its receipt's, e.g. STALE_LEASE, AGENT_FILES_LIMIT_EXCEEDED)",
                },
                "folderError": _MAYBE_TEXT,
                "folderFailedAt": _MAYBE_TIME,
                "folderStoppedAt": {
                    **_MAYBE_TIME,
                    "description": "the sandbox stopped with this folder: its final save"
                    " (saved, refused or given up), before the orchestrator ends the run",
                },
                "finalCheckpointAt": _MAYBE_TIME,
                "refreshRequested": {"type": "boolean"},
                "active": {"type": "boolean"},
                "superseded": {
                    "type": "boolean",
                    "description": "a newer run of its sandbox holds the lease",
                },
                "startedAt": _TIME,
                "endedAt": _MAYBE_TIME,
                "warnings": {"type": "array", "items": _ref("Warning")},
            }
        ),
        "Sync": _object(
            {
                "runs": {"type": "array", "items": _ref("SyncRun")},
                "lastOperationAt": {
                    **_MAYBE_TIME,
                    "description": "the newest direct file operation, never an agent save",
                },
            }
        ),
        "WriteResult": {
            "type": "object",
            "required": ["applied"],
            "description": "applied is false for an idempotent replay; file for a PUT,"
            " files for the entries an operation wrote, purged for a purge",
            "properties": {
                "applied": {"type": "boolean"},
                "file": _ref("Entry"),
                "files": {"type": "array", "items": _ref("Entry")},
                "purged": {"type": "integer"},
            },
        },
        "Directory": _object(
            {
                "agents": {
                    "type": "array",
                    "items": _object({**owner, "name": {"type": "string"}, **activity}, *activity),
                },
                "projects": {
                    "type": "array",
                    "items": _object({**owner, "name": {"type": "string"}, **activity}, *activity),
                },
                "tasks": {
                    "type": "array",
                    "items": _object(
                        {
                            **owner,
                            "title": {"type": "string"},
                            "projectId": {"type": "string", "format": "uuid"},
                            **activity,
                        },
                        *activity,
                    ),
                },
                "members": {
                    "type": "array",
                    "description": "email and role for people only",
                    "items": _object(
                        {
                            "userId": {"type": "string", "format": "uuid"},
                            "email": {"type": "string"},
                            "role": _ROLE,
                        },
                        "email",
                        "role",
                    ),
                },
            }
        ),
        "Session": _object(
            {
                "userId": {"type": "string", "format": "uuid"},
                "email": {"type": "string"},
                "csrfToken": {"type": "string"},
                "companies": {
                    "type": "array",
                    "items": _object(
                        {
                            "id": {"type": "string", "format": "uuid"},
                            "name": {"type": "string"},
                            "role": _ROLE,
                        }
                    ),
                },
            }
        ),
        "TaskRepos": _object(
            {
                "repos": {
                    "type": "array",
                    "items": _object(
                        {
                            "workspaceId": {"type": "string", "format": "uuid"},
                            "name": {"type": "string"},
                            "repoUrl": {"type": "string"},
                            "state": {
                                "type": "string",
                                "enum": ["unsaved", "saving", "saved", "failed"],
                            },
                            "lastSavedAt": _MAYBE_TIME,
                            "byteSize": {"type": "integer"},
                            "fileCount": {"type": "integer"},
                            "entries": {"type": "integer"},
                            "error": _MAYBE_TEXT,
                            "checkpointId": {"type": ["string", "null"]},
                            "removed": {"type": "boolean"},
                        }
                    ),
                }
            }
        ),
    }


def _admin_op(summary: str, who: str, *codes: str, **extra: Any) -> dict[str, Any]:
    op = _op(summary, *codes, description=who, **extra)
    op["responses"].update(_ADMIN_DENIALS)
    return op


def _admin_paths() -> dict[str, Any]:
    """The company admin and orchestrator API (controller/api/orgs.py, runs.py)."""
    company = "/api/companies/{companyId}"
    company_p = {"name": "companyId", "in": "path", "required": True, "schema": _UUID}

    def id_p(name: str) -> dict[str, Any]:
        return {"name": name, "in": "path", "required": True, "schema": _UUID}

    def listing(summary: str, **extra: Any) -> dict[str, Any]:
        return _admin_op(summary, _OPERATOR_OK, "200", **extra)

    def creation(summary: str, body: dict[str, Any], who: str = _OPERATOR_OK) -> dict[str, Any]:
        return _admin_op(summary, who, "201", "409", requestBody=body)

    run_filters = [
        {"name": "active", "in": "query", "schema": {"type": "boolean"}},
        {"name": "agentId", "in": "query", "schema": _UUID},
        {"name": "taskId", "in": "query", "schema": _UUID},
        {"name": "sandbox", "in": "query", "schema": {"type": "string", "maxLength": 256}},
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
        },
        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
    ]
    start_body = _json_body(
        {
            "agentId": _UUID,
            "taskId": {**_UUID, "type": ["string", "null"]},
            "projectId": {**_UUID, "type": ["string", "null"]},
            "userId": {**_UUID, "type": ["string", "null"]},
            "sandbox": {"type": ["string", "null"], "minLength": 1, "maxLength": 256},
            "home": {"type": ["string", "null"], "maxLength": 1024},
        },
        "agentId",
    )
    return {
        company + "/members": {
            "parameters": [company_p],
            "get": listing("Members with their email and role"),
            "post": creation(
                "Create a user with this email and a first API token (shown once), as a member",
                _json_body(
                    {"email": {"type": "string", "maxLength": 320}, "role": _ROLE}, "email", "role"
                ),
                _PEOPLE_ONLY,
            ),
        },
        company + "/members/{userId}": {
            "parameters": [company_p, id_p("userId")],
            "put": _admin_op(
                "Change a member's role (the owner role: owners only, 403 owner_required;"
                " 409 last_owner); anyone else, user or not, is 404 member_not_found:"
                " a person joins by accepting an invitation",
                _PEOPLE_ONLY,
                "200",
                "403",
                "409",
                requestBody=_json_body({"role": _ROLE}, "role"),
            ),
            "delete": _admin_op(
                "Remove a member; their access ends at the next request",
                _PEOPLE_ONLY,
                "200",
                "403",
                "409",
            ),
        },
        company + "/members/{userId}/sessions": {
            "parameters": [company_p, id_p("userId")],
            "delete": _admin_op(
                "End a member's Files page sessions for this company (end-sessions): their"
                " next request with one here is 401, their other companies stay open; an"
                " owner's only by an owner (403 owner_required)",
                _PEOPLE_ONLY,
                "200",
                "403",
            ),
        },
        company + "/invitations": {
            "parameters": [company_p],
            "get": _admin_op(
                "The company's pending invitations, oldest first (no emails; an invitation"
                f" lapses {INVITATION_TTL.days} days after it was made or renewed)",
                _PEOPLE_ONLY,
                "200",
            ),
            "post": _admin_op(
                "Invite an existing user (by id) with a role: they become a member only by"
                " accepting (the owner role: owners only, 403 owner_required; 404"
                " user_not_found; 409 already_member); inviting again changes the role and"
                f" renews the invitation for {INVITATION_TTL.days} days",
                _PEOPLE_ONLY,
                "201",
                "403",
                "409",
                requestBody=_json_body({"userId": _UUID, "role": _ROLE}, "userId", "role"),
            ),
        },
        company + "/invitations/{invitationId}": {
            "parameters": [company_p, id_p("invitationId")],
            "delete": _admin_op(
                "Withdraw a pending invitation (404 invitation_not_found)", _PEOPLE_ONLY, "200"
            ),
        },
        "/api/invitations": {
            "get": _op("The caller's own pending invitations, with each company's name", "200"),
        },
        "/api/invitations/{invitationId}": {
            "parameters": [id_p("invitationId")],
            "delete": _op(
                "Decline one's own invitation, lapsed or not (anyone else's: 404"
                " invitation_not_found)",
                "200",
            ),
        },
        "/api/invitations/{invitationId}/accept": {
            "parameters": [id_p("invitationId")],
            "post": _op(
                "Accept one's own invitation: the caller becomes a member with its role"
                " (anyone else's: 404 invitation_not_found; a lapsed one: 410"
                " invitation_expired)",
                "200",
                "410",
            ),
        },
        company + "/tokens": {
            "parameters": [company_p],
            "get": _admin_op(
                "The members' API tokens and the company's operator tokens, oldest first"
                " (list-tokens; never the tokens themselves)",
                _PEOPLE_ONLY,
                "200",
                parameters=[{"name": "userId", "in": "query", "schema": _UUID}],
            ),
        },
        company + "/tokens/{tokenId}": {
            "parameters": [company_p, id_p("tokenId")],
            "delete": _admin_op(
                "Revoke one of the company's operator tokens or a member's API token"
                " (revoke-token); an owner's only by an owner (403 owner_required), a token"
                " of a person who also belongs to another company not at all (403"
                " token_shared); 404 token_not_found for any other token",
                _PEOPLE_ONLY,
                "200",
                "403",
            ),
        },
        company + "/agents": {
            "parameters": [company_p],
            "get": listing("The company's agents"),
            "post": creation("Create an agent", _json_body({"name": _NAME}, "name")),
        },
        company + "/agents/{agentId}/entry": {
            "parameters": [company_p, id_p("agentId")],
            "put": _admin_op(
                "Make a path the agent's instruction entry, created empty when nothing is"
                " there (set-agent-entry); a directory there is 409 kind_conflict, a file over"
                " 1 MiB 422 entry_too_large; the old entry becomes an ordinary file",
                _OPERATOR_OK,
                "200",
                "409",
                "422",
                requestBody=_json_body({"path": {"type": "string", "maxLength": 1024}}, "path"),
            ),
        },
        company + "/agents/{agentId}/grants": {
            "parameters": [company_p, id_p("agentId")],
            "get": listing(
                "Members holding a permission on the agent through a grant (owners and admins"
                " hold it without one)"
            ),
        },
        company + "/agents/{agentId}/grants/{userId}": {
            "parameters": [company_p, id_p("agentId"), id_p("userId")],
            "put": _admin_op(
                "Let a member configure the agent (grant ... --configure): its folder opens"
                " to them from the next request (404 member_not_found for a non-member)",
                _PEOPLE_ONLY,
                "200",
            ),
            "delete": _admin_op(
                "Take a member's permission on the agent back (revoke ... --configure); a"
                " write not yet committed is refused too (revoked: false when there was none)",
                _PEOPLE_ONLY,
                "200",
            ),
        },
        company + "/projects": {
            "parameters": [company_p],
            "get": listing("The company's projects"),
            "post": creation("Create a project", _json_body({"name": _NAME}, "name")),
        },
        company + "/tasks": {
            "parameters": [company_p],
            "get": listing(
                "The company's tasks",
                parameters=[{"name": "projectId", "in": "query", "schema": _UUID}],
            ),
            "post": creation(
                "Create a task in a project",
                _json_body({"projectId": _UUID, "title": _NAME}, "projectId", "title"),
            ),
        },
        company + "/runs": {
            "parameters": [company_p],
            "get": listing("The company's runs, newest first", parameters=run_filters),
            "post": _admin_op(
                "Start a run: its token (shown once), lease epoch and env; a run already"
                " on the same sandbox ends (fenced)",
                _OPERATOR_OK,
                "201",
                requestBody=start_body,
            ),
        },
        company + "/runs/{runId}": {
            "parameters": [company_p, id_p("runId")],
            "get": _admin_op(
                "A run (never its token) with its current warnings, receipt counts and"
                " save state of each folder and repository; also for its responsible"
                " user and members who may configure its agent (others: 404"
                " run_not_found)",
                _OPERATOR_OK,
                "200",
            ),
        },
        company + "/runs/{runId}/end": {
            "parameters": [company_p, id_p("runId")],
            "post": _admin_op(
                "End a run; its token answers 401 from the next request", _OPERATOR_OK, "200"
            ),
        },
        company + "/projects/{projectId}/workspaces": {
            "parameters": [company_p, id_p("projectId")],
            "get": listing("The project's repository workspaces, removed ones too"),
            "post": creation(
                "Add a repository workspace (add-workspace); primary takes over",
                _json_body(
                    {
                        "repoUrl": {"type": "string", "minLength": 1, "maxLength": 2048},
                        "name": {"type": ["string", "null"]},
                        "ref": {"type": ["string", "null"]},
                        "primary": {"type": "boolean"},
                        "setupCommand": {"type": ["string", "null"], "maxLength": 8192},
                    },
                    "repoUrl",
                ),
            ),
        },
        company + "/workspaces/{workspaceId}": {
            "parameters": [company_p, id_p("workspaceId")],
            "delete": _admin_op(
                "Remove a workspace (remove-workspace): bound to no new task; bindings and"
                " saved checkpoints stay",
                _OPERATOR_OK,
                "200",
            ),
        },
        company + "/tasks/{taskId}/branch": {
            "parameters": [company_p, id_p("taskId")],
            "put": _admin_op(
                "The branch the task's primary checkout is cloned onto (set-task-branch)",
                _OPERATOR_OK,
                "200",
                requestBody=_json_body({"branch": {"type": "string", "minLength": 1}}, "branch"),
            ),
        },
        company + "/operator-tokens": {
            "parameters": [company_p],
            "get": _admin_op(
                "The company's operator tokens (never the tokens)", _PEOPLE_ONLY, "200"
            ),
            "post": creation(
                "Create an operator token for this company (shown once)",
                _json_body({"name": _NAME}, "name"),
                _PEOPLE_ONLY,
            ),
        },
        company + "/operator-tokens/{tokenId}": {
            "parameters": [company_p, id_p("tokenId")],
            "delete": _admin_op(
                "Revoke one of the company's operator tokens; it answers 401 at once",
                _PEOPLE_ONLY,
                "200",
            ),
        },
    }


def _uuid_p(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "format": "uuid"},
    }


def _agent_files_paths() -> dict[str, Any]:
    """Runs' history, agents' entries and task attachments."""
    company, run = _uuid_p("companyId"), _uuid_p("runId")
    attachments = "/api/companies/{companyId}/tasks/{taskId}/attachments"
    page = [
        {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
    ]  # fmt: skip
    return {
        "/api/companies/{companyId}/runs/{runId}/receipts": {
            "parameters": [company, run],
            "get": _op("The run's save receipts, oldest first", "200", parameters=page),
        },
        "/api/companies/{companyId}/agents/{agentId}": {
            "parameters": [company, _uuid_p("agentId")],
            "get": _op("An agent's instruction entry, storage limits, usage and warnings", "200"),
        },
        attachments: {
            "parameters": [company, _uuid_p("taskId")],
            "get": _op("The task's attachments (originals)", "200"),
            "post": _op(
                "Store an original upload (raw body) as a task attachment; a retry under"
                " the same Idempotency-Key adds nothing (200, applied false), the key with"
                " another request is 409 idempotency_conflict",
                "200",
                "201",
                "409",
                "413",
                parameters=[
                    {
                        "name": "name",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string", "minLength": 1, "maxLength": 218},
                    },
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
                    },
                    {
                        "name": "X-File-Content-Type",
                        "in": "header",
                        "schema": {"type": "string", "maxLength": 256},
                    },
                ],
                requestBody={
                    "required": True,
                    "content": {
                        "application/octet-stream": {
                            "schema": {"type": "string", "format": "binary"}
                        }
                    },
                },
            ),
        },
        attachments + "/{attachmentId}": {
            "parameters": [company, _uuid_p("taskId"), _uuid_p("attachmentId")],
            "get": _op("Download an attachment's original; supports Range", "200", "206", "416"),
        },
    }


def _public_paths() -> dict[str, Any]:
    page = {"200": {"description": "The Files page", "content": {"text/html": {}}}}
    return {
        "/openapi.json": {
            "get": {"summary": "This document", "security": _PUBLIC, "responses": page}
        },
        "/files": {"get": {"summary": "The Files page", "security": _PUBLIC, "responses": page}},
        "/files/{rest}": {
            "parameters": [
                {"name": "rest", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "get": {
                "summary": "The Files page (client routes)",
                "security": _PUBLIC,
                "responses": page,
            },
        },
        "/files/static/{name}": {
            "parameters": [
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "get": {
                "summary": "A static asset of the Files page",
                "security": _PUBLIC,
                "responses": {
                    "200": {"description": "The asset"},
                    "404": _resp("No such asset", _ERROR),
                },
            },
        },
    }


def document() -> dict[str, Any]:
    entry = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "path": {"type": "string"},
            "kind": {"type": "string", "enum": ["file", "directory"]},
            "byteSize": {"type": "integer"},
            "digest": {"type": ["string", "null"]},
            "executable": {"type": "boolean"},
            "contentType": {"type": ["string", "null"]},
            "deletedAt": {"type": ["string", "null"], "format": "date-time"},
            "updatedAt": {"type": "string", "format": "date-time"},
            "version": {"type": "integer"},
            "trashRoot": {"type": ["string", "null"]},
        },
    }
    entry["required"] = list(entry["properties"])  # every entry has every field
    base = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}"
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Work folders controller", "version": "1"},
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "session": {"type": "apiKey", "in": "cookie", "name": "fsa_session"},
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {"type": "string"},
                        "code": {"type": "string"},
                        "details": {"type": "array"},
                    },
                },
                "Entry": entry,
                **_files_page_schemas(),
            },
        },
        "security": [{"bearer": []}, {"session": []}],
        "paths": {
            base: {
                "parameters": _FOLDER_PARAMS,
                "get": {
                    "summary": "List active files or trash",
                    "parameters": [
                        {"name": "trash", "in": "query", "schema": {"type": "boolean"}},
                        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_LIMIT},
                        },
                        {"name": "dir", "in": "query", "schema": {"type": "string"}},
                        {
                            "name": "name",
                            "in": "query",
                            "description": "keep entries whose name contains this"
                            " (case-insensitive)",
                            "schema": {"type": "string", "maxLength": 255},
                        },
                    ],
                    "responses": {
                        "200": _resp(
                            "A page of entries",
                            {
                                "type": "object",
                                "properties": {
                                    "entries": {
                                        "type": "array",
                                        "items": {"$ref": "#/components/schemas/Entry"},
                                    },
                                    "nextCursor": {"type": ["string", "null"]},
                                    "lastOperationAt": {"type": ["string", "null"]},
                                    "total": {"type": "integer"},
                                    "version": {"type": "integer"},
                                },
                            },
                        ),
                        **_ERRORS,
                    },
                },
            },
            base + "/content": {
                "parameters": _FOLDER_PARAMS,
                "get": {
                    "summary": "Download (or preview, at most 8 MiB) a file; supports Range",
                    "parameters": [
                        _PATH_Q,
                        {"name": "preview", "in": "query", "schema": {"type": "boolean"}},
                    ],
                    "responses": {
                        "200": {
                            "description": "File bytes",
                            "content": {"application/octet-stream": {}},
                        },
                        "206": {"description": "Partial content"},
                        "413": _resp("Preview larger than 8 MiB", _ERROR),
                        "416": _resp("Range not satisfiable", _ERROR),
                        **_ERRORS,
                    },
                },
                "put": {
                    "summary": "Upload a file (raw body, at most 1 GiB)",
                    "parameters": [
                        _PATH_Q,
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "schema": {"type": "string", "maxLength": 256},
                        },
                        {
                            "name": "X-File-Content-Type",
                            "in": "header",
                            "schema": {"type": "string", "maxLength": 256},
                        },
                        {
                            "name": "X-File-Executable",
                            "in": "header",
                            "schema": {"type": "string", "enum": ["true", "false"]},
                        },
                        {
                            "name": "If-None-Match",
                            "in": "header",
                            "description": "* refuses to replace an existing entry (412)",
                            "schema": {"type": "string", "enum": ["*"]},
                        },
                        {
                            "name": "If-Match",
                            "in": "header",
                            "description": '* or "<sha256>": replace only that content (412)',
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "X-Base-Digest",
                            "in": "header",
                            "description": "the editor's base: <sha256> it read, or none"
                            " (409 stale_save when the file changed since)",
                            "schema": {"type": "string"},
                        },
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/octet-stream": {
                                "schema": {"type": "string", "format": "binary"}
                            }
                        },
                    },
                    "responses": {
                        "200": _resp(
                            "Replaced, or an idempotent replay (applied: false)",
                            _ref("WriteResult"),
                        ),
                        "201": _resp("Created", _ref("WriteResult")),
                        "409": _resp(
                            "Parent is a file, kind change, key reused, or a stale editor"
                            " save (X-Base-Digest, stale_save); nothing was written",
                            _ERROR,
                        ),
                        "412": _resp(
                            "If-Match or If-None-Match does not hold; nothing was written",
                            _ERROR,
                        ),
                        "413": _resp("Larger than 1 GiB", _ERROR),
                        "422": _resp(
                            "An agent folder's storage limit, or the agent's instruction"
                            " entry over 1 MiB or not UTF-8; nothing was written",
                            _ERROR,
                        ),
                        **_ERRORS,
                    },
                },
            },
            base + "/operations": {
                "parameters": _FOLDER_PARAMS,
                "post": {
                    "summary": "mkdir, delete (to trash), move, restore (optionally as) or purge",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "oneOf": [
                                        {
                                            "type": "object",
                                            "required": ["action", "path"],
                                            "properties": {
                                                "action": {"enum": ["mkdir", "delete"]},
                                                "path": {"type": "string"},
                                            },
                                        },
                                        {
                                            "type": "object",
                                            "required": ["action", "path", "to"],
                                            "properties": {
                                                "action": {"enum": ["move"]},
                                                "path": {"type": "string"},
                                                "to": {"type": "string"},
                                            },
                                        },
                                        {
                                            "type": "object",
                                            "required": ["action", "fileId"],
                                            "properties": {
                                                "action": {"enum": ["restore", "purge"]},
                                                "fileId": {"type": "string"},
                                                "to": {
                                                    "type": "string",
                                                    "description": "restore only: a new path",
                                                },
                                            },
                                        },
                                    ]
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _resp("Applied (or idempotent replay)", _ref("WriteResult")),
                        "409": _resp(
                            "Conflict (kind, parent is file, restore collision, move target"
                            " exists or lies under the source, the agent's instruction"
                            " entry deleted or moved)",
                            _ERROR,
                        ),
                        "422": _resp("An agent folder's storage limit", _ERROR),
                        **_ERRORS,
                    },
                },
            },
            base + "/changes": {
                "parameters": _FOLDER_PARAMS,
                "get": {
                    "summary": "Whether the folder (or one directory) changed after a version",
                    "parameters": [
                        {
                            "name": "since",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 0},
                        },
                        {"name": "dir", "in": "query", "schema": {"type": "string"}},
                        {
                            "name": "entries",
                            "in": "query",
                            "description": "with dir: when it changed, also what changed there",
                            "schema": {"type": "boolean"},
                        },
                        {
                            "name": "name",
                            "in": "query",
                            "description": "with entries: the listing's name filter",
                            "schema": {"type": "string", "maxLength": 255},
                        },
                    ],
                    "responses": {
                        "200": _resp(
                            "The newest version and whether anything changed; with entries"
                            " and a change, the directory's changed entries (trashed ones"
                            " have deletedAt), the paths moved out of it, its total and"
                            " complete (false: more than 200 changed, list it again)",
                            _object(
                                {
                                    "version": {"type": "integer"},
                                    "changed": {"type": "boolean"},
                                    "entries": {"type": "array", "items": _ref("Entry")},
                                    "gone": {"type": "array", "items": {"type": "string"}},
                                    "complete": {"type": "boolean"},
                                    "total": {"type": "integer"},
                                    "lastOperationAt": _MAYBE_TIME,
                                },
                                "entries",
                                "gone",
                                "complete",
                                "total",
                                "lastOperationAt",
                            ),
                        ),
                        **_ERRORS,
                    },
                },
            },
            base + "/sync": {
                "parameters": _FOLDER_PARAMS,
                "get": {
                    "summary": "Runs bound to this folder and their save state",
                    "responses": {
                        "200": _resp(
                            "Each run with its agent's name, save state and warnings",
                            _ref("Sync"),
                        ),
                        **_ERRORS,
                    },
                },
            },
            base + "/refresh": {
                "parameters": _FOLDER_PARAMS,
                "post": {
                    "summary": "Queue a refresh for a running run",
                    "responses": {
                        "202": _resp(
                            "Queued",
                            _object({"queued": {"type": "boolean", "const": True}}),
                        ),
                        "409": _resp("Run is not running", _ERROR),
                        **_ERRORS,
                    },
                },
            },
            "/api/companies/{companyId}/directory": {
                "parameters": [_FOLDER_PARAMS[0]],
                "get": {
                    "summary": "Agents, projects, tasks and members of a company (for people:"
                    " whether each folder has files and an active run)",
                    "responses": {"200": _resp("Directory", _ref("Directory")), **_ERRORS},
                },
            },
            "/files/api/session": {
                "post": {
                    "summary": "Sign in to the Files page with an API token",
                    # The credential is the body itself.
                    "security": _PUBLIC,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["token"],
                                    "properties": {"token": {"type": "string"}},
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _resp("Signed in", _ref("Session")),
                        "400": _resp("Malformed body", _ERROR),
                        "401": _resp("Bad token", _ERROR),
                    },
                },
                "get": {
                    "summary": "Current session",
                    "responses": {"200": _resp("Session", _ref("Session"))},
                },
                "delete": {
                    "summary": "Sign out",
                    "responses": {"204": {"description": "Signed out"}},
                },
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness: the process serves (no dependency is touched)",
                    "security": _PUBLIC,
                    "responses": {"200": _resp("Alive")},
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Readiness: the database and object storage answer",
                    "security": _PUBLIC,
                    "responses": {
                        "200": _resp("Ready"),
                        "503": _resp("Not ready; `failing` names the dependencies"),
                    },
                }
            },
            **_bridge_paths(),
            **_repo_paths(),
            **_api_bridge_paths(),
            **_admin_paths(),
            **_agent_files_paths(),
            **_public_paths(),
        },
    }
    paths = doc["paths"]
    # The listing answers with and without the trailing slash.
    paths[base + "/"] = paths[base]
    return doc
