"""A company's owners and admins reach no one outside the company: an existing
person joins only by accepting an invitation (or through the host's
operator), ending sessions from a company ends that company's alone, and no
company-scoped answer carries the email of someone who is not a member."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from tests.support.controller import ControllerProcess, Tenant, bootstrap_tenant, parse_api_time

OCTET = {"Content-Type": "application/octet-stream"}


def _email() -> str:
    return f"p-{uuid.uuid4().hex[:12]}@example.com"


def _person(ctl: ControllerProcess, company: str, role: str = "member") -> tuple[str, str, str]:
    """A new user made a member of ``company`` by the host's operator: id, token, email."""
    email = _email()
    user = ctl.admin("create-user", email)
    ctl.admin("add-member", company, user["user_id"], "--role", role)
    return str(user["user_id"]), str(user["token"]), email


def _memberships(ctl: ControllerProcess, user: str) -> dict[str, str]:
    with ctl.db() as db:
        rows = db.execute(
            "SELECT company_id, role FROM memberships WHERE user_id = %s", (user,)
        ).fetchall()
    return {str(c): str(r) for c, r in rows}


@contextlib.contextmanager
def _browser(ctl: ControllerProcess, token: str) -> Iterator[tuple[httpx.Client, str]]:
    """A Files page session of ``token``'s user (its cookie) and its CSRF token."""
    with httpx.Client(base_url=ctl.url, timeout=60) as c:
        r = c.post("/files/api/session", json={"token": token})
        assert r.status_code == 200 and c.cookies, r.text
        yield c, str(r.json()["csrfToken"])


def test_putting_a_non_member_adds_no_one_and_shows_no_email(tenant: Tenant) -> None:
    """``PUT /members/{id}`` changes a member's role; for a member of another
    company (or nobody) it is 404 member_not_found, the same answer whether
    the user exists or not, and changes nothing."""
    ctl = tenant.controller
    other = bootstrap_tenant(ctl)
    stranger, _, stranger_email = _person(ctl, other.company_id)
    base = f"/api/companies/{tenant.company_id}"
    _, admin_token, _ = _person(ctl, tenant.company_id, "admin")
    with tenant.client() as owner, tenant.client(admin_token) as admin:
        for role in ("member", "viewer", "admin", "owner"):
            r = owner.put(f"{base}/members/{stranger}", json={"role": role})
            assert r.status_code == 404 and r.json()["code"] == "member_not_found", r.text
            assert stranger_email not in r.text
            ghost = str(uuid.uuid4())
            g = owner.put(f"{base}/members/{ghost}", json={"role": role})
            assert g.status_code == 404
            assert g.json() == {
                **r.json(),
                "error": r.json()["error"].replace(stranger, ghost),
            }
        # An admin may not hand out the owner role at all: the same refusal for anyone.
        for target in (stranger, str(uuid.uuid4())):
            r = admin.put(f"{base}/members/{target}", json={"role": "owner"})
            assert r.status_code == 403 and r.json()["code"] == "owner_required", r.text
        assert _memberships(ctl, stranger) == {other.company_id: "member"}
        # A member's role still changes (and a member's email is the company's to see).
        member, _, member_email = _person(ctl, tenant.company_id)
        r = owner.put(f"{base}/members/{member}", json={"role": "viewer"})
        assert r.status_code == 200 and r.json()["email"] == member_email, r.text
        assert r.json()["role"] == "viewer"


def test_an_existing_person_joins_only_by_accepting_an_invitation(tenant: Tenant) -> None:
    ctl = tenant.controller
    other = bootstrap_tenant(ctl)
    person, person_token, person_email = _person(ctl, other.company_id)
    base = f"/api/companies/{tenant.company_id}"
    _, admin_token, _ = _person(ctl, tenant.company_id, "admin")
    with tenant.client() as owner, tenant.client(person_token) as invitee:
        r = owner.post(base + "/invitations", json={"userId": person, "role": "member"})
        assert r.status_code == 201, r.text
        invitation = r.json()
        assert person_email not in r.text
        assert invitation["userId"] == person and invitation["role"] == "member"
        assert invitation["companyId"] == tenant.company_id
        assert invitation["invitedBy"] == tenant.user_id
        # Invited is not a member: nothing of the company opens to them yet.
        assert _memberships(ctl, person) == {other.company_id: "member"}
        assert invitee.get(base + "/directory").status_code == 404
        listed = owner.get(base + "/invitations")
        assert listed.status_code == 200 and person_email not in listed.text
        assert [i["invitationId"] for i in listed.json()["invitations"]] == [
            invitation["invitationId"]
        ]
        members = owner.get(base + "/members").json()["members"]
        assert person not in {m["userId"] for m in members}

        # Refusals: no such user, a member already, the owner role by an admin.
        r = owner.post(base + "/invitations", json={"userId": str(uuid.uuid4()), "role": "member"})
        assert r.status_code == 404 and r.json()["code"] == "user_not_found", r.text
        r = owner.post(base + "/invitations", json={"userId": tenant.user_id, "role": "viewer"})
        assert r.status_code == 409 and r.json()["code"] == "already_member", r.text
        with tenant.client(admin_token) as admin:
            r = admin.post(base + "/invitations", json={"userId": person, "role": "owner"})
            assert r.status_code == 403 and r.json()["code"] == "owner_required", r.text
            # Nobody accepts another person's invitation, not even the inviter.
            for c in (admin, owner):
                r = c.post(f"/api/invitations/{invitation['invitationId']}/accept")
                assert r.status_code == 404 and r.json()["code"] == "invitation_not_found"
        with tenant.client(other.token) as stranger:
            r = stranger.post(f"/api/invitations/{invitation['invitationId']}/accept")
            assert r.status_code == 404 and r.json()["code"] == "invitation_not_found"
            assert stranger.get("/api/invitations").json() == {"invitations": []}
        assert _memberships(ctl, person) == {other.company_id: "member"}

        # The person sees the invitation, with the company's name, and accepts it.
        mine = invitee.get("/api/invitations")
        assert mine.status_code == 200, mine.text
        [seen] = mine.json()["invitations"]
        assert seen["companyId"] == tenant.company_id and seen["companyName"]
        assert seen["role"] == "member"
        r = invitee.post(f"/api/invitations/{invitation['invitationId']}/accept")
        assert r.status_code == 200, r.text
        assert r.json() == {"companyId": tenant.company_id, "userId": person, "role": "member"}
        assert _memberships(ctl, person) == {
            other.company_id: "member",
            tenant.company_id: "member",
        }
        assert invitee.get(base + "/directory").status_code == 200
        assert invitee.get("/api/invitations").json() == {"invitations": []}
        assert owner.get(base + "/invitations").json() == {"invitations": []}
        again = invitee.post(f"/api/invitations/{invitation['invitationId']}/accept")
        assert again.status_code == 404 and again.json()["code"] == "invitation_not_found"


def test_an_invitation_declined_or_withdrawn_adds_no_one(tenant: Tenant) -> None:
    ctl = tenant.controller
    other = bootstrap_tenant(ctl)
    person, person_token, _ = _person(ctl, other.company_id)
    base = f"/api/companies/{tenant.company_id}"

    def invite(c: httpx.Client, role: str) -> dict[str, Any]:
        r = c.post(base + "/invitations", json={"userId": person, "role": role})
        assert r.status_code == 201, r.text
        found: dict[str, Any] = r.json()
        return found

    with tenant.client() as owner, tenant.client(person_token) as invitee:
        first = invite(owner, "viewer")
        # Inviting again changes the pending invitation's role; there is one.
        second = invite(owner, "admin")
        assert second["invitationId"] == first["invitationId"] and second["role"] == "admin"
        r = invitee.delete(f"/api/invitations/{first['invitationId']}")
        assert r.status_code == 200, r.text
        assert r.json() == {"invitationId": first["invitationId"], "declined": True}
        gone = invitee.post(f"/api/invitations/{first['invitationId']}/accept")
        assert gone.status_code == 404 and gone.json()["code"] == "invitation_not_found"

        third = invite(owner, "member")
        r = owner.delete(f"{base}/invitations/{third['invitationId']}")
        assert r.status_code == 200, r.text
        assert r.json() == {"invitationId": third["invitationId"], "withdrawn": True}
        assert invitee.get("/api/invitations").json() == {"invitations": []}
        gone = invitee.post(f"/api/invitations/{third['invitationId']}/accept")
        assert gone.status_code == 404 and gone.json()["code"] == "invitation_not_found"
        # Another company cannot withdraw it (nor see it).
        fourth = invite(owner, "member")
        with tenant.client(other.token) as foreign:
            path = f"/api/companies/{other.company_id}/invitations/{fourth['invitationId']}"
            r = foreign.delete(path)
            assert r.status_code == 404 and r.json()["code"] == "invitation_not_found"
            listed = foreign.get(f"/api/companies/{other.company_id}/invitations").json()
            assert listed == {"invitations": []}
    assert _memberships(ctl, person) == {other.company_id: "member"}
    # An operator token handles no invitation (a membership is about a person).
    op = ctl.admin("create-operator-token", tenant.company_id, "--name", "ci")["token"]
    with tenant.client(op) as machine:
        for method, path in (
            ("GET", base + "/invitations"),
            ("POST", base + "/invitations"),
            ("GET", "/api/invitations"),
        ):
            r = machine.request(method, path, json={"userId": person, "role": "member"})
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text


def _lapse(ctl: ControllerProcess, invitation: str) -> None:
    """What 14 days do to an invitation, in one statement."""
    with ctl.db() as db:
        cur = db.execute(
            "UPDATE invitations SET expires_at = now() - interval '1 second' WHERE id = %s",
            (invitation,),
        )
        assert cur.rowcount == 1


def test_an_invitation_lapses_and_inviting_again_renews_it(tenant: Tenant) -> None:
    ctl = tenant.controller
    other = bootstrap_tenant(ctl)
    person, person_token, _ = _person(ctl, other.company_id)
    base = f"/api/companies/{tenant.company_id}"
    with tenant.client() as owner, tenant.client(person_token) as invitee:
        before = datetime.now(UTC)
        r = owner.post(base + "/invitations", json={"userId": person, "role": "admin"})
        assert r.status_code == 201, r.text
        made = r.json()
        lasts = parse_api_time(made["expiresAt"]) - parse_api_time(made["createdAt"])
        assert timedelta(days=14) <= lasts < timedelta(days=14, minutes=5), lasts
        assert parse_api_time(made["expiresAt"]) >= before + timedelta(days=14)
        _lapse(ctl, made["invitationId"])
        # Lapsed: listed nowhere, and accepting it is 410 for its invitee alone.
        assert owner.get(base + "/invitations").json() == {"invitations": []}
        assert invitee.get("/api/invitations").json() == {"invitations": []}
        accept = f"/api/invitations/{made['invitationId']}/accept"
        r = invitee.post(accept)
        assert r.status_code == 410 and r.json()["code"] == "invitation_expired", r.text
        with tenant.client(other.token) as stranger:
            r = stranger.post(accept)
            assert r.status_code == 404 and r.json()["code"] == "invitation_not_found"
        assert _memberships(ctl, person) == {other.company_id: "member"}
        # Inviting again renews the same invitation, with the new role.
        r = owner.post(base + "/invitations", json={"userId": person, "role": "member"})
        assert r.status_code == 201, r.text
        renewed = r.json()
        assert renewed["invitationId"] == made["invitationId"] and renewed["role"] == "member"
        assert parse_api_time(renewed["expiresAt"]) > datetime.now(UTC) + timedelta(days=13)
        [seen] = invitee.get("/api/invitations").json()["invitations"]
        assert seen["invitationId"] == made["invitationId"] and seen["expiresAt"]
        r = invitee.post(accept)
        assert r.status_code == 200, r.text
        assert r.json()["role"] == "member"
    assert _memberships(ctl, person) == {other.company_id: "member", tenant.company_id: "member"}
    # A lapsed invitation can still be declined: it is gone afterwards.
    second, second_token, _ = _person(ctl, other.company_id)
    with tenant.client() as owner, tenant.client(second_token) as invitee:
        r = owner.post(base + "/invitations", json={"userId": second, "role": "viewer"})
        assert r.status_code == 201, r.text
        lapsed = r.json()["invitationId"]
        _lapse(ctl, lapsed)
        r = invitee.delete(f"/api/invitations/{lapsed}")
        assert r.status_code == 200 and r.json() == {"invitationId": lapsed, "declined": True}
    with ctl.db() as db:
        assert db.execute(
            "SELECT count(*) FROM invitations WHERE id = %s", (lapsed,)
        ).fetchone() == (0,)
    assert _memberships(ctl, second) == {other.company_id: "member"}


def test_ending_sessions_from_a_company_ends_only_that_companys(tenant: Tenant) -> None:
    """A person in two companies: one company ending their sessions closes
    that company to those sessions (reads, writes and the session's company
    list) while the other company stays open; a company cannot end the
    sessions of someone who is not its member at all."""
    ctl = tenant.controller
    other = bootstrap_tenant(ctl)
    person, token, _ = _person(ctl, other.company_id)
    ctl.admin("add-member", tenant.company_id, person, "--role", "member")
    here = f"/api/companies/{tenant.company_id}"
    there = f"/api/companies/{other.company_id}"
    here_project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    there_project = ctl.admin("create-project", other.company_id, "p")["id"]
    here_folder = tenant.folder("project", here_project)
    there_folder = f"{there}/work-folders/project/{there_project}"
    outsider, outsider_token, _ = _person(ctl, other.company_id)
    with (
        _browser(ctl, token) as (browser, csrf),
        _browser(ctl, outsider_token) as (outsider_browser, _),
        tenant.client() as owner,
    ):
        # Someone who is not a member: refused, and their sessions stay.
        r = owner.delete(f"{here}/members/{outsider}/sessions")
        assert r.status_code == 404 and r.json()["code"] == "member_not_found", r.text
        assert outsider_browser.get(there + "/directory").status_code == 200

        ended = owner.delete(f"{here}/members/{person}/sessions")
        assert ended.status_code == 200, ended.text
        assert ended.json() == {"userId": person, "ended": 1}
        write = {"params": {"path": "x.txt"}, "headers": {**OCTET, "X-CSRF-Token": csrf}}
        r = browser.get(here + "/directory")
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
        r = browser.put(here_folder + "/content", content=b"x", **write)  # type: ignore[arg-type]
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
        assert tenant.file_rows("x.txt", live=False) == 0
        # The other company still opens, for reads and writes.
        assert browser.get(there + "/directory").status_code == 200
        r = browser.put(there_folder + "/content", content=b"y", **write)  # type: ignore[arg-type]
        assert r.status_code == 201, r.text
        session = browser.get("/files/api/session")
        assert session.status_code == 200
        assert [c["id"] for c in session.json()["companies"]] == [other.company_id]
        # Ending again ends nothing more; the API token is untouched.
        again = owner.delete(f"{here}/members/{person}/sessions")
        assert again.json() == {"userId": person, "ended": 0}
        with tenant.client(token) as direct:
            assert direct.get(here + "/directory").status_code == 200
    # Signing in again opens the company again.
    with _browser(ctl, token) as (fresh, _):
        assert fresh.get(here + "/directory").status_code == 200
        companies = {c["id"] for c in fresh.get("/files/api/session").json()["companies"]}
        assert companies == {tenant.company_id, other.company_id}


def test_no_company_answer_carries_a_non_members_email(tenant: Tenant) -> None:
    """Every company-scoped route that takes a person's id, asked about a
    member of another company, answers without that person's email."""
    ctl = tenant.controller
    other = bootstrap_tenant(ctl)
    stranger, _, email = _person(ctl, other.company_id)
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    base = f"/api/companies/{tenant.company_id}"
    with tenant.client() as owner:
        for method, path, body in (
            ("PUT", f"{base}/members/{stranger}", {"role": "member"}),
            ("DELETE", f"{base}/members/{stranger}", None),
            ("DELETE", f"{base}/members/{stranger}/sessions", None),
            ("PUT", f"{base}/agents/{agent}/grants/{stranger}", None),
            ("DELETE", f"{base}/agents/{agent}/grants/{stranger}", None),
            ("GET", f"{base}/tokens?userId={stranger}", None),
            ("GET", f"{base}/tokens", None),
            ("GET", f"{base}/members", None),
            ("GET", f"{base}/directory", None),
            ("POST", f"{base}/invitations", {"userId": stranger, "role": "viewer"}),
            ("GET", f"{base}/invitations", None),
        ):
            r = owner.request(method, path, json=body)
            assert r.status_code < 500, (method, path, r.text)
            assert email not in r.text, (method, path, r.text)
    assert _memberships(ctl, stranger) == {other.company_id: "member"}
