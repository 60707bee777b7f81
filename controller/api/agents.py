"""``GET /api/companies/{companyId}/agents/{agentId}``: an agent's instruction
entry, storage limits and usage, for whoever may open its folder (the same
rule: owners and admins, members with the agent's configure permission, the
agent's own runs); everyone else gets the folder's 404."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import NotFound
from common.paths import validate_uuid
from controller import agentfiles
from controller.api.common import authenticate, connection, json_errors, state
from controller.auth import authorize_folder


@json_errors
async def get_agent(request: Request) -> Response:
    company_id = validate_uuid(request.path_params["companyId"], "companyId")
    agent_id = validate_uuid(request.path_params["agentId"], "agentId")
    limits = state(request).settings.quotas.agent
    async with connection(request) as conn:
        principal = await authenticate(request, conn)
        await authorize_folder(conn, principal, company_id, "agent", agent_id, write=False)
        described = await agentfiles.describe_agent(conn, company_id, agent_id, limits)
    if described is None:
        raise NotFound()
    return JSONResponse(described)


routes = [Route("/api/companies/{companyId}/agents/{agentId}", get_agent, methods=["GET"])]
