"""GC: the sweeper never deletes an object a commit references, on either
storage provider. A single write and the sweeper serialize on the object's
lock, row or no row; a checkpoint references only pinned uploads, and the
sweeper honours the pins (and waits for a checkpoint that claimed one)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection

from common.errors import UnknownContent
from controller import foldercore, runs
from controller.api.uploads import restore_swept_spans
from controller.changeset import Entry, apply_changes
from controller.checkpoint import claim_contents
from controller.db import make_pool, migrate
from controller.gc import _collect, sweep_once
from controller.storage.base import Span, StorageProvider, object_key
from tests.support.controller import PgCluster
from tests.support.storage import read_all

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

    async def folder(self, conn: AsyncConnection[Any]) -> foldercore.Folder:
        folder = await foldercore.get_folder(conn, self.company, "task", "t1", create=True)
        assert folder is not None
        await foldercore.lock_folder(conn, folder)
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
                await foldercore.write_file(
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


# -- store marks: a registration asks storage only after a sweep -------------------


class Batch:
    """Members stored from one spool file, registered as a batch is
    (``runs.record_uploads`` with the batch's own ``ensure_objects``)."""

    def __init__(self, world: World, members: list[bytes]) -> None:
        self.world = world
        self.spool = world.tmp / f"spool-{uuid.uuid4().hex[:8]}"
        self.spool.write_bytes(b"".join(members))
        self.sizes: dict[str, int] = {}
        self.spans: dict[str, Span] = {}
        offset = 0
        for data in members:
            digest = hashlib.sha256(data).hexdigest()
            key = object_key(world.company, digest)
            self.sizes[digest] = len(data)
            self.spans[digest] = Span(key, offset, len(data), digest)
            offset += len(data)
        self.checked: list[str] = []

    def object_keys(self) -> list[str]:
        return [span.key for span in self.spans.values()]

    def store(self) -> list[bool]:
        return self.world.storage.put_spans(self.spool, list(self.spans.values()))

    async def register(self, conn: AsyncConnection[Any], mark: foldercore.StoreMark) -> None:
        restore = restore_swept_spans(self.world.storage, self.spool, self.spans)

        async def ensure(keys: list[str]) -> None:
            self.checked += keys
            await restore(keys)

        await runs.record_uploads(
            conn, self.world.run, self.world.company, self.sizes, ensure, HOUR, 3600, mark
        )


async def take_mark(pool: Any) -> foldercore.StoreMark:
    async with pool.connection() as conn:
        return await foldercore.take_store_mark(conn)


def test_a_registration_after_its_store_asks_storage_nothing(world: World) -> None:
    batch = Batch(world, [b"one", b"two", b"three"])
    # Another object's deletion, stamped before this writer's mark, is no
    # reason to ask either.
    other, _ = world.store(b"swept before")
    world.journal_due(other)

    async def scenario(pool: Any) -> None:
        assert (await sweep_once(pool, world.storage)).deleted == 1
        mark = await take_mark(pool)
        assert batch.store() == [True, True, True]
        async with pool.connection() as conn, conn.transaction():
            await batch.register(conn, mark)

    run_with_pool(world, scenario)
    assert batch.checked == []
    assert all(world.storage.exists(k) for k in batch.object_keys())
    assert world.sql("SELECT count(*) FROM run_uploads") == [(3,)]


def test_a_sweep_between_store_and_registration_makes_the_batch_restore_the_bytes(
    world: World,
) -> None:
    """The bytes are stored, a sweep of an older due entry deletes them (no
    pin yet), then the batch registers: its mark is older than the
    deletion's, so it checks and stores the member again."""
    batch = Batch(world, [b"kept member", b"swept member"])
    swept = hashlib.sha256(b"swept member").hexdigest()
    world.journal_due(swept)

    async def scenario(pool: Any) -> None:
        mark = await take_mark(pool)
        batch.store()
        assert (await sweep_once(pool, world.storage)).deleted == 1
        assert not world.storage.exists(object_key(world.company, swept))
        async with pool.connection() as conn, conn.transaction():
            await batch.register(conn, mark)

    run_with_pool(world, scenario)
    assert batch.checked == [object_key(world.company, swept)]
    assert read_all(world.storage, object_key(world.company, swept)) == b"swept member"
    assert world.sql("SELECT count(*) FROM objects") == [(2,)]


def test_batch_registration_waits_for_a_sweep_in_flight_and_restores_the_bytes(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep holds the object's lock while it deletes; the batch's
    registration waits on the lock, then sees the deletion stamped later
    than its mark and stores the bytes again before it pins them."""
    batch = Batch(world, [b"member raced by a sweep", b"an untouched member"])
    raced = hashlib.sha256(b"member raced by a sweep").hexdigest()
    raced_key = object_key(world.company, raced)
    world.journal_due(raced)
    deleted, go = threading.Event(), threading.Event()
    real_delete = world.storage.delete

    def slow_delete(key: str) -> None:
        real_delete(key)
        deleted.set()
        assert go.wait(10)

    monkeypatch.setattr(world.storage, "delete", slow_delete)

    async def race(pool: Any) -> dict[str, int]:
        mark = await take_mark(pool)
        batch.store()
        sweep = asyncio.create_task(sweep_once(pool, world.storage))
        assert await asyncio.to_thread(deleted.wait, 10)

        async def register() -> None:
            async with pool.connection() as conn, conn.transaction():
                await batch.register(conn, mark)

        registering = asyncio.create_task(register())
        await asyncio.sleep(1.0)
        assert not registering.done(), "the registration did not wait for the sweep's lock"
        go.set()
        report = (await asyncio.wait_for(sweep, 10)).as_json()
        await asyncio.wait_for(registering, 10)
        return report

    assert run_with_pool(world, race) == {"examined": 1, "deleted": 1, "kept": 0, "failed": 0}
    assert batch.checked == [raced_key]
    assert read_all(world.storage, raced_key) == b"member raced by a sweep"
    assert world.sql("SELECT count(*) FROM objects") == [(2,)]
    # Pinned now: the next sweep keeps it.
    world.journal_due(raced)
    monkeypatch.undo()
    report = run_with_pool(world, lambda pool: sweep_once(pool, world.storage))
    assert report.as_json() == {"examined": 1, "deleted": 0, "kept": 1, "failed": 0}
    assert world.storage.exists(raced_key)


def test_a_sweep_that_deleted_and_failed_to_commit_makes_writers_check(world: World) -> None:
    """A sweep deleted the bytes and died before it recorded so: its entry
    stays due and unsettled, and that alone makes a registration check."""
    data = b"deleted by a sweep that never committed"
    batch = Batch(world, [data])
    key = batch.object_keys()[0]
    world.journal_due(hashlib.sha256(data).hexdigest())

    async def scenario(pool: Any) -> None:
        mark = await take_mark(pool)
        batch.store()
        world.storage.delete(key)  # the dead sweep's only effect
        async with pool.connection() as conn, conn.transaction():
            await batch.register(conn, mark)

    run_with_pool(world, scenario)
    assert batch.checked == [key]
    assert read_all(world.storage, key) == data


def test_a_stale_sweep_of_a_settled_entry_deletes_nothing(world: World) -> None:
    """Two sweepers read the same due entry; the first deletes the bytes and
    settles it, a writer stores them again with a later mark and so skips
    its check. The second sweeper must not decide the settled entry again:
    its deletion would carry no mark and the registration would pin a
    missing object."""
    data = b"stored again after the first sweep"
    batch = Batch(world, [data])
    key = batch.object_keys()[0]
    world.journal_due(hashlib.sha256(data).hexdigest())
    (entry,) = world.sql(
        "SELECT id, company_id, digest FROM deletion_journal WHERE company_id = %s", world.company
    )
    stale = {"id": entry[0], "company_id": entry[1], "digest": entry[2]}

    async def scenario(pool: Any) -> str:
        batch.store()
        assert (await sweep_once(pool, world.storage)).deleted == 1
        mark = await take_mark(pool)
        assert batch.store() == [True]
        outcome = await _collect(pool, world.storage, stale)
        async with pool.connection() as conn, conn.transaction():
            await batch.register(conn, mark)
        return outcome

    assert run_with_pool(world, scenario) == "settled"
    assert batch.checked == []
    assert read_all(world.storage, key) == data
    assert world.outcomes() == ["deleted", None]  # None: the registration's own entry


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("swept", [False, True])
def test_a_single_write_in_pipeline_mode_checks_the_bytes_only_after_a_sweep(
    world: World, swept: bool, ahead: bool
) -> None:
    """A person's upload (``write_file`` with the store mark taken before the
    bytes were stored, in pipeline mode as the REST PUT runs it): the bytes
    are asked for, and stored again, exactly when a sweep deleted them since
    the mark. Without ``ahead`` its row is written before the upsert's
    answer is read; with it (as the REST PUT without an operation id does),
    the object is registered with the folder's lock and its answer read
    first, and the row is written unread: the row returned is still the row
    the database holds, column for column."""
    data = b"a person's upload"
    digest = hashlib.sha256(data).hexdigest()
    key = object_key(world.company, digest)
    if swept:
        world.journal_due(digest)  # the sweep's reason to delete the bytes
    checked: list[str] = []

    async def ensure(k: str) -> None:
        checked.append(k)
        world.store(data)

    async def scenario(pool: Any) -> tuple[dict[str, Any], bool]:
        mark = await take_mark(pool)
        world.store(data)
        if swept:
            assert (await sweep_once(pool, world.storage)).deleted == 1
        async with pool.connection() as conn, conn.pipeline(), conn.transaction():
            folder = await world.folder(conn)
            registered = None
            if ahead:
                pending = foldercore.PendingObject(digest, len(data), mark)
                registered = await foldercore.send_registration(conn, world.company, pending)
            return await foldercore.write_file(
                conn,
                folder,
                path="upload.bin",
                digest=digest,
                byte_size=len(data),
                executable=False,
                content_type=None,
                ensure_object=ensure,
                gc_delay=HOUR,
                stored_after=mark,
                registered=registered,
            )

    row, created = run_with_pool(world, scenario)
    assert created and row["digest"] == digest
    with psycopg.connect(world.url, row_factory=psycopg.rows.dict_row) as conn:
        assert conn.execute("SELECT * FROM files WHERE path = 'upload.bin'").fetchone() == row
    assert checked == ([key] if swept else [])
    assert read_all(world.storage, key) == data
    assert world.sql("SELECT count(*) FROM objects") == [(1,)]
    assert world.sql("SELECT count(*) FROM files WHERE path = 'upload.bin'") == [(1,)]
