"""The OpenAPI document covers every route, and a property-based fuzz run driven
by it (schemathesis) against a real ``controller serve``: no route answers 5xx,
and no route but the public ones answers 2xx without credentials."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from starlette.routing import Route

from common.bridge import PREFIX
from controller.api.app import create_app
from controller.api.openapi import document
from controller.cli import make_storage
from controller.config import Settings
from tests.support.bridge import start_run
from tests.support.controller import ControllerProcess, Tenant, bootstrap_tenant


def _openapi_path(starlette_path: str) -> str:
    return re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", starlette_path)


def test_every_route_has_an_openapi_schema(tmp_path: Path) -> None:
    st = Settings(data_dir=tmp_path, database_url="postgresql://unused@/unused")
    app = create_app(st, make_storage(st), run_gc=False)
    documented = {
        (path, method.upper())
        for path, item in document()["paths"].items()
        for method in item
        if method != "parameters"
    }
    served = {
        (_openapi_path(route.path), method)
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"  # starlette adds it beside every GET
    }
    assert served, "no routes found"
    assert served - documented == set(), "routes without an OpenAPI schema"
    assert documented - served == set(), "schemas for routes that do not exist"


@dataclass
class World:
    tenant: Tenant
    run_token: str
    owners: dict[str, str]
    workspace: str


@pytest.fixture(scope="module")
def world(controller: ControllerProcess) -> World:
    tenant = bootstrap_tenant(controller)
    run = start_run(tenant)
    assert run.task is not None and run.project is not None
    # A repository workspace, bound by a second run of the task (runs bind at start).
    workspace = controller.admin(
        "add-workspace", run.project, "--repo-url", "https://git.example/app.git"
    )["workspace_id"]
    token = controller.admin(
        "start-run", tenant.company_id, "--agent", run.agent, "--task", run.task,
        "--user", tenant.user_id,
    )["token"]  # fmt: skip
    owners = {
        "task": run.task,
        "project": run.project,
        "agent": run.agent,
        "user": tenant.user_id,
    }
    return World(tenant, token, owners, workspace)


EXAMPLES = int(os.environ.get("FSA_FUZZ_EXAMPLES", "12"))
"""Cases per operation and generation mode; raise it for a longer run."""

SCHEMA = schemathesis.openapi.from_dict(document())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]


def _aim_at_real_folders(case: Any, w: World) -> None:
    """Point most cases at folders that exist, so the fuzz reaches past the 404."""
    params = case.path_parameters
    if params is None:
        return
    if "companyId" in params:
        params["companyId"] = w.tenant.company_id
    if "taskId" in params:
        params["taskId"] = w.owners["task"]
    if "workspaceId" in params:
        params["workspaceId"] = w.workspace
    if params.get("scope") in w.owners and "ownerId" in params:
        params["ownerId"] = w.owners[params["scope"]]


def server_error(response: Any, case: Any, w: World) -> str:
    log = w.tenant.controller.log()
    return f"{response.status_code} {response.text[:300]}\n{case.as_curl_command()}\n{log[-4000:]}"


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_fuzz_no_server_errors_and_no_anonymous_success(operation: Any, world: World) -> None:
    public = operation.definition.raw.get("security") == []
    token = world.run_token if operation.path.startswith(PREFIX) else world.tenant.token
    base = world.tenant.controller.url
    cases = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
        GenerationMode.NEGATIVE
    )

    @settings(
        max_examples=EXAMPLES,
        # Fast and reproducible: no shrinking (the failure message has the request).
        phases=[Phase.explicit, Phase.generate],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def check(case: Any) -> None:
        _aim_at_real_folders(case, world)
        case.headers = {
            k: v
            for k, v in (case.headers or {}).items()
            if k.lower() not in ("authorization", "cookie")
        }
        case.cookies = {}
        authed = case.call(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert authed.status_code < 500, server_error(authed, case, world)
        anonymous = case.call(base_url=base, timeout=30)
        assert anonymous.status_code < 500, server_error(anonymous, case, world)
        if not public:
            assert not 200 <= anonymous.status_code < 300, (
                anonymous.status_code,
                case.as_curl_command(),
            )

    check()
