"""Who may open an agent's folder: owners and admins;
members (and viewers, read-only) only with the agent's configure permission
(``controller admin grant COMPANY USER --agent A --configure``); a run its own
agent's folder, saving there only while its responsible user holds that
permission. Grants and revocations take effect at once, also for a write
already in flight; every denial is a 404. Real controller and PostgreSQL."""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from tests.support.agentfiles import (
    agent_files,
    new_agent,
    operate,
    put,
    run_detail,
    run_receipts,
    start_agent_run,
)
from tests.support.bridge import Run, api_client
from tests.support.controller import Tenant


def grant(tenant: Tenant, user: str, agent: str, action: str = "grant") -> dict[str, object]:
    return tenant.controller.admin(action, tenant.company_id, user, "--agent", agent, "--configure")


def probe(tenant: Tenant, token: str, agent: str) -> dict[str, int]:
    """What a person gets from the agent folder's routes (status codes)."""
    folder = tenant.folder("agent", agent)
    with tenant.client(token) as c:
        return {
            "list": c.get(folder + "/").status_code,
            "read": c.get(folder + "/content", params={"path": "AGENTS.md"}).status_code,
            "sync": c.get(folder + "/sync").status_code,
            "changes": c.get(folder + "/changes").status_code,
            "agent": c.get(f"/api/companies/{tenant.company_id}/agents/{agent}").status_code,
            "write": put(c, tenant, "agent", agent, "probe.txt", b"p").status_code,
            "mkdir": operate(c, tenant, "agent", agent, action="mkdir", path="d").status_code,
        }


def directory_files(tenant: Tenant, token: str, agent: str) -> bool | None:
    """The directory's ``hasFiles`` of ``agent`` for the holder of ``token``."""
    with tenant.client(token) as c:
        agents = c.get(f"/api/companies/{tenant.company_id}/directory").json()["agents"]
    found: bool | None = next(a for a in agents if a["id"] == agent)["hasFiles"]
    return found


HIDDEN = dict.fromkeys(("list", "read", "sync", "changes", "agent", "write", "mkdir"), 404)


def test_people_need_the_configure_permission_and_it_applies_at_once(tenant: Tenant) -> None:
    agent, peer = new_agent(tenant, "mine"), new_agent(tenant, "peer")
    member, member_token = tenant.new_member("member")
    viewer, viewer_token = tenant.new_member("viewer")
    _, admin_token = tenant.new_member("admin")
    # Membership alone opens no agent's folder, and every denial looks like absence.
    assert probe(tenant, member_token, agent) == HIDDEN
    assert probe(tenant, viewer_token, agent) == HIDDEN
    with tenant.client(member_token) as c:
        r = c.get(tenant.folder("agent", agent) + "/")
        assert r.json() == {"error": "Work folder not found", "code": "not_found"}
    assert probe(tenant, admin_token, agent)["write"] == 201
    assert probe(tenant, tenant.token, agent)["list"] == 200
    # The company directory names the agent, and says nothing of its files.
    assert directory_files(tenant, member_token, agent) is None
    assert directory_files(tenant, tenant.token, agent) is True

    out = grant(tenant, member, agent)
    assert out == {
        "company_id": tenant.company_id, "user_id": member, "agent_id": agent,
        "permission": "configure", "granted": True,
    }  # fmt: skip
    allowed = probe(tenant, member_token, agent)
    assert allowed == {**dict.fromkeys(HIDDEN, 200), "write": 200}, allowed  # probe.txt replaced
    # The grant is for that agent only: its peer stays hidden.
    assert probe(tenant, member_token, peer) == HIDDEN
    assert directory_files(tenant, member_token, agent) is True
    assert directory_files(tenant, member_token, peer) is None
    # A viewer with the grant reads and cannot write.
    grant(tenant, viewer, agent)
    seen = probe(tenant, viewer_token, agent)
    assert (seen["list"], seen["read"], seen["write"], seen["mkdir"]) == (200, 200, 404, 404)

    out = grant(tenant, member, agent, "revoke")
    assert out["revoked"] is True
    assert probe(tenant, member_token, agent) == HIDDEN
    assert grant(tenant, member, agent, "revoke")["revoked"] is False  # nothing left to revoke

    # A grant belongs to the membership: removing the member removes it.
    grant(tenant, member, agent)
    tenant.controller.admin("remove-member", tenant.company_id, member)
    tenant.controller.admin("add-member", tenant.company_id, member, "--role", "member")
    assert probe(tenant, member_token, agent) == HIDDEN

    ctl = tenant.controller
    code, _, err = ctl.cli("admin", "grant", tenant.company_id, member, "--agent", agent)
    assert code == 1 and "--configure" in err
    stranger = ctl.admin("create-user", "stranger@example.com")["user_id"]
    code, _, err = ctl.cli(
        "admin", "grant", tenant.company_id, stranger, "--agent", agent, "--configure"
    )
    assert code == 1 and "not a member" in err, err
    assert agent_files(tenant, agent) == {"AGENTS.md": b"", "probe.txt": b"p"}


def bridge_run(tenant: Tenant, agent: str, user: str | None) -> Run:
    run = start_agent_run(tenant, agent, user=user)
    return Run(tenant, run.run_id, run.token, run.lease_epoch, agent, None, None)


def test_a_run_saves_its_agent_folder_only_while_its_user_may_configure_the_agent(
    tenant: Tenant,
) -> None:
    agent, peer = new_agent(tenant, "mine"), new_agent(tenant, "peer")
    member, member_token = tenant.new_member("member")
    run = bridge_run(tenant, agent, member)
    with run.client() as c:
        # The run reads its own agent's folder whatever its user may do.
        assert c.get("/folders/agent/manifest").status_code == 200
    # Its saves there are refused, from the first upload to the commit.
    assert run.upload("agent", b"note").status_code == 404
    r = run.commit("agent", [{"op": "mkdir", "path": "memory"}])
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    assert agent_files(tenant, agent) == {"AGENTS.md": b""}
    # Through the API bridge too, and never another agent's folder.
    with api_client(tenant, run.token) as c:
        r = put(c, tenant, "agent", agent, "memory.md", b"note")
        assert r.status_code == 404, r.text
        assert c.get(tenant.folder("agent", peer) + "/").status_code == 404
    receipts = run_receipts(tenant, run.run_id)
    # The checkpoint's refusal and the API save's: each save attempt has its receipt.
    assert [(r["outcome"], r["code"]) for r in receipts] == [("refused", "NOT_FOUND")] * 2
    # Its responsible user reads the run's history; a member without the grant
    # would not see someone else's run.
    assert run_detail(tenant, run.run_id, member_token).status_code == 200
    other_member, other_token = tenant.new_member("member")
    assert run_detail(tenant, run.run_id, other_token).status_code == 404

    grant(tenant, member, agent)
    r = run.save("agent", {"memory.md": b"note"})
    assert r.status_code == 200, r.text
    # Being the run's responsible user, and able to configure this agent,
    # opens no other agent's folder to the user's own token.
    assert probe(tenant, member_token, peer) == HIDDEN
    assert directory_files(tenant, member_token, peer) is None
    grant(tenant, member, agent, "revoke")
    assert run.upload("agent", b"changed").status_code == 404
    assert run.commit("agent", [{"op": "delete", "path": "memory.md"}]).status_code == 404
    assert agent_files(tenant, agent) == {"AGENTS.md": b"", "memory.md": b"note"}

    # A run without a responsible user saves its agent's folder.
    unattended = bridge_run(tenant, agent, None)
    assert unattended.save("agent", {"auto.md": b"a"}).status_code == 200
    assert run_detail(tenant, run.run_id, other_token).status_code == 404
    grant(tenant, other_member, agent)
    assert run_detail(tenant, run.run_id, other_token).status_code == 200


def test_a_revocation_lands_before_a_save_waiting_at_the_folder_lock(tenant: Tenant) -> None:
    """Rechecked inside the committing transaction: a save that was authorized
    when it arrived but commits after the revocation publishes nothing."""
    agent = new_agent(tenant)
    member, _ = tenant.new_member("member")
    grant(tenant, member, agent)
    run = bridge_run(tenant, agent, member)
    upload = run.upload("agent", b"late")
    assert upload.status_code == 200
    entry = {"op": "put", "path": "late.md", "digest": upload.json()["digest"], "executable": False}
    with tenant.controller.db() as db:
        row = db.execute(
            "SELECT id FROM folders WHERE company_id = %s AND scope = 'agent' AND owner_id = %s",
            (tenant.company_id, agent),
        ).fetchone()
        assert row is not None
        folder_id = int(row[0])
        db.execute("SELECT pg_advisory_lock(%s)", (folder_id,))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                pending = pool.submit(run.commit, "agent", [entry])
                deadline = time.monotonic() + 20
                while tenant.folder_lock_waiters(folder_id) < 1:
                    assert time.monotonic() < deadline, "the save never reached the folder lock"
                    time.sleep(0.05)
                grant(tenant, member, agent, "revoke")
            finally:
                db.execute("SELECT pg_advisory_unlock(%s)", (folder_id,))
            answer: httpx.Response = pending.result(60)
    assert answer.status_code == 404, answer.text
    assert agent_files(tenant, agent) == {"AGENTS.md": b""}
