"""The shipper, warm start and the upload frame writer against the in-memory
bridge client: no FUSE, no PostgreSQL, each test in well under a second.

The real-mount tests (test_checkpoints.py, test_checkpoint_faults.py) cover
the same paths end to end; these pin down the protocol decisions.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from common.bridge import CHUNK_MAX
from fsagent.bridge.base import Frames
from fsagent.checkpoint.ship import Shipper, checkpoint_loop
from fsagent.errors import ControllerRefused, SaveFailed
from fsagent.fuse.mount import warm_start
from fsagent.state.hydrate import hydrate_manifest
from fsagent.state.store import ROOT_INODE, InodeNo, Store
from tests.support.memclient import MemoryBridgeClient, new_run

SCOPE = "task"


async def hydrated(tmp_path: Path, mem: MemoryBridgeClient) -> Store:
    store = Store.open(tmp_path / "state")
    await hydrate_manifest(store, mem, SCOPE)
    return store


def write_small(store: Store, name: str, data: bytes, parent: InodeNo = ROOT_INODE) -> InodeNo:
    """What the filesystem does for a small file: inline contents, a new generation."""
    existing = store.tree.lookup(parent, name)
    f = store.get(existing) if existing else store.tree.create(parent, name, "file", 0o644)
    f.upper, f.digest, f.size = True, None, len(data)
    f.generation += 1
    store.tree.persist(f, touch="write", inline=data)
    return f.ino


@pytest.fixture
def mem() -> MemoryBridgeClient:
    client = MemoryBridgeClient()
    client.put_file(SCOPE, "old.txt", b"saved before")
    client.put_file(SCOPE, "gone.txt", b"to be deleted")
    return client


@pytest.mark.trio
async def test_ship_uploads_commits_and_clears_the_change_set(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "new.txt", b"hello")
        store.tree.create(ROOT_INODE, "dir", "directory", 0o755)
        store.tree.unlink(ROOT_INODE, "gone.txt", keep=False)
        result = await Shipper(store, mem, SCOPE, 1).ship_checkpoint()
        assert result.entries == 3 and result.receipt is not None
        assert mem.files(SCOPE) == {"old.txt": b"saved before", "new.txt": b"hello"}
        assert mem.folder(SCOPE).entries["dir"].kind == "directory"
        assert store.changes_since_baseline() == []
        assert store.journal.pending_checkpoint() is None
        assert store.journal.save_status()["lastSave"]["entries"] == 3
    finally:
        store.close()


@pytest.mark.trio
async def test_lost_commit_response_replays_the_same_operation(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"first")
        shipper = Shipper(store, mem, SCOPE, 1)
        mem.lose_next("commit_checkpoint")
        with pytest.raises(SaveFailed, match="lost the response"):
            await shipper.ship_checkpoint()
        pending = store.journal.pending_checkpoint()
        assert pending is not None and pending["state"] == "committing"
        assert mem.files(SCOPE)["a.txt"] == b"first"  # applied on the server
        high = mem.folder(SCOPE).high_water
        # A later write must not be lost, and the replay must not apply twice.
        write_small(store, "b.txt", b"second")
        result = await shipper.ship_checkpoint()
        assert mem.folder(SCOPE).high_water == high + 1  # only b.txt is new
        assert [k for k in mem.receipts] == [
            (SCOPE, pending["operationId"]),
            (SCOPE, result.operation_id),
        ]
        assert mem.files(SCOPE) == {"old.txt": b"saved before", "gone.txt": b"to be deleted",
                                    "a.txt": b"first", "b.txt": b"second"}  # fmt: skip
        assert store.changes_since_baseline() == [] and store.journal.pending_checkpoint() is None
    finally:
        store.close()


@pytest.mark.trio
async def test_failed_upload_is_recorded_reported_and_retried(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"content")
        shipper = Shipper(store, mem, SCOPE, 1)
        mem.fail_next("upload_object", 2)
        for _ in range(2):
            with pytest.raises(SaveFailed, match="injected"):
                await shipper.ship_checkpoint()
        assert "injected" in store.journal.save_status()["lastError"]["message"]
        assert [s for s, _ in mem.reports] == ["failed", "failed"]
        # Each failure stands on its folder (a failure receipt, not final),
        # not merely on the run, which another folder's save would clear.
        assert [(s, f) for s, _, f, _ in mem.failure_receipts] == [(SCOPE, False)] * 2
        assert "commit_checkpoint" not in mem.calls
        assert [c.path for c in store.changes_since_baseline()] == ["a.txt"]
        result = await shipper.ship_checkpoint()
        assert result.entries == 1 and mem.files(SCOPE)["a.txt"] == b"content"
        assert store.changes_since_baseline() == []
    finally:
        store.close()


@pytest.mark.trio
async def test_stale_lease_fences_the_shipper_and_nothing_is_applied(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"from the old run")
        mem.run = replace(mem.run, lease_epoch=2)  # a newer run took the folder
        high = mem.folder(SCOPE).high_water
        shipper = Shipper(store, mem, SCOPE, 1)
        with pytest.raises(SaveFailed, match="stale lease") as info:
            await shipper.ship_checkpoint()
        cause = info.value.__cause__
        assert isinstance(cause, ControllerRefused) and cause.code == "stale_lease"
        assert mem.folder(SCOPE).high_water == high and "a.txt" not in mem.files(SCOPE)
        assert [c.path for c in store.changes_since_baseline()] == ["a.txt"]  # kept locally
        # Fenced: later saves, the final one included, send nothing at all.
        calls = len(mem.calls)
        for final in (False, True):
            with pytest.raises(SaveFailed, match="newer run holds the lease"):
                await shipper.ship_checkpoint(final=final)
        assert len(mem.calls) == calls
        assert "newer run" in store.journal.save_status()["lastError"]["message"]
        assert mem.failure_receipts == []  # the refusal is its receipt already
    finally:
        store.close()


class WatchingClient(MemoryBridgeClient):
    """Records the state dir's pending record at the moment each upload starts."""

    def __init__(self, store_ref: list[Store]) -> None:
        super().__init__()
        self.store_ref = store_ref
        self.seen: list[dict[str, Any] | None] = []

    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        self.seen.append(self.store_ref[0].journal.pending_checkpoint())
        return await super().upload_object(scope, frames)


@pytest.mark.trio
async def test_operation_id_is_persisted_before_any_byte_is_sent(tmp_path: Path) -> None:
    ref: list[Store] = []
    mem = WatchingClient(ref)
    store = await hydrated(tmp_path, mem)
    ref.append(store)
    try:
        write_small(store, "a.txt", b"a")
        shipper = Shipper(store, mem, SCOPE, 1)
        mem.fail_next("upload_object")
        with pytest.raises(SaveFailed):
            await shipper.ship_checkpoint()
        first = mem.seen[0]
        assert first is not None and first["state"] == "uploading"
        op_id = first["operationId"]
        # Reopened from disk (a crash): the same operation id carries on.
        store.close()
        store = Store.open(tmp_path / "state")
        ref[0] = store
        shipper = Shipper(store, mem, SCOPE, 1)
        result = await shipper.ship_checkpoint()
        assert result.operation_id == op_id
        assert mem.seen[1] is not None and mem.seen[1]["operationId"] == op_id
    finally:
        store.close()


@pytest.mark.trio
async def test_warm_start_ships_local_changes_then_takes_newer_server_ones(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "local.txt", b"never saved")
        mem.put_file(SCOPE, "theirs.txt", b"another writer")
        mem.put_file(SCOPE, "local.txt", b"server copy loses")  # journal has the path
        await warm_start(store, mem, Shipper(store, mem, SCOPE, 1), SCOPE)
        assert mem.files(SCOPE)["local.txt"] == b"never saved"
        theirs = store.tree.lookup(ROOT_INODE, "theirs.txt")
        assert theirs is not None and store.get(theirs).size == len(b"another writer")
        assert store.journal.baseline().high_water == mem.folder(SCOPE).high_water
        assert store.changes_since_baseline() == []
    finally:
        store.close()


@pytest.mark.trio
async def test_warm_start_keeps_local_state_when_the_server_asks_to_resync(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        mem.put_file(SCOPE, "theirs.txt", b"x")
        mem.folder(SCOPE).purge_floor = mem.folder(SCOPE).high_water + 1
        before = store.journal.baseline().high_water
        with caplog.at_level(logging.WARNING):
            await warm_start(store, mem, Shipper(store, mem, SCOPE, 1), SCOPE)
        assert "incomplete on the server" in caplog.text
        assert store.tree.lookup(ROOT_INODE, "theirs.txt") is None
        assert store.journal.baseline().high_water == before
    finally:
        store.close()


@pytest.mark.trio
async def test_upload_frames_carry_a_large_file_byte_exact(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        data = os.urandom(CHUNK_MAX * 2 + 12345)  # three frames, the last one short
        f = store.tree.create(ROOT_INODE, "big.bin", "file", 0o644)
        store.upper.write_complete(f.ino, lambda p: p.write_bytes(data))
        f.upper, f.size = True, len(data)
        f.generation += 1
        store.tree.persist(f, touch="write")
        store.tree.drop_inline(f)  # complete in upper/<inode>, as the filesystem leaves it
        result = await Shipper(store, mem, SCOPE, 1).ship_checkpoint()
        assert result.entries == 1 and mem.files(SCOPE)["big.bin"] == data
    finally:
        store.close()


@pytest.mark.trio
async def test_memory_client_refuses_a_corrupt_frame_like_the_controller() -> None:
    mem = MemoryBridgeClient()

    async def frames() -> Any:
        yield b"\x00\x00\x00\x05\x00\x00\x00\x05" + b"\x00" * 8 + b"junk!"

    with pytest.raises(ControllerRefused) as info:
        await mem.upload_object(SCOPE, frames)
    assert info.value.status == 400 and info.value.code == "bad_frame"
    assert mem.objects == {}


class BuggyClient(MemoryBridgeClient):
    """A commit that hits a bug (not a FsagentError) the first two times."""

    def __init__(self) -> None:
        super().__init__()
        self.bugs = 2
        self.committed = trio.Event()

    async def commit_checkpoint(self, scope: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.bugs:
            self.bugs -= 1
            raise RuntimeError("a bug")
        receipt = await super().commit_checkpoint(scope, body)
        self.committed.set()
        return receipt


async def _loop_survives_an_unexpected_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mem = BuggyClient()
    store = Store.open(tmp_path / "state")
    try:
        await hydrate_manifest(store, mem, SCOPE)
        write_small(store, "a.txt", b"survives")
        with caplog.at_level(logging.ERROR), trio.move_on_after(3600):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(checkpoint_loop, Shipper(store, mem, SCOPE, 1), 5.0)
                await mem.committed.wait()
                nursery.cancel_scope.cancel()
        assert mem.files(SCOPE)["a.txt"] == b"survives"
        assert caplog.text.count("checkpoint failed unexpectedly") == 2
        # Backoff: 5 s, then 10 s and 20 s after the two failures.
        assert trio.current_time() >= 35
    finally:
        store.close()


def test_checkpoint_loop_survives_an_unexpected_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(_loop_survives_an_unexpected_error, tmp_path, caplog, clock=clock)


# --- the agent folder contract ----------------------------------------------------


@pytest.mark.trio
async def test_an_entry_the_receipt_refuses_stays_unsaved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries the folder refuses one by one (the instruction entry) are not
    taken as saved: they stay in the change set for the next checkpoint."""
    mem = MemoryBridgeClient(new_run(agent_entry="AGENTS.md"))
    mem.put_file("agent", "AGENTS.md", b"# saved\n")
    store = Store.open(tmp_path / "state")
    try:
        await hydrate_manifest(store, mem, "agent")
        write_small(store, "AGENTS.md", b"caf\xe9\n")
        write_small(store, "notes.md", b"notes")
        result = await Shipper(store, mem, "agent", 1).ship_checkpoint()
        assert result.receipt is not None
        assert result.receipt["refusedEntries"] == [
            {"path": "AGENTS.md", "code": "ENTRY_NOT_UTF8", "message": "ENTRY_NOT_UTF8"}
        ]
        assert mem.files("agent") == {"AGENTS.md": b"# saved\n", "notes.md": b"notes"}
        assert [c.path for c in store.changes_since_baseline()] == ["AGENTS.md"]
        assert "AGENTS.md was not saved: ENTRY_NOT_UTF8" in caplog.text
        write_small(store, "AGENTS.md", b"# fixed\n")
        await Shipper(store, mem, "agent", 1).ship_checkpoint()
        assert mem.files("agent")["AGENTS.md"] == b"# fixed\n"
        assert store.changes_since_baseline() == []
    finally:
        store.close()


@pytest.mark.trio
async def test_a_limit_refusal_drops_its_body_and_the_next_checkpoint_starts_afresh(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    """The controller checks storage limits only for an operation it has no
    receipt of: the refused body was not applied, so it is not replayed."""
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "big.bin", b"b" * 100)
        shipper = Shipper(store, mem, SCOPE, 1)
        refusal = ControllerRefused("over a limit", 422, "agent_files_limit_exceeded")
        mem.fail_next("commit_checkpoint", exc=refusal)
        with pytest.raises(SaveFailed) as exc:
            await shipper.ship_checkpoint()
        assert exc.value.refused is True
        assert store.journal.pending_checkpoint() is None
        assert mem.reports == []  # a warning of the run, not a failed run
        store.tree.unlink(ROOT_INODE, "big.bin", keep=False)
        write_small(store, "small.txt", b"s")
        result = await shipper.ship_checkpoint()
        assert result.receipt is not None
        assert mem.files(SCOPE) == {"old.txt": b"saved before", "gone.txt": b"to be deleted",
                                    "small.txt": b"s"}  # fmt: skip
    finally:
        store.close()
