"""Downloads keep their content type only when it is on a short allowlist of
inert types (text/plain, PDF, raster images); everything else, whatever the
uploader (a sandbox, too) declared, is served as application/octet-stream,
always as an attachment, sandboxed by CSP and with nosniff."""

from __future__ import annotations

import httpx

from tests.support.bridge import start_run
from tests.support.controller import Tenant

OCTET = {"Content-Type": "application/octet-stream"}

SERVED = {
    # declared by the uploader -> served
    "text/javascript": "application/octet-stream",
    "application/javascript": "application/octet-stream",
    "text/html": "application/octet-stream",
    "text/html; charset=utf-8": "application/octet-stream",
    "image/svg+xml": "application/octet-stream",
    "application/xhtml+xml": "application/octet-stream",
    "text/xml": "application/octet-stream",
    "application/x-shockwave-flash": "application/octet-stream",
    "text/css": "application/octet-stream",
    "multipart/x-mixed-replace; boundary=x": "application/octet-stream",
    "text/plain": "text/plain; charset=utf-8",
    "text/plain; charset=utf-7": "text/plain; charset=utf-8",
    "TEXT/PLAIN": "text/plain; charset=utf-8",
    "application/pdf": "application/pdf",
    "image/png": "image/png",
    "image/jpeg": "image/jpeg",
    "image/gif": "image/gif",
    "image/webp": "image/webp",
}


def assert_safe_download(r: httpx.Response, served: str) -> None:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == served
    assert r.headers["content-disposition"].startswith("attachment; filename*=UTF-8''")
    assert r.headers["content-security-policy"] == "sandbox; default-src 'none'"
    assert r.headers["x-content-type-options"] == "nosniff"


def test_work_folder_downloads_serve_only_allowlisted_types(tenant: Tenant) -> None:
    folder = tenant.my_folder
    with tenant.client() as c:
        for i, declared in enumerate(SERVED):
            r = c.put(
                folder + "/content",
                params={"path": f"f{i}"},
                content=b"alert(document.domain)",
                headers={**OCTET, "X-File-Content-Type": declared},
            )
            assert r.status_code == 201, r.text
        listed = {e["path"]: e["contentType"] for e in c.get(folder + "/").json()["entries"]}
        for i, (declared, served) in enumerate(SERVED.items()):
            # The listing keeps what was declared; only what is served changes.
            assert listed[f"f{i}"] == declared
            for method in ("GET", "HEAD"):
                r = c.request(method, folder + "/content", params={"path": f"f{i}"})
                assert_safe_download(r, served)
            r = c.get(folder + "/content", params={"path": f"f{i}", "preview": "true"})
            assert_safe_download(r, served)
            assert r.content == b"alert(document.domain)"


def test_a_sandbox_cannot_choose_how_its_files_are_served(tenant: Tenant) -> None:
    """The same through the API bridge, the way sandbox code writes."""
    run = start_run(tenant)
    task = tenant.folder("task", str(run.task))
    with run.api_client() as c:
        r = c.put(
            task + "/content",
            params={"path": "page.js"},
            content=b"fetch('/api/companies')",
            headers={**OCTET, "X-File-Content-Type": "text/javascript"},
        )
        assert r.status_code == 201, r.text
    with tenant.client() as c:
        assert_safe_download(
            c.get(task + "/content", params={"path": "page.js"}), "application/octet-stream"
        )


def test_attachment_downloads_serve_only_allowlisted_types(tenant: Tenant) -> None:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    url = f"/api/companies/{tenant.company_id}/tasks/{task}/attachments"
    with tenant.client() as c:
        for declared in ("text/html", "image/svg+xml", "image/png"):
            r = c.post(
                url,
                params={"name": "a.bin"},
                content=declared.encode(),
                headers={**OCTET, "X-File-Content-Type": declared},
            )
            assert r.status_code == 201, r.text
            made = r.json()["attachment"]
            assert made["contentType"] == declared
            got = c.get(f"{url}/{made['id']}")
            assert_safe_download(got, SERVED[declared])
