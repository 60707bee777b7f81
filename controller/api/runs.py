"""A run's state, warnings and save receipts for people:
``GET /api/companies/{companyId}/runs/{runId}`` and ``…/receipts``.

Readable by the company's owners and admins, the run's responsible user and
members who may configure the run's agent (``controller.receipts.may_read_run``);
anyone else, runs included, sees no such run (404 ``run_not_found``).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import RunNotFound
from common.paths import validate_uuid
from controller import receipts
from controller.api.common import authenticate, connection, json_errors
from controller.api.params import BIGINT_MAX, query_int
from controller.api.serialize import iso, run_warnings


def _run_detail_json(row: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    def s(value: Any) -> str | None:
        return None if value is None else str(value)

    return {
        "runId": str(row["id"]),
        "companyId": str(row["company_id"]),
        "agentId": str(row["agent_id"]),
        "taskId": s(row["task_id"]),
        "projectId": s(row["project_id"]),
        "userId": s(row["user_id"]),
        "leaseEpoch": int(row["lease_epoch"]),
        "state": row["state"],
        "active": bool(row["active"]),
        "error": row["error"],
        "startedAt": iso(row["started_at"]),
        "endedAt": iso(row["ended_at"]),
        "lastSavedAt": iso(row["last_saved_at"]),
        "finalCheckpointAt": iso(row["final_checkpoint_at"]),
        "warnings": run_warnings(row),
        "receipts": counts,
    }


async def _readable_run(request: Request, conn: Any) -> dict[str, Any]:
    company_id = validate_uuid(request.path_params["companyId"], "companyId")
    run_id = validate_uuid(request.path_params["runId"], "runId")
    principal = await authenticate(request, conn)
    row = await receipts.run_row(conn, company_id, run_id)
    if row is None or not await receipts.may_read_run(conn, principal, company_id, row):
        raise RunNotFound()
    return row


@json_errors
async def get_run(request: Request) -> Response:
    async with connection(request) as conn:
        row = await _readable_run(request, conn)
        counts = await receipts.receipt_counts(conn, str(row["id"]))
    return JSONResponse(_run_detail_json(row, counts))


@json_errors
async def get_receipts(request: Request) -> Response:
    after = query_int(request, "after", 0, minimum=0, maximum=BIGINT_MAX, code="invalid_integer")
    limit = query_int(
        request,
        "limit",
        receipts.RECEIPTS_PAGE_MAX,
        minimum=1,
        maximum=receipts.RECEIPTS_PAGE_MAX,
        code="invalid_limit",
    )
    async with connection(request) as conn:
        row = await _readable_run(request, conn)
        page = await receipts.list_for_run(conn, str(row["id"]), after, limit)
    more = len(page) == limit
    return JSONResponse({"receipts": page, "nextAfter": page[-1]["id"] if more else None})


routes = [
    Route("/api/companies/{companyId}/runs/{runId}", get_run, methods=["GET"]),
    Route("/api/companies/{companyId}/runs/{runId}/receipts", get_receipts, methods=["GET"]),
]
