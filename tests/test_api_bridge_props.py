"""Properties of the API bridge: generated methods, routes and headers, in
process (the matcher and the forwarded headers) and against a real controller
(the allowlist is the only way through, and a refusal changes nothing)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.routing import Route

from common.bridge import PREFIX
from controller.api import (
    agents,
    apibridge,
    attachments,
    audit,
    bridge,
    runs,
    web,
    workfolders,
)
from controller.api.apibridge import (
    DEFAULT_ALLOW,
    FORWARDED_HEADERS,
    IDENTITY_HEADERS,
    KNOWN_METHODS,
    WORK_FOLDER,
    BridgePolicy,
    _child_scope,
)
from controller.api.app import create_app
from controller.api.common import BRIDGE_IDENTITY, BridgeIdentity
from controller.cli import make_storage
from controller.config import BridgeLimits, Settings
from tests.support.bridge import Run, api_client, start_run
from tests.support.controller import ControllerProcess, Tenant, bootstrap_tenant


def _all_routes(tmp: Path) -> list[Route]:
    conf = Settings(data_dir=tmp, database_url="postgresql://unused@/unused")
    app = create_app(conf, make_storage(conf), run_gc=False)
    return [r for r in app.routes if isinstance(r, Route)]


ROUTES = [
    *workfolders.routes,
    *bridge.routes,
    *apibridge.routes,
    *audit.routes,
    *runs.routes,
    *agents.routes,
    *attachments.routes,
    *web.routes,
]
TEMPLATES = sorted({r.path for r in ROUTES})
METHODS = {
    t: sorted({m for r in ROUTES if r.path == t for m in r.methods or ()}) for t in TEMPLATES
}


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> list[Route]:
    return _all_routes(tmp_path_factory.mktemp("routes"))


_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def _template_regex(template: str) -> re.Pattern[str]:
    """A template as a regex, each parameter one path segment (Starlette's ``str``)."""
    out, pos = "", 0
    for m in _PARAM.finditer(template):
        out += re.escape(template[pos : m.start()]) + "[^/]+"
        pos = m.end()
    return re.compile(out + re.escape(template[pos:]) + r"\Z")


def _oracle(method: str, path: str) -> bool:
    """Allowed iff an allowlisted pair's template matches the whole path."""
    return any(m == method and _template_regex(t).match(path) for m, t in DEFAULT_ALLOW)


SEGMENTS = st.sampled_from(
    ["api", "companies", "work-folders", "task", "agent", "content", "sync", "operations",
     "refresh", "directory", "runs", "audit", "files", "session", "bridge", "v1", "x", "",
     ".", "..", str(uuid.UUID(int=1)), "%2e"]
)  # fmt: skip


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=st.sampled_from([*KNOWN_METHODS, "OPTIONS", "TRACE"]),
    template_index=st.integers(min_value=0),
    segments=st.lists(SEGMENTS, max_size=8),
    use_template=st.booleans(),
)
def test_the_matcher_forwards_exactly_the_allowlist(
    routes: list[Route], method: str, template_index: int, segments: list[str], use_template: bool
) -> None:
    policy = BridgePolicy.build(routes, BridgeLimits())
    if use_template:
        template = routes[template_index % len(routes)].path
        path = _PARAM.sub("p", template)
    else:
        path = "/api/" + "/".join(segments)
    template_found, route = policy.match(path, method)
    assert (route is not None) == _oracle(method, path), (method, path)
    if route is not None:
        assert (method, route.path) in DEFAULT_ALLOW and template_found == route.path


HEADER_NAMES = st.sampled_from(
    [
        b"authorization", b"cookie", b"x-csrf-token", b"x-forwarded-for", b"x-forwarded-host",
        b"forwarded", b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding",
        b"upgrade", b"proxy-authorization", b"host", b"x-paperclip-run-id",
        b"x-paperclip-agent-id", b"x-paperclip-lease-epoch", *sorted(FORWARDED_HEADERS),
    ]
) | st.from_regex(rb"\A[a-z][a-z0-9-]{0,20}\Z")  # fmt: skip
HEADERS = st.lists(st.tuples(HEADER_NAMES, st.binary(max_size=20)), max_size=12)


@given(headers=HEADERS)
def test_only_allowlisted_headers_and_the_run_identity_are_forwarded(
    headers: list[tuple[bytes, bytes]],
) -> None:
    ident = BridgeIdentity(str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4()), 7)
    outer = {
        "type": "http",
        "method": "GET",
        "path": PREFIX + "/api/x",
        "raw_path": (PREFIX + "/api/x").encode(),
        "headers": headers,
        "path_params": {"path": "x"},
    }
    child = _child_scope(outer, "/api/x", ident)
    forwarded = child["headers"]
    assert [h for h in forwarded if h[0] not in IDENTITY_HEADERS] == [
        h for h in headers if h[0] in FORWARDED_HEADERS
    ]
    identity = [h for h in forwarded if h[0] in IDENTITY_HEADERS]
    assert identity == [
        (b"x-paperclip-run-id", ident.run_id.encode()),
        (b"x-paperclip-agent-id", ident.agent_id.encode()),
        (b"x-paperclip-lease-epoch", b"7"),
    ]
    assert child[BRIDGE_IDENTITY] is ident and "path_params" not in child
    assert child["path"] == "/api/x" and child["raw_path"] == b"/api/x"


# --- against the real controller ----------------------------------------------


def test_the_generated_routes_are_the_applications(routes: list[Route]) -> None:
    assert {r.path for r in routes} - set(TEMPLATES) == {"/openapi.json", "/healthz", "/readyz"}


@dataclass
class World:
    tenant: Tenant
    run: Run


@pytest.fixture(scope="module")
def world(controller: ControllerProcess) -> World:
    tenant = bootstrap_tenant(controller)
    return World(tenant, start_run(tenant))


def _fill(template: str, w: World, scope: str) -> str:
    run = w.run
    owners = {
        "task": run.task,
        "agent": run.agent,
        "project": run.project,
        "user": w.tenant.user_id,
    }
    values = {
        "companyId": w.tenant.company_id,
        "scope": scope,
        "ownerId": owners.get(scope) or "none",
        "runId": run.run_id,
    }
    return _PARAM.sub(lambda m: values.get(m.group(1), "x"), template)


def _company_rows(t: Tenant) -> tuple[int, int]:
    with t.controller.db() as db:
        row = db.execute(
            "SELECT (SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
            "         WHERE d.company_id = %s),"
            " (SELECT count(*) FROM folders WHERE company_id = %s)",
            (t.company_id, t.company_id),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


AUDIT = "/api/companies/{companyId}/runs/{runId}/audit"


def _refused(template: str, method: str) -> Any:
    """An explicit case: a route that answers ``method`` but is not for sandbox code."""
    return example(
        template=template,
        any_method=method,
        index=0,
        answered=False,
        scope="task",
        suffix="",
        headers={},
    )


SENT_HEADERS = st.dictionaries(
    st.sampled_from(
        ["Cookie", "X-CSRF-Token", "X-Forwarded-For", "Forwarded", "Proxy-Authorization",
         "X-Paperclip-Run-Id", "Idempotency-Key", "Range", "If-None-Match", "X-File-Executable",
         "X-File-Content-Type", "Content-Type"]
    ),
    st.sampled_from(["1", "bytes=0-0", "application/json", "application/octet-stream", "true"]),
    max_size=5,
)  # fmt: skip


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    template=st.sampled_from(TEMPLATES),
    any_method=st.sampled_from(KNOWN_METHODS),
    index=st.integers(min_value=0),
    answered=st.booleans(),
    scope=st.sampled_from(["task", "agent", "project", "user"]),
    suffix=st.sampled_from(["", "", "/x"]),
    headers=SENT_HEADERS,
)
# Routes that exist and answer the method, but are not for sandbox code.
@_refused(AUDIT, "GET")
@_refused("/files/api/session", "POST")
@_refused(PREFIX + "/run", "GET")
@_refused(WORK_FOLDER, "HEAD")
def test_the_allowlist_is_the_only_way_through(
    world: World,
    template: str,
    any_method: str,
    index: int,
    answered: bool,
    scope: str,
    suffix: str,
    headers: dict[str, str],
) -> None:
    # Half the time a method the route answers: then only the allowlist refuses.
    method = METHODS[template][index % len(METHODS[template])] if answered else any_method
    path = _fill(template, world, scope) + suffix
    inner = path if path.startswith("/api/") else "/api" + path
    allowed = suffix == "" and (method, template) in DEFAULT_ALLOW
    body = b'{"action": "mkdir", "path": "hyp"}' if method in ("POST", "PUT", "PATCH") else None
    before = _company_rows(world.tenant)
    with api_client(world.tenant, world.run.token) as c:
        r = c.request(method, inner, params={"path": "hyp.txt"}, content=body, headers=headers)
    assert "set-cookie" not in r.headers
    denied = r.status_code == 403 and (
        method == "HEAD" or r.json()["code"] == "bridge_route_denied"
    )
    if allowed:
        assert not denied and r.status_code < 500, (method, inner, r.status_code, r.text)
    else:
        assert denied, (method, inner, r.status_code, r.text)
        assert _company_rows(world.tenant) == before
