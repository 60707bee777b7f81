"""A task's repositories for people: the listing, the streamed tar download,
and who may see them (the task folder's read rule; every denial a 404; a run
token only through the API bridge, which does not open these routes and
audits the attempt). Real controller and PostgreSQL."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

from tests.support.bridge import api_client
from tests.support.controller import Tenant, bootstrap_tenant, parse_api_time
from tests.support.repos import repo_run, sha, small_repo


def repos_url(tenant: Tenant, task: str) -> str:
    return f"/api/companies/{tenant.company_id}/tasks/{task}/repos"


def test_the_listing_shows_each_repository_and_its_last_save(tenant: Tenant) -> None:
    run = repo_run(tenant, {"app": "https://h/app.git", "lib": "https://h/lib.git"})
    tree = small_repo()
    receipt = run.save(run.ws("app"), tree)
    with tenant.client() as c:
        r = c.get(repos_url(tenant, run.task))
    assert r.status_code == 200
    app, lib = r.json()["repos"]
    files = [c for c in tree.values() if isinstance(c, bytes)]
    assert app == {
        "workspaceId": run.ws("app"),
        "name": "app",
        "repoUrl": "https://h/app.git",
        "state": "saved",
        "lastSavedAt": app["lastSavedAt"],
        "byteSize": sum(len(f) for f in files),
        "fileCount": len(files),
        "entries": len(tree),
        "error": None,
        "checkpointId": receipt["checkpointId"],
        "removed": False,
    }
    assert parse_api_time(app["lastSavedAt"]) == parse_api_time(receipt["savedAt"])
    assert lib["state"] == "unsaved" and lib["checkpointId"] is None
    assert (lib["lastSavedAt"], lib["byteSize"], lib["fileCount"]) == (None, 0, 0)


def test_who_may_see_a_tasks_repositories(tenant: Tenant) -> None:
    run = repo_run(tenant)
    run.save(run.ws(), small_repo())
    url = repos_url(tenant, run.task)
    archive = f"{url}/{run.ws()}/archive"
    for role in ("member", "viewer", "admin"):
        _, token = tenant.new_member(role)
        with tenant.client(token) as c:
            assert c.get(url).status_code == 200, role
            assert c.get(archive).status_code == 200, role
    stranger = bootstrap_tenant(tenant.controller)
    with stranger.client() as c:
        for path in (url, archive):
            r = c.get(path)
            assert r.status_code == 404 and r.json()["code"] == "not_found"
    # A user with no membership at all, an unknown task, a malformed id.
    outsider = tenant.controller.admin("create-user", "outsider@example.com")
    with tenant.client(outsider["token"]) as c:
        assert c.get(url).status_code == 404
    with tenant.client() as c:
        other_task = f"/api/companies/{tenant.company_id}/tasks/{os.urandom(16).hex()[:8]}"
        assert c.get(f"{other_task}-0000-4000-8000-000000000000/repos").status_code == 404
        assert c.get(f"/api/companies/{tenant.company_id}/tasks/nope/repos").status_code == 400
    # A run token is no credential here; through the API bridge these routes
    # are not open, and the attempt is in the run's audit trail.
    with tenant.client(run.token) as c:
        assert c.get(url).status_code == 401
    with api_client(tenant, run.token) as c:
        for path in (url, archive):
            r = c.get(path)
            assert r.status_code == 403 and r.json()["code"] == "bridge_route_denied"
    audit = tenant.controller.admin("audit", "--run", run.run_id)["entries"]
    assert [(e["method"], e["route"], e["status"]) for e in audit[-2:]] == [
        ("GET", "/api/companies/{companyId}/tasks/{taskId}/repos", 403),
        ("GET", "/api/companies/{companyId}/tasks/{taskId}/repos/{workspaceId}/archive", 403),
    ]


def test_the_archive_is_a_tar_of_the_current_checkpoint(tenant: Tenant, tmp_path: Path) -> None:
    run = repo_run(tenant)
    ws = run.ws()
    big = os.urandom(5 << 20)
    tree = {**small_repo(), "data/big.bin": big, "empty": b"", "lib/current": "../src"}
    receipt = run.save(ws, tree)
    url = f"{repos_url(tenant, run.task)}/{ws}/archive"
    with tenant.client() as c, c.stream("GET", url) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-tar"
        assert r.headers["content-disposition"] == "attachment; filename*=UTF-8''app.tar"
        assert "content-length" not in r.headers  # streamed, never built whole
        body = b"".join(r.iter_bytes())
    assert len(body) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(body), mode="r|") as tar:
        seen = {}
        for info in tar:
            data = tar.extractfile(info).read() if info.isfile() else None  # type: ignore[union-attr]
            seen[info.name] = (info, data)
    assert set(seen) == {"app"} | {f"app/{p}" for p in tree}
    assert seen["app"][0].isdir()
    for path, content in tree.items():
        info, data = seen[f"app/{path}"]
        if content is None:
            assert info.isdir() and info.mode == 0o755
        elif isinstance(content, str):
            assert info.issym() and info.linkname == content
        else:
            assert info.isfile() and data == content
            assert info.mode == (0o755 if path == "bin/run.sh" else 0o644), path
            assert sha(data) == sha(content)
        assert info.mtime == int(parse_api_time(receipt["savedAt"]).timestamp())
    # GNU tar reads it too, exec bits and link targets included.
    listed = subprocess.run(
        ["tar", "-tvf", "-"], input=body, capture_output=True, check=True
    ).stdout.decode()
    assert "-rwxr-xr-x" in next(line for line in listed.splitlines() if "app/bin/run.sh" in line)
    assert "app/lib/current -> ../src" in listed
    # It extracts safely with tarfile's "data" filter: links stay inside.
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        tar.extractall(tmp_path, filter="data")
    assert (tmp_path / "app/lib/current/main.py").read_bytes() == tree["src/main.py"]
    assert os.access(tmp_path / "app/bin/run.sh", os.X_OK)
    assert (tmp_path / "app/data/big.bin").read_bytes() == big


def test_no_archive_without_a_save_or_for_another_tasks_workspace(tenant: Tenant) -> None:
    run = repo_run(tenant)
    other = repo_run(tenant)
    other.save(other.ws(), small_repo())
    with tenant.client() as c:
        r = c.get(f"{repos_url(tenant, run.task)}/{run.ws()}/archive")
        assert r.status_code == 404
        r = c.get(f"{repos_url(tenant, run.task)}/{other.ws()}/archive")
        assert r.status_code == 404
        r = c.get(f"{repos_url(tenant, other.task)}/{other.ws()}/archive")
        assert r.status_code == 200
