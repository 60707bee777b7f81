"""Controller-side quotas: entries per folder, rows per checkpoint, pending upload
bytes, company storage, statement timeout and each token's share of the pool."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time
import uuid
from collections.abc import Iterator

import pytest

from common.bridge import encode_batch
from tests.support.bridge import start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    running_controller,
    world_searchable_tmpdir,
)

OCTET = {"Content-Type": "application/octet-stream"}
MAX_ENTRIES = 5
MAX_ROWS = 50
PENDING_BYTES = 10_000
UPLOAD_TTL = 5
COMPANY_BYTES = 20_000
POOL, SHARE = 6, 2


@pytest.fixture(scope="module")
def quota_ctl(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    tmp = world_searchable_tmpdir("fsa-quota-")
    args = {
        "--max-folder-entries": MAX_ENTRIES,
        "--max-checkpoint-rows": MAX_ROWS,
        "--max-pending-upload-bytes": PENDING_BYTES,
        "--pending-upload-ttl": UPLOAD_TTL,
        "--company-storage-bytes": COMPANY_BYTES,
        "--pool-size": POOL,
        "--pool-share": SHARE,
        # The run's writes below go through the API bridge, all at once.
        "--bridge-max-concurrent": 3 * POOL,
    }
    try:
        with running_controller(
            pg_cluster, tmp, *[str(x) for kv in args.items() for x in kv]
        ) as ctl:
            yield ctl
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def qt(quota_ctl: ControllerProcess) -> Tenant:
    return bootstrap_tenant(quota_ctl)


def folder_rows(t: Tenant, folder_path: str) -> int:
    scope, owner = folder_path.rsplit("/", 2)[-2:]
    with t.controller.db() as db:
        row = db.execute(
            "SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
            " WHERE d.company_id = %s AND d.scope = %s AND d.owner_id = %s",
            (t.company_id, scope, owner),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_folder_entry_limit_on_uploads_and_checkpoints(qt: Tenant) -> None:
    with qt.client() as c:
        for i in range(MAX_ENTRIES):
            r = c.put(f"{qt.my_folder}/content?path=f{i}", content=b"x", headers=OCTET)
            assert r.status_code == 201, r.text
        r = c.put(f"{qt.my_folder}/content?path=one-more", content=b"x", headers=OCTET)
        assert r.status_code == 413 and r.json()["code"] == "folder_entry_limit"
        r = c.post(f"{qt.my_folder}/operations", json={"action": "mkdir", "path": "d"})
        assert r.status_code == 413 and r.json()["code"] == "folder_entry_limit"
        # Replacing a file does not grow the folder's live entries (the old
        # content waits in the trash, which the limit does not count).
        assert (
            c.put(f"{qt.my_folder}/content?path=f0", content=b"y", headers=OCTET).status_code == 200
        )
        trash = c.get(f"{qt.my_folder}/", params={"trash": "true"}).json()["entries"]
        assert [e["path"] for e in trash] == ["f0"]
    assert folder_rows(qt, qt.my_folder) == MAX_ENTRIES + 1

    run = start_run(qt)
    entries = [{"op": "mkdir", "path": f"d{i}"} for i in range(MAX_ENTRIES + 1)]
    r = run.commit("task", entries)
    assert r.status_code == 413 and r.json()["code"] == "folder_entry_limit"
    assert run.task is not None
    assert folder_rows(qt, qt.folder("task", run.task)) == 0
    assert run.commit("task", entries[:MAX_ENTRIES]).status_code == 200


def test_checkpoint_row_limit_counts_parent_directories(qt: Tenant) -> None:
    run = start_run(qt)
    deep = "/".join(["d"] * MAX_ROWS + ["leaf"])
    r = run.commit("task", [{"op": "mkdir", "path": deep}])
    assert r.status_code == 413, r.text
    assert r.json()["code"] == "checkpoint_row_limit"
    # Two chains that share nothing add up.
    half = MAX_ROWS // 2 + 1
    chains = [{"op": "mkdir", "path": "/".join([c] * half)} for c in "ab"]
    r = run.commit("task", chains)
    assert r.status_code == 413 and r.json()["code"] == "checkpoint_row_limit"
    # An agent folder's checkpoint may create twice its entry limit in rows
    # (its save is one checkpoint, whole or refused): the folder's own entry
    # limit is what refuses this one.
    r = run.commit("agent", [{"op": "mkdir", "path": deep}])
    assert r.status_code == 413 and r.json()["code"] == "folder_entry_limit", r.text
    with qt.controller.db() as db:
        row = db.execute(
            "SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
            " WHERE d.company_id = %s AND f.path <> 'AGENTS.md'",  # the new agent's entry
            (qt.company_id,),
        ).fetchone()
    assert row == (0,)


def test_pending_upload_bytes_per_run(qt: Tenant) -> None:
    run = start_run(qt)
    first, second = os.urandom(6000), os.urandom(6000)
    up = run.upload("task", first)
    assert up.status_code == 200, up.text
    refused = run.upload("task", second)
    assert refused.status_code == 429, refused.text
    assert refused.json()["code"] == "upload_quota_exceeded"
    put = {"op": "put", "path": "a.bin", "digest": up.json()["digest"], "executable": False}
    assert run.commit("task", [put]).status_code == 200
    # Committed bytes no longer count against the run.
    assert run.upload("task", second).status_code == 200


def test_uncommitted_uploads_expire(qt: Tenant) -> None:
    run = start_run(qt)
    expired = os.urandom(3000)
    up = run.upload("task", expired)
    assert up.status_code == 200
    time.sleep(UPLOAD_TTL + 0.5)
    # The expired upload stops counting, and may no longer be committed.
    assert run.upload("task", os.urandom(6000)).status_code == 200
    put = {"op": "put", "path": "late.bin", "digest": up.json()["digest"], "executable": False}
    r = run.commit("task", [put])
    assert r.status_code == 422 and r.json()["code"] == "unknown_content"
    # Uploading it again renews it.
    assert run.upload("task", expired).status_code == 200
    assert run.commit("task", [put]).status_code == 200


def test_company_storage_quota(qt: Tenant) -> None:
    big = os.urandom(COMPANY_BYTES - 5000)
    with qt.client() as c:
        assert (
            c.put(f"{qt.my_folder}/content?path=big", content=big, headers=OCTET).status_code == 201
        )
        r = c.put(f"{qt.my_folder}/content?path=more", content=os.urandom(6000), headers=OCTET)
        assert r.status_code == 413 and r.json()["code"] == "storage_quota_exceeded"
        # Bytes the company already stores cost nothing again.
        assert (
            c.put(f"{qt.my_folder}/content?path=copy", content=big, headers=OCTET).status_code
            == 201
        )
    run = start_run(qt)
    r = run.upload("task", os.urandom(6000))
    assert r.status_code == 413 and r.json()["code"] == "storage_quota_exceeded"


def test_one_run_saturating_its_share_leaves_others_fast(qt: Tenant) -> None:
    run = start_run(qt)
    assert run.task is not None
    folder = qt.folder("task", run.task)
    other = bootstrap_tenant(qt.controller)
    with other.client() as c:
        assert (
            c.put(f"{other.my_folder}/content?path=x", content=b"x", headers=OCTET).status_code
            == 201
        )
    with run.api_client() as c:
        assert c.put(f"{folder}/content?path=p", content=b"0", headers=OCTET).status_code == 201
    with qt.controller.db() as db:
        row = db.execute(
            "SELECT id FROM folders WHERE company_id = %s AND scope = 'task'", (qt.company_id,)
        ).fetchone()
        assert row is not None
        folder_id = int(row[0])
        # Every write of the run to this folder now waits inside its transaction.
        db.execute("SELECT pg_advisory_lock(%s)", (folder_id,))

        def write(i: int) -> int:
            with run.api_client() as c:
                r = c.put(f"{folder}/content?path=p", content=str(i).encode(), headers=OCTET)
                return r.status_code

        with concurrent.futures.ThreadPoolExecutor(3 * POOL) as pool:
            try:
                writes = [pool.submit(write, i) for i in range(3 * POOL)]
                deadline = time.monotonic() + 20
                while qt.folder_lock_waiters(folder_id) < SHARE:
                    assert time.monotonic() < deadline, "the run's writes never reached the lock"
                    time.sleep(0.1)
                time.sleep(1.0)
                assert qt.folder_lock_waiters(folder_id) == SHARE
                started = time.monotonic()
                with other.client() as c:
                    listing = c.get(other.my_folder + "/")
                elapsed = time.monotonic() - started
                print(f"\nlisting while another run holds its pool share: {elapsed * 1000:.0f} ms")
                assert listing.status_code == 200, listing.text
                assert [e["path"] for e in listing.json()["entries"]] == ["x"]
                assert elapsed < 2.0, f"another company's listing took {elapsed:.1f}s"
            finally:
                db.execute("SELECT pg_advisory_unlock(%s)", (folder_id,))
            assert sorted({w.result(60) for w in writes}) == [200]


def test_statement_timeout_bounds_a_lock_wait(pg_cluster: PgCluster) -> None:
    tmp = world_searchable_tmpdir("fsa-stmt-")
    try:
        with running_controller(pg_cluster, tmp, "--statement-timeout", "1") as ctl:
            t = bootstrap_tenant(ctl)
            with t.client() as c:
                assert (
                    c.put(f"{t.my_folder}/content?path=a", content=b"a", headers=OCTET).status_code
                    == 201
                )
            with ctl.db() as db:
                row = db.execute(
                    "SELECT id FROM folders WHERE company_id = %s", (t.company_id,)
                ).fetchone()
                assert row is not None
                db.execute("SELECT pg_advisory_lock(%s)", (row[0],))
                started = time.monotonic()
                with t.client() as c:
                    r = c.put(f"{t.my_folder}/content?path=b", content=b"b", headers=OCTET)
                elapsed = time.monotonic() - started
                db.execute("SELECT pg_advisory_unlock(%s)", (row[0],))
            assert r.status_code == 503 and r.json()["code"] == "database_unavailable"
            assert elapsed < 10
            assert folder_rows(t, t.my_folder) == 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_over_limit_folder_can_still_delete_and_overwrite(qt: Tenant) -> None:
    """A folder past the limit (say the limit was lowered) shrinks and changes
    freely; only a write that adds entries is refused, and a refused
    checkpoint publishes nothing: no rows, no receipt, no claimed upload."""
    run = start_run(qt)
    assert run.task is not None
    folder = qt.folder("task", run.task)
    up = run.upload("task", b"content")
    digest = up.json()["digest"]
    entries = [{"op": "put", "path": f"f{i}", "digest": digest, "executable": False}
               for i in range(MAX_ENTRIES)]  # fmt: skip
    assert run.commit("task", entries).status_code == 200
    with qt.controller.db() as db:
        row = db.execute(
            "SELECT id FROM folders WHERE company_id = %s AND scope = 'task'", (qt.company_id,)
        ).fetchone()
        assert row is not None
        fid = row[0]
        # Three more entries than the limit, as a folder that grew before it was lowered.
        db.execute(
            "INSERT INTO files (id, folder_id, path, parent, kind, digest, byte_size, version)"
            " SELECT gen_random_uuid(), %s, 'extra' || i, '', 'file', %s, 7, 100 + i"
            " FROM generate_series(1, 3) AS i",
            (fid, digest),
        )
        db.execute(
            "UPDATE folders SET live_entries = live_entries + 3, version_counter = 103"
            " WHERE id = %s",
            (fid,),
        )

    def counted() -> tuple[int, int]:
        with qt.controller.db() as db:
            r = db.execute(
                "SELECT live_entries, (SELECT count(*) FROM files"
                "  WHERE folder_id = %s AND deleted_at IS NULL) FROM folders WHERE id = %s",
                (fid, fid),
            ).fetchone()
        assert r is not None
        return int(r[0]), int(r[1])

    assert counted() == (MAX_ENTRIES + 3, MAX_ENTRIES + 3)
    with qt.client() as c:
        r = c.put(f"{folder}/content?path=f0", content=b"new", headers=OCTET)
        assert r.status_code == 200, r.text
        r = c.post(f"{folder}/operations", json={"action": "delete", "path": "extra1"})
        assert r.status_code == 200, r.text
        restored = c.post(
            f"{folder}/operations", json={"action": "restore", "fileId": r.json()["files"][0]["id"]}
        )
        assert restored.status_code == 413 and restored.json()["code"] == "folder_entry_limit"
        r = c.put(f"{folder}/content?path=new", content=b"x", headers=OCTET)
        assert r.status_code == 413 and r.json()["code"] == "folder_entry_limit"
    assert counted() == (MAX_ENTRIES + 2, MAX_ENTRIES + 2)
    # A checkpoint that removes more than it adds is accepted ...
    shrink = [
        {"op": "delete", "path": "extra2"},
        {"op": "delete", "path": "extra3"},
        {"op": "put", "path": "f1", "digest": digest, "executable": True},
        {"op": "put", "path": "g", "digest": digest, "executable": False},
    ]
    assert run.commit("task", shrink).status_code == 200
    assert counted() == (MAX_ENTRIES + 1, MAX_ENTRIES + 1)
    # ... one that grows the folder is refused after its rows were written.
    fresh = run.upload("task", b"fresh bytes")
    assert fresh.status_code == 200
    grow = [{"op": "put", "path": "h", "digest": fresh.json()["digest"], "executable": False}]
    op = str(uuid.uuid4())
    r = run.commit("task", grow, operationId=op)
    assert r.status_code == 413 and r.json()["code"] == "folder_entry_limit"
    assert counted() == (MAX_ENTRIES + 1, MAX_ENTRIES + 1)
    assert qt.file_rows("h", live=False) == 0
    with qt.controller.db() as db:
        assert db.execute(
            "SELECT count(*) FROM receipts WHERE folder_id = %s AND operation_id = %s", (fid, op)
        ).fetchone() == (0,)
        assert db.execute(
            "SELECT committed_at IS NULL FROM run_uploads WHERE run_id = %s AND digest = %s",
            (run.run_id, fresh.json()["digest"]),
        ).fetchone() == (True,)


def test_company_storage_quota_counts_a_whole_batch(qt: Tenant) -> None:
    """Each member fits the company's quota on its own; together they do not,
    and the batch is refused as a whole (its bytes are never registered)."""
    with qt.client() as c:
        r = c.put(f"{qt.my_folder}/content?path=base", content=os.urandom(12_000), headers=OCTET)
        assert r.status_code == 201, r.text
    members = [os.urandom(4500) for _ in range(2)]
    run = start_run(qt)
    with run.client() as c:
        r = c.put("/folders/task/uploads/batch", content=encode_batch(members))
        assert r.status_code == 413 and r.json()["code"] == "storage_quota_exceeded", r.text
        with qt.controller.db() as db:
            row = db.execute(
                "SELECT count(*) FROM objects WHERE company_id = %s", (qt.company_id,)
            ).fetchone()
            assert row == (1,)
        r = c.put("/folders/task/uploads/batch", content=encode_batch(members[:1]))
        assert r.status_code == 200, r.text
