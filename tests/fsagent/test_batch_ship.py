"""The shipper's batches against the in-memory bridge client: small files go
up many per request, a batch failure fails the checkpoint and keeps every
change, and a retry ships them all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsagent.checkpoint.ship import BATCH_TARGET_MEMBERS, Shipper
from fsagent.errors import SaveFailed
from fsagent.state.store import ROOT_INODE
from tests.fsagent.test_fsagent_ship_inproc import SCOPE, hydrated, write_small
from tests.support.memclient import MemoryBridgeClient


@pytest.fixture
def mem() -> MemoryBridgeClient:
    return MemoryBridgeClient()


@pytest.mark.trio
async def test_small_files_go_up_in_batches_and_large_ones_alone(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        files = {f"f{i:04d}.txt": os.urandom(100 + i) for i in range(2 * BATCH_TARGET_MEMBERS + 2)}
        for name, data in files.items():
            write_small(store, name, data)
        big = os.urandom(200_000)
        f = store.tree.create(ROOT_INODE, "big.bin", "file", 0o644)
        store.upper.write_complete(f.ino, lambda p: p.write_bytes(big))
        f.upper, f.size = True, len(big)
        f.generation += 1
        store.tree.persist(f, touch="write")
        store.tree.drop_inline(f)
        result = await Shipper(store, mem, SCOPE, 1).ship_checkpoint()
        assert result.entries == len(files) + 1
        assert mem.calls.count("upload_batch") == 3
        assert mem.calls.count("upload_object") == 1  # the large file
        assert mem.files(SCOPE) == {**files, "big.bin": big}
        assert store.changes_since_baseline() == []
    finally:
        store.close()


@pytest.mark.trio
async def test_a_failed_batch_fails_the_checkpoint_and_the_retry_ships_everything(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        files = {f"f{i}.txt": f"file {i}".encode() for i in range(10)}
        for name, data in files.items():
            write_small(store, name, data)
        shipper = Shipper(store, mem, SCOPE, 1)
        mem.fail_next("upload_batch")
        with pytest.raises(SaveFailed, match="injected"):
            await shipper.ship_checkpoint()
        assert "commit_checkpoint" not in mem.calls
        assert {c.path for c in store.changes_since_baseline()} == set(files)
        mem.lose_next("upload_batch")  # stored, but the answer is lost: uploaded again
        with pytest.raises(SaveFailed, match="lost the response"):
            await shipper.ship_checkpoint()
        result = await shipper.ship_checkpoint()
        assert result.entries == len(files) and mem.files(SCOPE) == files
        assert store.changes_since_baseline() == []
    finally:
        store.close()
