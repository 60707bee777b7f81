"""A task's repositories for people: their save state, and the current
checkpoint of one as a streamed tar.

``GET /api/companies/{companyId}/tasks/{taskId}/repos`` and
``GET .../repos/{workspaceId}/archive`` (contract: :mod:`common.repos`).
Whoever may read the task's work folder may read its repositories; every
denial is 404, like a task that does not exist.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from psycopg import AsyncConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.errors import NotFound
from common.paths import validate_uuid
from controller import repomanifest, repos
from controller.api.common import authenticate, connection, json_errors, state
from controller.api.objects import in_thread
from controller.api.serialize import task_repo_json
from controller.auth import authorize_folder
from controller.repostream import tar_body

BASE = "/api/companies/{companyId}/tasks/{taskId}/repos"


async def _task(request: Request, conn: AsyncConnection[Any]) -> tuple[str, str]:
    """The company and task, once the caller may read the task's folder."""
    company_id = validate_uuid(request.path_params["companyId"], "companyId")
    task_id = validate_uuid(request.path_params["taskId"], "taskId")
    principal = await authenticate(request, conn)
    await authorize_folder(conn, principal, company_id, "task", task_id, write=False)
    return company_id, task_id


@json_errors
async def list_repos(request: Request) -> Response:
    async with connection(request) as conn:
        company_id, task_id = await _task(request, conn)
        rows = await repos.list_for_task(conn, company_id, task_id)
    return JSONResponse({"repos": [task_repo_json(r) for r in rows]})


@json_errors
async def archive(request: Request) -> Response:
    st = state(request)
    async with connection(request) as conn:
        company_id, task_id = await _task(request, conn)
        bound = await repos.binding(conn, company_id, task_id, request.path_params["workspaceId"])
    if bound.manifest_digest is None:
        raise NotFound("The repository has no saved checkpoint")
    manifest = await asyncio.to_thread(
        repomanifest.load, st.storage, company_id, bound.manifest_digest
    )
    body = tar_body(st.storage, company_id, bound.name, manifest, bound.saved_at.timestamp())
    return StreamingResponse(
        in_thread(body),
        media_type="application/x-tar",
        headers={
            "Cache-Control": "private, no-store",
            "X-Content-Type-Options": "nosniff",
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(bound.name)}.tar",
        },
    )


routes = [
    Route(BASE, list_repos, methods=["GET"]),
    Route(BASE + "/{workspaceId}/archive", archive, methods=["GET"]),
]
