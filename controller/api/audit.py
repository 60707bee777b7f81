"""``GET /api/companies/{companyId}/runs/{runId}/audit``: the API bridge's audit
trail of one run, for the company's owners and admins and its operator tokens."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import CompanyNotFound, RunNotFound
from common.paths import validate_uuid
from controller import bridgeaudit
from controller.api.common import company_read, company_route, path_company
from controller.api.params import BIGINT_MAX, query_int
from controller.auth import CompanyActor


@company_route
async def get_audit(request: Request) -> Response:
    path_company(request)
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

    async def work(conn: AsyncConnection[Any], actor: CompanyActor) -> list[dict[str, Any]]:
        if await bridgeaudit.run_company(conn, run_id) != actor.company_id:
            raise RunNotFound()
        return await bridgeaudit.list_for_run(conn, run_id, after, limit)

    try:
        entries = await company_read(request, work)
    except CompanyNotFound:
        # Anyone but the company's owners, admins and operator tokens (a run,
        # a member, another company) sees no such run.
        raise RunNotFound() from None
    more = len(entries) == limit
    return JSONResponse(
        {"entries": entries, "nextAfter": entries[-1]["id"] if more and entries else None}
    )


routes = [Route("/api/companies/{companyId}/runs/{runId}/audit", get_audit, methods=["GET"])]
