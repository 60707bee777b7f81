"""The API bridge's resource limits on a real controller started with small ones:
body size (413), response size (502), time (504) and calls in flight per run
(429 with Retry-After), each refused call changing nothing; and the operator's
allowlist (``--bridge-allow``, ``--bridge-allow-file``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controller.api.apibridge import WORK_FOLDER
from controller.cli import main as controller_main
from tests.support.bridge import Run, api_client, start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)
from tests.support.repos import repo_run, small_repo

OCTET = {"Content-Type": "application/octet-stream"}
MAX_BODY, MAX_RESPONSE, TIMEOUT, CONCURRENT = 1024, 2048, 3, 2


ARCHIVE = "/api/companies/{companyId}/tasks/{taskId}/repos/{workspaceId}/archive"
"""A route that streams its answer with no Content-Length (a tar of a checkout)."""
TIGHT = [
    *("--bridge-max-body", str(MAX_BODY), "--bridge-max-response", str(MAX_RESPONSE)),
    *("--bridge-timeout", str(TIMEOUT), "--bridge-max-concurrent", str(CONCURRENT)),
    # The operator lets runs download their task's repositories too.
    *("--bridge-allow", "default", "--bridge-allow", f"GET:{ARCHIVE}"),
]


@pytest.fixture(scope="module")
def tight(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    with private_controller(pg_cluster, "fsa-bridge-limits-", *TIGHT) as ctl:
        yield ctl


@pytest.fixture
def lt(tight: ControllerProcess) -> Tenant:
    return bootstrap_tenant(tight)


def folder_of(t: Tenant, run: Run) -> str:
    assert run.task is not None
    return t.folder("task", run.task)


def test_bodies_over_the_limit_are_413_but_uploads_keep_the_file_limit(lt: Tenant) -> None:
    run = start_run(lt)
    folder = folder_of(lt, run)
    big = {"action": "mkdir", "path": "d" * 200 + "/" + "e" * (MAX_BODY)}
    with run.api_client() as c:
        r = c.post(f"{folder}/operations", json=big)
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
        # Without a Content-Length the count is kept while the body arrives.
        chunks = iter([b'{"action": "mkdir", "path": "', b"x" * MAX_BODY, b'"}'])
        r = c.post(
            f"{folder}/operations",
            content=chunks,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
        data = bytes(range(256)) * 16
        r = c.put(f"{folder}/content", params={"path": "big.bin"}, content=data, headers=OCTET)
        assert r.status_code == 201, r.text
        # ... and downloads keep it too.
        got = c.get(f"{folder}/content", params={"path": "big.bin"})
        assert got.status_code == 200 and got.content == data
    assert lt.file_rows("x" * MAX_BODY, live=False) == 0
    with lt.client() as owner:
        assert [e["path"] for e in owner.get(folder + "/").json()["entries"]] == ["big.bin"]


def test_an_answer_over_the_response_limit_is_502(lt: Tenant) -> None:
    run = start_run(lt)
    folder = folder_of(lt, run)
    with run.api_client() as c:
        for i in range(12):
            assert c.put(f"{folder}/content?path=f{i:02}", content=b"x", headers=OCTET).is_success
        r = c.get(folder + "/")
        assert r.status_code == 502, r.text
        assert r.json()["code"] == "bridge_response_too_large"
        small = c.get(folder + "/", params={"limit": 1})
        assert small.status_code == 200 and len(small.json()["entries"]) == 1


def test_an_answer_without_length_is_cut_at_the_response_limit(lt: Tenant) -> None:
    """A streamed answer (no Content-Length) cannot be refused before it
    starts: the bridge cuts the connection once it passes the limit, so the
    client never takes it for a complete answer, and the controller serves on."""
    run = repo_run(lt)
    ws = run.ws()
    run.save(ws, {**small_repo(), "data/big.bin": os.urandom(8 * MAX_RESPONSE)})
    archive = f"/api/companies/{lt.company_id}/tasks/{run.task}/repos/{ws}/archive"
    with lt.client() as owner:
        whole = owner.get(archive)
    assert whole.status_code == 200 and "content-length" not in whole.headers
    assert len(whole.content) > 8 * MAX_RESPONSE
    got = bytearray()
    with api_client(lt, run.token) as c:
        with pytest.raises(httpx.RemoteProtocolError), c.stream("GET", archive) as r:
            assert r.status_code == 200 and "content-length" not in r.headers
            for chunk in r.iter_raw():
                got += chunk
        assert len(got) <= MAX_RESPONSE and whole.content.startswith(bytes(got))
        assert c.get(f"/api/companies/{lt.company_id}/directory").status_code == 200
    with lt.controller.db() as db:
        row = db.execute(
            "SELECT route, response_bytes FROM bridge_audit WHERE run_id = %s"
            " AND method = 'GET' AND route = %s",
            (run.run_id, ARCHIVE),
        ).fetchone()
    assert row is not None and int(row[1]) > MAX_RESPONSE, row
    log = lt.controller.log()
    assert f"answer to run {run.run_id}'s GET {ARCHIVE} cut after" in log
    assert "Traceback" not in log


def _folder_id(t: Tenant) -> int:
    with t.controller.db() as db:
        row = db.execute(
            "SELECT id FROM folders WHERE company_id = %s AND scope = 'task'", (t.company_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_slow_calls_are_504_and_one_too_many_is_429(lt: Tenant) -> None:
    run = start_run(lt)
    folder = folder_of(lt, run)
    with run.api_client() as c:
        assert c.put(f"{folder}/content?path=seed", content=b"s", headers=OCTET).is_success
    folder_id = _folder_id(lt)

    def write(i: int) -> httpx.Response:
        with run.api_client() as c:
            return c.put(f"{folder}/content?path=slow{i}", content=b"w", headers=OCTET)

    with lt.controller.db() as db, concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        # Every write to the folder now waits inside its transaction.
        db.execute("SELECT pg_advisory_lock(%s)", (folder_id,))
        try:
            slow = [pool.submit(write, i) for i in range(CONCURRENT)]
            deadline = time.monotonic() + TIMEOUT
            while lt.folder_lock_waiters(folder_id) < CONCURRENT:
                assert time.monotonic() < deadline, "the writes never reached the folder lock"
                time.sleep(0.05)
            with run.api_client() as c:
                # A write, refused before it reaches the folder: it changes nothing.
                busy = c.put(f"{folder}/content?path=busy", content=b"b", headers=OCTET)
            assert busy.status_code == 429, busy.text
            assert busy.json()["code"] == "too_many_requests"
            assert busy.headers["Retry-After"] == "1"
            answers = [f.result(TIMEOUT + 30) for f in slow]
        finally:
            db.execute("SELECT pg_advisory_unlock(%s)", (folder_id,))
    for r in answers:
        assert r.status_code == 504, r.text
        assert r.json()["code"] == "bridge_timeout"
    assert lt.file_rows("slow0", live=False) == 0 and lt.file_rows("slow1", live=False) == 0
    assert lt.file_rows("busy", live=False) == 0
    # The run's slots and the database connections are free again.
    with run.api_client() as c:
        assert c.put(f"{folder}/content?path=after", content=b"a", headers=OCTET).is_success
        statuses = [c.get(folder + "/", params={"limit": 1}).status_code for _ in range(3)]
    assert statuses == [200, 200, 200]
    with lt.controller.db() as db:
        rows = db.execute(
            "SELECT status FROM bridge_audit WHERE run_id = %s ORDER BY id", (run.run_id,)
        ).fetchall()
    assert sorted(r[0] for r in rows).count(504) == CONCURRENT
    assert [r[0] for r in rows].count(429) == 1
    assert "Traceback" not in lt.controller.log()


def test_a_download_streams_at_its_readers_pace_past_the_timeout(lt: Tenant) -> None:
    run = start_run(lt)
    folder = folder_of(lt, run)
    data = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than the socket buffers hold
    with run.api_client() as c:
        r = c.put(f"{folder}/content?path=big", content=data, headers=OCTET)
        assert r.status_code == 201, r.text
        started, got = time.monotonic(), bytearray()
        with c.stream("GET", f"{folder}/content?path=big") as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_bytes(1024 * 1024):
                got += chunk
                time.sleep(0.5)
    assert time.monotonic() - started > TIMEOUT
    assert bytes(got) == data


# --- operator configuration ----------------------------------------------------


def test_serve_refuses_an_allowlist_entry_that_names_no_route(tmp_path: Path) -> None:
    def serve(*args: str) -> tuple[int, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = controller_main(["serve", "--data-dir", str(tmp_path / "data"), *args])
        return code, err.getvalue()

    for args, message in (
        (("--bridge-allow", "GET:/api/nowhere"), "no API route GET /api/nowhere"),
        (("--bridge-allow", f"DELETE:{WORK_FOLDER}/content"), "no API route DELETE"),
        (("--bridge-allow", "GET /api/x"), "METHOD:/TEMPLATE"),
        (("--bridge-allow", "GET:/files/api/session"), "no API route"),
        (("--bridge-allow-file", str(tmp_path / "missing")), "--bridge-allow-file"),
    ):
        code, err = serve(*args)
        assert code == 1, (args, err)
        assert message in err and err.count("\n") == 1, (args, err)
    # Nothing was started: no data dir, no cluster.
    assert not (tmp_path / "data").exists()


def test_an_operator_allowlist_replaces_the_default(pg_cluster: PgCluster, tmp_path: Path) -> None:
    allow = tmp_path / "allow"
    allow.write_text(f"# listing only\nGET:{WORK_FOLDER}/  # trailing comment\n\n")
    flags = ["--bridge-allow", "GET:/api/companies/{companyId}/directory"]
    with private_controller(
        pg_cluster, "fsa-bridge-allow-", *flags, "--bridge-allow-file", str(allow)
    ) as ctl:
        t = bootstrap_tenant(ctl)
        run = start_run(t)
        folder = folder_of(t, run)
        with t.client() as owner:
            assert owner.put(f"{folder}/content?path=a", content=b"a", headers=OCTET).is_success
        with run.api_client() as c:
            assert c.get(f"/api/companies/{t.company_id}/directory").status_code == 200
            assert [e["path"] for e in c.get(folder + "/").json()["entries"]] == ["a"]
            for r in (
                c.get(folder),  # the template without the slash is not listed
                c.get(f"{folder}/content?path=a"),
                c.put(f"{folder}/content?path=b", content=b"b", headers=OCTET),
            ):
                assert r.status_code == 403 and r.json()["code"] == "bridge_route_denied"
        assert t.file_rows("b", live=False) == 0
