"""`GET /metrics` on the separate `--metrics-listen` address of a real controller."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.bridge import BATCH_MAX_MEMBERS, encode_batch
from controller.storage.base import object_key
from tests.support.bridge import start_run
from tests.support.constants import REPO
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    bootstrap_tenant,
    world_searchable_tmpdir,
)
from tests.support.procs import free_port
from tests.support.repos import file_member, members_of, repo_run, small_repo

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

GC_DEADLINE = 120.0
"""Seconds a test waits for the sweeper (every 0.3 s here) to reach what it
checks; generous because CI machines are shared and often loaded."""


@pytest.fixture(scope="module")
def metered(pg_cluster: PgCluster) -> Iterator[tuple[ControllerProcess, str]]:
    port = free_port()
    ctl = ControllerProcess(
        pg_cluster.create_database(),
        world_searchable_tmpdir("fsa-ctl-metrics-"),
        extra_args=["--metrics-listen", f"127.0.0.1:{port}"],
        gc_args=["--gc-delay", "0", "--gc-interval", "0.3"],
    )
    try:
        yield ctl.start(), f"http://127.0.0.1:{port}/metrics"
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


def scrape(url: str) -> Samples:
    # Up to SCRAPE_QUERY_TIMEOUT (5 s) of it may be the active runs query.
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def end_runs(ctl: ControllerProcess, *run_ids: str) -> None:
    """End a test's runs once it has checked its figures. An active run's
    uploads stay pinned, and every sweep (every 0.3 s here) examines each
    pinned journal entry again: a batch of 1,024 left pinned makes every later
    sweep of the module's controller take seconds."""
    for run_id in run_ids:
        ctl.admin("end-run", run_id)


def test_metrics_are_not_on_the_api_listener(metered: tuple[ControllerProcess, str]) -> None:
    ctl, _ = metered
    r = httpx.get(ctl.url + "/metrics")
    assert r.status_code == 404
    assert r.json()["code"] == "route_not_found"


def test_counters_move_with_real_traffic(metered: tuple[ControllerProcess, str]) -> None:
    ctl, url = metered
    before = scrape(url)
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    data = b"metrics " * 1000
    r = run.save("task", {"a.txt": data, "b.txt": b"second"})
    assert r.status_code == 200, r.text
    assert r.json()["byteSize"] == len(data) + len(b"second")
    refused = run.commit(
        "task", [{"op": "put", "path": "c.txt", "digest": "0" * 64, "executable": False}]
    )
    assert 400 <= refused.status_code < 500, refused.text
    refused_code = refused.json()["code"]
    with tenant.client() as c:
        for _ in range(3):
            assert c.get(tenant.folder("task", str(run.task)) + "/").status_code == 200
        assert httpx.get(ctl.url + "/readyz").status_code == 200
        put = c.put(
            tenant.folder("task", str(run.task)) + "/content",
            params={"path": "d.bin"},
            content=b"x" * 321,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert put.status_code == 201, put.text
        # An object nothing references any more: the sweeper deletes it.
        gone = c.put(
            tenant.folder("task", str(run.task)) + "/content",
            params={"path": "gone.bin"},
            content=b"purged " * 50,
            headers={"Content-Type": "application/octet-stream"},
        )
        ops = tenant.folder("task", str(run.task)) + "/operations"
        assert c.post(ops, json={"action": "delete", "path": "gone.bin"}).status_code == 200
        purge = c.post(ops, json={"action": "purge", "fileId": gone.json()["file"]["id"]})
        assert purge.status_code == 200, purge.text
    time.sleep(1.0)  # a few GC sweeps (every 0.3 s)
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    listing = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}/"
    assert moved("controller_http_requests_total", route=listing, method="GET", status="200") == 3
    assert (
        moved(
            "controller_http_request_duration_seconds_count",
            route=listing,
            method="GET",
            status="200",
        )
        == 3
    )
    assert moved("controller_http_requests_total", route="/readyz", method="GET", status="200") == 1
    assert moved("controller_checkpoint_commits_total", kind="folder", outcome="applied") == 1
    assert moved("controller_checkpoint_entries_total", kind="folder") == 2
    assert moved("controller_checkpoint_bytes_total", kind="folder") == len(data) + len(b"second")
    assert moved("controller_checkpoint_refusals_total", kind="folder", code=refused_code) == 1
    uploads = "/bridge/v1/folders/{scope}/uploads"
    assert moved("controller_upload_bytes_total", route=uploads) == len(data) + len(b"second")
    content = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}/content"
    assert moved("controller_upload_bytes_total", route=content) == 321 + len(b"purged " * 50)
    assert moved("controller_gc_sweeps_total", outcome="ok") >= 2
    # The purged object was deleted; the uploads the checkpoint references were kept.
    assert moved("controller_gc_objects_total", outcome="deleted") >= 1
    assert moved("controller_gc_objects_total", outcome="kept") >= 2
    assert moved("controller_gc_objects_total", outcome="failed") == 0
    assert moved("controller_active_runs") == 1
    tenant.controller.admin("end-run", run.run_id)
    assert value(scrape(url), "controller_active_runs") == value(before, "controller_active_runs")
    assert value(after, "controller_db_pool_max") == 20
    in_use = value(after, "controller_db_pool_connections", state="in_use")
    idle = value(after, "controller_db_pool_connections", state="idle")
    assert in_use >= 0 and in_use + idle >= 1
    # Route labels are templates: no tenant id ever becomes a label value.
    assert not any(tenant.company_id in v for (_, labels) in after for _, v in labels)


def test_batch_repository_and_attachment_uploads_are_counted(
    metered: tuple[ControllerProcess, str],
) -> None:
    """Every upload route counts its content bytes: batches (fsagent sends
    small files that way) of a folder and of a repository, single repository
    uploads, and task attachments."""
    ctl, url = metered
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    repo = repo_run(tenant)
    ws = repo.ws()
    # A full batch: its answer lists every member and is longer than 64 KiB.
    full = [f"member {i} ".encode() * (1 + i % 7) for i in range(BATCH_MAX_MEMBERS)]
    small = [b"one", b"two two", b""]
    big = os.urandom(70_000)  # over a batch member's limit: a single upload
    attachment = b"attached " * 123
    before = scrape(url)
    with run.client() as c:
        for members in (full, small):
            r = c.put("/folders/task/uploads/batch", content=encode_batch(members))
            assert r.status_code == 200, r.text
            assert len(r.json()["objects"]) == len(members)
    with repo.client() as c:
        r = c.put(f"/repos/{ws}/uploads/batch", content=encode_batch(small))
        assert r.status_code == 200, r.text
    assert repo.upload(ws, big).status_code == 200
    with tenant.client() as c:
        r = c.post(
            f"/api/companies/{tenant.company_id}/tasks/{run.task}/attachments",
            params={"name": "notes.txt"},
            content=attachment,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
    after = scrape(url)

    def moved(route: str) -> float:
        return value(after, "controller_upload_bytes_total", route=route) - value(
            before, "controller_upload_bytes_total", route=route
        )

    total = sum(map(len, small))
    assert moved("/bridge/v1/folders/{scope}/uploads/batch") == sum(map(len, full)) + total
    assert moved("/bridge/v1/repos/{workspaceId}/uploads/batch") == total
    assert moved("/bridge/v1/repos/{workspaceId}/uploads") == len(big)
    assert moved("/api/companies/{companyId}/tasks/{taskId}/attachments") == len(attachment)
    end_runs(ctl, run.run_id, repo.run_id)


def test_repository_checkpoints_are_counted(metered: tuple[ControllerProcess, str]) -> None:
    ctl, url = metered
    tenant = bootstrap_tenant(ctl)
    repo = repo_run(tenant)
    ws = repo.ws()
    tree = small_repo()
    files = [c for c in tree.values() if isinstance(c, bytes)]
    before = scrape(url)
    op = str(uuid.uuid4())
    receipt = repo.save(ws, tree, operation_id=op)
    assert receipt["byteSize"] == sum(map(len, files))
    # The same operation again (a retry after a lost answer): replayed.
    again = repo.commit(ws, members_of(tree), operation_id=op)
    assert again.status_code == 200 and again.json()["replayed"] is True, again.text
    unknown = repo.commit(
        ws, [file_member("x.txt", b"never uploaded")], base=receipt["checkpointId"]
    )
    assert unknown.status_code == 422, unknown.text
    code = unknown.json()["code"]
    # A folder checkpoint moves only the folder's series.
    folder_run = start_run(tenant)
    folder = folder_run.save("task", {"f.txt": b"folder"})
    assert folder.status_code == 200, folder.text
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    commits = "controller_checkpoint_commits_total"
    assert moved(commits, kind="repository", outcome="applied") == 1
    assert moved(commits, kind="repository", outcome="replayed") == 1
    assert moved("controller_checkpoint_entries_total", kind="repository") == receipt["entries"]
    assert receipt["entries"] == len(tree)
    assert moved("controller_checkpoint_bytes_total", kind="repository") == receipt["byteSize"]
    assert moved("controller_checkpoint_refusals_total", kind="repository", code=code) == 1
    assert moved(commits, kind="folder", outcome="applied") == 1
    assert moved("controller_checkpoint_bytes_total", kind="folder") == len(b"folder")
    assert moved(commits, kind="folder", outcome="replayed") == 0
    end_runs(ctl, repo.run_id, folder_run.run_id)


def test_answers_carry_a_request_id(metered: tuple[ControllerProcess, str]) -> None:
    ctl, _ = metered
    r = httpx.get(ctl.url + "/healthz", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    bad = httpx.get(ctl.url + "/healthz", headers={"X-Request-Id": "no spaces\tplease"})
    assert bad.headers["x-request-id"] != "no spaces\tplease"
    assert len(bad.headers["x-request-id"]) == 16


def wait_for_sample(url: str, name: str, at_least: float, timeout: float, **labels: str) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if value(samples, name, **labels) >= at_least:
            return samples
        assert time.monotonic() < deadline, f"{name}{labels} stayed below {at_least}"
        time.sleep(0.2)


def test_a_failed_gc_sweep_is_counted(pg_cluster: PgCluster) -> None:
    """A sweep whose query PostgreSQL refuses (its journal table is gone for a
    moment) counts as ``failed``; the sweeps succeed again once it is back.
    (A database outage fails a sweep too, but only after the pool's 30 s wait
    for a connection.)"""
    port = free_port()
    ctl = ControllerProcess(
        pg_cluster.create_database(),
        world_searchable_tmpdir("fsa-ctl-gcfail-"),
        extra_args=["--metrics-listen", f"127.0.0.1:{port}"],
        gc_args=["--gc-delay", "0", "--gc-interval", "0.2"],
    )
    url = f"http://127.0.0.1:{port}/metrics"
    sweeps = "controller_gc_sweeps_total"
    ctl.start()
    try:
        wait_for_sample(url, sweeps, 1, 30, outcome="ok")
        assert value(scrape(url), sweeps, outcome="failed") == 0
        with ctl.db() as db:
            db.execute("ALTER TABLE deletion_journal RENAME TO deletion_journal_away")
        try:
            during = wait_for_sample(url, sweeps, 2, 30, outcome="failed")
        finally:
            with ctl.db() as db:
                db.execute("ALTER TABLE deletion_journal_away RENAME TO deletion_journal")
        ok = value(during, sweeps, outcome="ok")
        after = wait_for_sample(url, sweeps, ok + 2, 30, outcome="ok")
        # Back to normal: no further failure once the table is back.
        failed = value(after, sweeps, outcome="failed")
        time.sleep(0.5)
        assert value(scrape(url), sweeps, outcome="failed") == failed
        assert "GC sweep failed" in ctl.log()
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


@pytest.mark.allow_warning_logs
def test_a_busy_metrics_address_stops_the_start(pg_cluster: PgCluster) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        data_dir = world_searchable_tmpdir("fsa-ctl-busy-")
        try:
            out = subprocess.run(
                [sys.executable, "-m", "controller.cli", "serve",
                 "--database-url", pg_cluster.create_database(), "--data-dir", str(data_dir),
                 "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", f"127.0.0.1:{port}"],
                capture_output=True, text=True, cwd=REPO, timeout=120,
            )  # fmt: skip
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (
        f"controller: cannot listen on --metrics-listen 127.0.0.1:{port}: Address already in use"
    )


def test_a_gc_object_that_cannot_be_deleted_is_counted_failed_then_retried(
    metered: tuple[ControllerProcess, str],
) -> None:
    """An unreferenced object whose bytes storage cannot remove (a directory
    stands at its path) counts as ``failed`` on each sweep, keeps its journal
    entry and its row; once storage can remove it, the next sweep deletes it."""
    ctl, url = metered
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    body = b"undeletable " * 40
    folder = tenant.folder("task", str(run.task))
    with tenant.client() as c:
        put = c.put(f"{folder}/content", params={"path": "stuck.bin"}, content=body,
                    headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        assert put.status_code == 201, put.text
        with ctl.db() as db:
            row = db.execute(
                "SELECT digest FROM files WHERE id = %s", (put.json()["file"]["id"],)
            ).fetchone()
            assert row is not None
            digest = str(row[0])
        path = ctl.data_dir / "objects" / object_key(tenant.company_id, digest)
        assert path.read_bytes() == body
        path.unlink()
        path.mkdir()
        (path / "blocker").write_bytes(b"")
        before = scrape(url)
        ops = f"{folder}/operations"
        assert c.post(ops, json={"action": "delete", "path": "stuck.bin"}).status_code == 200
        purge = c.post(ops, json={"action": "purge", "fileId": put.json()["file"]["id"]})
        assert purge.status_code == 200, purge.text
    failed = "controller_gc_objects_total"
    try:
        # Sweeps come every 0.3 s, but a busy machine can hold the controller
        # off for many seconds at a time: the deadline is for a loaded CI host.
        wait_for_sample(url, failed, value(before, failed, outcome="failed") + 2, GC_DEADLINE,
                        outcome="failed")  # fmt: skip
        with ctl.db() as db:
            rows = db.execute(
                "SELECT done_at, outcome FROM deletion_journal"
                " WHERE company_id = %s AND digest = %s", (tenant.company_id, digest),
            ).fetchall()  # fmt: skip
            assert rows and all(done_at is None for done_at, _ in rows), rows
            kept = db.execute(
                "SELECT 1 FROM objects WHERE company_id = %s AND digest = %s",
                (tenant.company_id, digest),
            ).fetchone()
            assert kept is not None
        assert f"GC of {tenant.company_id}/{digest} failed; will retry" in ctl.log()
    finally:
        shutil.rmtree(path)
        path.write_bytes(body)
    # The sweep removes the bytes first and settles the journal when its
    # transaction commits, so the wait is for the journal, then the bytes.
    deadline = time.monotonic() + GC_DEADLINE
    while True:
        with ctl.db() as db:
            outcomes = db.execute(
                "SELECT outcome FROM deletion_journal WHERE company_id = %s AND digest = %s",
                (tenant.company_id, digest),
            ).fetchall()  # fmt: skip
        if outcomes and all(o == "deleted" for (o,) in outcomes):
            break
        assert time.monotonic() < deadline, f"the retried sweep did not settle: {outcomes}"
        time.sleep(0.2)
    assert not path.exists()
    tenant.controller.admin("end-run", run.run_id)
