"""The API bridge (``/bridge/v1/api/...``) against a real controller and PostgreSQL:
sandbox code reaches the API only through it, with the run's own authority,
and every refusal changes nothing."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.bridge import PREFIX
from controller.api.apibridge import BridgePolicy
from controller.api.app import create_app
from controller.api.common import bridge_identity
from controller.cli import make_storage
from controller.config import Settings
from tests.support.bridge import Run, api_client, start_run
from tests.support.controller import Tenant

OCTET = {"Content-Type": "application/octet-stream"}


def task_folder(tenant: Tenant, run: Run) -> str:
    assert run.task is not None
    return tenant.folder("task", run.task)


def put(c: httpx.Client, folder: str, path: str, data: bytes, **headers: str) -> httpx.Response:
    return c.put(
        f"{folder}/content", params={"path": path}, content=data, headers={**OCTET, **headers}
    )


def audit_rows(tenant: Tenant, run_id: str) -> list[dict[str, Any]]:
    with tenant.controller.db() as db:
        cur = db.execute(
            "SELECT method, route, status, request_bytes, response_bytes, agent_id::text,"
            " lease_epoch FROM bridge_audit WHERE run_id = %s ORDER BY id",
            (run_id,),
        )
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


# --- allowed calls -----------------------------------------------------------


def test_a_run_reads_and_writes_its_folders_through_the_bridge(tenant: Tenant) -> None:
    run = start_run(tenant)
    folder = task_folder(tenant, run)
    assert run.project is not None
    with run.api_client() as c:
        r = put(c, folder, "notes.md", b"hi", **{"X-File-Executable": "true"})
        assert r.status_code == 201, r.text
        listing = c.get(folder + "/")
        assert listing.status_code == 200, listing.text
        [entry] = listing.json()["entries"]
        assert (entry["path"], entry["executable"]) == ("notes.md", True)
        got = c.get(f"{folder}/content", params={"path": "notes.md"}, headers={"Range": "bytes=1-"})
        assert got.status_code == 206 and got.content == b"i"
        mk = c.post(f"{folder}/operations", json={"action": "mkdir", "path": "d"})
        assert mk.status_code == 200, mk.text
        for scope, owner in (
            ("agent", run.agent),
            ("project", run.project),
            ("user", tenant.user_id),
        ):
            r = put(c, tenant.folder(scope, owner), "x.txt", scope.encode())
            assert r.status_code == 201, (scope, r.text)
        directory = c.get(f"/api/companies/{tenant.company_id}/directory")
        assert directory.status_code == 200
        assert directory.json()["members"] == [{"userId": tenant.user_id}]
    with tenant.client() as owner:
        assert owner.get(f"{folder}/content", params={"path": "notes.md"}).content == b"hi"
        assert owner.get(f"{tenant.my_folder}/content?path=x.txt").content == b"user"


def test_a_run_token_on_the_api_directly_is_401_and_writes_nothing(tenant: Tenant) -> None:
    run = start_run(tenant)
    folder = task_folder(tenant, run)
    with tenant.client(run.token) as c:
        r = c.get(folder + "/")
        assert r.status_code == 401, r.text
        assert r.json()["code"] == "unauthenticated" and PREFIX in r.json()["error"]
        assert put(c, folder, "direct.txt", b"d").status_code == 401
        assert c.get(f"/api/companies/{tenant.company_id}/directory").status_code == 401
    assert tenant.file_rows("direct.txt", live=False) == 0


# --- refusals: each one changes nothing --------------------------------------


def test_a_user_token_or_session_on_the_bridge_is_401(tenant: Tenant) -> None:
    with api_client(tenant, tenant.token) as c:
        r = put(c, tenant.my_folder, "u.txt", b"u")
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
        assert c.get(tenant.my_folder + "/").status_code == 401
    # A person's session cookie (with its CSRF token) is no credential there either.
    cookie, csrf = _session(tenant)
    session = {"Cookie": f"fsa_session={cookie}", "X-CSRF-Token": csrf}
    with httpx.Client(base_url=tenant.controller.url + PREFIX, timeout=30) as raw:
        for r in (
            put(raw, tenant.my_folder, "u.txt", b"u", **session),
            put(raw, tenant.my_folder, "u.txt", b"u", Cookie=session["Cookie"]),
            raw.get(tenant.my_folder + "/", headers=session),
            raw.get("/run", headers=session),
        ):
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
    assert tenant.file_rows("u.txt", live=False) == 0


def test_an_ended_or_superseded_run_is_401(tenant: Tenant) -> None:
    sandbox = f"sb-{uuid.uuid4().hex[:8]}"
    first = start_run(tenant, sandbox=sandbox)
    folder = task_folder(tenant, first)
    with first.api_client() as c:
        assert put(c, folder, "before.txt", b"1").status_code == 201
    ctl = tenant.controller
    # A new run for the same sandbox takes the next lease epoch and fences the first.
    out = ctl.admin(
        "start-run", tenant.company_id, "--agent", first.agent, "--task", first.task or "",
        "--sandbox", sandbox,
    )  # fmt: skip
    assert out["lease_epoch"] == first.lease_epoch + 1
    with first.api_client() as c:
        r = put(c, folder, "stale.txt", b"2")
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
    with api_client(tenant, out["token"]) as c:
        assert put(c, folder, "newer.txt", b"3").status_code == 201
    ctl.admin("end-run", out["run_id"])
    with api_client(tenant, out["token"]) as c:
        r = put(c, folder, "ended.txt", b"4")
        assert r.status_code == 401, r.text
        assert c.get(folder + "/").status_code == 401
    assert tenant.file_rows("stale.txt", live=False) == 0
    assert tenant.file_rows("ended.txt", live=False) == 0
    assert tenant.file_rows("newer.txt") == 1


def test_routes_and_methods_outside_the_allowlist_are_refused(tenant: Tenant) -> None:
    run = start_run(tenant)
    folder = task_folder(tenant, run)
    with run.api_client() as c:
        assert put(c, folder, "keep.txt", b"k").status_code == 201
        denied = [
            c.get(f"/api/companies/{tenant.company_id}/runs/{run.run_id}/audit"),  # not allowed
            c.delete(f"{folder}/content", params={"path": "keep.txt"}),  # no such pair
            c.patch(f"{folder}/content", params={"path": "keep.txt"}, content=b"x"),
            c.head(folder + "/"),
            c.get("/api/nowhere"),
            c.get("/api/%2e%2e/bridge/v1/run"),  # dot segments, percent-encoded
            c.get(f"/api/companies/{tenant.company_id}//directory"),
            c.post("/api/%2E%2E/files/api/session", json={"token": tenant.token}),
        ]
        for r in denied:
            assert r.status_code == 403, (r.request.method, r.request.url, r.text)
            if r.request.method != "HEAD":
                assert r.json()["code"] == "bridge_route_denied"
            assert "set-cookie" not in r.headers
        odd = c.request("PROPFIND", f"{folder}/content", params={"path": "keep.txt"})
        assert odd.status_code == 405 and odd.json()["code"] == "method_not_allowed"
    with tenant.client() as owner:
        assert owner.get(f"{folder}/content?path=keep.txt").content == b"k"
    assert tenant.file_rows("keep.txt") == 1


def test_another_agents_folder_is_not_found(tenant: Tenant) -> None:
    run = start_run(tenant)
    other = start_run(tenant, user=False)
    assert other.task is not None
    ctl = tenant.controller
    member_id, _ = tenant.new_member()
    with run.api_client() as c:
        for folder in (
            tenant.folder("agent", other.agent),
            tenant.folder("task", other.task),
            tenant.folder("user", member_id),
        ):
            r = put(c, folder, "intruder.txt", b"x")
            assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
            assert c.get(folder + "/").status_code == 404
    elsewhere = ctl.admin("bootstrap", "--email", f"o-{uuid.uuid4().hex[:8]}@example.com")
    with run.api_client() as c:
        r = c.get(f"/api/companies/{elsewhere['company_id']}/directory")
        assert r.status_code == 404
    assert tenant.file_rows("intruder.txt", live=False) == 0


def _session(tenant: Tenant) -> tuple[str, str]:
    r = httpx.post(f"{tenant.controller.url}/files/api/session", json={"token": tenant.token})
    assert r.status_code == 200, r.text
    return r.cookies["fsa_session"], r.json()["csrfToken"]


def test_smuggled_credentials_are_not_used(tenant: Tenant) -> None:
    # A run without a user folder; the owner's own folder is out of its reach.
    run = start_run(tenant, user=False)
    cookie, csrf = _session(tenant)
    smuggled = {
        "Cookie": f"fsa_session={cookie}",
        "X-CSRF-Token": csrf,
        "X-Forwarded-For": "10.0.0.1",
        "Forwarded": "for=10.0.0.1",
        "X-Paperclip-Run-Id": str(uuid.uuid4()),
    }
    with run.api_client() as c:
        r = put(c, tenant.my_folder, "smuggled.txt", b"s", **smuggled)
        assert r.status_code == 404, r.text
        assert c.get(tenant.my_folder + "/", headers=smuggled).status_code == 404
        # The run's own folder still answers: the run's authority, nothing more.
        assert put(c, task_folder(tenant, run), "own.txt", b"o", **smuggled).status_code == 201
    # A second Authorization header (a person's token) is refused outright.
    two = [("Authorization", f"Bearer {run.token}"), ("Authorization", f"Bearer {tenant.token}")]
    with httpx.Client(base_url=tenant.controller.url + PREFIX, timeout=30) as raw:
        r = raw.put(
            f"{tenant.my_folder}/content?path=smuggled.txt",
            content=b"s",
            headers=httpx.Headers([*two, ("Content-Type", "application/octet-stream")]),
        )
        assert r.status_code == 401, r.text
    assert tenant.file_rows("smuggled.txt", live=False) == 0


# --- audit ---------------------------------------------------------------------


def test_every_bridged_request_is_audited(tenant: Tenant) -> None:
    run = start_run(tenant)
    folder = task_folder(tenant, run)
    with run.api_client() as c:
        assert put(c, folder, "a.txt", b"12345").status_code == 201
        listing = c.get(folder + "/")
        assert c.get("/api/nowhere").status_code == 403
    rows = audit_rows(tenant, run.run_id)
    wf = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}"
    assert [(r["method"], r["route"], r["status"]) for r in rows] == [
        ("PUT", wf + "/content", 201),
        ("GET", wf + "/", 200),
        ("GET", None, 403),
    ]
    assert rows[0]["request_bytes"] == 5
    assert rows[1]["response_bytes"] == len(listing.content)
    assert {(r["agent_id"], r["lease_epoch"]) for r in rows} == {(run.agent, run.lease_epoch)}

    url = f"/api/companies/{tenant.company_id}/runs/{run.run_id}/audit"
    with tenant.client() as owner:
        r = owner.get(url)
        assert r.status_code == 200, r.text
        entries = r.json()["entries"]
        assert [e["status"] for e in entries] == [201, 200, 403]
        assert entries[0]["runId"] == run.run_id and entries[0]["requestBytes"] == 5
        page = owner.get(url, params={"after": entries[0]["id"], "limit": 1}).json()
        assert [e["id"] for e in page["entries"]] == [entries[1]["id"]]
        assert page["nextAfter"] == entries[1]["id"]
    _, member_token = tenant.new_member("member")
    with tenant.client(member_token) as member:
        assert member.get(url).status_code == 404
    out = tenant.controller.admin("audit", "--run", run.run_id)
    assert out["run_id"] == run.run_id and out["entries"] == entries
    code, text, _ = tenant.controller.cli("admin", "audit", "--run", run.run_id)
    assert code == 0 and len(text.splitlines()) == 3
    assert text.splitlines()[2].endswith("ms") and " GET - 403 0B/" in text.splitlines()[2]
    code, _, err = tenant.controller.cli("admin", "audit", "--run", "nope")
    assert code == 1 and "UUID" in err


# --- headers the API sees, in process ----------------------------------------


async def _echo(request: Request) -> Response:
    ident = bridge_identity(request.scope)
    resp = JSONResponse(
        {
            "headers": dict(request.headers),
            "identity": None
            if ident is None
            else [ident.run_id, ident.agent_id, ident.lease_epoch],
        }
    )
    resp.set_cookie("leak", "1")
    return resp


def echo_app_call(
    db_url: str, token: str, headers: list[tuple[str, str]]
) -> tuple[dict[str, Any], int, list[tuple[str, str]]]:
    """``GET /bridge/v1/api/echo`` in process, on an application with one extra
    allowlisted route that answers with what reached it (and sets a cookie)."""
    with tempfile.TemporaryDirectory(prefix="fsa-echo-") as tmp:
        st = Settings(data_dir=Path(tmp), database_url=db_url)
        app = create_app(st, make_storage(st), run_gc=False)
        app.router.routes.append(Route("/api/echo", _echo, methods=["GET"]))
        st.bridge.allow = [("default", ""), ("GET", "/api/echo")]
        app.state.apibridge = BridgePolicy.build(app.routes, st.bridge)

        async def call() -> httpx.Response:
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://bridge"
                ) as client,
            ):
                return await client.get(PREFIX + "/api/echo", headers=httpx.Headers(headers))

        r = asyncio.run(call())
    assert r.status_code == 200, r.text
    return r.json(), r.status_code, list(r.headers.multi_items())


def test_the_api_sees_only_allowlisted_headers_and_never_sets_cookies(tenant: Tenant) -> None:
    """An extra route behind the bridge reports what reached it."""
    run = start_run(tenant)
    seen, status, headers = echo_app_call(
        tenant.controller.db_url,
        run.token,
        [
            ("authorization", f"Bearer {run.token}"),
            ("cookie", "fsa_session=abc"),
            ("x-csrf-token", "t"),
            ("x-forwarded-for", "1.2.3.4"),
            ("forwarded", "for=1.2.3.4"),
            ("connection", "keep-alive, x-secret"),
            ("x-secret", "1"),
            ("te", "trailers"),
            ("idempotency-key", "k1"),
            ("x-paperclip-run-id", "forged"),
        ],
    )
    assert status == 200
    assert "set-cookie" not in {k.lower() for k, _ in headers}
    assert seen["identity"] == [run.run_id, run.agent, run.lease_epoch]
    assert seen["headers"] == {
        "accept": "*/*",  # httpx's own, allowlisted
        "idempotency-key": "k1",
        "x-paperclip-run-id": run.run_id,
        "x-paperclip-agent-id": run.agent,
        "x-paperclip-lease-epoch": str(run.lease_epoch),
    }
