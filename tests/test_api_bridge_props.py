"""Properties of the API bridge: generated methods, routes and headers, in
process (the matcher and the forwarded headers) and against a real controller
(the allowlist is the only way through, and a refusal changes nothing)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
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
    orgs,
    repobridge,
    runs,
    taskrepos,
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
from tests.support.bridge import Run, start_run
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
    *orgs.routes,
    *runs.routes,
    *agents.routes,
    *attachments.routes,
    *repobridge.routes,
    *taskrepos.routes,
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
    foreign: dict[str, str]
    """An owner of each scope the run is not bound to (another agent, task,
    project and member), and ``company``: another company."""
    smuggled: dict[str, str]
    """Headers carrying real credentials the sandbox might get hold of: the
    owner's session cookie and CSRF token, another run's identity."""
    db: psycopg.Connection[Any]
    clients: dict[str, httpx.Client]
    """A bridge client per credential: ``run``, ``user`` (a person's token), ``none``."""


@pytest.fixture(scope="module")
def world(controller: ControllerProcess) -> Iterator[World]:
    tenant = bootstrap_tenant(controller)
    run = start_run(tenant)
    other = start_run(tenant, user=False)
    member_id, _ = tenant.new_member()
    elsewhere = bootstrap_tenant(controller)
    with httpx.Client(base_url=controller.url, timeout=30) as c:
        session = c.post("/files/api/session", json={"token": tenant.token})
        assert session.status_code == 200, session.text
    foreign = {
        "task": other.task or "",
        "agent": other.agent,
        "project": other.project or "",
        "user": member_id,
        "company": elsewhere.company_id,
    }
    smuggled = {
        "Cookie": f"fsa_session={session.cookies['fsa_session']}",
        "X-CSRF-Token": session.json()["csrfToken"],
        "X-Paperclip-Run-Id": other.run_id,
        "X-Paperclip-Agent-Id": other.agent,
        "X-Paperclip-Lease-Epoch": "99",
        "X-Forwarded-For": "127.0.0.1",
        "Forwarded": "for=127.0.0.1",
        "Proxy-Authorization": f"Bearer {tenant.token}",
    }
    clients = {}
    for name, token in (("run", run.token), ("user", tenant.token), ("none", None)):
        clients[name] = httpx.Client(base_url=controller.url + PREFIX, timeout=60)
        if token is not None:
            clients[name].headers["Authorization"] = f"Bearer {token}"
    with controller.db() as db:
        yield World(tenant, run, foreign, smuggled, db, clients)
    for client in clients.values():
        client.close()


def _fill(template: str, w: World, scope: str, foreign: bool) -> str:
    """The template with real ids: the run's own (or, ``foreign``, an owner of
    the same scope the run is not bound to; another company where the
    template names no owner)."""
    run = w.run
    owners = {
        "task": run.task,
        "agent": run.agent,
        "project": run.project,
        "user": w.tenant.user_id,
    }
    owner = w.foreign[scope] if foreign else owners.get(scope) or "none"
    other_company = foreign and "{ownerId}" not in template
    values = {
        "companyId": w.foreign["company"] if other_company else w.tenant.company_id,
        "scope": scope,
        "ownerId": owner,
        "runId": run.run_id,
    }
    return _PARAM.sub(lambda m: values.get(m.group(1), "x"), template)


def _footprint(w: World) -> tuple[int, int, int, int]:
    """Files, folders and receipts of the company (any write shows in one of
    them), and the run's audit rows."""
    row = w.db.execute(
        "SELECT (SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
        "         WHERE d.company_id = %(c)s),"
        " (SELECT count(*) FROM folders WHERE company_id = %(c)s),"
        " (SELECT count(*) FROM receipts r JOIN folders d ON d.id = r.folder_id"
        "         WHERE d.company_id = %(c)s),"
        " (SELECT count(*) FROM bridge_audit WHERE run_id = %(r)s)",
        {"c": w.tenant.company_id, "r": w.run.run_id},
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


AUDIT = "/api/companies/{companyId}/runs/{runId}/audit"

# Methods no API route answers: extension methods HTTP parsers know (405 from
# the controller) and arbitrary tokens (which uvicorn's parser may refuse as a
# malformed request first). CONNECT is left out: clients treat it as a proxy request.
UNKNOWN_METHODS = st.sampled_from(
    ["OPTIONS", "TRACE", "PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK",
     "SEARCH", "PURGE", "REPORT", "LINK", "UNLINK", "QUERY"]
) | st.from_regex(r"\A[A-Z]{3,10}\Z").filter(lambda m: m not in KNOWN_METHODS and m != "CONNECT")  # fmt: skip


def _refused(template: str, method: str) -> Any:
    """An explicit case: a route that answers ``method`` but is not for sandbox code."""
    return example(
        template=template,
        method_choice=method,
        index=0,
        answered=False,
        scope="task",
        foreign=False,
        suffix="",
        credential="run",
        headers={},
    )


SENT_HEADERS = st.lists(
    st.sampled_from(
        ["Cookie", "X-CSRF-Token", "X-Forwarded-For", "Forwarded", "Proxy-Authorization",
         "X-Paperclip-Run-Id", "X-Paperclip-Agent-Id", "X-Paperclip-Lease-Epoch",
         "Idempotency-Key", "Range", "If-None-Match", "X-File-Executable",
         "X-File-Content-Type", "Content-Type"]
    ),
    max_size=6,
    unique=True,
)  # fmt: skip
"""Names of headers to send; credentials get real values (World.smuggled)."""

PLAIN_VALUES = {
    "Idempotency-Key": "hyp-key",
    "Range": "bytes=0-0",
    "If-None-Match": "*",
    "X-File-Executable": "true",
    "X-File-Content-Type": "text/plain",
    "Content-Type": "application/octet-stream",
}


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    template=st.sampled_from(TEMPLATES),
    method_choice=st.sampled_from(KNOWN_METHODS) | UNKNOWN_METHODS,
    index=st.integers(min_value=0),
    answered=st.booleans(),
    scope=st.sampled_from(["task", "agent", "project", "user"]),
    foreign=st.booleans(),
    suffix=st.sampled_from(["", "", "/x"]),
    credential=st.sampled_from(["run", "run", "run", "run", "user", "none"]),
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
    method_choice: str,
    index: int,
    answered: bool,
    scope: str,
    foreign: bool,
    suffix: str,
    credential: str,
    headers: list[str],
) -> None:
    """Generated methods, routes, owners, credentials and headers: a call gets
    to an API route only with an active run's token, an allowlisted method and
    route template and a folder of the run's binding. Anything else is refused
    (405, 401, 403 ``bridge_route_denied`` or 404 ``not_found``) and changes
    nothing; every call of an authenticated run is one audit row."""
    # Half the time a method the route answers: then only the allowlist refuses.
    method = METHODS[template][index % len(METHODS[template])] if answered else method_choice
    path = _fill(template, world, scope, foreign) + suffix
    inner = path if path.startswith("/api/") else "/api" + path
    known = method in KNOWN_METHODS
    allowed = known and suffix == "" and (method, template) in DEFAULT_ALLOW
    sent = {name: world.smuggled.get(name) or PLAIN_VALUES[name] for name in headers}
    body = b'{"action": "mkdir", "path": "hyp"}' if method in ("POST", "PUT", "PATCH") else None
    before = _footprint(world)
    client = world.clients[credential]
    r = client.request(method, inner, params={"path": "hyp.txt"}, content=body, headers=sent)
    what = (method, inner, credential, sorted(sent), r.status_code, r.text[:300])
    assert "set-cookie" not in r.headers, what
    json_body = r.headers.get("content-type", "").startswith("application/json") and r.content
    code = r.json().get("code") if json_body else None

    def refused(status: int, *codes: str) -> bool:
        # A HEAD answer has no body to carry the code.
        return r.status_code == status and (code in codes or (method == "HEAD" and code is None))

    if not known:
        parser_refused = r.status_code == 400 and r.text == "Invalid HTTP request received."
        assert refused(405, "method_not_allowed") or parser_refused, what
    elif credential != "run":
        assert refused(401, "unauthenticated"), what
    elif not allowed:
        assert refused(403, "bridge_route_denied"), what
    elif foreign:
        # The route is open to the run, the folder (or company) is not: it is
        # hidden like a missing one (a malformed body may be refused first).
        assert refused(404, "not_found") or refused(400, "validation_error"), what
    else:
        # Through to the API: whatever it answers, it is not a bridge refusal.
        assert r.status_code < 500 and r.status_code not in (401, 403, 405), what
        assert code != "not_found", what
    after = _footprint(world)
    if not (allowed and not foreign and credential == "run"):
        assert after[:3] == before[:3], what
    # One audit row per call of the run, refused ones included; none otherwise.
    assert after[3] == before[3] + (1 if known and credential == "run" else 0), what
