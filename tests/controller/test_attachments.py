"""Task attachments: an original upload is kept
as it was; when a run of the task is prepared it appears in the task folder
as an editable working copy ``attachments/<attachmentId>-<filename>``, and
editing or deleting that copy never changes the original (not even after a
GC sweep). Real controller, PostgreSQL and FUSE."""

from __future__ import annotations

import concurrent.futures
import hashlib
import shutil
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.agentfiles import OCTET, new_agent, start_agent_run
from tests.support.controller import ControllerProcess, PgCluster, Tenant, world_searchable_tmpdir
from tests.support.mount import MountFactory

REPORT = b"%PDF-1.4 quarterly report\n" + bytes(range(256)) * 40


@pytest.fixture(scope="module")
def controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """The module's own controller and database (``tenant`` uses it). ``gc
    --now`` sweeps every due entry of its database, and re-examines each
    upload still pinned by an active run: on the session's controller, late in
    a run of the suite, that is thousands of other modules' entries (70 s)."""
    ctl = ControllerProcess(pg_cluster.create_database(), world_searchable_tmpdir("fsa-ctl-att-"))
    try:
        yield ctl.start()
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


def attachments_url(tenant: Tenant, task: str) -> str:
    return f"/api/companies/{tenant.company_id}/tasks/{task}/attachments"


def new_task(tenant: Tenant) -> str:
    project = tenant.controller.admin("create-project", tenant.company_id, "p")["id"]
    task: str = tenant.controller.admin("create-task", tenant.company_id, project, "t")["id"]
    return task


def attach(
    tenant: Tenant, task: str, name: str, data: bytes, token: str | None = None, key: str = ""
) -> Any:
    headers = {**OCTET, "X-File-Content-Type": "application/pdf"}
    if key:
        headers["Idempotency-Key"] = key
    with tenant.client(token) as c:
        return c.post(
            attachments_url(tenant, task), params={"name": name}, content=data, headers=headers
        )


def attachment_rows(tenant: Tenant, task: str) -> int:
    with tenant.controller.db() as db:
        row = db.execute("SELECT count(*) FROM task_attachments WHERE task_id = %s", (task,))
        found = row.fetchone()
    assert found is not None
    return int(found[0])


def task_files(tenant: Tenant, task: str) -> dict[str, bytes]:
    folder = tenant.folder("task", task)
    with tenant.client() as c:
        entries = c.get(folder + "/", params={"limit": 1000}).json()["entries"]
        return {
            e["path"]: c.get(folder + "/content", params={"path": e["path"]}).content
            for e in entries
            if e["kind"] == "file"
        }


def test_attachments_are_stored_listed_and_downloaded_as_uploaded(tenant: Tenant) -> None:
    task = new_task(tenant)
    r = attach(tenant, task, "report.pdf", REPORT)
    assert r.status_code == 201, r.text
    made = r.json()["attachment"]
    assert made["filename"] == "report.pdf" and made["byteSize"] == len(REPORT)
    assert made["digest"] == hashlib.sha256(REPORT).hexdigest()
    assert made["copyPath"] == f"attachments/{made['id']}-report.pdf"
    with tenant.client() as c:
        listed = c.get(attachments_url(tenant, task)).json()["attachments"]
        assert [a["id"] for a in listed] == [made["id"]]
        got = c.get(f"{attachments_url(tenant, task)}/{made['id']}")
        assert got.status_code == 200 and got.content == REPORT
        assert got.headers["content-type"] == "application/pdf"
        assert got.headers["etag"] == f'"{made["digest"]}"'
        missing = c.get(f"{attachments_url(tenant, task)}/{tenant.company_id}")
        assert missing.status_code == 404 and missing.json()["code"] == "attachment_not_found"
    for bad in ("a/b.txt", "..", "x" * 219, "tab\there"):
        r = attach(tenant, task, bad, b"x")
        assert r.status_code == 400 and r.json()["code"] == "invalid_path", (bad, r.text)
    # The task folder's access rules: a viewer lists, cannot add; strangers see nothing.
    _, viewer = tenant.new_member("viewer")
    assert attach(tenant, task, "v.txt", b"v", viewer).status_code == 404
    with tenant.client(viewer) as c:
        assert c.get(attachments_url(tenant, task)).status_code == 200
    other = tenant.controller.admin("bootstrap", "--email", "attach-other@example.com")
    assert attach(tenant, task, "o.txt", b"o", other["token"]).status_code == 404
    # Nothing is in the task folder until a run of the task is prepared.
    assert task_files(tenant, task) == {}


@pytest.mark.fuse
def test_a_working_copy_is_edited_and_deleted_while_the_original_stays(
    mounts: MountFactory, tenant: Tenant
) -> None:
    task = new_task(tenant)
    report = attach(tenant, task, "report.pdf", REPORT).json()["attachment"]
    notes = attach(tenant, task, "notes.txt", b"first notes").json()["attachment"]
    agent = new_agent(tenant)
    run = start_agent_run(tenant, agent, user=tenant.user_id, task=task)
    assert task_files(tenant, task) == {
        report["copyPath"]: REPORT,
        notes["copyPath"]: b"first notes",
    }

    m = mounts.mount(
        tenant.controller.url, scope="task", token_file=run.token_file(mounts), extra=[]
    )
    copy = m.mountpoint / report["copyPath"]
    assert copy.read_bytes() == REPORT
    with open(copy, "r+b") as fh:
        fh.write(b"%PDF-1.7 EDITED")
    (m.mountpoint / notes["copyPath"]).unlink()
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    edited = b"%PDF-1.7 EDITED" + REPORT[len(b"%PDF-1.7 EDITED") :]
    assert task_files(tenant, task) == {report["copyPath"]: edited}

    # The originals are untouched, also once GC has swept what the edit replaced.
    tenant.controller.gc_now()
    with tenant.client() as c:
        base = attachments_url(tenant, task)
        assert c.get(f"{base}/{report['id']}").content == REPORT
        assert c.get(f"{base}/{notes['id']}").content == b"first notes"
    # A copy is made once: the next run does not bring the deleted one back.
    run.end()
    start_agent_run(tenant, agent, user=tenant.user_id, task=task)
    assert task_files(tenant, task) == {report["copyPath"]: edited}
    # A new attachment appears at the next run's preparation.
    later = attach(tenant, task, "later.md", b"added later").json()["attachment"]
    start_agent_run(tenant, agent, user=tenant.user_id, task=task)
    assert task_files(tenant, task)[later["copyPath"]] == b"added later"


def test_a_retried_post_with_its_idempotency_key_adds_nothing(tenant: Tenant) -> None:
    """A client that lost the answer sends the same POST again under the same
    key: it gets the attachment the first one added, and nothing is added."""
    task = new_task(tenant)
    first = attach(tenant, task, "report.pdf", REPORT, key="upload-1")
    assert first.status_code == 201 and first.json()["applied"] is True, first.text
    again = attach(tenant, task, "report.pdf", REPORT, key="upload-1")
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "applied": False}
    assert attachment_rows(tenant, task) == 1
    # The same key for another request is a conflict, and changes nothing.
    for name, data in (("report.pdf", REPORT + b"!"), ("other.pdf", REPORT)):
        r = attach(tenant, task, name, data, key="upload-1")
        assert r.status_code == 409 and r.json()["code"] == "idempotency_conflict", r.text
    assert attachment_rows(tenant, task) == 1
    # A key is the task folder's: its file writes share it, other tasks do not.
    with tenant.client() as c:
        r = c.put(
            tenant.folder("task", task) + "/content",
            params={"path": "x.txt"},
            content=b"x",
            headers={**OCTET, "Idempotency-Key": "upload-1"},
        )
        assert r.status_code == 409 and r.json()["code"] == "idempotency_conflict", r.text
    other = new_task(tenant)
    assert attach(tenant, other, "report.pdf", REPORT, key="upload-1").status_code == 201
    # Without a key every POST adds one; a malformed key is refused before the body.
    assert attach(tenant, task, "report.pdf", REPORT).status_code == 201
    assert attach(tenant, task, "report.pdf", REPORT).status_code == 201
    assert attachment_rows(tenant, task) == 3
    for bad in ("k" * 257, "tab\tinside"):
        r = attach(tenant, task, "r.pdf", b"r", key=bad)
        assert r.status_code == 400, r.text
        assert r.json()["details"][0]["code"] == "invalid_idempotency_key", r.text
    assert attachment_rows(tenant, task) == 3


def test_concurrent_retries_of_one_key_add_one_attachment(tenant: Tenant) -> None:
    task = new_task(tenant)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda _: attach(tenant, task, "r.pdf", REPORT, key="same"), range(4))
        )
    assert sorted(a.status_code for a in answers) == [200, 200, 200, 201], [a.text for a in answers]
    assert len({a.json()["attachment"]["id"] for a in answers}) == 1
    assert attachment_rows(tenant, task) == 1
