"""The company admin API: members and roles, agents (their instruction entry
and who may configure them), projects, tasks, the projects' repository
workspaces and the tasks' branches, operator tokens, and the members'
credentials (their API tokens listed and revoked, their Files page sessions
ended), under ``/api/companies/{companyId}/…``.

Each route is one call of the domain function ``controller admin`` calls
(:mod:`controller.orgs`, :mod:`controller.agentfiles`, :mod:`controller.grants`,
:mod:`controller.workspaces`, :mod:`controller.tokens`).
Owners and admins of the company may use them; anyone else gets 404
``company_not_found``. Only an owner gives or takes the owner role.

The company's operator tokens may read the members and an agent's grants and
manage agents (their entry too), projects, tasks and workspaces
(``company_route``), but not change who belongs to the company or who may
configure an agent, nor see, mint or revoke tokens, nor end sessions (plain
``json_errors`` routes, where
``authenticate`` refuses them with 401): a machine's credential must never
turn itself into a person's API token, role or permission, nor mint or keep
operator tokens. A grant is about a person, like a membership.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import ValidationError
from common.paths import validate_uuid
from controller import agentfiles, grants, orgs, tokens, workspaces
from controller.api.common import (
    company_read,
    company_route,
    company_write,
    json_errors,
    path_company,
    read_json,
)
from controller.api.params import strict_query, string_fields
from controller.api.serialize import (
    added_workspace_json,
    agent_entry_change_json,
    grant_change_json,
    grant_json,
    member_json,
    named_json,
    new_member_json,
    new_operator_token_json,
    operator_token_json,
    removed_workspace_json,
    task_json,
    token_json,
    workspace_json,
)
from controller.auth import CompanyActor

Conn = AsyncConnection[Any]


# --- members (changes: people only) -------------------------------------------------


@company_route
async def list_members(request: Request) -> Response:
    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        return [member_json(r) for r in await orgs.list_members(conn, actor.company_id)]

    return JSONResponse({"members": await company_read(request, work)})


@json_errors
async def create_member(request: Request) -> Response:
    """A new user with a first API token (shown once), made a member."""
    path_company(request)
    fields = string_fields(await read_json(request), required=("email", "role"))
    email, role = str(fields["email"]), str(fields["role"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        user, member = await orgs.add_new_member(conn, actor.company_id, email, role, actor=actor)
        return new_member_json(user, member.role)

    return JSONResponse(await company_write(request, work), status_code=201)


@json_errors
async def put_member(request: Request) -> Response:
    """Change a member's role. Anyone else, whether or not such a user exists,
    is 404 ``member_not_found``: a person joins by accepting an invitation
    (:mod:`controller.api.invitations`), or through the host's operator."""
    user_id = validate_uuid(request.path_params["userId"], "userId")
    path_company(request)
    role = str(string_fields(await read_json(request), required=("role",))["role"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        await orgs.set_member_role(conn, actor.company_id, user_id, role, actor=actor)
        return member_json(await orgs.get_member(conn, actor.company_id, user_id))

    return JSONResponse(await company_write(request, work))


@json_errors
async def delete_member(request: Request) -> Response:
    user_id = validate_uuid(request.path_params["userId"], "userId")

    async def work(conn: Conn, actor: CompanyActor) -> None:
        await orgs.remove_member(conn, actor.company_id, user_id, actor=actor)

    await company_write(request, work)
    return JSONResponse({"userId": user_id, "removed": True})


# --- agents, projects, tasks -------------------------------------------------------------


@company_route
async def list_agents(request: Request) -> Response:
    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        return [named_json(r) for r in await orgs.list_agents(conn, actor.company_id)]

    return JSONResponse({"agents": await company_read(request, work)})


@company_route
async def create_agent(request: Request) -> Response:
    path_company(request)
    name = str(string_fields(await read_json(request), required=("name",))["name"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        return named_json(await orgs.create_agent(conn, actor.company_id, name))

    return JSONResponse(await company_write(request, work), status_code=201)


@company_route
async def set_agent_entry(request: Request) -> Response:
    """``set-agent-entry``: ``path`` becomes the agent's instruction entry,
    created empty when nothing is there."""
    agent = validate_uuid(request.path_params["agentId"], "agentId")
    path_company(request)
    path = str(string_fields(await read_json(request), required=("path",))["path"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        changed = await agentfiles.set_entry(conn, agent, path, company_id=actor.company_id)
        return agent_entry_change_json(changed)

    return JSONResponse(await company_write(request, work))


@company_route
async def list_grants(request: Request) -> Response:
    """Who holds a permission on the agent through a grant (an orchestrator
    checks that a run's user may save the agent's folder)."""
    agent = validate_uuid(request.path_params["agentId"], "agentId")

    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        return [grant_json(r) for r in await grants.list_grants(conn, actor.company_id, agent)]

    return JSONResponse({"agentId": agent, "grants": await company_read(request, work)})


def _grant_parties(request: Request) -> tuple[str, str]:
    agent = validate_uuid(request.path_params["agentId"], "agentId")
    user = validate_uuid(request.path_params["userId"], "userId")
    path_company(request)
    return agent, user


@json_errors
async def put_grant(request: Request) -> Response:
    """``grant``: the member may configure the agent (its folder), from the
    next request on. Granting again changes nothing."""
    agent, user = _grant_parties(request)

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        changed = await grants.grant_configure(conn, actor.company_id, user, agent)
        return grant_change_json(changed)

    return JSONResponse(await company_write(request, work))


@json_errors
async def delete_grant(request: Request) -> Response:
    """``revoke``: the member's permission ends for the next request and for a
    write not yet committed (``revoked`` false: there was none)."""
    agent, user = _grant_parties(request)

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        changed = await grants.revoke_configure(conn, actor.company_id, user, agent)
        return grant_change_json(changed)

    return JSONResponse(await company_write(request, work))


@company_route
async def list_projects(request: Request) -> Response:
    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        return [named_json(r) for r in await orgs.list_projects(conn, actor.company_id)]

    return JSONResponse({"projects": await company_read(request, work)})


@company_route
async def create_project(request: Request) -> Response:
    path_company(request)
    name = str(string_fields(await read_json(request), required=("name",))["name"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        return named_json(await orgs.create_project(conn, actor.company_id, name))

    return JSONResponse(await company_write(request, work), status_code=201)


@company_route
async def list_tasks(request: Request) -> Response:
    values = strict_query(request, "projectId")
    if len(values) > 1:
        raise ValidationError.single("projectId", "invalid_uuid", "at most one projectId")
    project = validate_uuid(values[0], "projectId") if values else None

    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        return [task_json(r) for r in await orgs.list_tasks(conn, actor.company_id, project)]

    return JSONResponse({"tasks": await company_read(request, work)})


@company_route
async def create_task(request: Request) -> Response:
    path_company(request)
    fields = string_fields(await read_json(request), required=("projectId", "title"))
    project = validate_uuid(str(fields["projectId"]), "projectId")
    title = str(fields["title"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        return task_json(await orgs.create_task(conn, actor.company_id, project, title))

    return JSONResponse(await company_write(request, work), status_code=201)


# --- repositories: workspaces and the task's branch (controller/workspaces.py) ----------


@company_route
async def list_workspaces(request: Request) -> Response:
    project = validate_uuid(request.path_params["projectId"], "projectId")

    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        rows = await workspaces.list_workspaces(conn, actor.company_id, project)
        return [workspace_json(r) for r in rows]

    return JSONResponse({"workspaces": await company_read(request, work)})


@company_route
async def add_workspace(request: Request) -> Response:
    """``add-workspace``: with ``primary`` the project's primary workspace
    changes (``replacedPrimary`` names the one that no longer is)."""
    project = validate_uuid(request.path_params["projectId"], "projectId")
    path_company(request)
    body = await read_json(request)
    primary = body.pop("primary", False)
    if not isinstance(primary, bool):
        raise ValidationError.single("primary", "invalid_type", "primary must be true or false")
    fields = string_fields(body, required=("repoUrl",), optional=("name", "ref", "setupCommand"))

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        await orgs.require_project(conn, actor.company_id, project)
        added = await workspaces.add_workspace(
            conn,
            project,
            repo_url=str(fields["repoUrl"]),
            name=fields["name"],
            ref=fields["ref"],
            primary=primary,
            setup_command=fields["setupCommand"],
        )
        return added_workspace_json(added)

    return JSONResponse(await company_write(request, work), status_code=201)


@company_route
async def remove_workspace(request: Request) -> Response:
    workspace = validate_uuid(request.path_params["workspaceId"], "workspaceId")

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        removed = await workspaces.remove_workspace(conn, workspace, company_id=actor.company_id)
        return removed_workspace_json(removed)

    return JSONResponse(await company_write(request, work))


@company_route
async def set_task_branch(request: Request) -> Response:
    task = validate_uuid(request.path_params["taskId"], "taskId")
    path_company(request)
    branch = str(string_fields(await read_json(request), required=("branch",))["branch"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        await workspaces.set_task_branch(conn, task, branch, company_id=actor.company_id)
        return {"taskId": task, "branch": branch}

    return JSONResponse(await company_write(request, work))


# --- operator tokens (people only: an operator token is refused with 401) ------------


@json_errors
async def list_operator_tokens(request: Request) -> Response:
    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        rows = await tokens.list_operator_tokens(conn, actor.company_id)
        return [operator_token_json(r) for r in rows]

    return JSONResponse({"operatorTokens": await company_read(request, work)})


@json_errors
async def create_operator_token(request: Request) -> Response:
    path_company(request)
    name = str(string_fields(await read_json(request), required=("name",))["name"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        made = await tokens.create_operator_token(conn, actor.company_id, name)
        return new_operator_token_json(made)

    return JSONResponse(await company_write(request, work), status_code=201)


@json_errors
async def revoke_operator_token(request: Request) -> Response:
    token_id = validate_uuid(request.path_params["tokenId"], "tokenId")

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        row = await tokens.revoke_token(conn, token_id, actor=actor, operator_only=True)
        return operator_token_json(row)

    return JSONResponse(await company_write(request, work))


# --- the members' credentials (people only; the rules are controller/tokens.py's) ----


@json_errors
async def list_tokens(request: Request) -> Response:
    """``list-tokens --company C [--user U]``: the members' API tokens and the
    company's operator tokens, oldest first."""
    values = strict_query(request, "userId")
    if len(values) > 1:
        raise ValidationError.single("userId", "invalid_uuid", "at most one userId")
    user = validate_uuid(values[0], "userId") if values else None

    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        rows = await tokens.list_tokens(conn, company=actor.company_id, user=user)
        return [token_json(r) for r in rows]

    return JSONResponse({"tokens": await company_read(request, work)})


@json_errors
async def revoke_token(request: Request) -> Response:
    """``revoke-token``: one of the company's operator tokens, or a member's
    API token while it serves this company alone (403 token_shared)."""
    token_id = validate_uuid(request.path_params["tokenId"], "tokenId")

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        return token_json(await tokens.revoke_token(conn, token_id, actor=actor))

    return JSONResponse(await company_write(request, work))


@json_errors
async def end_sessions(request: Request) -> Response:
    """``end-sessions`` for this company only: the member's Files page sessions
    signed in so far stop reaching it; their other companies stay open."""
    user_id = validate_uuid(request.path_params["userId"], "userId")

    async def work(conn: Conn, actor: CompanyActor) -> int:
        return await tokens.end_sessions(conn, user_id, actor=actor)

    ended = await company_write(request, work)
    return JSONResponse({"userId": user_id, "ended": ended})


COMPANY = "/api/companies/{companyId}"

routes = [
    Route(COMPANY + "/members", list_members, methods=["GET"]),
    Route(COMPANY + "/members", create_member, methods=["POST"]),
    Route(COMPANY + "/members/{userId}", put_member, methods=["PUT"]),
    Route(COMPANY + "/members/{userId}", delete_member, methods=["DELETE"]),
    Route(COMPANY + "/members/{userId}/sessions", end_sessions, methods=["DELETE"]),
    Route(COMPANY + "/agents", list_agents, methods=["GET"]),
    Route(COMPANY + "/agents", create_agent, methods=["POST"]),
    Route(COMPANY + "/agents/{agentId}/entry", set_agent_entry, methods=["PUT"]),
    Route(COMPANY + "/agents/{agentId}/grants", list_grants, methods=["GET"]),
    Route(COMPANY + "/agents/{agentId}/grants/{userId}", put_grant, methods=["PUT"]),
    Route(COMPANY + "/agents/{agentId}/grants/{userId}", delete_grant, methods=["DELETE"]),
    Route(COMPANY + "/projects", list_projects, methods=["GET"]),
    Route(COMPANY + "/projects", create_project, methods=["POST"]),
    Route(COMPANY + "/tasks", list_tasks, methods=["GET"]),
    Route(COMPANY + "/tasks", create_task, methods=["POST"]),
    Route(COMPANY + "/projects/{projectId}/workspaces", list_workspaces, methods=["GET"]),
    Route(COMPANY + "/projects/{projectId}/workspaces", add_workspace, methods=["POST"]),
    Route(COMPANY + "/workspaces/{workspaceId}", remove_workspace, methods=["DELETE"]),
    Route(COMPANY + "/tasks/{taskId}/branch", set_task_branch, methods=["PUT"]),
    Route(COMPANY + "/operator-tokens", list_operator_tokens, methods=["GET"]),
    Route(COMPANY + "/operator-tokens", create_operator_token, methods=["POST"]),
    Route(COMPANY + "/operator-tokens/{tokenId}", revoke_operator_token, methods=["DELETE"]),
    Route(COMPANY + "/tokens", list_tokens, methods=["GET"]),
    Route(COMPANY + "/tokens/{tokenId}", revoke_token, methods=["DELETE"]),
]
