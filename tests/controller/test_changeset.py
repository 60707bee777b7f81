"""A checkpoint as one change set: many entries in one commit, contiguous
versions in entry order, the one-by-one semantics of kind conflicts and
trash, idempotent replays, nothing published on a refusal, and the folder's
live-entry counter equal to its rows after every kind of write."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tests.support.bridge import Run, start_run
from tests.support.checkpoints import folder_id
from tests.support.controller import Tenant

OCTET = {"Content-Type": "application/octet-stream"}


def put(path: str, digest: str, executable: bool = False) -> dict[str, Any]:
    return {"op": "put", "path": path, "digest": digest, "executable": executable}


def task_folder_id(run: Run) -> int:
    assert run.task is not None
    fid = folder_id(run.tenant.controller, run.tenant.company_id, "task", run.task)
    assert fid is not None
    return fid


def live_rows(t: Tenant, fid: int) -> dict[str, dict[str, Any]]:
    with t.controller.db() as db:
        rows = db.execute(
            "SELECT path, kind, digest, version, id FROM files"
            " WHERE folder_id = %s AND deleted_at IS NULL",
            (fid,),
        ).fetchall()
    return {r[0]: {"kind": r[1], "digest": r[2], "version": int(r[3]), "id": r[4]} for r in rows}


def trash_rows(t: Tenant, fid: int) -> dict[str, Any]:
    """Trashed path -> its trash root's id."""
    with t.controller.db() as db:
        rows = db.execute(
            "SELECT path, trash_root FROM files WHERE folder_id = %s AND deleted_at IS NOT NULL",
            (fid,),
        ).fetchall()
    return {r[0]: r[1] for r in rows}


def counters(t: Tenant, fid: int) -> tuple[int, int, int]:
    """(live_entries, live rows counted, version_counter)."""
    with t.controller.db() as db:
        row = db.execute(
            "SELECT d.live_entries, (SELECT count(*) FROM files f"
            "  WHERE f.folder_id = d.id AND f.deleted_at IS NULL), d.version_counter"
            " FROM folders d WHERE d.id = %s",
            (fid,),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_large_checkpoint_commits_once_with_contiguous_versions(tenant: Tenant) -> None:
    run = start_run(tenant)
    up = run.upload("task", b"one object for every file\n")
    assert up.status_code == 200, up.text
    digest = up.json()["digest"]
    paths = [f"d{d:03}/f{f:03}.txt" for d in range(200) for f in range(100)]
    entries = [put(p, digest) for p in paths]
    body_id = str(uuid.uuid4())
    started = time.monotonic()
    r = run.commit("task", entries, operationId=body_id)
    elapsed = time.monotonic() - started
    print(f"\n20,000-entry checkpoint committed in {elapsed * 1000:.0f} ms")
    assert r.status_code == 200, r.text
    receipt = r.json()
    fid = task_folder_id(run)
    rows = live_rows(tenant, fid)
    assert len(rows) == 20_200  # 20,000 files and their 200 directories
    versions = sorted(v["version"] for v in rows.values())
    assert versions == list(range(1, 20_201)), "versions are not contiguous"
    assert receipt["highWater"] == 20_200
    # Entry order: each directory before its first file, the files as sent.
    file_versions = [rows[p]["version"] for p in paths]
    assert file_versions == sorted(file_versions)
    for p in paths[::997]:
        assert rows[p.split("/")[0]]["version"] < rows[p]["version"]
    assert counters(tenant, fid) == (20_200, 20_200, 20_200)
    with tenant.controller.db() as db:
        n = db.execute("SELECT count(*) FROM receipts WHERE folder_id = %s", (fid,)).fetchone()
    assert n == (1,)

    # The replay answers the original receipt and changes nothing.
    again = run.commit("task", entries, operationId=body_id)
    assert again.status_code == 200 and again.json() == {**receipt, "replayed": True}
    assert live_rows(tenant, fid) == rows
    assert counters(tenant, fid) == (20_200, 20_200, 20_200)


def test_kind_conflicts_and_trash_as_entry_by_entry(tenant: Tenant) -> None:
    run = start_run(tenant)
    a = run.upload("task", b"a").json()["digest"]
    b = run.upload("task", b"b").json()["digest"]
    seed = [
        {"op": "mkdir", "path": "dir"},
        put("dir/x", a),
        put("dir/sub/y", a),
        put("file", a),
        put("keep", a),
    ]
    assert run.commit("task", seed).status_code == 200
    fid = task_folder_id(run)
    before = live_rows(tenant, fid)
    r = run.commit(
        "task",
        [
            put("dir", b),  # a file over a directory: the subtree goes to trash
            {"op": "mkdir", "path": "file/inner"},  # a file in the way of a parent
            put("tmp/t", a),
            {"op": "delete", "path": "tmp"},  # created and trashed in one checkpoint
            put("keep", b),
            put("keep", a),  # the last put wins
            {"op": "delete", "path": "missing"},  # nothing there: nothing happens
            {"op": "mkdir", "path": "file"},  # already a directory by now
        ],
    )
    assert r.status_code == 200, r.text
    after = live_rows(tenant, fid)
    assert {p: (v["kind"], v["digest"]) for p, v in after.items()} == {
        "dir": ("file", b),
        "file": ("directory", None),
        "file/inner": ("directory", None),
        "keep": ("file", a),
    }
    trash = trash_rows(tenant, fid)
    assert trash == {
        "dir": before["dir"]["id"],
        "dir/x": before["dir"]["id"],
        "dir/sub": before["dir"]["id"],
        "dir/sub/y": before["dir"]["id"],
        "file": before["file"]["id"],
        "tmp": trash["tmp"],
        "tmp/t": trash["tmp"],
    }
    # Seven rows changed (dir's subtree of 4 and the new dir file count once
    # each, "keep" once, and so on): contiguous versions after the seed's.
    with tenant.controller.db() as db:
        got = sorted(
            int(v[0])
            for v in db.execute(
                "SELECT version FROM files WHERE folder_id = %s AND version > 6", (fid,)
            ).fetchall()
        )
    assert got == list(range(7, 7 + len(got)))
    assert r.json()["highWater"] == 6 + len(got)
    live, counted, _ = counters(tenant, fid)
    assert live == counted == 4


def test_entry_counter_follows_every_kind_of_write(tenant: Tenant) -> None:
    run = start_run(tenant)
    assert run.task is not None
    folder = tenant.folder("task", run.task)
    digest = run.upload("task", b"c").json()["digest"]
    with tenant.client() as c:
        assert c.put(f"{folder}/content?path=a/b/c.txt", content=b"1", headers=OCTET).is_success
        assert c.put(f"{folder}/content?path=a/b/c.txt", content=b"2", headers=OCTET).is_success
        assert c.post(f"{folder}/operations", json={"action": "mkdir", "path": "m/n"}).is_success
        deleted = c.post(f"{folder}/operations", json={"action": "delete", "path": "a"})
        assert deleted.is_success
        top = deleted.json()["files"][0]["id"]
        restored = c.post(f"{folder}/operations", json={"action": "restore", "fileId": top})
        assert restored.is_success, restored.text
        gone = c.post(f"{folder}/operations", json={"action": "delete", "path": "m"}).json()
        purged = c.post(
            f"{folder}/operations", json={"action": "purge", "fileId": gone["files"][0]["id"]}
        )
        assert purged.is_success, purged.text
    fid = task_folder_id(run)
    live, counted, _ = counters(tenant, fid)
    assert live == counted == 3
    entries = [put("a", digest), put("x/y/z", digest), {"op": "delete", "path": "x/y"}]
    op = str(uuid.uuid4())
    assert run.commit("task", entries, operationId=op).status_code == 200
    assert run.commit("task", entries, operationId=op).json()["replayed"] is True
    live, counted, _ = counters(tenant, fid)
    assert live == counted == 2  # "a" is a file now, "x" stays
