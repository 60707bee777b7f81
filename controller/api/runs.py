"""Runs under ``/api/companies/{companyId}/runs``: the orchestrator's start,
end, read and list, and a run's state, warnings and save receipts.

Start, end and list are one call of the domain functions that ``controller
admin start-run`` and ``end-run`` call (:mod:`controller.runs`). Owners,
admins and the company's operator tokens may use them; anyone else gets 404
``company_not_found``. A run's details and receipts are also readable by its
responsible user and by members who may configure its agent
(``controller.receipts.may_read_run``); anyone else sees no such run (404
``run_not_found``). A run token is never accepted here (401, as on every
``/api/`` route), also not through the API bridge's allowlist.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from psycopg import AsyncConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import CompanyNotFound, RunNotFound, ValidationError
from common.paths import validate_uuid
from controller import receipts, repos, runs
from controller.api.common import (
    authenticate,
    company_read,
    company_route,
    company_write,
    connection,
    path_company,
    read_json,
)
from controller.api.params import (
    BIGINT_MAX,
    decode_run_cursor,
    encode_cursor,
    query_bool,
    query_int,
    strict_query,
    string_fields,
)
from controller.api.serialize import (
    folder_state_json,
    run_record_json,
    run_repo_json,
    run_warnings,
    started_run_json,
)
from controller.auth import CompanyActor, authorize_company
from controller.rowjson import iso

Conn = AsyncConnection[Any]
T = TypeVar("T")

RUN_PAGE_MAX = 1000
RUN_PAGE_DEFAULT = 200


def _optional_uuid(value: str | None, field: str) -> str | None:
    return None if value is None else validate_uuid(value, field)


def _home(value: str | None) -> str:
    return runs.DEFAULT_HOME if value is None else runs.check_home(value)


@company_route
async def start_run(request: Request) -> Response:
    """Bind the task's repositories, then a run and a new lease for its
    sandbox: the run token (shown once), the lease epoch, the agent's ``env``
    and the repositories. Older runs of the same sandbox end (their tokens
    answer 401; their saves in flight are refused)."""
    company_id = path_company(request)
    fields = string_fields(
        await read_json(request),
        required=("agentId",),
        optional=("taskId", "projectId", "userId", "sandbox", "home"),
    )
    agent = validate_uuid(str(fields["agentId"]), "agentId")
    task = _optional_uuid(fields["taskId"], "taskId")
    project = _optional_uuid(fields["projectId"], "projectId")
    user = _optional_uuid(fields["userId"], "userId")
    sandbox = fields["sandbox"]
    if sandbox is not None:
        runs.check_sandbox_key(sandbox)
    home = _home(fields["home"])

    async def transact(work: Callable[[Conn], Awaitable[T]]) -> T:
        # The caller's authority is checked again in each transaction.
        async def as_actor(conn: Conn, actor: CompanyActor) -> T:
            return await work(conn)

        return await company_write(request, as_actor)

    started = await runs.start_bound_run(
        transact,
        company_id,
        agent=agent,
        task=task,
        project=project,
        user=user,
        sandbox=sandbox,
        home=home,
    )
    return JSONResponse(started_run_json(started), status_code=201)


@company_route
async def end_run(request: Request) -> Response:
    """End a run; its token answers 401 from the next request. Ending an
    ended run changes nothing and answers the same."""
    run_id = validate_uuid(request.path_params["runId"], "runId")

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        return run_record_json(await runs.end_run(conn, run_id, company=actor.company_id))

    return JSONResponse(await company_write(request, work))


async def _readable_run(request: Request, conn: Conn) -> dict[str, Any]:
    """The run's row for its details, or RunNotFound: the company's owners,
    admins and operator tokens read every run; the run's responsible user and
    members who may configure its agent read that run."""
    company_id = path_company(request)
    run_id = validate_uuid(request.path_params["runId"], "runId")
    principal = await authenticate(request, conn)
    row = await receipts.run_row(conn, company_id, run_id)
    if row is None:
        raise RunNotFound()
    try:
        await authorize_company(conn, principal, company_id, write=False)
    except CompanyNotFound:
        if not await receipts.may_read_run(conn, principal, company_id, row):
            raise RunNotFound() from None
    return row


def _repo_json(
    run: dict[str, Any], repo: dict[str, Any], saved: dict[str, Any] | None
) -> dict[str, Any]:
    """A repository in a run's details: the run's failed save of it while that
    stands, else the repository's own state."""
    failure = runs.repository_failure(run, repo["name"])
    state, error = ("failed", failure) if failure is not None else (repo["state"], repo["error"])
    return run_repo_json(repo, state, error, runs.error_code(error), saved)


@company_route
async def get_run(request: Request) -> Response:
    """A run as the orchestrator sees it, with its warnings, the number of its
    save receipts by outcome, and its save state of each of its folders and
    repositories (a failure stands until a later save of the same thing
    succeeds)."""
    async with connection(request) as conn:
        row = await _readable_run(request, conn)
        run_id = str(row["id"])
        record = await runs.get_run(conn, run_id, company=str(row["company_id"]))
        counts = await receipts.receipt_counts(conn, run_id)
        saves = (await receipts.folder_saves(conn, [run_id])).get(run_id, [])
        baselines = await runs.run_folder_baselines(conn, run_id)
        repo_rows: list[dict[str, Any]] = []
        repo_saves: dict[str, dict[str, Any]] = {}
        if row["task_id"] is not None:
            repo_rows = await repos.list_for_task(conn, str(row["company_id"]), str(row["task_id"]))
            repo_saves = await runs.run_repo_saves(conn, run_id)
    state, error = runs.run_state(record, saves)
    bound = {
        "task": row["task_id"],
        "agent": row["agent_id"],
        "user": row["user_id"],
        "project": row["project_id"],
    }
    folders = []
    states = []
    for scope, owner in bound.items():
        if owner is None:
            continue
        key = (scope, str(owner))
        saved_at = baselines.get(key)
        own = next((s for s in saves if (s.scope, s.owner_id) == key), None)
        if own is not None and own.saved_at is not None:
            saved_at = max(filter(None, (saved_at, own.saved_at)))
        st = runs.folder_state(record, scope, str(owner), saves, baselines.get(key))
        states.append(st)
        folders.append(folder_state_json(scope, str(owner), saved_at, st))
    return JSONResponse(
        {
            **run_record_json(record),
            "state": state,
            "error": error,
            "companyId": str(row["company_id"]),
            "agentId": str(row["agent_id"]),
            "taskId": None if row["task_id"] is None else str(row["task_id"]),
            "projectId": None if row["project_id"] is None else str(row["project_id"]),
            "userId": None if row["user_id"] is None else str(row["user_id"]),
            "warnings": run_warnings(row),
            # The sandbox's final save of every folder it binds succeeded or
            # was given up on: it stopped, whether or not the run has ended.
            "stoppedAt": iso(runs.stopped_at(states)),
            "receipts": counts,
            "folders": folders,
            "repos": [
                _repo_json(record, r, repo_saves.get(str(r["workspace_id"]))) for r in repo_rows
            ],
        }
    )


@company_route
async def get_receipts(request: Request) -> Response:
    """A run's save receipts, oldest first: later successes never erase earlier
    failures."""
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


def _one(request: Request, name: str) -> str | None:
    values = strict_query(request, name)
    if len(values) > 1:
        raise ValidationError.single(name, "repeated", f"at most one {name} query parameter")
    return values[0] if values else None


@company_route
async def list_runs(request: Request) -> Response:
    """The company's runs, newest first, a page at a time."""
    limit = query_int(
        request,
        "limit",
        RUN_PAGE_DEFAULT,
        minimum=1,
        maximum=RUN_PAGE_MAX,
        code="invalid_limit",
    )
    active = None if _one(request, "active") is None else query_bool(request, "active")
    sandbox = _one(request, "sandbox")
    match = runs.RunFilter(
        active=active,
        agent=_optional_uuid(_one(request, "agentId"), "agentId"),
        task=_optional_uuid(_one(request, "taskId"), "taskId"),
        sandbox=None if sandbox is None else runs.check_sandbox_key(sandbox),
    )
    cursor = _one(request, "cursor")
    before = None if cursor is None else decode_run_cursor(cursor)

    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        return await runs.list_runs(conn, actor.company_id, match, limit=limit, before=before)

    rows = await company_read(request, work)
    next_cursor = None
    if len(rows) == limit:
        last = rows[-1]
        next_cursor = encode_cursor({"s": last["started_at"].isoformat(), "i": str(last["id"])})
    return JSONResponse({"runs": [run_record_json(r) for r in rows], "nextCursor": next_cursor})


RUNS = "/api/companies/{companyId}/runs"

routes = [
    Route(RUNS, list_runs, methods=["GET"]),
    Route(RUNS, start_run, methods=["POST"]),
    Route(RUNS + "/{runId}", get_run, methods=["GET"]),
    Route(RUNS + "/{runId}/end", end_run, methods=["POST"]),
    Route(RUNS + "/{runId}/receipts", get_receipts, methods=["GET"]),
]
