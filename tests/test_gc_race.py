"""GC: the sweeper never deletes an object a commit references, on either
storage provider. A single write and the sweeper serialize on the object's
lock, row or no row; a checkpoint references only pinned uploads, and the
sweeper honours the pins (and waits for a checkpoint that claimed one)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection

from common.errors import UnknownContent
from controller import apply, runs
from controller.changeset import Entry, apply_changes
from controller.checkpoint import claim_contents
from controller.db import make_pool, migrate
from controller.gc import sweep_once
from controller.storage.base import StorageProvider, object_key
from tests.support.controller import PgCluster

HOUR = timedelta(hours=1)


class World:
    """A fresh database with one company and one active run, and a provider."""

    def __init__(self, url: str, storage: StorageProvider, tmp: Path) -> None:
        self.url, self.storage, self.tmp = url, storage, tmp
        self.company, self.agent, self.run = (str(uuid.uuid4()) for _ in range(3))
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("INSERT INTO companies (id, name) VALUES (%s, 'c')", (self.company,))
            conn.execute(
                "INSERT INTO agents (id, company_id, name) VALUES (%s, %s, 'a')",
                (self.agent, self.company),
            )
            conn.execute(
                "INSERT INTO runs (id, company_id, agent_id, sandbox_key, lease_epoch, token_hash)"
                " VALUES (%s, %s, %s, 's', 1, %s)",
                (self.run, self.company, self.agent, uuid.uuid4().bytes),
            )

    def store(self, data: bytes) -> tuple[str, str]:
        digest = hashlib.sha256(data).hexdigest()
        key = object_key(self.company, digest)
        src = self.tmp / f"src-{digest[:12]}"
        src.write_bytes(data)
        self.storage.put_file(key, src, len(data), digest)
        return digest, key

    def sql(self, query: str, *params: Any) -> Any:
        with psycopg.connect(self.url, autocommit=True) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else None

    def journal_due(self, digest: str) -> None:
        self.sql(
            "INSERT INTO deletion_journal (company_id, digest, reason, not_before)"
            " VALUES (%s, %s, 'orphaned upload', now() - interval '1 second')",
            self.company,
            digest,
        )

    def outcomes(self) -> list[str | None]:
        rows = self.sql(
            "SELECT outcome FROM deletion_journal WHERE company_id = %s ORDER BY id", self.company
        )
        return [r[0] for r in rows]

    async def upload(self, conn: AsyncConnection[Any], digest: str, size: int, ttl: float) -> None:
        async def present(key: str) -> None:
            assert self.storage.exists(key)

        # Journaled as due at once: only the pin may keep it.
        await runs.record_upload(
            conn, self.run, self.company, digest, size, present, timedelta(0), ttl
        )

    async def folder(self, conn: AsyncConnection[Any]) -> apply.Folder:
        folder = await apply.get_folder(conn, self.company, "task", "t1", create=True)
        assert folder is not None
        await apply.lock_folder(conn, folder)
        return folder


@pytest.fixture
def world(pg_cluster: PgCluster, provider: StorageProvider, tmp_path: Path) -> World:
    url = pg_cluster.create_database()
    migrate(url)
    return World(url, provider, tmp_path)


def run_with_pool(world: World, body: Callable[[Any], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        pool = make_pool(world.url, min_size=2, max_size=4)
        await pool.open(wait=True)
        try:
            return await body(pool)
        finally:
            await pool.close()

    return asyncio.run(main())


def test_first_writer_and_due_sweep_keep_the_blob(world: World) -> None:
    """A due journal entry for a digest whose ``objects`` row does not exist
    yet, and a writer between its object check and its commit: the sweep must
    wait for the writer and then keep the bytes it references. (Row locks
    alone lock nothing here, and the sweep deleted the blob.)"""
    data = b"first writer's bytes"
    digest, key = world.store(data)
    world.journal_due(digest)

    async def race(pool: Any) -> dict[str, int]:
        checked, go = asyncio.Event(), asyncio.Event()

        async def ensure(k: str) -> None:
            assert world.storage.exists(k)
            checked.set()
            await go.wait()  # the writer's transaction stays open here

        async def writer() -> None:
            async with pool.connection() as conn, conn.transaction():
                folder = await world.folder(conn)
                await apply.write_file(
                    conn,
                    folder,
                    path="memory.md",
                    digest=digest,
                    byte_size=len(data),
                    executable=False,
                    content_type=None,
                    ensure_object=ensure,
                    gc_delay=HOUR,
                )

        write = asyncio.create_task(writer())
        await asyncio.wait_for(checked.wait(), 10)
        sweep = asyncio.create_task(sweep_once(pool, world.storage))
        await asyncio.sleep(1.0)
        assert not sweep.done(), "the sweep did not wait for the writer's object lock"
        go.set()
        await asyncio.wait_for(write, 10)
        report = await asyncio.wait_for(sweep, 10)
        return report.as_json()

    report = run_with_pool(world, race)
    assert report == {"examined": 1, "deleted": 0, "kept": 1, "failed": 0}
    assert world.storage.exists(key)
    assert world.outcomes() == ["referenced"]
    assert world.sql("SELECT count(*) FROM objects") == [(1,)]


def test_sweep_between_upload_and_commit_keeps_the_pinned_object(world: World) -> None:
    data = b"uploaded, not yet committed"
    digest, key = world.store(data)

    async def scenario(pool: Any) -> list[dict[str, int]]:
        async with pool.connection() as conn, conn.transaction():
            await world.upload(conn, digest, len(data), ttl=3600)
        reports = [(await sweep_once(pool, world.storage)).as_json()]
        async with pool.connection() as conn, conn.transaction():
            folder = await world.folder(conn)
            sizes = await claim_contents(conn, folder, world.run, {digest})
            await apply_changes(conn, folder, [Entry("put", "a.txt", digest)], sizes, HOUR)
        reports.append((await sweep_once(pool, world.storage)).as_json())
        return reports

    pending, after = run_with_pool(world, scenario)
    assert pending == {"examined": 1, "deleted": 0, "kept": 1, "failed": 0}
    assert after == {"examined": 1, "deleted": 0, "kept": 1, "failed": 0}
    assert world.outcomes() == ["referenced"]
    assert world.storage.exists(key)


def test_pin_expiring_while_its_commit_runs_keeps_the_object(world: World) -> None:
    """The checkpoint claims the upload, then its pin's time runs out before
    the commit: a sweep in between must wait for the claim's row lock and then
    see the committed file. (Deciding on the pin's expiry alone, it would
    delete the bytes the commit is about to reference.)"""
    data = b"claimed just in time"
    digest, key = world.store(data)

    async def race(pool: Any) -> dict[str, int]:
        async with pool.connection() as conn, conn.transaction():
            await world.upload(conn, digest, len(data), ttl=1.0)
        claimed, go = asyncio.Event(), asyncio.Event()

        async def commit() -> None:
            async with pool.connection() as conn, conn.transaction():
                folder = await world.folder(conn)
                sizes = await claim_contents(conn, folder, world.run, {digest})
                claimed.set()
                await go.wait()
                await apply_changes(conn, folder, [Entry("put", "late.txt", digest)], sizes, HOUR)

        committing = asyncio.create_task(commit())
        await asyncio.wait_for(claimed.wait(), 10)
        await asyncio.sleep(1.5)  # the pin has expired by the clock
        sweep = asyncio.create_task(sweep_once(pool, world.storage))
        await asyncio.sleep(1.0)
        assert not sweep.done(), "the sweep did not wait for the claimed upload"
        go.set()
        await asyncio.wait_for(committing, 10)
        return (await asyncio.wait_for(sweep, 10)).as_json()

    assert run_with_pool(world, race) == {"examined": 1, "deleted": 0, "kept": 1, "failed": 0}
    assert world.outcomes() == ["referenced"]
    assert world.storage.exists(key)


def test_expired_and_ended_pins_are_swept_and_refused(world: World) -> None:
    expired, ended = b"an expired upload", b"an ended run's upload"
    d_expired, k_expired = world.store(expired)
    d_ended, k_ended = world.store(ended)

    async def scenario(pool: Any) -> dict[str, int]:
        async with pool.connection() as conn, conn.transaction():
            await world.upload(conn, d_expired, len(expired), ttl=0)
            await world.upload(conn, d_ended, len(ended), ttl=3600)
        # A committed upload pins its object only while its run is running.
        world.sql("UPDATE run_uploads SET committed_at = now() WHERE digest = %s", d_ended)
        world.sql("UPDATE runs SET active = false WHERE id = %s", world.run)
        report = (await sweep_once(pool, world.storage)).as_json()
        world.sql("UPDATE runs SET active = true WHERE id = %s", world.run)
        async with pool.connection() as conn, conn.transaction():
            folder = await world.folder(conn)
            with pytest.raises(UnknownContent):
                await claim_contents(conn, folder, world.run, {d_expired})
        return report

    assert run_with_pool(world, scenario) == {"examined": 2, "deleted": 2, "kept": 0, "failed": 0}
    assert world.outcomes() == ["deleted", "deleted"]
    assert not world.storage.exists(k_expired) and not world.storage.exists(k_ended)
    assert world.sql("SELECT count(*) FROM objects") == [(0,)]
