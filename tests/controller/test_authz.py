"""Authorization: membership, viewers, private user folders, revocation, tokens."""

from __future__ import annotations

import re
import uuid

import httpx

from tests.support.bridge import api_client
from tests.support.constants import REPO
from tests.support.controller import Tenant

OCTET = {"Content-Type": "application/octet-stream"}
NOT_FOUND = {"error": "Work folder not found", "code": "not_found"}


def put(c: httpx.Client, folder: str, path: str, data: bytes) -> httpx.Response:
    return c.put(f"{folder}/content", params={"path": path}, content=data, headers=OCTET)


def test_private_user_folder_is_invisible_to_other_members(tenant: Tenant) -> None:
    other_id, other_token = tenant.new_member("admin")
    with tenant.client() as owner:
        assert put(owner, tenant.my_folder, "secret.txt", b"mine").status_code == 201
    with tenant.client(other_token) as other:
        for method, url, kw in [
            ("GET", tenant.my_folder + "/", {}),
            ("GET", tenant.my_folder + "/content?path=secret.txt", {}),
            ("GET", tenant.my_folder + "/sync", {}),
            ("PUT", tenant.my_folder + "/content?path=x", {"content": b"x", "headers": OCTET}),
            (
                "POST",
                tenant.my_folder + "/operations",
                {"json": {"action": "delete", "path": "secret.txt"}},
            ),
        ]:
            r = other.request(method, url, **kw)  # type: ignore[arg-type]
            assert r.status_code == 404, (method, url, r.text)
            assert r.json() == NOT_FOUND
        # Indistinguishable from a folder that does not exist at all.
        ghost = other.get(tenant.folder("user", str(uuid.uuid4())) + "/")
        assert ghost.status_code == 404 and ghost.json() == NOT_FOUND
        # Their own folder works.
        assert put(other, tenant.folder("user", other_id), "own.txt", b"ok").status_code == 201
    with tenant.client() as owner:
        g = owner.get(tenant.my_folder + "/content", params={"path": "secret.txt"})
        assert g.content == b"mine"


def test_viewer_reads_but_cannot_write(tenant: Tenant) -> None:
    project = tenant.controller.admin("create-project", tenant.company_id, "p")["id"]
    folder = tenant.folder("project", project)
    with tenant.client() as owner:
        assert put(owner, folder, "plan.md", b"plan").status_code == 201
    _, viewer_token = tenant.new_member("viewer")
    with tenant.client(viewer_token) as viewer:
        assert viewer.get(folder + "/content", params={"path": "plan.md"}).content == b"plan"
        assert put(viewer, folder, "plan.md", b"hacked").status_code == 404
        r = viewer.post(folder + "/operations", json={"action": "delete", "path": "plan.md"})
        assert r.status_code == 404
        r = viewer.post(folder + "/operations", json={"action": "mkdir", "path": "x"})
        assert r.status_code == 404
    with tenant.client() as owner:
        assert owner.get(folder + "/content", params={"path": "plan.md"}).content == b"plan"
        assert [e["path"] for e in owner.get(folder + "/").json()["entries"]] == ["plan.md"]


def _documented_error_row(phrase: str) -> tuple[int, str]:
    """The status and code of the error-table row (docs/reference/errors.md)
    whose "when" names ``phrase``."""
    section = (REPO / "docs" / "reference" / "errors.md").read_text()
    rows = re.findall(r"^\| (\d{3}) \| `([a-z0-9_]+)` \| (.*) \|$", section, re.M)
    [(status, code)] = [(int(s), c) for s, c, when in rows if phrase in when]
    return status, code


def test_a_viewers_write_answers_what_the_docs_say(tenant: Tenant) -> None:
    """Every write route a viewer may see answers the documented error-table row
    for a viewer's write (every authorization denial is the 404 of a
    missing folder), and changes nothing."""
    status, code = _documented_error_row("a viewer's write")
    assert (status, code) == (404, "not_found")
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    folder = tenant.folder("project", project)
    with tenant.client() as owner:
        assert put(owner, folder, "plan.md", b"plan").status_code == 201
    _, viewer_token = tenant.new_member("viewer")
    attachments = f"/api/companies/{tenant.company_id}/tasks/{task}/attachments"
    with tenant.client(viewer_token) as viewer:
        assert viewer.get(folder + "/content", params={"path": "plan.md"}).content == b"plan"
        assert viewer.get(tenant.folder("task", task) + "/").status_code == 200
        for method, url, kw in [
            ("PUT", folder + "/content?path=plan.md", {"content": b"hacked", "headers": OCTET}),
            ("PUT", folder + "/content?path=new.md", {"content": b"new", "headers": OCTET}),
            ("POST", folder + "/operations", {"json": {"action": "delete", "path": "plan.md"}}),
            ("POST", folder + "/operations", {"json": {"action": "mkdir", "path": "x"}}),
            (
                "POST",
                folder + "/operations",
                {"json": {"action": "move", "path": "plan.md", "to": "moved.md"}},
            ),
            ("POST", folder + "/refresh", {"json": {"runId": str(uuid.uuid4())}}),
            ("POST", attachments + "?name=a.txt", {"content": b"a", "headers": OCTET}),
        ]:
            r = viewer.request(method, url, **kw)  # type: ignore[arg-type]
            assert r.status_code == status, (method, url, r.text)
            assert r.json() == {**NOT_FOUND, "code": code}, (method, url)
    with tenant.client() as owner:
        assert owner.get(folder + "/content", params={"path": "plan.md"}).content == b"plan"
        assert [e["path"] for e in owner.get(folder + "/").json()["entries"]] == ["plan.md"]
        assert owner.get(attachments).json()["attachments"] == []


def test_revoked_membership_loses_access_immediately(tenant: Tenant) -> None:
    project = tenant.controller.admin("create-project", tenant.company_id, "p")["id"]
    folder = tenant.folder("project", project)
    member_id, member_token = tenant.new_member("member")
    with tenant.client(member_token) as member:
        assert put(member, folder, "a.txt", b"a").status_code == 201
        assert member.get(folder + "/").status_code == 200
        tenant.controller.admin("remove-member", tenant.company_id, member_id)
        assert member.get(folder + "/").status_code == 404
        assert put(member, folder, "b.txt", b"b").status_code == 404
        assert member.get(tenant.folder("user", member_id) + "/").status_code == 404


def test_other_company_cannot_reach_folders(tenant: Tenant) -> None:
    project = tenant.controller.admin("create-project", tenant.company_id, "p")["id"]
    outsider = tenant.controller.admin("bootstrap", "--email", f"{uuid.uuid4().hex}@x.org")
    with tenant.client(outsider["token"]) as c:
        assert c.get(tenant.folder("project", project) + "/").json() == NOT_FOUND
        # The outsider's own company cannot name another company's project either.
        other = f"/api/companies/{outsider['company_id']}/work-folders/project/{project}/"
        assert c.get(other).status_code == 404


def test_owner_must_exist_in_company(tenant: Tenant) -> None:
    with tenant.client() as c:
        for scope in ("task", "agent", "project"):
            r = c.get(tenant.folder(scope, str(uuid.uuid4())) + "/")
            assert r.status_code == 404 and r.json() == NOT_FOUND


def test_bad_tokens_and_auth_headers(tenant: Tenant) -> None:
    url = tenant.controller.url + tenant.my_folder + "/"
    assert httpx.get(url).status_code == 401
    for header in (
        "Bearer",
        "Basic abc",
        "Bearer fsa_u_wrong",
        "token xyz",
        f"Bearer {tenant.token}x",
    ):
        r = httpx.get(url, headers={"Authorization": header})
        assert r.status_code == 401, header
        assert r.json()["code"] == "unauthenticated"


def test_malformed_route_parameters(tenant: Tenant) -> None:
    with tenant.client() as c:
        cases = [
            "/api/companies/not-a-uuid/work-folders/user/x/",
            f"/api/companies/{tenant.company_id}/work-folders/nope/{tenant.user_id}/",
            f"/api/companies/{tenant.company_id}/work-folders/project/not-a-uuid/",
            f"/api/companies/{tenant.company_id}/work-folders/user/{'u' * 257}/",
        ]
        for url in cases:
            r = c.get(url)
            assert r.status_code == 400, url
            assert r.json()["error"] == "Validation error"


def test_malformed_operation_bodies(tenant: Tenant) -> None:
    with tenant.client() as c:
        url = tenant.my_folder + "/operations"
        bad = [
            {"action": "explode", "path": "x"},
            {"action": "mkdir"},
            {"action": "mkdir", "path": "x", "extra": 1},
            {"action": "mkdir", "path": 5},
            {"action": "restore", "fileId": "nope"},
            {"action": "purge", "fileId": 7},
            {"action": "delete", "path": "../x"},
        ]
        for body in bad:
            r = c.post(url, json=body)
            assert r.status_code == 400, body
            assert r.json()["error"] == "Validation error"
        assert (
            c.post(
                url, content=b"{not json", headers={"Content-Type": "application/json"}
            ).status_code
            == 400
        )
        assert (
            c.post(url, content=b"[]", headers={"Content-Type": "application/json"}).status_code
            == 400
        )
        assert c.post(url, content=b"{}", headers={"Content-Type": "text/plain"}).status_code == 400
        assert c.get(tenant.my_folder + "/").json()["entries"] == []


def test_run_token_scopes(tenant: Tenant) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    other_agent = ctl.admin("create-agent", tenant.company_id, "b")["id"]
    run = ctl.admin(
        "start-run", tenant.company_id, "--agent", agent, "--task", task, "--user", tenant.user_id
    )
    with api_client(tenant, run["token"]) as c:
        assert put(c, tenant.folder("agent", agent), "notes.md", b"n").status_code == 201
        assert put(c, tenant.folder("task", task), "out.txt", b"o").status_code == 201
        assert put(c, tenant.my_folder, "from-agent.txt", b"u").status_code == 201
        # An agent may write only its own agent folder.
        assert put(c, tenant.folder("agent", other_agent), "x", b"x").status_code == 404
        # Another member's user folder is out of reach.
        other_id, _ = tenant.new_member()
        assert c.get(tenant.folder("user", other_id) + "/").status_code == 404
        ctl.admin("end-run", run["run_id"])
        assert c.get(tenant.folder("task", task) + "/").status_code == 401


def test_each_refusal_of_a_put_to_a_folder_written_before(tenant: Tenant) -> None:
    """A PUT with a person's API token to a folder that exists is authorized
    in one statement (controller.auth.token_write_access); a folder's first
    write takes the general way, which creates it. Both refuse alike: an
    unknown, revoked or operator token 401, every folder the person may not
    write 404, between two PUTs as soon as the change is made."""
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    member_id, member_token = tenant.new_member("member")
    folders = {
        "own": tenant.folder("user", member_id),
        "project": tenant.folder("project", project),
        "task": tenant.folder("task", task),
        "agent": tenant.folder("agent", agent),
    }
    with tenant.client(member_token) as member:
        for name, folder in folders.items():
            first = put(member, folder, "first.txt", b"1")
            if name == "agent":  # a member needs the configure permission
                assert first.status_code == 404 and first.json() == NOT_FOUND
                continue
            assert first.status_code == 201, (name, first.text)  # creates the folder
            assert put(member, folder, "second.txt", b"2").status_code == 201, name
        ctl.admin("grant", tenant.company_id, member_id, "--agent", agent, "--configure")
        assert put(member, folders["agent"], "first.txt", b"1").status_code == 201
        assert put(member, folders["agent"], "second.txt", b"2").status_code == 201
        ctl.admin("revoke", tenant.company_id, member_id, "--agent", agent, "--configure")
        r = put(member, folders["agent"], "third.txt", b"3")
        assert r.status_code == 404 and r.json() == NOT_FOUND

        # Folders the member may not write, existing or not, and owners that do not exist.
        with tenant.client() as owner:
            assert put(owner, tenant.my_folder, "mine.txt", b"m").status_code == 201
        for scope, owner_id in [
            ("user", tenant.user_id),
            ("user", str(uuid.uuid4())),
            ("project", str(uuid.uuid4())),
            ("task", str(uuid.uuid4())),
            ("agent", str(uuid.uuid4())),
        ]:
            r = put(member, tenant.folder(scope, owner_id), "x.txt", b"x")
            assert r.status_code == 404 and r.json() == NOT_FOUND, (scope, owner_id)

        # Made a viewer: no write anywhere, not even to the member's own folder.
        ctl.admin("add-member", tenant.company_id, member_id, "--role", "viewer")
        for folder in folders.values():
            r = put(member, folder, "viewer.txt", b"v")
            assert r.status_code == 404 and r.json() == NOT_FOUND, folder
        ctl.admin("add-member", tenant.company_id, member_id, "--role", "member")
        assert put(member, folders["own"], "again.txt", b"a").status_code == 201

        # Removed from the company: every folder is gone from sight.
        ctl.admin("remove-member", tenant.company_id, member_id)
        for folder in folders.values():
            r = put(member, folder, "removed.txt", b"r")
            assert r.status_code == 404 and r.json() == NOT_FOUND, folder
    assert tenant.file_rows("viewer.txt", live=False) == 0
    assert tenant.file_rows("removed.txt", live=False) == 0

    # A token revoked between two PUTs, and tokens that never were a person's.
    admin_id, token = tenant.new_member("admin")
    operator = ctl.admin("create-operator-token", tenant.company_id, "--name", "o")["token"]
    with tenant.client(token) as admin:
        assert put(admin, folders["project"], "before.txt", b"b").status_code == 201
        [mine] = ctl.admin("list-tokens", "--user", admin_id)["tokens"]
        ctl.admin("revoke-token", mine["token_id"])
        r = put(admin, folders["project"], "after.txt", b"a")
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    for bad in (operator, "fsa_u_unknown", f"{tenant.token}x"):
        with tenant.client(bad) as c:
            r = put(c, folders["project"], "bad.txt", b"x")
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated", bad
    assert tenant.file_rows("after.txt", live=False) == 0
    assert tenant.file_rows("bad.txt", live=False) == 0
    # The owner's own token is untouched by all of it.
    with tenant.client() as owner:
        assert put(owner, folders["project"], "owner.txt", b"o").status_code == 201
