"""``GET /api/companies/{companyId}/runs/{runId}/audit``: the API bridge's audit
trail of one run, for the company's owners and admins."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import RunNotFound
from common.paths import validate_uuid
from controller import bridgeaudit
from controller.api.common import authenticate, connection, json_errors
from controller.api.params import BIGINT_MAX, query_int
from controller.auth import membership_role

AUDIT_ROLES = ("owner", "admin")


@json_errors
async def get_audit(request: Request) -> Response:
    company_id = validate_uuid(request.path_params["companyId"], "companyId")
    run_id = validate_uuid(request.path_params["runId"], "runId")
    after = query_int(request, "after", 0, minimum=0, maximum=BIGINT_MAX, code="invalid_integer")
    limit = query_int(
        request,
        "limit",
        bridgeaudit.AUDIT_PAGE_MAX,
        minimum=1,
        maximum=bridgeaudit.AUDIT_PAGE_MAX,
        code="invalid_limit",
    )
    async with connection(request) as conn:
        principal = await authenticate(request, conn)
        # A person with the owner or admin role of the run's company; anyone
        # else (a run, a member, another company) sees no such run.
        role = (
            None
            if principal.user_id is None
            else await membership_role(conn, company_id, principal.user_id)
        )
        if role not in AUDIT_ROLES or await bridgeaudit.run_company(conn, run_id) != company_id:
            raise RunNotFound()
        entries = await bridgeaudit.list_for_run(conn, run_id, after, limit)
    more = len(entries) == limit
    return JSONResponse(
        {"entries": entries, "nextAfter": entries[-1]["id"] if more and entries else None}
    )


routes = [Route("/api/companies/{companyId}/runs/{runId}/audit", get_audit, methods=["GET"])]
