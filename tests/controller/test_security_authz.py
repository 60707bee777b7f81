"""Authority at commit and on reads: revocation is final, a run sees only its binding."""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.support.bridge import Run, api_client, framed, start_run
from tests.support.checkpoints import wait_for
from tests.support.controller import Tenant, bootstrap_tenant

OCTET = {"Content-Type": "application/octet-stream"}


LARGE = 3 << 20
"""A large upload body: the first MiB is sent, then the rest after the revocation."""


def parked_put(
    tenant: Tenant, client: Callable[[], httpx.Client], folder: str, path: str,
    revoke: Callable[[], None],
) -> httpx.Response:  # fmt: skip
    """A chunked ``LARGE`` PUT /content that stalls mid-body while ``revoke``
    runs (once the controller authorized it and spools its body), then finishes."""
    release = threading.Event()
    spool = tenant.controller.data_dir / "spool"

    def body() -> Iterator[bytes]:
        yield b"a" * (1 << 20)
        release.wait(60)
        yield b"b" * (LARGE - (1 << 20))

    def send() -> httpx.Response:
        with client() as c:
            return c.put(f"{folder}/content", params={"path": path}, content=body(), headers=OCTET)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send)
        try:
            # Authorized: the body is being spooled (a spool file exists only then).
            wait_for(lambda: any(spool.glob("upload-*")), 60, "the upload to be spooled")
            revoke()
        finally:
            release.set()
        return answer.result(60)


def run_folder(tenant: Tenant, run: Run) -> str:
    assert run.task is not None
    return tenant.folder("task", run.task)


def signed_in(tenant: Tenant, token: str) -> tuple[httpx.Client, str]:
    """A client holding a Files page session of ``token``'s user, and its CSRF token."""
    c = httpx.Client(base_url=tenant.controller.url, timeout=60)
    r = c.post("/files/api/session", json={"token": token})
    assert r.status_code == 200 and c.cookies, r.text
    return c, str(r.json()["csrfToken"])


@pytest.mark.parametrize(
    ("case", "status", "code"),
    [
        ("run_ended", 401, "unauthenticated"),
        ("run_superseded", 401, "unauthenticated"),
        ("member_removed", 403, "membership_revoked"),
        ("member_made_viewer", 403, "write_not_allowed"),
        ("api_token_revoked", 401, "unauthenticated"),
        ("session_ended", 401, "unauthenticated"),
        ("signed_out", 401, "unauthenticated"),
    ],
)
def test_revocation_mid_upload_publishes_nothing(
    tenant: Tenant, case: str, status: int, code: str
) -> None:
    """Each credential revoked while a large body is still arriving: the write
    answers the refusal and publishes nothing (no file row, no version)."""
    ctl = tenant.controller
    base = f"/api/companies/{tenant.company_id}"
    browser: httpx.Client | None = None
    if case.startswith("run"):
        run = start_run(tenant, sandbox=f"box-{case}-{tenant.company_id}")
        folder = run_folder(tenant, run)

        def client() -> httpx.Client:
            return api_client(tenant, run.token)  # the bridge: a run's only way in

        if case == "run_ended":

            def revoke() -> None:
                ctl.admin("end-run", run.run_id)
        else:

            def revoke() -> None:
                start_run(tenant, sandbox=f"box-{case}-{tenant.company_id}")
    else:
        member_id, token = tenant.new_member("member")
        folder = tenant.folder("project", ctl.admin("create-project", tenant.company_id, "p")["id"])

        def client() -> httpx.Client:
            return tenant.client(token)

        if case == "member_removed":

            def revoke() -> None:
                ctl.admin("remove-member", tenant.company_id, member_id)
        elif case == "member_made_viewer":

            def revoke() -> None:
                ctl.admin("add-member", tenant.company_id, member_id, "--role", "viewer")
        elif case == "api_token_revoked":

            def revoke() -> None:
                [mine] = ctl.admin("list-tokens", "--user", member_id)["tokens"]
                with tenant.client() as owner:
                    r = owner.delete(f"{base}/tokens/{mine['token_id']}")
                    assert r.status_code == 200, r.text
        else:
            browser, csrf = signed_in(tenant, token)
            cookies = dict(browser.cookies)

            def client() -> httpx.Client:
                return httpx.Client(
                    base_url=ctl.url, cookies=cookies, headers={"X-CSRF-Token": csrf}, timeout=60
                )

            if case == "session_ended":

                def revoke() -> None:
                    with tenant.client() as owner:
                        r = owner.delete(f"{base}/members/{member_id}/sessions")
                        assert r.status_code == 200 and r.json()["ended"] == 1, r.text
            else:

                def revoke() -> None:
                    assert browser is not None
                    r = browser.delete("/files/api/session", headers={"X-CSRF-Token": csrf})
                    assert r.status_code == 204, r.text

    try:
        r = parked_put(tenant, client, folder, "late.bin", revoke)
    finally:
        if browser is not None:
            browser.close()
    assert r.status_code == status, r.text
    assert r.json()["code"] == code
    assert tenant.file_rows("late.bin", live=False) == 0
    with tenant.client() as owner:
        listing = owner.get(folder + "/")
        assert listing.status_code == 200 and listing.json()["entries"] == []
    with ctl.db() as db:
        versions = db.execute(
            "SELECT coalesce(max(version_counter), 0) FROM folders"
            " WHERE company_id = %s AND scope = %s AND owner_id = %s",
            (tenant.company_id, *folder.rsplit("/", 2)[1:]),
        ).fetchone()
    assert versions is not None and versions[0] == 0  # no write drew a version


def test_run_reads_only_its_bound_folders(tenant: Tenant) -> None:
    r1 = start_run(tenant)
    r2 = start_run(tenant)
    assert r2.save("agent", {"memory.md": b"agent2 private"}).status_code == 200
    assert r2.save("task", {"plan.md": b"task2"}).status_code == 200
    with tenant.client() as owner:
        assert owner.get(run_folder(tenant, r2) + "/").json()["entries"]
    assert r2.project is not None and r1.task is not None and r1.project is not None
    unbound = [
        tenant.folder("agent", r2.agent),
        tenant.folder("task", r2.task or ""),
        tenant.folder("project", r2.project),
    ]
    with r1.api_client() as c:
        for folder in unbound:
            for suffix in ("/", "/sync", "/content?path=memory.md", "/content?path=plan.md"):
                r = c.get(folder + suffix)
                assert r.status_code == 404, (folder, suffix, r.text)
                assert r.json()["code"] == "not_found"
        for scope, owner in [
            ("agent", r1.agent),
            ("task", r1.task),
            ("project", r1.project),
            ("user", tenant.user_id),
        ]:
            for suffix in ("/", "/sync"):
                r = c.get(tenant.folder(scope, owner) + suffix)
                assert r.status_code == 200, (scope, suffix, r.text)
        # Another member's user folder stays invisible, too.
        other_id, _ = tenant.new_member("admin")
        assert c.get(tenant.folder("user", other_id) + "/").status_code == 404


def test_run_user_folder_only_while_the_user_is_a_member(tenant: Tenant) -> None:
    member_id, _ = tenant.new_member("member")
    ctl = tenant.controller
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    run = ctl.admin("start-run", tenant.company_id, "--agent", agent, "--user", member_id)
    folder = tenant.folder("user", member_id)
    with api_client(tenant, run["token"]) as c:
        assert c.get(folder + "/").status_code == 200
        ctl.admin("remove-member", tenant.company_id, member_id)
        assert c.get(folder + "/").status_code == 404
        assert c.get(folder + "/sync").status_code == 404


def test_company_directory_shows_a_run_no_emails_or_roles(tenant: Tenant) -> None:
    run = start_run(tenant)
    url = f"/api/companies/{tenant.company_id}/directory"
    with run.api_client() as c:
        r = c.get(url)
    assert r.status_code == 200
    members = r.json()["members"]
    assert members == [{"userId": tenant.user_id}]
    assert "@" not in r.text
    with tenant.client() as owner:
        people = owner.get(url).json()["members"]
    assert people[0]["role"] == "owner" and "@" in people[0]["email"]


def test_runs_cannot_purge_trash(tenant: Tenant) -> None:
    run = start_run(tenant)
    folder = run_folder(tenant, run)
    with run.api_client() as c:
        assert c.put(f"{folder}/content?path=x.txt", content=b"x", headers=OCTET).status_code == 201
        deleted = c.post(f"{folder}/operations", json={"action": "delete", "path": "x.txt"})
        assert deleted.status_code == 200
        file_id = deleted.json()["files"][0]["id"]
        r = c.post(f"{folder}/operations", json={"action": "purge", "fileId": file_id})
        assert r.status_code == 403, r.text
        assert r.json()["code"] == "purge_forbidden"
    with tenant.client() as owner:
        trash = owner.get(folder + "/", params={"trash": "true"}).json()["entries"]
        assert [e["id"] for e in trash] == [file_id]
        r = owner.post(f"{folder}/operations", json={"action": "purge", "fileId": file_id})
        assert r.status_code == 200 and r.json()["purged"] == 1


def test_a_viewers_run_cannot_write_the_viewers_folder(tenant: Tenant) -> None:
    viewer_id, viewer_token = tenant.new_member("member")
    ctl = tenant.controller
    folder = tenant.folder("user", viewer_id)
    with tenant.client(viewer_token) as member:
        r = member.put(f"{folder}/content?path=own.txt", content=b"v", headers=OCTET)
        assert r.status_code == 201
    ctl.admin("add-member", tenant.company_id, viewer_id, "--role", "viewer")
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    out = ctl.admin("start-run", tenant.company_id, "--agent", agent, "--user", viewer_id)
    run = Run(tenant, out["run_id"], out["token"], out["lease_epoch"], agent, None, None)
    # Through the bridge: the upload and the checkpoint are refused.
    up = run.upload("user", b"from the run")
    assert up.status_code == 403, up.text
    assert up.json()["code"] == "write_not_allowed"
    cp = run.commit("user", [{"op": "mkdir", "path": "d"}])
    assert cp.status_code == 403 and cp.json()["code"] == "write_not_allowed"
    # Through the REST API with the run token: reads work, writes do not.
    with run.api_client() as c:
        assert c.get(folder + "/").status_code == 200
        r = c.put(f"{folder}/content?path=run.txt", content=b"r", headers=OCTET)
        assert r.status_code == 403 and r.json()["code"] == "write_not_allowed"
        r = c.post(f"{folder}/operations", json={"action": "delete", "path": "own.txt"})
        assert r.status_code == 403 and r.json()["code"] == "write_not_allowed"
    assert tenant.file_rows("run.txt", live=False) == 0 and tenant.file_rows("d", live=False) == 0
    assert tenant.file_rows("own.txt", live=False) == 1


def test_versions_count_per_folder_and_leak_no_other_writes(tenant: Tenant) -> None:
    """``version`` and ``highWater`` follow this folder's own writes only."""
    run = start_run(tenant)
    assert run.save("task", {"one.txt": b"1"}).status_code == 200
    with run.client() as c:
        first = c.get("/folders/task/manifest").json()
    v1 = first["entries"][0]["version"]
    assert first["highWater"] == v1
    # Another folder of the same company and another company write a lot.
    other = bootstrap_tenant(tenant.controller)
    with other.client() as o, tenant.client() as me:
        for i in range(20):
            r = o.put(f"{other.my_folder}/content?path=f{i}", content=b"x", headers=OCTET)
            assert r.status_code == 201
            r = me.put(f"{tenant.my_folder}/content?path=f{i}", content=b"x", headers=OCTET)
            assert r.status_code == 201
    commit = run.save("task", {"two.txt": b"2"})
    assert commit.status_code == 200 and commit.json()["highWater"] == v1 + 1
    with run.client() as c:
        later = c.get("/folders/task/manifest", params={"since": v1}).json()
    assert [(e["path"], e["version"]) for e in later["entries"]] == [("two.txt", v1 + 1)]
    assert later["highWater"] == v1 + 1


def test_bridge_upload_revoked_mid_body_registers_nothing_and_queues_the_blob(
    tenant: Tenant,
) -> None:
    run = start_run(tenant, sandbox=f"box-upload-{tenant.company_id}")
    data = b"uploaded while the run ended " * 1000
    digest = hashlib.sha256(data).hexdigest()
    body = framed(data)
    first_sent, release = threading.Event(), threading.Event()

    def chunks() -> Iterator[bytes]:
        yield body[:100]
        first_sent.set()
        release.wait(30)
        yield body[100:]

    def send() -> httpx.Response:
        with run.client() as c:
            return c.put(
                "/folders/task/uploads", content=chunks(), headers={"X-Content-SHA256": digest}
            )

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send)
        assert first_sent.wait(30)
        time.sleep(1.0)  # authorized; the body is being read
        tenant.controller.admin("end-run", run.run_id)
        release.set()
        r = answer.result(60)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
    with tenant.controller.db() as db:
        uploads = db.execute(
            "SELECT count(*) FROM run_uploads WHERE run_id = %s", (run.run_id,)
        ).fetchone()
        journal = db.execute(
            "SELECT reason FROM deletion_journal WHERE company_id = %s AND digest = %s",
            (tenant.company_id, digest),
        ).fetchall()
    assert uploads is not None and uploads[0] == 0
    # The bytes reached storage before the refusal: GC will collect them.
    assert [row[0] for row in journal] == ["orphaned upload"]
