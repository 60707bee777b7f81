"""GC: the sweeper and a first writer of an object serialize, row or no row."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from datetime import timedelta
from pathlib import Path

import psycopg

from controller import apply
from controller.db import make_pool, migrate
from controller.gc import sweep_once
from controller.storage.base import object_key
from controller.storage.local_disk import LocalDiskProvider
from tests.support.controller import PgCluster


def test_first_writer_and_due_sweep_keep_the_blob(pg_cluster: PgCluster, tmp_path: Path) -> None:
    """A due journal entry for a digest whose ``objects`` row does not exist
    yet, and a writer between its object check and its commit: the sweep must
    wait for the writer and then keep the bytes it references. (Row locks
    alone lock nothing here, and the sweep deleted the blob.)"""
    url = pg_cluster.create_database()
    migrate(url)
    company = str(uuid.uuid4())
    data = b"first writer's bytes"
    digest = hashlib.sha256(data).hexdigest()
    key = object_key(company, digest)
    storage = LocalDiskProvider(tmp_path / "objects")
    src = tmp_path / "blob"
    src.write_bytes(data)
    storage.put_file(key, src, len(data), digest)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO companies (id, name) VALUES (%s, 'c')", (company,))
        conn.execute(
            "INSERT INTO deletion_journal (company_id, digest, reason, not_before)"
            " VALUES (%s, %s, 'orphaned upload', now() - interval '1 second')",
            (company, digest),
        )

    async def race() -> dict[str, int]:
        pool = make_pool(url, min_size=2, max_size=4)
        await pool.open(wait=True)
        try:
            checked, go = asyncio.Event(), asyncio.Event()

            async def ensure(k: str) -> None:
                assert storage.exists(k)
                checked.set()
                await go.wait()  # the writer's transaction stays open here

            async def writer() -> None:
                async with pool.connection() as conn, conn.transaction():
                    folder = await apply.get_folder(conn, company, "agent", "a1", create=True)
                    assert folder is not None
                    await apply.lock_folder(conn, folder)
                    await apply.write_file(
                        conn,
                        folder,
                        path="memory.md",
                        digest=digest,
                        byte_size=len(data),
                        executable=False,
                        content_type=None,
                        ensure_object=ensure,
                        gc_delay=timedelta(hours=1),
                    )

            write = asyncio.create_task(writer())
            await asyncio.wait_for(checked.wait(), 10)
            sweep = asyncio.create_task(sweep_once(pool, storage))
            await asyncio.sleep(1.0)
            assert not sweep.done(), "the sweep did not wait for the writer's object lock"
            go.set()
            await asyncio.wait_for(write, 10)
            report = await asyncio.wait_for(sweep, 10)
            return report.as_json()
        finally:
            await pool.close()

    report = asyncio.run(race())
    assert report == {"examined": 1, "deleted": 0, "kept": 1, "failed": 0}
    assert storage.exists(key)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT outcome FROM deletion_journal WHERE company_id = %s", (company,)
        ).fetchone()
        assert row == ("referenced",)
        assert conn.execute("SELECT count(*) FROM objects").fetchone() == (1,)
