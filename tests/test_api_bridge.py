"""The API bridge (``/bridge/v1/api/...``) against a real controller and PostgreSQL:
sandbox code reaches the API only through it, with the run's own authority."""

from __future__ import annotations

from tests.support.bridge import start_run
from tests.support.controller import Tenant

OCTET = {"Content-Type": "application/octet-stream"}


def test_a_run_reads_and_writes_its_task_folder_through_the_bridge(tenant: Tenant) -> None:
    run = start_run(tenant)
    assert run.task is not None
    folder = tenant.folder("task", run.task)
    with run.api_client() as c:
        r = c.put(f"{folder}/content", params={"path": "notes.md"}, content=b"hi", headers=OCTET)
        assert r.status_code == 201, r.text
        listing = c.get(folder + "/")
        assert listing.status_code == 200, listing.text
        assert [e["path"] for e in listing.json()["entries"]] == ["notes.md"]
        got = c.get(f"{folder}/content", params={"path": "notes.md"})
        assert got.status_code == 200 and got.content == b"hi"
    with tenant.client() as owner:
        assert owner.get(f"{folder}/content", params={"path": "notes.md"}).content == b"hi"


def test_a_run_token_on_the_api_directly_is_401(tenant: Tenant) -> None:
    run = start_run(tenant)
    assert run.task is not None
    with tenant.client(run.token) as c:
        r = c.get(tenant.folder("task", run.task) + "/")
    assert r.status_code == 401, r.text
    assert r.json()["code"] == "unauthenticated"
