"""Properties of the API bridge: generated methods, routes and headers, in
process (the matcher and the forwarded headers) and against a real controller
(the allowlist is the only way through, and a refusal changes nothing)."""

from __future__ import annotations

import http.client
import json
import random
import re
import urllib.parse
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
    invitations,
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
    _plain_path,
)
from controller.api.app import create_app
from controller.api.common import BRIDGE_IDENTITY, BridgeIdentity
from controller.cli import make_storage
from controller.config import BridgeLimits, Settings
from tests.support.bridge import Run, start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)


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
    *invitations.routes,
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


API_PAIRS = sorted(
    (m, t) for t in TEMPLATES if t.startswith("/api/") for m in METHODS[t] if m in KNOWN_METHODS
)
"""Every (method, API route template) pair an operator may allowlist."""

ALLOWLISTS = st.none() | st.lists(
    st.sampled_from(API_PAIRS) | st.just(("default", "")), min_size=1, max_size=8
)
"""No operator list (the default one), or an operator's ``--bridge-allow``
entries, ``default`` among them now and then."""


def _expanded(allow: list[tuple[str, str]] | None) -> set[tuple[str, str]]:
    if allow is None:
        return set(DEFAULT_ALLOW)
    pairs: set[tuple[str, str]] = set()
    for pair in allow:
        pairs |= set(DEFAULT_ALLOW) if pair[0] == "default" else {pair}
    return pairs


def _oracle(allow: set[tuple[str, str]], method: str, path: str) -> bool:
    """Forwarded iff no segment is empty (but a trailing one), ``.`` or ``..``,
    and an allowlisted pair's template matches the whole path."""
    segments = path.split("/")[1:]
    if segments and segments[-1] == "":
        segments.pop()
    if any(seg in ("", ".", "..") for seg in segments):
        return False
    return any(m == method and _template_regex(t).match(path) for m, t in allow)


SEGMENTS = st.sampled_from(
    ["api", "companies", "work-folders", "task", "agent", "content", "sync", "operations",
     "refresh", "directory", "runs", "audit", "files", "session", "bridge", "v1", "x", "",
     ".", "..", str(uuid.UUID(int=1)), "tasks", "repos", "agents", "archive", "members"]
)  # fmt: skip


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    allow=ALLOWLISTS,
    method=st.sampled_from([*KNOWN_METHODS, "OPTIONS", "TRACE"]),
    template_index=st.integers(min_value=0),
    segments=st.lists(SEGMENTS, max_size=8),
    use_template=st.booleans(),
    pick_allowed=st.booleans(),
    dots=st.none()
    | st.tuples(
        st.sampled_from(["insert", "replace"]),
        st.sampled_from([".", "..", ""]),
        st.integers(min_value=0),
    ),
)
def test_the_matcher_forwards_exactly_the_allowlist(
    routes: list[Route],
    allow: list[tuple[str, str]] | None,
    method: str,
    template_index: int,
    segments: list[str],
    use_template: bool,
    pick_allowed: bool,
    dots: tuple[str, str, int] | None,
) -> None:
    """What the bridge forwards (``_plain_path`` and the matcher, as
    ``ApiBridge._forward`` applies them), for the default list and generated
    operator lists, is what a regex oracle of the allowlist says."""
    policy = BridgePolicy.build(routes, BridgeLimits(allow=allow))
    expected = _expanded(allow)
    assert policy.allow == expected
    if use_template and pick_allowed:  # often an allowlisted pair: then dots decide
        method, template = sorted(expected)[template_index % len(expected)]
        path = _PARAM.sub("p", template)
    elif use_template:
        template = routes[template_index % len(routes)].path
        path = _PARAM.sub("p", template)
    else:
        path = "/api/" + "/".join(segments)
    # A "." / ".." / empty segment before or in place of one of the path's
    # segments: in place of a parameter, a template still matches.
    path = _mutate(path, dots)
    template_found, route = policy.match(path, method)
    forwarded = _plain_path(path) and route is not None
    assert forwarded == _oracle(expected, method, path), (method, path, sorted(expected))
    if route is not None:
        assert (method, route.path) in expected and template_found == route.path


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
    allow: frozenset[tuple[str, str]]
    """The allowlist the controller was started with, resolved."""
    operator: bool = False
    """The controller has an operator's allowlist (``--bridge-allow`` and a file)."""


def _world(controller: ControllerProcess, allow: frozenset[tuple[str, str]]) -> Iterator[World]:
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
        yield World(
            tenant, run, foreign, smuggled, db, clients, allow, operator=allow != set(DEFAULT_ALLOW)
        )
    for client in clients.values():
        client.close()


@pytest.fixture(scope="module")
def world(controller: ControllerProcess) -> Iterator[World]:
    yield from _world(controller, frozenset(DEFAULT_ALLOW))


OPERATOR_SEED = 20240611


def operator_allowlist(seed: int) -> list[tuple[str, str]]:
    """An operator's allowlist drawn from ``seed``: some of the default pairs
    (the writes among them) and some read routes the default list leaves out."""
    rng = random.Random(seed)
    kept = rng.sample(sorted(DEFAULT_ALLOW), 5)
    reads = [p for p in API_PAIRS if p not in DEFAULT_ALLOW and p[0] in ("GET", "HEAD")]
    return sorted({*kept, *rng.sample(reads, 5)})


@pytest.fixture(scope="module")
def operator_world(
    pg_cluster: PgCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """A controller whose allowlist is the operator's: half of it given with
    ``--bridge-allow``, the other half in a ``--bridge-allow-file``."""
    allow = operator_allowlist(OPERATOR_SEED)
    listed = tmp_path_factory.mktemp("allow") / "allow"
    listed.write_text("".join(f"{m}:{t}  # from the file\n" for m, t in allow[1::2]))
    flags = [arg for m, t in allow[::2] for arg in ("--bridge-allow", f"{m}:{t}")]
    with private_controller(
        pg_cluster, "fsa-bridge-operator-", *flags, "--bridge-allow-file", str(listed)
    ) as ctl:
        yield from _world(ctl, frozenset(allow))


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
        "taskId": (w.foreign["task"] if foreign else run.task) or "x",
        "agentId": w.foreign["agent"] if foreign else run.agent,
        "projectId": (w.foreign["project"] if foreign else run.project) or "x",
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


def _last_audit(w: World) -> tuple[str, str | None, int]:
    row = w.db.execute(
        "SELECT method, route, status FROM bridge_audit WHERE run_id = %s ORDER BY at DESC, id DESC"
        " LIMIT 1",
        (w.run.run_id,),
    ).fetchone()
    assert row is not None
    return str(row[0]), row[1], int(row[2])


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
        mutation=None,
        pick_allowed=False,
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

DOT_SEGMENTS = (".", "..", "", "%2e", "%2E", "%2e%2e", "%2E%2e", ".%2e", "%2e.")
"""Segments that mean "here", "up" or nothing once the server decodes the
path: the bridge refuses a path holding one (403 ``bridge_route_denied``),
also where one stands for a parameter (``/api/companies/../directory``)."""
ENCODED_SLASHES = ("%2F", "%2f")
"""In place of one of the path's slashes: the decoded path is the same path."""
MUTATIONS = (
    st.none()
    | st.tuples(
        st.sampled_from(["insert", "replace"]),
        st.sampled_from(DOT_SEGMENTS),
        st.integers(min_value=0),
    )
    | st.tuples(st.just("slash"), st.sampled_from(ENCODED_SLASHES), st.integers(min_value=0))
)


def _mutate(inner: str, mutation: tuple[str, str, int] | None) -> str:
    """``inner`` (``/api/...``) with a dot or empty segment inserted before, or
    put in place of, one of its segments after ``api`` but the last (so never
    a trailing slash), or one of its slashes after ``/api`` percent-encoded."""
    if mutation is None:
        return inner
    kind, what, at = mutation
    segments = inner.split("/")[1:]
    if kind == "slash":
        if len(segments) < 2:
            return inner
        i = 1 + at % (len(segments) - 1)  # the slash before segments[i]
        return "/" + "/".join(segments[:i]) + what + "/".join(segments[i:])
    if len(segments) < 3:
        return inner
    i = 1 + at % (len(segments) - 2)
    segments[i : i + (kind == "replace")] = [what]
    return "/" + "/".join(segments)


def _dotted(path: str) -> bool:
    """A segment of the decoded path is empty (not a trailing one), ``.`` or ``..``."""
    segments = urllib.parse.unquote(path).split("/")[1:]
    if segments and segments[-1] == "":
        segments.pop()
    return any(seg in ("", ".", "..") for seg in segments)


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


def _send_raw(
    w: World, credential: str, method: str, target: str, headers: dict[str, str], body: bytes | None
) -> Answer:
    """The request line exactly as given: httpx would remove ``.`` and ``..``."""
    url = httpx.URL(w.tenant.controller.url)
    conn = http.client.HTTPConnection(url.host, url.port, timeout=60)
    try:
        sent = dict(headers)
        auth = w.clients[credential].headers.get("authorization")
        if auth is not None:
            sent["Authorization"] = auth
        conn.request(method, PREFIX + target, body=body, headers=sent)
        res = conn.getresponse()
        return Answer(res.status, {k.lower(): v for k, v in res.getheaders()}, res.read())
    finally:
        conn.close()


CALL = given(
    template=st.sampled_from(TEMPLATES),
    method_choice=st.sampled_from(KNOWN_METHODS) | UNKNOWN_METHODS,
    index=st.integers(min_value=0),
    answered=st.booleans(),
    scope=st.sampled_from(["task", "agent", "project", "user"]),
    foreign=st.booleans(),
    suffix=st.sampled_from(["", "", "/x"]),
    credential=st.sampled_from(["run", "run", "run", "run", "user", "none"]),
    headers=SENT_HEADERS,
    mutation=MUTATIONS,
    pick_allowed=st.booleans(),
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@CALL
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
    mutation: tuple[str, str, int] | None,
    pick_allowed: bool,
) -> None:
    """Generated methods, routes, owners, credentials, headers and path
    variations: a call gets to an API route only with an active run's token,
    an allowlisted method and route template, a plain path and a folder of
    the run's binding. Anything else is refused (405, 401, 403
    ``bridge_route_denied`` or 404 ``not_found``) and changes nothing; every
    call of an authenticated run is one audit row, whose route is allowlisted
    unless the bridge refused the call."""
    _one_call(world, template, method_choice, index, answered, scope, foreign, suffix,
              credential, headers, mutation, pick_allowed)  # fmt: skip


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@CALL
def test_an_operator_allowlist_is_the_only_way_through(
    operator_world: World,
    template: str,
    method_choice: str,
    index: int,
    answered: bool,
    scope: str,
    foreign: bool,
    suffix: str,
    credential: str,
    headers: list[str],
    mutation: tuple[str, str, int] | None,
    pick_allowed: bool,
) -> None:
    """The same, on a controller started with an operator's allowlist: the
    default pairs it leaves out are refused, the routes it adds get through."""
    _one_call(operator_world, template, method_choice, index, answered, scope, foreign, suffix,
              credential, headers, mutation, pick_allowed)  # fmt: skip


def test_the_operator_allowlist_differs_from_the_default_both_ways() -> None:
    allow = set(operator_allowlist(OPERATOR_SEED))
    assert set(DEFAULT_ALLOW) - allow and allow - set(DEFAULT_ALLOW)
    assert {m for m, _ in allow & set(DEFAULT_ALLOW)} - {"GET", "HEAD"}, "no write kept"


def _one_call(
    w: World,
    template: str,
    method_choice: str,
    index: int,
    answered: bool,
    scope: str,
    foreign: bool,
    suffix: str,
    credential: str,
    headers: list[str],
    mutation: tuple[str, str, int] | None,
    pick_allowed: bool,
) -> None:
    if pick_allowed:  # an allowlisted pair: then owners, paths and credentials decide
        method, template = sorted(w.allow)[index % len(w.allow)]
    else:
        # Half the time a method the route answers: then only the allowlist refuses.
        method = METHODS[template][index % len(METHODS[template])] if answered else method_choice
    path = _fill(template, w, scope, foreign) + suffix
    inner = path if path.startswith("/api/") else "/api" + path
    target = _mutate(inner, mutation)
    dotted = _dotted(target)
    assert dotted or urllib.parse.unquote(target) == inner, (inner, target)
    known = method in KNOWN_METHODS
    allowed = known and suffix == "" and not dotted and (method, template) in w.allow
    sent = {name: w.smuggled.get(name) or PLAIN_VALUES[name] for name in headers}
    body = b'{"action": "mkdir", "path": "hyp"}' if method in ("POST", "PUT", "PATCH") else None
    before = _footprint(w)
    r: httpx.Response | Answer
    if target == inner:
        r = w.clients[credential].request(
            method, inner, params={"path": "hyp.txt"}, content=body, headers=sent
        )
    else:
        r = _send_raw(w, credential, method, target + "?path=hyp.txt", sent, body)
    what = (method, target, credential, sorted(sent), r.status_code, r.text[:300])
    assert "set-cookie" not in r.headers, what
    json_body = r.headers.get("content-type", "").startswith("application/json") and r.content
    code = json.loads(r.content).get("code") if json_body else None

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
    elif w.operator:
        # Routes beyond the work folders answer a run as they answer it
        # (often 401, 403 or 404): only no bridge refusal is certain.
        assert r.status_code < 500 and code not in ("bridge_route_denied", "method_not_allowed")
    elif foreign:
        # The route is open to the run, the folder (or company) is not: it is
        # hidden like a missing one (a malformed body may be refused first).
        assert refused(404, "not_found") or refused(400, "validation_error"), what
    else:
        # Through to the API: whatever it answers, it is not a bridge refusal.
        assert r.status_code < 500 and r.status_code not in (401, 403, 405), what
        assert code != "not_found", what
    after = _footprint(w)
    if not (allowed and not foreign and credential == "run"):
        assert after[:3] == before[:3], what
    # One audit row per call of the run, refused ones included; none otherwise.
    assert after[3] == before[3] + (1 if known and credential == "run" else 0), what
    if known and credential == "run":
        # The trail shows the allowlist is the only way through: a call whose
        # route and method are not an allowlisted pair was refused by the bridge.
        audited_method, route, status = _last_audit(w)
        assert audited_method == method and status == r.status_code, (what, route)
        if (method, route) not in w.allow or dotted:
            assert status == 403 and refused(403, "bridge_route_denied"), (what, route)
