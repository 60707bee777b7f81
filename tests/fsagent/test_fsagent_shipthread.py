"""Checkpoints on a thread of their own (fsagent.checkpoint.thread) against the
in-memory bridge client: the same saves as on the mount's loop, the
acknowledgement in parts, failures reported across the thread, and the
snapshot rule when the mount's loop writes a file while it is uploaded."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio

from fsagent.checkpoint.thread import ACK_PART, ShipThread, call_on
from fsagent.errors import SaveFailed
from fsagent.state.records import InodeNo
from fsagent.state.statedir import ROOT_INODE
from fsagent.state.store import Store
from tests.fsagent.test_fsagent_ship_inproc import SCOPE, hydrated, write_small
from tests.support.memclient import MemoryBridgeClient


class ThreadNoting(MemoryBridgeClient):
    """Notes the thread of every upload and commit; can write a file on the
    mount's loop while a batch is being uploaded."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()
        self.store: Store | None = None
        self.mount: trio.lowlevel.TrioToken | None = None
        self.rewrite: tuple[str, bytes] | None = None
        self.committed = threading.Event()

    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        self.threads.add(threading.get_ident())
        if self.rewrite is not None:
            assert self.store is not None and self.mount is not None
            store, (name, data) = self.store, self.rewrite
            self.rewrite = None
            # What a FUSE write does, on the mount's loop, while the bytes travel.
            await call_on(self.mount, lambda: write_small(store, name, data))
        return await super().upload_batch(scope, members)

    async def commit_checkpoint(self, scope: str, body: dict[str, object]) -> dict[str, object]:
        self.threads.add(threading.get_ident())
        receipt = await super().commit_checkpoint(scope, body)
        self.committed.set()
        return receipt


@pytest.mark.trio
async def test_saves_from_its_own_thread_and_acknowledges_in_parts(tmp_path: Path) -> None:
    mem = ThreadNoting()
    store = await hydrated(tmp_path, mem)
    try:
        files = {f"f{i:04d}.txt": os.urandom(50 + i) for i in range(2 * ACK_PART + 5)}
        for name, data in files.items():
            write_small(store, name, data)
        async with ShipThread(store, mem, SCOPE, 1) as shipper:
            result = await shipper.ship_checkpoint()
            assert shipper.last_checkpoint is not None
            assert shipper.last_checkpoint["entries"] == len(files)
        assert result.entries == len(files) and result.skipped_torn == 0 and result.seconds > 0
        assert mem.files(SCOPE) == files
        assert mem.threads and threading.get_ident() not in mem.threads
        assert store.changes_since_baseline() == [] and store.journal.pending_checkpoint() is None
        assert store.journal.save_status()["lastSave"]["entries"] == len(files)
    finally:
        store.close()


@pytest.mark.trio
async def test_a_file_written_while_uploaded_stays_dirty_and_ships_next_time(
    tmp_path: Path,
) -> None:
    mem = ThreadNoting()
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"old bytes")
        write_small(store, "b.txt", b"steady")
        mem.store, mem.mount = store, trio.lowlevel.current_trio_token()
        mem.rewrite = ("a.txt", b"newer bytes")
        async with ShipThread(store, mem, SCOPE, 1) as shipper:
            first = await shipper.ship_checkpoint()
            assert first.skipped_torn == 1
            assert mem.files(SCOPE) == {"b.txt": b"steady"}  # torn content never ships
            assert [c.path for c in store.changes_since_baseline()] == ["a.txt"]
            second = await shipper.ship_checkpoint()
        assert second.entries == 1 and second.skipped_torn == 0
        assert mem.files(SCOPE) == {"a.txt": b"newer bytes", "b.txt": b"steady"}
        assert store.changes_since_baseline() == []
    finally:
        store.close()


@pytest.mark.trio
async def test_a_failure_on_the_thread_is_the_callers_and_keeps_every_change(
    tmp_path: Path,
) -> None:
    mem = ThreadNoting()
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"kept")
        mem.fail_next("upload_object")  # a batch of one goes up as a plain upload
        async with ShipThread(store, mem, SCOPE, 1) as shipper:
            with pytest.raises(SaveFailed, match="injected"):
                await shipper.ship_checkpoint()
            assert "injected" in store.journal.save_status()["lastError"]["message"]
            assert [c.path for c in store.changes_since_baseline()] == ["a.txt"]
            assert (await shipper.ship_checkpoint(final=True)).entries == 1
        assert mem.files(SCOPE) == {"a.txt": b"kept"}
    finally:
        store.close()


@pytest.mark.trio
async def test_after_the_thread_stops_a_save_fails_instead_of_hanging(tmp_path: Path) -> None:
    mem = ThreadNoting()
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"x")
        thread = ShipThread(store, mem, SCOPE, 1)
        async with thread:
            pass
        with trio.fail_after(10), pytest.raises(SaveFailed, match="checkpoint thread"):
            await thread.ship_checkpoint()
        assert [c.path for c in store.changes_since_baseline()] == ["a.txt"]
    finally:
        store.close()


@pytest.mark.trio
async def test_the_cadence_runs_on_the_thread_once_started(tmp_path: Path) -> None:
    mem = ThreadNoting()
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"on the cadence")
        async with ShipThread(store, mem, SCOPE, 1) as shipper:
            await trio.sleep(0.3)
            assert "upload_object" not in mem.calls  # nothing ships before it starts
            shipper.start_cadence(0.05)
            assert await trio.to_thread.run_sync(mem.committed.wait, 30)
        assert mem.files(SCOPE) == {"a.txt": b"on the cadence"}
        assert threading.get_ident() not in mem.threads
    finally:
        store.close()


def write_upper(store: Store, name: str, data: bytes, *, commit: bool) -> InodeNo:
    """What the filesystem does for a file out of line: the bytes in its upper
    file, a new size and generation; committed with its journal entry, or
    (``commit`` false) kept in memory, as a WRITE to a durable file does
    (fsagent.fuse.content), for the mount's next batch."""
    existing = store.tree.lookup(ROOT_INODE, name)
    f = store.get(existing) if existing else store.tree.create(ROOT_INODE, name, "file", 0o644)
    store.upper.path(f.ino).write_bytes(data)
    f.upper, f.digest, f.size = True, None, len(data)
    f.generation += 1
    if commit:
        store.tree.drop_inline(f)  # out of line: its bytes are the upper file's
        store.tree.persist(f, touch="write")
    return f.ino


@pytest.mark.trio
async def test_a_listing_commits_first_what_the_mount_keeps_in_memory(tmp_path: Path) -> None:
    """The ship thread lists from committed records. A WRITE to a durable file
    keeps its new size and generation in memory until the mount's next batch;
    the listing has the mount commit them first (``Store.commit_behind``), or it
    would see the old generation, take the new bytes for a write made during
    their upload and leave the file for a later save (at a stop: unsaved)."""
    mem = ThreadNoting()
    store = await hydrated(tmp_path, mem)
    try:
        first, latest = os.urandom(100_000), os.urandom(120_000)
        ino = write_upper(store, "wal", first, commit=True)
        write_upper(store, "wal", latest, commit=False)
        calls: list[int] = []

        def commit_behind() -> None:
            calls.append(threading.get_ident())
            store.tree.write_behind([ino], [])

        store.commit_behind = commit_behind
        async with ShipThread(store, mem, SCOPE, 1) as shipper:
            result = await shipper.ship_checkpoint(final=True)
        assert calls == [threading.get_ident()]  # on the mount's loop, before the listing
        assert result.entries == 1 and result.skipped_torn == 0
        assert mem.files(SCOPE)["wal"] == latest
        assert store.changes_since_baseline() == []
    finally:
        store.close()


@pytest.mark.trio
async def test_a_listing_fails_when_the_mount_cannot_commit_what_it_keeps(
    tmp_path: Path,
) -> None:
    """A save that cannot see every answered write fails instead of saving
    without it; the change stays for the next one."""
    mem = ThreadNoting()
    store = await hydrated(tmp_path, mem)
    try:
        write_upper(store, "wal", b"x" * 70_000, commit=True)

        def full() -> None:
            raise OSError(28, "No space left on device")

        store.commit_behind = full
        async with ShipThread(store, mem, SCOPE, 1) as shipper:
            with pytest.raises(SaveFailed):
                await shipper.ship_checkpoint(final=True)
        assert "wal" not in mem.files(SCOPE)
        assert [c.path for c in store.changes_since_baseline()] == ["wal"]
    finally:
        store.close()
