"""The bridge's manifest pages by version (keyset): complete and without a
row seen twice while writes go on between pages, and the same wire format
for every entry kind."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import psycopg
from psycopg.rows import dict_row

from controller import foldercore, folders
from controller.db import connection_options, migrate
from tests.support.bridge import start_run
from tests.support.checkpoints import folder_id
from tests.support.controller import PgCluster, Tenant

OCTET = {"Content-Type": "application/octet-stream"}


def path(i: int) -> str:
    return f"d{i % 7}/f{i:03}"


def test_pages_are_complete_and_disjoint_under_concurrent_writes(tenant: Tenant) -> None:
    run = start_run(tenant)
    assert run.task is not None
    folder = tenant.folder("task", run.task)
    digest = run.upload("task", b"seed").json()["digest"]
    seed = [
        {"op": "put", "path": path(i), "digest": digest, "executable": i % 5 == 0}
        for i in range(400)
    ]
    assert run.commit("task", seed).status_code == 200
    stop = threading.Event()
    writes: list[str] = []

    def writer() -> None:
        # Overwrites, deletes and new files, spread over the whole version range.
        with tenant.client() as c:
            i = 0
            while not stop.is_set() and i < 120:
                if i % 3 == 0:
                    r = c.put(f"{folder}/content?path={path(i * 3)}", content=b"%d" % i,
                              headers=OCTET)  # fmt: skip
                elif i % 3 == 1:
                    r = c.post(f"{folder}/operations",
                               json={"action": "delete", "path": path(i * 3 + 1)})  # fmt: skip
                else:
                    r = c.put(f"{folder}/content?path=new/n{i:03}", content=b"n", headers=OCTET)
                assert r.status_code in (200, 201), r.text
                writes.append(r.text)
                i += 1

    seen: list[dict[str, Any]] = []
    pages = 0
    with run.client() as c:
        thread = threading.Thread(target=writer)
        since = 0
        thread.start()
        try:
            while True:
                r = c.get("/folders/task/manifest", params={"since": since, "limit": 25})
                assert r.status_code == 200, r.text
                body = r.json()
                seen.extend(body["entries"])
                pages += 1
                if pages == 12:
                    thread.join(60)  # the rest is read after the writes ended
                if body["nextSince"] is None:
                    break
                assert body["nextSince"] == body["entries"][-1]["version"]
                since = body["nextSince"]
        finally:
            stop.set()
            thread.join(60)
    assert len(writes) == 120 and pages > 12
    versions = [e["version"] for e in seen]
    assert versions == sorted(set(versions)), "a version was served twice or out of order"
    # Applying the pages in order gives the folder as it is now.
    state: dict[str, dict[str, Any]] = {}
    for e in seen:
        if e["deleted"]:
            state.pop(e["path"], None)
        else:
            state[e["path"]] = e
    fid = folder_id(tenant.controller, tenant.company_id, "task", run.task)
    with tenant.controller.db() as db:
        rows = db.execute(
            "SELECT path, kind, digest, byte_size, executable, version FROM files"
            " WHERE folder_id = %s AND deleted_at IS NULL",
            (fid,),
        ).fetchall()
    expected = {
        r[0]: {"path": r[0], "kind": r[1], "digest": r[2], "byteSize": r[3],
               "executable": r[4], "version": r[5], "deleted": False}
        for r in rows
    }  # fmt: skip
    assert state == expected


def test_empty_and_unknown_folders_page_as_empty(tenant: Tenant) -> None:
    run = start_run(tenant)
    with run.client() as c:
        r = c.get("/folders/task/manifest")
    assert r.status_code == 200
    assert r.json() == {"entries": [], "nextSince": None, "highWater": 0}
    assert r.headers["content-type"].startswith("application/json")


def _folder_of_20000_rows(pg_cluster: PgCluster) -> tuple[str, str, int]:
    """A fresh database with one task folder of 20,000 directory rows at
    versions 1 to 20,000 (not analyzed): (url, company id, folder id)."""
    url = pg_cluster.create_database()
    migrate(url)
    company = str(uuid.uuid4())
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("INSERT INTO companies (id, name) VALUES (%s, 'c')", (company,))
        row = db.execute(
            "INSERT INTO folders (company_id, scope, owner_id, version_counter)"
            " VALUES (%s, 'task', 't', 20000) RETURNING id",
            (company,),
        ).fetchone()
        assert row is not None
        db.execute(
            "INSERT INTO files (id, folder_id, path, parent, kind, version)"
            " SELECT gen_random_uuid(), %s, 'd' || i, '', 'directory', i"
            " FROM generate_series(1, 20000) AS i",
            (row[0],),
        )
    return url, company, int(row[0])


def test_a_page_reads_only_its_rows_before_the_table_is_analyzed(pg_cluster: PgCluster) -> None:
    """Right after a folder fills up (a fresh database, no ANALYZE yet), a
    page of 100 must read about 100 rows. The planner, guessing a couple of
    rows for "this folder, live", chose a bitmap scan of the whole folder and
    a sort, once per page: a 100,000-entry manifest took seconds to page."""
    url, company, _ = _folder_of_20000_rows(pg_cluster)

    async def page_reads() -> tuple[int, int]:
        conn = await psycopg.AsyncConnection.connect(url, row_factory=dict_row)
        async with conn, conn.transaction():
            folder = await foldercore.get_folder(conn, company, "task", "t", create=False)
            page = await folders.manifest_page(conn, folder, since=0, limit=100)
            cur = await conn.execute(
                "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) AS n"
                " FROM pg_stat_xact_user_tables WHERE relname = 'files'"
            )
            stats = await cur.fetchone()
            assert stats is not None and page.last_version == 100
            return len(json.loads(page.entries_json)), int(stats["n"])

    entries, reads = asyncio.run(page_reads())
    assert entries == 100
    assert reads <= 200, f"a page of 100 read {reads} rows"


def test_a_changes_page_is_not_jit_compiled(pg_cluster: PgCluster) -> None:
    """A page after the first (``since`` > 0) merges the folder's rows with
    its move tombstones and sorts them; with sorting discouraged (see the
    test above) the planner costs that step at 10^10, past jit_above_cost, and
    PostgreSQL compiled every 5,000-entry page for about 250 ms. The
    controller's connections (and the page's own transaction) keep JIT off."""
    url, company, fid = _folder_of_20000_rows(pg_cluster)
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("ANALYZE files")

    sql = folders._MANIFEST_SQL.format(page=folders._CHANGES_PAGE)
    params = {"fid": fid, "since": 5000, "limit": 5000}

    def plan_of(**kwargs: Any) -> str:
        with psycopg.connect(url, **kwargs) as conn, conn.transaction():
            conn.execute("SELECT set_config('enable_sort', 'off', true)")
            rows = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchall()
            return json.dumps(rows[0][0])

    # The database's own default compiles this page (what the fix is about)...
    assert '"JIT"' in plan_of()
    # ... the controller's connections do not.
    assert '"JIT"' not in plan_of(options=connection_options(30.0))

    async def page() -> tuple[int, str]:
        conn = await psycopg.AsyncConnection.connect(url, row_factory=dict_row)
        async with conn, conn.transaction():
            folder = await foldercore.get_folder(conn, company, "task", "t", create=False)
            got = await folders.manifest_page(conn, folder, since=5000, limit=5000)
            cur = await conn.execute("SELECT current_setting('jit') AS jit")
            setting = await cur.fetchone()
            assert setting is not None
            return len(json.loads(got.entries_json)), str(setting["jit"])

    entries, jit = asyncio.run(page())
    assert (entries, jit) == (5000, "off")
