"""A write to a large folder reads what it touches, and a page of a read
what it answers, not the folder.

Every write looks up the rows at its path and the path's parents (a PUT,
a delete, a move, a restore, a checkpoint) or the subtree below one path
(a delete or a move of a directory), under the folder's lock. Both partial
indexes on ``files`` start with the folder, and a lookup that pins only the
folder lets the planner walk the whole folder on either: a folder of a few
thousand files then made each PUT read thousands of buffers, and the
folder's writes (serialized by its lock) slowed as it grew. Statistics
decide which plan is taken, so the folder here is 20,000 rows in a table
PostgreSQL has never analyzed (a new deployment's first minutes, or any
bulk load), and then the same again once it has. The reads (a page of the
listing, of a directory or of the trash, a directory's changes, a page of
the manifest) answer 50 entries or fewer each, and must read no more than
a write: before the first ``ANALYZE`` the planner took nearly every row
for trash and few for a folder, and a page of the trash read the whole
table while a page of the listing sorted the whole folder.

PostgreSQL itself reports what each statement read: ``auto_explain``, on the
controller's own database, logs every plan with its buffer counts, and each
statement that reads ``files`` must stay within :data:`MAX_BUFFERS`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.bridge import Run, start_run
from tests.support.checkpoints import folder_id
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    world_searchable_tmpdir,
)

DIRS, FILES_EACH = 100, 200
"""The seeded folder: ``big/dNN/fNNN.bin``, 20,000 files in 100 directories."""
OCTET = {"Content-Type": "application/octet-stream"}
MAX_BUFFERS = 120
"""Buffers one statement may read (hit or read) in the 20,000-row folder. An
exact lookup reads a few index and heap pages per path; a walk of the
folder's rows reads thousands."""
PLAN = re.compile(rb"LOG:  duration: [0-9.]+ ms  plan:\n((?:\t.*\n?)+)")


class PlanLog:
    """The plans ``auto_explain`` logged for one database, between two points."""

    def __init__(self, cluster: PgCluster, url: str) -> None:
        self.cluster = cluster
        cluster.configure_database(
            url,
            {
                "session_preload_libraries": "auto_explain",
                "auto_explain.log_min_duration": "0",
                "auto_explain.log_analyze": "on",
                "auto_explain.log_buffers": "on",
                "auto_explain.log_timing": "off",
                "auto_explain.log_format": "json",
            },
        )
        self.start = 0

    def mark(self) -> None:
        self.start = self.cluster.pg.logfile.stat().st_size

    def plans(self) -> list[dict[str, Any]]:
        text = self.cluster.log_since(self.start)
        found = []
        for m in PLAN.finditer(text):
            body = b"\n".join(line[1:] for line in m.group(1).splitlines())
            found.append(json.loads(body))
        return found


def buffers(plan: dict[str, Any]) -> int:
    """Buffers the statement read: the top node's counts include its children's."""
    top = plan["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def reads_files(plan: dict[str, Any]) -> bool:
    return re.search(r"\bfiles\b", plan["Query Text"]) is not None


@pytest.fixture(scope="module")
def explained(pg_cluster: PgCluster) -> Iterator[tuple[ControllerProcess, PlanLog]]:
    """A controller on a database of its own whose plans are logged, with the
    ``files`` table kept from autovacuum's ANALYZE (the test decides when)."""
    url = pg_cluster.create_database()
    plans = PlanLog(pg_cluster, url)
    ctl = ControllerProcess(url, world_searchable_tmpdir("fsa-plans-"))
    ctl.start()
    try:
        with ctl.db() as db:
            db.execute("ALTER TABLE files SET (autovacuum_enabled = false)")
        yield ctl, plans
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


def seed(ctl: ControllerProcess, folder: int, digest: str, size: int) -> None:
    """``big/`` with :data:`DIRS` directories of :data:`FILES_EACH` files of one
    stored object, written as the controller would: fresh versions from the
    folder's counter, and its counters moved on."""
    with ctl.db() as db, db.transaction():
        (counter,) = db.execute(
            "SELECT version_counter FROM folders WHERE id = %s FOR UPDATE", (folder,)
        ).fetchone()
        db.execute(
            "INSERT INTO files (id, folder_id, path, parent, kind, version)"
            " SELECT gen_random_uuid(), %(f)s, p, parent, 'directory', %(c)s + n FROM ("
            "  SELECT 'big', '', 0 UNION ALL"
            "  SELECT 'big/d' || lpad(d::text, 3, '0'), 'big', d + 1"
            "   FROM generate_series(0, %(dirs)s - 1) AS d) AS t(p, parent, n)",
            {"f": folder, "c": counter, "dirs": DIRS},
        )
        counter += DIRS + 1
        db.execute(
            "INSERT INTO files (id, folder_id, path, parent, kind, digest, byte_size, version)"
            " SELECT gen_random_uuid(), %(f)s,"
            "  'big/d' || lpad(d::text, 3, '0') || '/f' || lpad(i::text, 3, '0') || '.bin',"
            "  'big/d' || lpad(d::text, 3, '0'), 'file', %(digest)s, %(size)s,"
            "  %(c)s + d * %(each)s + i + 1"
            " FROM generate_series(0, %(dirs)s - 1) AS d, generate_series(0, %(each)s - 1) AS i",
            {"f": folder, "c": counter, "dirs": DIRS, "each": FILES_EACH, "digest": digest,
             "size": size},
        )  # fmt: skip
        added = DIRS + 1 + DIRS * FILES_EACH
        db.execute(
            "UPDATE folders SET version_counter = %s, live_entries = live_entries + %s,"
            " live_bytes = live_bytes + %s WHERE id = %s",
            (counter + DIRS * FILES_EACH, added, DIRS * FILES_EACH * size, folder),
        )


def rest_writes(tenant: Tenant, tag: str, n: int, data: bytes) -> None:
    """The REST writes of a person, each checked: a PUT of a new file and one
    over a seeded file, a move, a delete of a file and of a directory, and a
    restore of the deleted file. Pass ``n`` picks the seeded files."""
    folder = f"/api/companies/{tenant.company_id}/work-folders/user/{tenant.user_id}"
    with tenant.client() as c:

        def put(path: str, body: bytes) -> None:
            r = c.put(f"{folder}/content", params={"path": path}, content=body, headers=OCTET)
            assert r.status_code in (200, 201), r.text

        def op(**body: str) -> dict[str, Any]:
            r = c.post(f"{folder}/operations", json=body)
            assert r.status_code == 200, r.text
            answer: dict[str, Any] = r.json()
            return answer

        put(f"big/d007/{tag}-new.bin", data)
        put(f"big/d008/f00{n}.bin", data + tag.encode())
        op(action="move", path=f"big/d009/f00{n}.bin", to=f"big/d009/{tag}-moved.bin")
        for k in range(3):
            put(f"{tag}-tree/sub/f{k}.txt", data)
        op(action="delete", path=f"{tag}-tree")
        gone = op(action="delete", path=f"big/d010/f00{n}.bin")
        op(action="restore", fileId=gone["files"][0]["id"])
        r = c.get(f"{folder}/content", params={"path": f"big/d008/f00{n}.bin"})
        assert r.status_code == 200 and r.content == data + tag.encode()
        r = c.get(f"{folder}/content", params={"path": f"big/d010/f00{n}.bin"})
        assert r.status_code == 200 and r.content == data


def checkpoint(run: Run, tag: str, n: int, digest: str) -> None:
    """A sandbox's checkpoint into its seeded task folder: a new file, a
    changed one and a deleted one."""
    r = run.commit(
        "task",
        [
            {"op": "put", "path": f"big/d011/{tag}.bin", "digest": digest, "executable": False},
            {"op": "put", "path": f"big/d012/f00{n}.bin", "digest": digest, "executable": True},
            {"op": "delete", "path": f"big/d013/f00{n}.bin"},
        ],
    )
    assert r.status_code == 200, r.text
    assert r.json()["applied"] is True


def reads(tenant: Tenant, run: Run) -> int:
    """The reads a person and a sandbox make of a large folder, each checked:
    pages of the whole folder's listing, of one directory's (filtered by
    name too) and of the trash, whether a directory changed and what, and
    the sandbox's manifest, full and since a version. Each answers a page
    (50 entries) or less, whatever the folder's size. Returns the total the
    whole folder's listing gave."""
    folder = f"/api/companies/{tenant.company_id}/work-folders/user/{tenant.user_id}"
    with tenant.client() as c:

        def get(path: str, **params: Any) -> dict[str, Any]:
            r = c.get(folder + path, params=params)
            assert r.status_code == 200, r.text
            answer: dict[str, Any] = r.json()
            return answer

        first = get("/", limit=50)
        assert len(first["entries"]) == 50 and first["nextCursor"] is not None
        second = get("/", limit=50, cursor=first["nextCursor"])
        assert second["entries"][0]["path"] > first["entries"][-1]["path"]
        assert first["total"] == second["total"] > DIRS * FILES_EACH
        listed = get("/", dir="big/d020", limit=50)
        assert len(listed["entries"]) == 50 and listed["total"] == FILES_EACH
        named = get("/", dir="big/d020", name="F01", limit=50)
        assert [e["path"] for e in named["entries"]] == [f"big/d020/f01{k}.bin" for k in range(10)]
        assert named["total"] == 10
        get("/", trash="true", limit=50)
        since = first["version"] - 5
        changed = get("/changes", since=since, dir="big/d007", entries="true")
        assert changed["version"] == first["version"]
    with run.client() as b:
        page = b.get("/folders/task/manifest", params={"since": 0, "limit": 50})
        assert page.status_code == 200 and len(page.json()["entries"]) == 50, page.text
        high = page.json()["highWater"]
        recent = b.get("/folders/task/manifest", params={"since": high - 5, "limit": 50})
        assert recent.status_code == 200 and len(recent.json()["entries"]) <= 5, recent.text
    total: int = first["total"]
    return total


def test_writes_and_reads_of_a_large_folder_read_only_their_own_rows(
    explained: tuple[ControllerProcess, PlanLog],
) -> None:
    ctl, plans = explained
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    data = b"seeded bytes\n"
    digest = hashlib.sha256(data).hexdigest()
    with tenant.client() as c:  # the user's folder, and the object the seeded rows share
        r = c.put(
            f"/api/companies/{tenant.company_id}/work-folders/user/{tenant.user_id}/content",
            params={"path": "first.txt"},
            content=data,
            headers=OCTET,
        )
        assert r.status_code == 201, r.text
    up = run.upload("task", data)
    assert up.status_code == 200 and up.json()["digest"] == digest, up.text
    first = run.commit(
        "task", [{"op": "put", "path": "first.bin", "digest": digest, "executable": False}]
    )
    assert first.status_code == 200, first.text
    assert run.task is not None
    for scope, owner in (("user", tenant.user_id), ("task", run.task)):
        fid = folder_id(ctl, tenant.company_id, scope, owner)
        assert fid is not None
        seed(ctl, fid, digest, len(data))

    for n, analyzed in enumerate((False, True)):
        if analyzed:
            with ctl.db() as db:
                db.execute("ANALYZE files")
        tag = "after-analyze" if analyzed else "never-analyzed"
        plans.mark()
        rest_writes(tenant, tag, n, data)
        checkpoint(run, tag, n, digest)
        total = reads(tenant, run)
        logged = [p for p in plans.plans() if reads_files(p)]
        # Each write's lookups were logged (the log is read as expected).
        assert len(logged) >= 10, [p["Query Text"] for p in logged]
        heavy = [(buffers(p), p["Query Text"]) for p in logged if buffers(p) > MAX_BUFFERS]
        assert heavy == [], (tag, heavy)
        # The listing's total (the folder's counter) is what the rows count.
        with ctl.db() as db:
            live = db.execute(
                "SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
                " WHERE d.company_id = %s AND d.scope = 'user' AND f.deleted_at IS NULL",
                (tenant.company_id,),
            ).fetchone()
        assert live is not None and total == live[0]

    # The writes themselves, as rows: (scope, path) → executable, live ones only.
    with ctl.db() as db:
        rows = db.execute(
            "SELECT d.scope, f.path, f.executable FROM files f JOIN folders d"
            " ON d.id = f.folder_id WHERE d.company_id = %s AND f.deleted_at IS NULL"
            " AND f.path = ANY(%s)",
            (tenant.company_id, [
                "big/d009/f000.bin", "big/d009/never-analyzed-moved.bin", "big/d010/f000.bin",
                "never-analyzed-tree", "big/d011/never-analyzed.bin", "big/d012/f000.bin",
                "big/d013/f000.bin",
            ]),
        ).fetchall()  # fmt: skip
    assert {(scope, path): x for scope, path, x in rows} == {
        ("user", "big/d009/never-analyzed-moved.bin"): False,  # moved from f000
        ("user", "big/d010/f000.bin"): False,  # deleted, then restored
        ("user", "big/d012/f000.bin"): False,
        ("user", "big/d013/f000.bin"): False,
        ("task", "big/d009/f000.bin"): False,
        ("task", "big/d010/f000.bin"): False,
        ("task", "big/d011/never-analyzed.bin"): False,  # the checkpoint's new file
        ("task", "big/d012/f000.bin"): True,  # and its changed one; f013 it deleted
    }
