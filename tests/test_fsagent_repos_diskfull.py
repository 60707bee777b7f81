"""Saving a repository with the sandbox's disk completely full.

A small real filesystem (tmpfs with a size and an inode limit) holds
``$HOME/repos`` and fsagent's state. It is filled until every write fails
with ENOSPC (blocks and inodes), and then a checkpoint must still succeed:
nothing in a save needs to write to the sandbox (no archive, no temporary
copy, the metadata cache degrading to memory). The checkpoint is then
restored into a fresh sandbox and checked: the commit, staged content, an
unstaged edit, the untracked result, an exec bit, an in-checkout symlink,
``git fsck --strict`` and ``origin``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import trio

from fsagent.memclient import MemoryBridgeClient
from fsagent.repos import RepoSavers, prepare_all, repo_status
from tests.support.gitrepos import assert_restored, git, make_local_state, make_origin
from tests.support.smallfs import assert_full, fill, small_tmpfs


def tree_listing(root: Path) -> list[tuple[str, int]]:
    """Every path under ``root`` with its size: what a save must not change."""
    return sorted((str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*") if p.name)


def overwrite_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.write(data)


@pytest.mark.trio
async def test_checkpoint_succeeds_on_a_full_disk_and_restores_elsewhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    origin = make_origin(tmp_path / "origin")
    mem = MemoryBridgeClient()
    ws = mem.add_repo(str(origin), primary=True)
    caplog.set_level(logging.INFO, logger="fsagent")
    with small_tmpfs("48m", inodes=4096) as disk:
        home, state = disk / "home", disk / "state"
        _, _, results = await prepare_all(mem, home)
        assert [r.mode for r in results] == ["clone"]
        checkout = home / "repos" / "app"
        savers = RepoSavers(mem, mem.run, home, state)
        assert await savers.save_all() == 0  # state files exist from here on
        status_before = repo_status(home, state)[0]
        assert status_before["state"] == "saved"

        local = make_local_state(checkout)
        big = checkout / "results" / "big.bin"
        big.write_bytes(bytes(range(256)) * 4096 * 4)  # 4 MiB, uploaded in frames
        await trio.sleep(1.1)  # old enough for the metadata cache to keep them
        fill(disk)
        assert_full(disk)
        before = tree_listing(disk)

        assert await savers.save_all() == 0
        first = mem.repo(ws).saved[-1]
        assert mem.repo_files(ws)["results/big.bin"] == big.read_bytes()
        assert mem.repo_files(ws)[local.untracked_path] == local.untracked_text.encode()
        (saver,) = savers.savers.values()
        assert saver.cache.degraded is not None and saver.cache.degraded.startswith("ENOSPC")

        # A restarted saver (cache from its file, base from the controller).
        # Overwriting in place needs no new block: the agent can still change
        # a file, and the checkpoint saves it as a delta.
        overwrite_in_place(big, b"CHANGED!")
        restarted = RepoSavers(mem, mem.run, home, state)
        assert await restarted.save_all() == 0
        second = mem.repo(ws).saved[-1]
        assert second["checkpointId"] != first["checkpointId"]
        assert second["entries"] == first["entries"]
        assert mem.repo_files(ws)["results/big.bin"][:8] == b"CHANGED!"
        assert tree_listing(disk) == before  # the saves wrote nothing
        assert "not written" in caplog.text
        # The status file could not be replaced: it still shows the save before the fill.
        assert repo_status(home, state)[0]["lastSave"] == status_before["lastSave"]

    fresh = tmp_path / "fresh-home"
    _, _, results = await prepare_all(mem, fresh)
    assert [r.mode for r in results] == ["restore"]
    restored = fresh / "repos" / "app"
    assert_restored(restored, local, str(origin))
    assert (restored / "results" / "big.bin").read_bytes()[:8] == b"CHANGED!"
    record = json.loads((restored / ".git" / "fsagent" / "binding.json").read_text())
    assert record["prepared"] == "restore" and record["checkpointId"] == second["checkpointId"]
    assert git(restored, "log", "--format=%s", "-1").strip() == "local commit"
