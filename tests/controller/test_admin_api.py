"""The company admin and orchestrator REST API (members, agents, projects,
tasks, runs, operator tokens) against a real controller and PostgreSQL: who
may call each route, what a refusal leaves unchanged, fencing of a second
start for one sandbox, and that the command line and the API give the same
result for the same operation (they share one domain layer)."""

from __future__ import annotations

import argparse
import contextlib
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from common.bridge import PREFIX
from controller.api.openapi import document
from controller.cli import build_parser
from tests.support.bridge import Run, api_client, start_run
from tests.support.constants import REPO
from tests.support.controller import ControllerProcess, Tenant, bootstrap_tenant, client_tls


def _email() -> str:
    return f"u-{uuid.uuid4().hex[:12]}@example.com"


def _client(tenant: Tenant, token: str | None) -> httpx.Client:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.Client(
        base_url=tenant.controller.url, headers=headers, timeout=60, verify=client_tls()
    )


@dataclass
class World:
    """One company with a caller of every kind, and a second company."""

    tenant: Tenant
    tokens: dict[str, str | None]
    run: Run
    project: str
    task: str
    agent: str

    @property
    def ctl(self) -> ControllerProcess:
        return self.tenant.controller

    @property
    def base(self) -> str:
        return f"/api/companies/{self.tenant.company_id}"

    def operator_token(self, company: str | None = None) -> dict[str, Any]:
        return self.ctl.admin(
            "create-operator-token", company or self.tenant.company_id, "--name", "orchestrator"
        )

    def fresh_member(self, role: str = "member") -> str:
        user_id, _ = self.tenant.new_member(role)
        return user_id

    def fresh_workspace(self) -> str:
        out = self.ctl.admin("add-workspace", self.project, "--repo-url",
                             f"https://git.example/{uuid.uuid4().hex[:8]}.git")  # fmt: skip
        return str(out["workspace_id"])

    def fresh_agent(self) -> str:
        return str(self.ctl.admin("create-agent", self.tenant.company_id, "bot")["id"])

    def granted_member(self) -> tuple[str, str]:
        """(agent, member): a new member holding the configure grant on a new agent."""
        agent, member = self.fresh_agent(), self.fresh_member()
        self.ctl.admin(
            "grant", self.tenant.company_id, member, "--agent", agent, "--configure"
        )  # fmt: skip
        return agent, member

    def member_token_id(self) -> str:
        """The API token id of a new member (in this company only)."""
        user_id = self.fresh_member()
        return token_ids(self.ctl, user_id)[0]

    def signed_in_member(self) -> str:
        """A new member with a Files page session; their id."""
        user_id, token = self.tenant.new_member("member")
        with sign_in(self.tenant, token):
            pass  # the session stays
        return user_id

    def fresh_run(self) -> str:
        out = self.ctl.admin("start-run", self.tenant.company_id, "--agent", self.agent)
        return str(out["run_id"])

    def snapshot(self) -> tuple[Any, ...]:
        """Everything a refused admin request must leave as it was."""
        with self.ctl.db() as db:
            row = db.execute(
                "SELECT (SELECT array_agg((user_id, role)::text ORDER BY user_id)"
                "        FROM memberships WHERE company_id = %(c)s),"
                " (SELECT count(*) FROM agents WHERE company_id = %(c)s),"
                " (SELECT count(*) FROM projects WHERE company_id = %(c)s),"
                " (SELECT count(*) FROM tasks WHERE company_id = %(c)s),"
                " (SELECT array_agg((id, active)::text ORDER BY id) FROM runs"
                "   WHERE company_id = %(c)s),"
                " (SELECT array_agg((id, revoked_at IS NULL)::text ORDER BY id)"
                "   FROM operator_tokens WHERE company_id = %(c)s),"
                " (SELECT count(*) FROM users),"
                " (SELECT array_agg((id, removed_at IS NULL, is_primary)::text ORDER BY id)"
                "   FROM workspaces WHERE company_id = %(c)s),"
                " (SELECT array_agg((id, branch)::text ORDER BY id) FROM tasks"
                "   WHERE company_id = %(c)s),"
                " (SELECT array_agg((id, entry_path)::text ORDER BY id) FROM agents"
                "   WHERE company_id = %(c)s),"
                " (SELECT array_agg((agent_id, user_id, permission)::text"
                "   ORDER BY agent_id, user_id) FROM agent_grants WHERE company_id = %(c)s),"
                " (SELECT array_agg((t.id, t.revoked_at IS NULL)::text ORDER BY t.id)"
                "   FROM api_tokens t JOIN memberships m ON m.user_id = t.user_id"
                "   AND m.company_id = %(c)s),"
                " (SELECT count(*) FROM web_sessions s JOIN memberships m"
                "   ON m.user_id = s.user_id AND m.company_id = %(c)s"
                "   AND (m.sessions_ended_at IS NULL OR s.created_at > m.sessions_ended_at))",
                {"c": self.tenant.company_id},
            ).fetchone()
        assert row is not None
        return tuple(row)


def token_ids(ctl: ControllerProcess, user_id: str) -> list[str]:
    """The user's API token ids, oldest first."""
    with ctl.db() as db:
        rows = db.execute(
            "SELECT id FROM api_tokens WHERE user_id = %s ORDER BY created_at, id", (user_id,)
        ).fetchall()
    return [str(r[0]) for r in rows]


@contextlib.contextmanager
def sign_in(tenant: Tenant, token: str) -> Iterator[httpx.Client]:
    """A client holding a Files page session of ``token``'s user."""
    with httpx.Client(base_url=tenant.controller.url, timeout=60, verify=client_tls()) as c:
        r = c.post("/files/api/session", json={"token": token})
        assert r.status_code == 200 and c.cookies, r.text
        yield c


@pytest.fixture(scope="module")
def world(controller: ControllerProcess) -> World:
    tenant = bootstrap_tenant(controller)
    other = bootstrap_tenant(controller)
    run = start_run(tenant)
    assert run.project is not None and run.task is not None
    _, admin_token = tenant.new_member("admin")
    _, member_token = tenant.new_member("member")
    _, viewer_token = tenant.new_member("viewer")
    w = World(tenant, {}, run, run.project, run.task, run.agent)
    revoked = w.operator_token()
    controller.admin("revoke-token", revoked["token_id"])
    w.tokens = {
        "owner": tenant.token,
        "admin": admin_token,
        "operator": w.operator_token()["token"],
        "member": member_token,
        "viewer": viewer_token,
        "other company's owner": other.token,
        "other company's operator": w.operator_token(other.company_id)["token"],
        "revoked operator": revoked["token"],
        "run token": run.token,
        "no token": None,
    }
    return w


# Each case builds a fresh request (a new target where the route consumes one)
# and names the status an authorized caller gets.
Case = Callable[[World], tuple[str, str, dict[str, Any] | None]]

CASES: dict[str, tuple[Case, int]] = {
    "list members": (lambda w: ("GET", w.base + "/members", None), 200),
    "create member": (
        lambda w: ("POST", w.base + "/members", {"email": _email(), "role": "member"}),
        201,
    ),
    "set a role": (
        lambda w: ("PUT", f"{w.base}/members/{w.fresh_member()}", {"role": "viewer"}),
        200,
    ),
    "remove member": (lambda w: ("DELETE", f"{w.base}/members/{w.fresh_member()}", None), 200),
    "list agents": (lambda w: ("GET", w.base + "/agents", None), 200),
    "create agent": (lambda w: ("POST", w.base + "/agents", {"name": "bot"}), 201),
    "set agent entry": (
        lambda w: (
            "PUT",
            f"{w.base}/agents/{w.agent}/entry",
            {"path": f"docs/{uuid.uuid4().hex[:8]}.md"},
        ),
        200,
    ),
    "list grants": (lambda w: ("GET", f"{w.base}/agents/{w.agent}/grants", None), 200),
    "grant": (
        lambda w: ("PUT", f"{w.base}/agents/{w.fresh_agent()}/grants/{w.fresh_member()}", None),
        200,
    ),
    "revoke grant": (
        lambda w: ("DELETE", "{}/agents/{}/grants/{}".format(w.base, *w.granted_member()), None),
        200,
    ),
    "list projects": (lambda w: ("GET", w.base + "/projects", None), 200),
    "create project": (lambda w: ("POST", w.base + "/projects", {"name": "p"}), 201),
    "list tasks": (lambda w: ("GET", w.base + "/tasks", None), 200),
    "create task": (
        lambda w: ("POST", w.base + "/tasks", {"projectId": w.project, "title": "t"}),
        201,
    ),
    "list workspaces": (lambda w: ("GET", f"{w.base}/projects/{w.project}/workspaces", None), 200),
    "add workspace": (
        lambda w: (
            "POST",
            f"{w.base}/projects/{w.project}/workspaces",
            {"repoUrl": f"https://git.example/{uuid.uuid4().hex[:8]}.git"},
        ),
        201,
    ),
    "remove workspace": (
        lambda w: ("DELETE", f"{w.base}/workspaces/{w.fresh_workspace()}", None),
        200,
    ),
    "set task branch": (
        lambda w: (
            "PUT",
            f"{w.base}/tasks/{w.task}/branch",
            {"branch": f"topic-{uuid.uuid4().hex[:8]}"},
        ),
        200,
    ),
    "list runs": (lambda w: ("GET", w.base + "/runs", None), 200),
    "start run": (
        lambda w: ("POST", w.base + "/runs", {"agentId": w.agent, "taskId": w.task}),
        201,
    ),
    "get run": (lambda w: ("GET", f"{w.base}/runs/{w.run.run_id}", None), 200),
    "end run": (lambda w: ("POST", f"{w.base}/runs/{w.fresh_run()}/end", None), 200),
    "audit": (lambda w: ("GET", f"{w.base}/runs/{w.run.run_id}/audit", None), 200),
    "list operator tokens": (lambda w: ("GET", w.base + "/operator-tokens", None), 200),
    "create operator token": (
        lambda w: ("POST", w.base + "/operator-tokens", {"name": "ci"}),
        201,
    ),
    "revoke operator token": (
        lambda w: ("DELETE", f"{w.base}/operator-tokens/{w.operator_token()['token_id']}", None),
        200,
    ),
    "list tokens": (lambda w: ("GET", w.base + "/tokens", None), 200),
    "revoke token": (lambda w: ("DELETE", f"{w.base}/tokens/{w.member_token_id()}", None), 200),
    "end sessions": (
        lambda w: ("DELETE", f"{w.base}/members/{w.signed_in_member()}/sessions", None),
        200,
    ),
}

PEOPLE_ONLY = {
    "create member",
    "set a role",
    "remove member",
    "grant",
    "revoke grant",
    "list operator tokens",
    "create operator token",
    "revoke operator token",
    "list tokens",
    "revoke token",
    "end sessions",
}
"""Routes an operator token may not use: who belongs to the company, who may
configure an agent, tokens and sessions."""


def expected(case: str, caller: str, ok: int) -> tuple[int, str | None]:
    """The status (and error code) the caller gets for the case."""
    if caller in ("owner", "admin"):
        return ok, None
    if caller == "operator":
        return (401, "unauthenticated") if case in PEOPLE_ONLY else (ok, None)
    if caller in ("revoked operator", "run token", "no token"):
        return 401, "unauthenticated"
    if caller == "other company's operator" and case in PEOPLE_ONLY:
        return 401, "unauthenticated"
    # Members, viewers, strangers, another company's operator: like absence.
    # A run's own routes answer as for a run that does not exist.
    return 404, "run_not_found" if case in ("audit", "get run") else "company_not_found"


@pytest.mark.parametrize("case", sorted(CASES))
def test_who_may_call_each_admin_route(world: World, case: str) -> None:
    build, ok = CASES[case]
    clients = {caller: _client(world.tenant, token) for caller, token in world.tokens.items()}
    try:
        for caller, c in clients.items():
            method, path, body = build(world)
            before = None if method == "GET" else world.snapshot()
            r = c.request(method, path, json=body)
            status, code = expected(case, caller, ok)
            assert r.status_code == status, (caller, method, path, r.text)
            if code is not None:
                assert r.json()["code"] == code, (caller, r.text)
            if before is not None:
                # A refusal changes nothing; an accepted change changes something.
                assert (world.snapshot() == before) == (code is not None), (caller, case)
    finally:
        for c in clients.values():
            c.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_token_through_the_api_bridge_is_refused(world: World, case: str) -> None:
    method, path, body = CASES[case][0](world)
    before = world.snapshot()
    with api_client(world.tenant, world.run.token) as c:
        r = c.request(method, path, json=body)
    assert r.status_code == 403 and r.json()["code"] == "bridge_route_denied", r.text
    assert world.snapshot() == before


def test_an_operator_token_opens_nothing_but_its_companys_admin_routes(world: World) -> None:
    token = world.tokens["operator"]
    t = world.tenant
    folder = t.folder("task", world.task)
    with _client(t, token) as c:
        for method, path in (
            ("GET", folder + "/"),
            ("PUT", folder + "/content?path=op.txt"),
            ("GET", t.my_folder + "/"),
            ("GET", world.base + "/directory"),
            ("GET", PREFIX + "/run"),
            ("GET", PREFIX + "/api/companies/" + t.company_id + "/directory"),
        ):
            r = c.request(
                method,
                path,
                content=b"x" if method == "PUT" else None,
                headers={"Content-Type": "application/octet-stream"} if method == "PUT" else {},
            )
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated", (path, r.text)
        signin = c.post("/files/api/session", json={"token": token})
        assert signin.status_code == 401 and "set-cookie" not in signin.headers
    assert t.file_rows("op.txt", live=False) == 0


def _token_id(world: World) -> str:
    """The id of the owner's API token."""
    [mine] = world.ctl.admin("list-tokens", "--user", world.tenant.user_id)["tokens"]
    return str(mine["token_id"])


def test_operator_tokens_from_the_command_line(world: World) -> None:
    ctl, company = world.ctl, world.tenant.company_id
    made = world.operator_token()
    assert made["token"].startswith("fsa_o_") and made["company_id"] == company
    with ctl.db() as db:
        [(stored,)] = db.execute(
            "SELECT token_hash FROM operator_tokens WHERE id = %s", (made["token_id"],)
        ).fetchall()
    assert made["token"].encode() not in bytes(stored) and len(bytes(stored)) == 32
    listed = {t["token_id"]: t for t in ctl.admin("list-tokens", "--company", company)["tokens"]}
    mine = listed[made["token_id"]]
    assert mine["kind"] == "operator" and mine["name"] == "orchestrator"
    assert mine["company_id"] == company and mine["user_id"] is None and "token" not in mine
    assert listed[_token_id(world)]["kind"] == "user"
    # A user filter lists that person's API tokens only.
    only_user = ctl.admin("list-tokens", "--user", world.tenant.user_id)["tokens"]
    assert {t["kind"] for t in only_user} == {"user"}

    with _client(world.tenant, made["token"]) as c:
        assert c.get(world.base + "/agents").status_code == 200
        out = ctl.admin("revoke-token", made["token_id"])
        assert out["revoked"] is True and out["kind"] == "operator" and out["revoked_at"]
        r = c.get(world.base + "/agents")
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    code, _, err = ctl.cli("admin", "create-operator-token", str(uuid.uuid4()), "--name", "x")
    assert code == 1 and err.startswith("controller: no such company: ")
    code, _, err = ctl.cli("admin", "create-operator-token", company, "--name", " ")
    assert code == 1 and "name must not be empty" in err


def test_operator_tokens_over_the_api(world: World) -> None:
    with _client(world.tenant, world.tokens["admin"]) as c:
        made = c.post(world.base + "/operator-tokens", json={"name": "deployer"})
        assert made.status_code == 201, made.text
        token_id = made.json()["tokenId"]
        listed = c.get(world.base + "/operator-tokens").json()["operatorTokens"]
        assert {"tokenId": token_id, "name": "deployer", "revokedAt": None}.items() <= next(
            t for t in listed if t["tokenId"] == token_id
        ).items()
        assert all("token" not in t for t in listed)
        with _client(world.tenant, made.json()["token"]) as op:
            assert op.get(world.base + "/runs").status_code == 200
            revoked = c.delete(f"{world.base}/operator-tokens/{token_id}")
            assert revoked.status_code == 200 and revoked.json()["revokedAt"] is not None
            assert op.get(world.base + "/runs").status_code == 401
        # A person's API token is not an operator token of this company.
        r = c.delete(f"{world.base}/operator-tokens/{_token_id(world)}")
        assert r.status_code == 404 and r.json()["code"] == "token_not_found"
    other = bootstrap_tenant(world.ctl)
    foreign = world.operator_token(other.company_id)
    with _client(world.tenant, world.tokens["owner"]) as c:
        r = c.delete(f"{world.base}/operator-tokens/{foreign['token_id']}")
        assert r.status_code == 404 and r.json()["code"] == "token_not_found"
    with _client(other, foreign["token"]) as op:
        assert op.get(f"/api/companies/{other.company_id}/agents").status_code == 200


def _listed(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(t["tokenId"], t["kind"], t["userId"], t["name"], t["revokedAt"] is None) for t in rows]


def test_members_tokens_and_sessions_over_the_api(world: World) -> None:
    """Owners and admins list the company's tokens and revoke them, and end
    members' sessions, with the command line's domain functions and under
    the owner rule; a person's token serving another company stays theirs."""
    t, ctl, b = world.tenant, world.ctl, world.base
    member, member_token = t.new_member("member")
    (member_token_id,) = token_ids(ctl, member)
    with _client(t, world.tokens["admin"]) as admin:
        listed = admin.get(b + "/tokens")
        assert listed.status_code == 200, listed.text
        rows = listed.json()["tokens"]
        assert all("token" not in r for r in rows)
        by_id = {r["tokenId"]: r for r in rows}
        assert by_id[member_token_id]["kind"] == "user"
        assert by_id[member_token_id]["userId"] == member
        assert {r["kind"] for r in rows} == {"user", "operator"}
        # The command line lists the same tokens, in the same order.
        cli = ctl.admin("list-tokens", "--company", t.company_id)["tokens"]
        assert [(r["token_id"], r["kind"], r["user_id"], r.get("name"), r["revoked_at"] is None)
                for r in cli] == _listed(rows)  # fmt: skip
        mine = admin.get(b + "/tokens", params={"userId": member}).json()["tokens"]
        assert [r["tokenId"] for r in mine] == [member_token_id]
        bad = admin.get(b + "/tokens", params={"userId": "me"})
        assert bad.status_code == 400 and bad.json()["details"][0]["field"] == "userId"

        # Revoked: the member's token answers 401 from the next request.
        with _client(t, member_token) as m:
            assert m.get(b + "/directory").status_code == 200
            r = admin.delete(f"{b}/tokens/{member_token_id}")
            assert r.status_code == 200, r.text
            assert r.json()["tokenId"] == member_token_id and r.json()["revokedAt"] is not None
            assert m.get(b + "/directory").status_code == 401
        again = admin.delete(f"{b}/tokens/{member_token_id}")
        assert again.json()["revokedAt"] == r.json()["revokedAt"]

        # Refusals change nothing: an owner's token (admins), a token that also
        # serves another company, tokens that are none of this company's.
        other = bootstrap_tenant(ctl)
        shared, shared_token = t.new_member("member")
        ctl.admin("add-member", other.company_id, shared, "--role", "viewer")
        (shared_id,) = token_ids(ctl, shared)
        for token_id, status, code in (
            (token_ids(ctl, t.user_id)[0], 403, "owner_required"),
            (shared_id, 403, "token_shared"),
            (token_ids(ctl, other.user_id)[0], 404, "token_not_found"),
            (world.operator_token(other.company_id)["token_id"], 404, "token_not_found"),
            (str(uuid.uuid4()), 404, "token_not_found"),
        ):
            before = world.snapshot()
            r = admin.delete(f"{b}/tokens/{token_id}")
            assert r.status_code == status and r.json()["code"] == code, r.text
            assert world.snapshot() == before
        with _client(t, shared_token) as s:
            assert s.get(b + "/directory").status_code == 200
        # The host's operator is bound by no company: it may.
        assert ctl.admin("revoke-token", shared_id)["revoked"] is True

        # Sessions: the member's sessions no longer reach this company (their
        # other companies: tests/controller/test_company_reach.py).
        signed_in, token = t.new_member("member")
        with sign_in(t, token) as browser:
            assert browser.get(b + "/directory").status_code == 200
            ended = admin.delete(f"{b}/members/{signed_in}/sessions")
            assert ended.status_code == 200, ended.text
            assert ended.json() == {"userId": signed_in, "ended": 1}
            r = browser.get(b + "/directory")
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
            assert browser.get("/files/api/session").json()["companies"] == []
        assert admin.delete(f"{b}/members/{signed_in}/sessions").json()["ended"] == 0
        with sign_in(t, t.token) as owner_browser:
            for user, status, code in (
                (t.user_id, 403, "owner_required"),
                (other.user_id, 404, "member_not_found"),
                (str(uuid.uuid4()), 404, "member_not_found"),
            ):
                before = world.snapshot()
                r = admin.delete(f"{b}/members/{user}/sessions")
                assert r.status_code == status and r.json()["code"] == code, r.text
                assert world.snapshot() == before
            assert owner_browser.get("/files/api/session").status_code == 200
    # An owner acts on an admin's credentials.
    admin_id, admin_token = t.new_member("admin")
    with _client(t, t.token) as owner:
        with sign_in(t, admin_token):
            r = owner.delete(f"{b}/members/{admin_id}/sessions")
            assert r.json() == {"userId": admin_id, "ended": 1}
        r = owner.delete(f"{b}/tokens/{token_ids(ctl, admin_id)[0]}")
        assert r.status_code == 200 and r.json()["revokedAt"] is not None, r.text


def test_only_an_owner_touches_the_owner_role_and_one_owner_stays(world: World) -> None:
    t = world.tenant
    target = world.fresh_member("member")
    with _client(t, world.tokens["admin"]) as admin:
        for method, path, body in (
            ("PUT", f"{world.base}/members/{target}", {"role": "owner"}),
            ("PUT", f"{world.base}/members/{t.user_id}", {"role": "admin"}),
            ("DELETE", f"{world.base}/members/{t.user_id}", None),
            ("POST", world.base + "/members", {"email": _email(), "role": "owner"}),
        ):
            before = world.snapshot()
            r = admin.request(method, path, json=body)
            assert r.status_code == 403 and r.json()["code"] == "owner_required", r.text
            assert world.snapshot() == before
        r = admin.put(f"{world.base}/members/{target}", json={"role": "admin"})
        assert r.status_code == 200 and r.json()["role"] == "admin"
    with _client(t, world.tokens["operator"]) as op:
        r = op.put(f"{world.base}/members/{target}", json={"role": "owner"})
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        assert {m["userId"] for m in op.get(world.base + "/members").json()["members"]} >= {
            t.user_id,
            target,
        }
    with _client(t, t.token) as owner:
        r = owner.put(f"{world.base}/members/{t.user_id}", json={"role": "admin"})
        assert r.status_code == 409 and r.json()["code"] == "last_owner", r.text
        assert owner.delete(f"{world.base}/members/{t.user_id}").json()["code"] == "last_owner"
        r = owner.put(f"{world.base}/members/{target}", json={"role": "owner"})
        assert r.status_code == 200 and r.json()["role"] == "owner"
        # With a second owner the first may step down.
        r = owner.put(f"{world.base}/members/{target}", json={"role": "member"})
        assert r.status_code == 200, r.text
    roles = {m["userId"]: m["role"] for m in _members(world)}
    assert roles[t.user_id] == "owner" and roles[target] == "member"


def _members(world: World) -> list[dict[str, Any]]:
    with _client(world.tenant, world.tenant.token) as c:
        members: list[dict[str, Any]] = c.get(world.base + "/members").json()["members"]
    return members


def test_a_second_start_for_one_sandbox_fences_the_first(world: World) -> None:
    t, sandbox = world.tenant, f"box-{uuid.uuid4().hex[:8]}"
    body = {"agentId": world.agent, "taskId": world.task, "userId": t.user_id, "sandbox": sandbox}
    with _client(t, world.tokens["operator"]) as op:
        first = op.post(world.base + "/runs", json={**body, "home": "/home/ci"})
        assert first.status_code == 201, first.text
        one = first.json()
        assert one["leaseEpoch"] == 1 and one["sandbox"] == sandbox
        assert one["bindings"] == {
            "task": world.task,
            "agent": world.agent,
            "user": t.user_id,
            "project": world.project,
        }
        assert one["env"]["PAPERCLIP_TASK_DIR"] == "/home/ci/task"
        assert one["env"]["PAPERCLIP_USER_DIR"] == "/home/ci/user"
        old = Run(t, one["runId"], one["token"], 1, world.agent, world.task, world.project)
        assert old.save("task", {"fenced-before.txt": b"1"}).status_code == 200
        digest = old.upload("task", b"late bytes").json()["digest"]

        second = op.post(world.base + "/runs", json=body)
        assert second.status_code == 201, second.text
        two = second.json()
        assert two["leaseEpoch"] == 2 and two["token"] != one["token"]
        # The first run's token stops at once: its next commit and reads are refused.
        late = old.commit(
            "task", [{"op": "put", "path": "late.txt", "digest": digest, "executable": False}]
        )
        assert late.status_code in (401, 409), late.text
        with old.client() as c:
            assert c.get("/run").status_code == 401
        with api_client(t, two["token"]) as c:
            assert c.get(t.folder("task", world.task) + "/").status_code == 200

        got = op.get(f"{world.base}/runs/{one['runId']}").json()
        assert (got["active"], got["superseded"], got["leaseEpoch"]) == (False, True, 1)
        assert "token" not in got and got["endedAt"] is not None
        now = op.get(f"{world.base}/runs/{two['runId']}").json()
        assert (now["active"], now["superseded"]) == (True, False)
        ended = op.post(f"{world.base}/runs/{two['runId']}/end")
        assert ended.status_code == 200 and ended.json()["active"] is False
        again = op.post(f"{world.base}/runs/{two['runId']}/end")
        assert again.json() == ended.json()
    with api_client(t, two["token"]) as c:
        assert c.get(t.folder("task", world.task) + "/").status_code == 401
    assert t.file_rows("late.txt", live=False) == 0
    assert t.file_rows("fenced-before.txt") == 1


def test_runs_are_listed_newest_first_a_page_at_a_time(controller: ControllerProcess) -> None:
    t = bootstrap_tenant(controller)
    agent = controller.admin("create-agent", t.company_id, "a")["id"]
    other = controller.admin("create-agent", t.company_id, "b")["id"]
    started = [
        controller.admin("start-run", t.company_id, "--agent", a)["run_id"]
        for a in (agent, agent, other, agent)
    ]
    controller.admin("end-run", started[0])
    base = f"/api/companies/{t.company_id}/runs"
    with _client(t, t.token) as c:
        seen, cursor = [], None
        while True:
            page = c.get(base, params={"limit": 3, **({"cursor": cursor} if cursor else {})})
            assert page.status_code == 200, page.text
            seen += [r["runId"] for r in page.json()["runs"]]
            cursor = page.json()["nextCursor"]
            if cursor is None:
                break
        assert seen == started[::-1]
        active = c.get(base, params={"active": "true"}).json()["runs"]
        assert [r["runId"] for r in active] == started[:0:-1]
        mine = c.get(base, params={"agentId": other}).json()["runs"]
        assert [r["runId"] for r in mine] == [started[2]]
        for params, field in (
            ({"cursor": "nope"}, "cursor"),
            ({"limit": "0"}, "limit"),
            ({"active": "yes"}, "active"),
            ({"agentId": "x"}, "agentId"),
        ):
            r = c.get(base, params=params)
            assert r.status_code == 400 and r.json()["details"][0]["field"] == field, r.text
        r = c.get(f"{base}/{uuid.uuid4()}")
        assert r.status_code == 404 and r.json()["code"] == "run_not_found"


def test_bad_input_is_a_400_that_names_the_field_and_changes_nothing(world: World) -> None:
    b = world.base
    cases = [
        ("POST", b + "/agents", {"name": ""}, "name", "empty"),
        ("POST", b + "/agents", {"name": "a\x00b"}, "name", "control_character"),
        ("POST", b + "/agents", {"name": "x" * 257}, "name", "too_long"),
        ("POST", b + "/agents", {"name": 3}, "name", "invalid_type"),
        ("POST", b + "/agents", {"name": "a", "owner": "me"}, "owner", "unknown_field"),
        ("POST", b + "/tasks", {"projectId": "p", "title": "t"}, "projectId", "invalid_uuid"),
        ("POST", b + "/members", {"email": "nope", "role": "member"}, "email", "invalid_email"),
        ("POST", b + "/members", {"email": _email(), "role": "god"}, "role", "invalid_role"),
        ("PUT", f"{b}/members/{world.tenant.user_id}", {}, "role", "required"),
        ("POST", b + "/runs", {"taskId": world.task}, "agentId", "required"),
        ("POST", f"{b}/projects/{world.project}/workspaces", {"repoUrl": "-u/x"}, "repoUrl",
         "invalid"),
        ("POST", f"{b}/projects/{world.project}/workspaces",
         {"repoUrl": "https://h/r.git", "primary": "yes"}, "primary", "invalid_type"),
        ("PUT", f"{b}/tasks/{world.task}/branch", {"branch": "a..b"}, "branch", "invalid"),
        ("PUT", f"{b}/agents/{world.agent}/entry", {"path": "../x.md"}, "path", "invalid_segment"),
        ("PUT", f"{b}/agents/{world.agent}/entry", {"path": 3}, "path", "invalid_type"),
        ("PUT", f"{b}/agents/{world.agent}/entry", {}, "path", "required"),
        ("PUT", f"{b}/agents/{world.agent}/grants/me", None, "userId", "invalid_uuid"),
        ("DELETE", f"{b}/agents/x/grants/{world.tenant.user_id}", None, "agentId",
         "invalid_uuid"),
        ("POST", b + "/runs", {"agentId": world.agent, "home": "rel"}, "home", "invalid_home"),
        ("POST", b + "/runs", {"agentId": world.agent, "sandbox": ""}, "sandbox",
         "invalid_sandbox"),
        ("POST", b + "/runs", {"agentId": world.agent, "taskId": world.task,
                               "projectId": str(uuid.uuid4())}, "projectId",
         "task_project_mismatch"),
    ]  # fmt: skip
    with _client(world.tenant, world.tenant.token) as c:
        for method, path, body, field, code in cases:
            before = world.snapshot()
            r = c.request(method, path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["details"][0]["field"] == field, (body, r.text)
            assert r.json()["details"][0]["code"] == code, (body, r.text)
            assert world.snapshot() == before
        for method, path, body, code in (
            ("POST", b + "/runs", {"agentId": str(uuid.uuid4())}, "agent_not_found"),
            ("POST", b + "/tasks", {"projectId": str(uuid.uuid4()), "title": "t"},
             "project_not_found"),
            ("PUT", f"{b}/members/{uuid.uuid4()}", {"role": "member"}, "member_not_found"),
            ("DELETE", f"{b}/members/{uuid.uuid4()}", None, "member_not_found"),
            ("POST", f"{b}/runs/{uuid.uuid4()}/end", None, "run_not_found"),
            ("DELETE", f"{b}/workspaces/{uuid.uuid4()}", None, "workspace_not_found"),
            ("PUT", f"{b}/tasks/{uuid.uuid4()}/branch", {"branch": "main"}, "task_not_found"),
            ("GET", f"{b}/projects/{uuid.uuid4()}/workspaces", None, "project_not_found"),
            ("PUT", f"{b}/agents/{uuid.uuid4()}/entry", {"path": "A.md"}, "agent_not_found"),
            ("GET", f"{b}/agents/{uuid.uuid4()}/grants", None, "agent_not_found"),
            ("PUT", f"{b}/agents/{uuid.uuid4()}/grants/{world.tenant.user_id}", None,
             "agent_not_found"),
            ("PUT", f"{b}/agents/{world.agent}/grants/{uuid.uuid4()}", None, "member_not_found"),
            ("DELETE", f"{b}/agents/{world.agent}/grants/{uuid.uuid4()}", None,
             "member_not_found"),
        ):  # fmt: skip
            r = c.request(method, path, json=body)
            assert r.status_code == 404 and r.json()["code"] == code, r.text
        email = _email()
        world.ctl.admin("create-user", email)
        taken = c.post(b + "/members", json={"email": email, "role": "member"})
        assert taken.status_code == 409 and taken.json()["code"] == "email_taken"
        r = c.post(b + "/agents", content=b'{"name": "x"}')
        assert r.status_code == 400  # not application/json


def test_the_command_line_and_the_api_give_the_same_result(controller: ControllerProcess) -> None:
    """Each operation once through ``controller admin`` and once through REST,
    in two fresh companies: the same rows and the same answer (snake_case on
    the command line, camelCase over HTTP)."""
    cli_t, api_t = bootstrap_tenant(controller), bootstrap_tenant(controller)
    ctl = controller
    api = _client(api_t, api_t.token)
    base = f"/api/companies/{api_t.company_id}"

    def company_rows(company: str) -> dict[str, list[tuple[Any, ...]]]:
        with ctl.db() as db:
            return {
                "agents": db.execute(
                    "SELECT name FROM agents WHERE company_id = %s ORDER BY name", (company,)
                ).fetchall(),
                "projects": db.execute(
                    "SELECT name FROM projects WHERE company_id = %s ORDER BY name", (company,)
                ).fetchall(),
                "tasks": db.execute(
                    "SELECT t.title, p.name FROM tasks t JOIN projects p ON p.id = t.project_id"
                    " WHERE t.company_id = %s ORDER BY t.title",
                    (company,),
                ).fetchall(),
                "members": db.execute(
                    "SELECT u.email LIKE 'owner-%%', m.role FROM memberships m"
                    " JOIN users u ON u.id = m.user_id WHERE m.company_id = %s"
                    " ORDER BY 1, 2",
                    (company,),
                ).fetchall(),
                "workspaces": db.execute(
                    "SELECT repo_url, name, is_primary, removed_at IS NULL FROM workspaces"
                    " WHERE company_id = %s ORDER BY repo_url",
                    (company,),
                ).fetchall(),
                "branches": db.execute(
                    "SELECT branch FROM tasks WHERE company_id = %s", (company,)
                ).fetchall(),
                "repos": db.execute(
                    "SELECT b.name, w.is_primary FROM task_repos b"
                    " JOIN workspaces w ON w.id = b.workspace_id WHERE b.company_id = %s",
                    (company,),
                ).fetchall(),
                "agent entries": db.execute(
                    "SELECT name, entry_path FROM agents WHERE company_id = %s ORDER BY name",
                    (company,),
                ).fetchall(),
                "agent files": db.execute(
                    "SELECT a.name, f.path, f.kind, f.byte_size FROM files f"
                    " JOIN folders d ON d.id = f.folder_id"
                    " JOIN agents a ON d.scope = 'agent' AND d.owner_id = a.id::text"
                    " WHERE d.company_id = %s AND f.deleted_at IS NULL ORDER BY 1, 2",
                    (company,),
                ).fetchall(),
                "grants": db.execute(
                    "SELECT a.name, m.role, g.permission FROM agent_grants g"
                    " JOIN agents a ON a.id = g.agent_id"
                    " JOIN memberships m ON m.company_id = g.company_id AND m.user_id = g.user_id"
                    " WHERE g.company_id = %s ORDER BY 1, 2",
                    (company,),
                ).fetchall(),
                "runs": db.execute(
                    "SELECT a.name, t.title, p.name, r.user_id IS NOT NULL, r.sandbox_key,"
                    " r.lease_epoch, r.active, r.state, r.error"
                    " FROM runs r JOIN agents a ON a.id = r.agent_id"
                    " LEFT JOIN tasks t ON t.id = r.task_id"
                    " LEFT JOIN projects p ON p.id = r.project_id"
                    " WHERE r.company_id = %s ORDER BY r.lease_epoch, r.sandbox_key",
                    (company,),
                ).fetchall(),
            }

    with api:
        c_agent = ctl.admin("create-agent", cli_t.company_id, "Bot")["id"]
        a_agent = api.post(base + "/agents", json={"name": "Bot"}).json()["id"]
        # The agent's instruction entry and who may configure the agent.
        c_entry = ctl.admin("set-agent-entry", c_agent, "docs/GUIDE.md")
        a_entry = api.put(f"{base}/agents/{a_agent}/entry", json={"path": "docs/GUIDE.md"})
        assert a_entry.status_code == 200, a_entry.text
        assert c_entry == {"agent_id": c_agent, "entry_path": "docs/GUIDE.md", "created": True}
        assert a_entry.json() == {"agentId": a_agent, "entryPath": "docs/GUIDE.md", "created": True}
        (c_member, _), (a_member, _) = cli_t.new_member(), api_t.new_member()
        (c_kept, _), (a_kept, _) = cli_t.new_member("viewer"), api_t.new_member("viewer")
        for user in (c_member, c_kept):
            c_grant = ctl.admin("grant", cli_t.company_id, user, "--agent", c_agent, "--configure")
        for user in (a_member, a_kept):
            a_grant = api.put(f"{base}/agents/{a_agent}/grants/{user}")
            assert a_grant.status_code == 200, a_grant.text
        assert c_grant == {"company_id": cli_t.company_id, "user_id": c_kept,
                           "agent_id": c_agent, "permission": "configure", "granted": True}  # fmt: skip
        assert a_grant.json() == {"agentId": a_agent, "userId": a_kept,
                                  "permission": "configure", "granted": True}  # fmt: skip
        listed = api.get(f"{base}/agents/{a_agent}/grants").json()
        assert listed["agentId"] == a_agent
        assert [(g["userId"], g["role"], g["permission"]) for g in listed["grants"]] == [
            (a_member, "member", "configure"),
            (a_kept, "viewer", "configure"),
        ]
        for _ in range(2):  # the second time there is nothing left to revoke
            c_revoke = ctl.admin(
                "revoke", cli_t.company_id, c_member, "--agent", c_agent, "--configure"
            )
            a_revoke = api.delete(f"{base}/agents/{a_agent}/grants/{a_member}")
            assert a_revoke.status_code == 200, a_revoke.text
            assert c_revoke["revoked"] == a_revoke.json()["revoked"]
        assert a_revoke.json()["revoked"] is False
        c_project = ctl.admin("create-project", cli_t.company_id, "Proj")["id"]
        a_project = api.post(base + "/projects", json={"name": "Proj"}).json()["id"]
        c_task = ctl.admin("create-task", cli_t.company_id, c_project, "Do it")["id"]
        a_task = api.post(base + "/tasks", json={"projectId": a_project, "title": "Do it"})
        a_task_id = a_task.json()["id"]
        assert a_task.json()["projectId"] == a_project

        c_user = ctl.admin("create-user", _email())["user_id"]
        ctl.admin("add-member", cli_t.company_id, c_user, "--role", "admin")
        a_user = ctl.admin("create-user", _email())["user_id"]
        # The API changes a member's role; joining takes the person's consent.
        ctl.admin("add-member", api_t.company_id, a_user, "--role", "viewer")
        put = api.put(f"{base}/members/{a_user}", json={"role": "admin"})
        assert put.json() | {"email": None, "createdAt": None} == {
            "userId": a_user,
            "role": "admin",
            "email": None,
            "createdAt": None,
        }

        # Workspaces of each project (one added through each side) and a primary:
        # the start binds them and names the primary in env.
        c_added = ctl.admin("add-workspace", c_project, "--repo-url",
                            "https://git.example/lib.git", "--name", "lib")  # fmt: skip
        a_added = api.post(f"{base}/projects/{a_project}/workspaces",
                           json={"repoUrl": "https://git.example/lib.git", "name": "lib"})  # fmt: skip
        assert a_added.status_code == 201, a_added.text
        c_ws = ctl.admin("add-workspace", c_project, "--repo-url",
                         "https://git.example/app.git", "--primary")["workspace_id"]  # fmt: skip
        a_ws = ctl.admin("add-workspace", a_project, "--repo-url",
                         "https://git.example/app.git", "--primary")["workspace_id"]  # fmt: skip
        assert {k: v for k, v in c_added.items() if not k.endswith("_id")} == {
            "repo_url": a_added.json()["repoUrl"],
            "name": a_added.json()["name"],
            "ref": a_added.json()["ref"],
            "primary": a_added.json()["primary"],
            "setup_command": a_added.json()["setupCommand"],
            "replaced_primary": a_added.json()["replacedPrimary"],
        }
        ctl.admin("set-task-branch", c_task, "feature/x")
        branch = api.put(f"{base}/tasks/{a_task_id}/branch", json={"branch": "feature/x"})
        assert branch.json() == {"taskId": a_task_id, "branch": "feature/x"}

        cli_run = ctl.admin(
            "start-run", cli_t.company_id, "--agent", c_agent, "--task", c_task,
            "--user", cli_t.user_id, "--sandbox", "box", "--home", "/home/a",
        )  # fmt: skip
        api_run = api.post(
            base + "/runs",
            json={"agentId": a_agent, "taskId": a_task_id, "userId": api_t.user_id,
                  "sandbox": "box", "home": "/home/a"},
        ).json()  # fmt: skip
        assert cli_run["env"] == api_run["env"]
        assert cli_run["lease_epoch"] == api_run["leaseEpoch"] == 1
        assert cli_run["sandbox"] == api_run["sandbox"] == "box"
        assert cli_run["bindings"] == {
            "task": c_task, "agent": c_agent, "user": cli_t.user_id, "project": c_project,
        }  # fmt: skip
        assert api_run["bindings"] == {
            "task": a_task_id, "agent": a_agent, "user": api_t.user_id, "project": a_project,
        }  # fmt: skip
        assert set(cli_run) == {"run_id", "token", "lease_epoch", "sandbox", "bindings", "env",
                                "repos"}  # fmt: skip
        assert cli_run["repos"] == [
            {"workspace_id": c_added["workspace_id"], "name": "lib", "primary": False},
            {"workspace_id": c_ws, "name": "app", "primary": True},
        ]
        assert api_run["repos"] == [
            {"workspaceId": a_added.json()["workspaceId"], "name": "lib", "primary": False},
            {"workspaceId": a_ws, "name": "app", "primary": True},
        ]
        assert cli_run["env"]["PAPERCLIP_PRIMARY_REPO"] == "/home/a/repos/app"

        cli_end = ctl.admin("end-run", cli_run["run_id"])
        api_end = api.post(f"{base}/runs/{api_run['runId']}/end").json()
        assert cli_end == {
            "run_id": cli_run["run_id"],
            "active": api_end["active"],
            "state": api_end["state"],
            "error": api_end["error"],
        }
        c_removed = ctl.admin("remove-workspace", c_added["workspace_id"])
        a_removed = api.delete(f"{base}/workspaces/{a_added.json()['workspaceId']}").json()
        assert (
            (c_removed["bindings_kept"], c_removed["was_primary"])
            == (
                a_removed["bindingsKept"],
                a_removed["wasPrimary"],
            )
            == (1, False)
        )
        c_gone = ctl.admin("create-user", _email())["user_id"]
        ctl.admin("add-member", cli_t.company_id, c_gone, "--role", "viewer")
        out = ctl.admin("remove-member", cli_t.company_id, c_gone)
        a_gone = ctl.admin("create-user", _email())["user_id"]
        ctl.admin("add-member", api_t.company_id, a_gone, "--role", "viewer")
        gone = api.delete(f"{base}/members/{a_gone}").json()
        assert (out["removed"], out["user_id"]) == (gone["removed"], c_gone)

        assert company_rows(cli_t.company_id) == company_rows(api_t.company_id)
        assert len(company_rows(cli_t.company_id)["runs"]) == 1

        # The same refusal, worded the same way.
        wrong = str(uuid.uuid4())
        code, _, err = ctl.cli(
            "admin", "start-run", cli_t.company_id, "--agent", c_agent, "--task", c_task,
            "--project", wrong,
        )  # fmt: skip
        r = api.post(
            base + "/runs", json={"agentId": a_agent, "taskId": a_task_id, "projectId": wrong}
        )
        assert code == 1 and r.status_code == 400
        assert err == f"controller: task {c_task} belongs to project {c_project}, not {wrong}\n"
        assert r.json()["details"][0]["message"] == (
            f"task {a_task_id} belongs to project {a_project}, not {wrong}"
        )
        code, _, err = ctl.cli("admin", "set-agent-entry", c_agent, "docs")
        r = api.put(f"{base}/agents/{a_agent}/entry", json={"path": "docs"})
        assert code == 1 and r.status_code == 409 and r.json()["code"] == "kind_conflict"
        assert err == "controller: kind_conflict: docs is a directory\n"
        assert r.json()["error"] == "docs is a directory"
        code, _, err = ctl.cli("admin", "grant", cli_t.company_id, c_gone, "--agent", c_agent,
                               "--configure")  # fmt: skip
        r = api.put(f"{base}/agents/{a_agent}/grants/{a_gone}")
        assert code == 1 and r.status_code == 404 and r.json()["code"] == "member_not_found"
        assert err == (
            f"controller: member_not_found: user {c_gone} is not a member of company"
            f" {cli_t.company_id}\n"
        )
        assert r.json()["error"] == f"user {a_gone} is not a member of company {api_t.company_id}"
        code, _, err = ctl.cli("admin", "remove-member", cli_t.company_id, c_gone)
        r = api.delete(f"{base}/members/{a_gone}")
        assert code == 1 and r.status_code == 404 and r.json()["code"] == "member_not_found"
        assert err == f"controller: user {c_gone} is not a member of company {cli_t.company_id}\n"
        assert r.json()["error"] == f"user {a_gone} is not a member of company {api_t.company_id}"
        assert company_rows(cli_t.company_id) == company_rows(api_t.company_id)


COMMAND_ROUTES = {
    "add-member": ("put", "/members/{userId}"),
    "remove-member": ("delete", "/members/{userId}"),
    "end-sessions": ("delete", "/members/{userId}/sessions"),
    "list-tokens": ("get", "/tokens"),
    "revoke-token": ("delete", "/tokens/{tokenId}"),
    "create-operator-token": ("post", "/operator-tokens"),
    "create-agent": ("post", "/agents"),
    "set-agent-entry": ("put", "/agents/{agentId}/entry"),
    "grant": ("put", "/agents/{agentId}/grants/{userId}"),
    "revoke": ("delete", "/agents/{agentId}/grants/{userId}"),
    "create-project": ("post", "/projects"),
    "create-task": ("post", "/tasks"),
    "add-workspace": ("post", "/projects/{projectId}/workspaces"),
    "remove-workspace": ("delete", "/workspaces/{workspaceId}"),
    "set-task-branch": ("put", "/tasks/{taskId}/branch"),
    "start-run": ("post", "/runs"),
    "end-run": ("post", "/runs/{runId}/end"),
    "audit": ("get", "/runs/{runId}/audit"),
}
"""Each company-scoped ``controller admin`` command and its REST route
(under ``/api/companies/{companyId}``)."""


def test_every_admin_command_has_a_route_or_a_documented_reason() -> None:
    """The commands are exactly those with a route here plus those the
    "why no route" table of docs/operators/admin-commands.md names; each route is in the OpenAPI
    document, and the two sets do not overlap."""

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(action.choices)

    commands = set(subcommands(subcommands(build_parser())["admin"]))
    page = (REPO / "docs" / "operators" / "admin-commands.md").read_text()
    table = page.split("| command | why no route |\n| --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    cli_only = set()
    for row in table.splitlines():
        first = row.split(" | ", 1)[0]
        if "not `admin` commands" not in first:
            cli_only |= set(re.findall(r"`([a-z-]+)`", first))
    assert cli_only == {"bootstrap", "create-user", "import-agent-files", "backup", "restore"}
    assert not cli_only & set(COMMAND_ROUTES)
    assert commands == cli_only | set(COMMAND_ROUTES)
    paths = document()["paths"]
    for command, (method, path) in COMMAND_ROUTES.items():
        assert method in paths.get("/api/companies/{companyId}" + path, {}), command
