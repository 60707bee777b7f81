"""The OpenAPI document covers every route, the Files page's answers match its
response schemas field for field, and a property-based fuzz run driven by it
(schemathesis) against a real ``controller serve``: no route answers 5xx, and
no route but the public ones answers 2xx without credentials."""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
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


def _strict(node: Any) -> Any:
    """The schema with every object closed unless it says otherwise, so an
    answer's undocumented field fails as a missing one does."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


STRICT = _strict(document())


def assert_conforms(resp: httpx.Response, path: str, method: str = "get") -> None:
    """The JSON answer matches the document's schema for its route and status."""
    responses = STRICT["paths"][path][method]["responses"]
    schema = responses[str(resp.status_code)]["content"]["application/json"]["schema"]
    jsonschema.validate(resp.json(), {**schema, "components": STRICT["components"]})


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


def test_the_files_pages_answers_match_their_schemas(world: World) -> None:
    """/sync (a run with its agent's name and a warning), the writes, refresh,
    the directory (a person's and a run's), the session and a task's
    repositories answer exactly what the document says."""
    t = world.tenant
    ctl = t.controller
    run = ctl.admin(
        "start-run", t.company_id, "--agent", world.owners["agent"], "--task", world.owners["task"],
        "--user", t.user_id,
    )  # fmt: skip
    with httpx.Client(
        base_url=ctl.url, timeout=30, headers={"Authorization": f"Bearer {run['token']}"}
    ) as bridge:
        saved = bridge.post(
            PREFIX + "/folders/task/checkpoints",
            json={
                "operationId": f"schema-{run['run_id']}",
                "leaseEpoch": run["lease_epoch"],
                "entries": [{"op": "mkdir", "path": f"schema-{run['run_id']}"}],
                "localRefusals": [{"path": "a-link", "code": "symlink"}],
            },
        )
        assert saved.status_code == 200, saved.text
        run_directory = bridge.get(PREFIX + f"/api/companies/{t.company_id}/directory")
    folder_path = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}"
    task_folder = t.folder("task", world.owners["task"])
    top = f"schema-{uuid.uuid4().hex[:8]}"
    with t.client() as c:
        sync = c.get(task_folder + "/sync")
        assert sync.status_code == 200, sync.text
        assert_conforms(sync, folder_path + "/sync")
        mine = next(r for r in sync.json()["runs"] if r["runId"] == run["run_id"])
        assert mine["agentName"] and mine["folderSavedAt"]
        assert [w["code"] for w in mine["warnings"]] == ["SANDBOX_REFUSED"]

        octet = {"Content-Type": "application/octet-stream"}
        created = c.put(task_folder + "/content", params={"path": f"{top}/a.txt"},
                        content=b"a", headers=octet)  # fmt: skip
        replaced = c.put(task_folder + "/content", params={"path": f"{top}/a.txt"},
                         content=b"b", headers=octet)  # fmt: skip
        assert (created.status_code, replaced.status_code) == (201, 200)
        for resp in (created, replaced):
            assert_conforms(resp, folder_path + "/content", "put")
        ops = folder_path + "/operations"
        moved = c.post(task_folder + "/operations",
                       json={"action": "move", "path": f"{top}/a.txt", "to": f"{top}/b.txt"})  # fmt: skip
        deleted = c.post(task_folder + "/operations",
                         json={"action": "delete", "path": f"{top}/b.txt"})  # fmt: skip
        file_id = deleted.json()["files"][0]["id"]
        restored = c.post(
            task_folder + "/operations", json={"action": "restore", "fileId": file_id}
        )
        deleted_again = c.post(task_folder + "/operations",
                               json={"action": "delete", "path": f"{top}/b.txt"})  # fmt: skip
        purged = c.post(task_folder + "/operations", json={"action": "purge", "fileId": file_id})
        for resp in (moved, deleted, restored, deleted_again, purged):
            assert resp.status_code == 200, resp.text
            assert_conforms(resp, ops, "post")
        assert purged.json()["purged"] == 1

        listing = c.get(task_folder, params={"limit": 5})
        changes = c.get(
            task_folder + "/changes", params={"since": 0, "dir": top, "entries": "true"}
        )
        for resp, route in ((listing, folder_path), (changes, folder_path + "/changes")):
            assert resp.status_code == 200, resp.text
            assert_conforms(resp, route)
        assert listing.json()["entries"] and changes.json()["changed"] is True
        assert changes.json()["complete"] is True and changes.json()["entries"]

        refresh = c.post(task_folder + "/refresh", json={"runId": run["run_id"]})
        assert refresh.status_code == 202, refresh.text
        assert_conforms(refresh, folder_path + "/refresh", "post")

        directory = c.get(f"/api/companies/{t.company_id}/directory")
        repos = c.get(f"/api/companies/{t.company_id}/tasks/{world.owners['task']}/repos")
    for resp in (directory, run_directory):
        assert resp.status_code == 200, resp.text
        assert_conforms(resp, "/api/companies/{companyId}/directory")
    assert "hasFiles" in directory.json()["tasks"][0]
    assert set(run_directory.json()["members"][0]) == {"userId"}
    assert repos.status_code == 200 and repos.json()["repos"], repos.text
    assert_conforms(repos, "/api/companies/{companyId}/tasks/{taskId}/repos")

    with httpx.Client(base_url=ctl.url, timeout=30) as browser:
        signed_in = browser.post("/files/api/session", json={"token": t.token})
        current = browser.get("/files/api/session")
    for resp, method in ((signed_in, "post"), (current, "get")):
        assert resp.status_code == 200, resp.text
        assert_conforms(resp, "/files/api/session", method)

    # The check has teeth: a field the document does not name fails it.
    with pytest.raises(jsonschema.ValidationError, match="agentNickname"):
        jsonschema.validate(
            {**sync.json(), "runs": [{**mine, "agentNickname": "x"}]},
            {**STRICT["components"]["schemas"]["Sync"], "components": STRICT["components"]},
        )


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
