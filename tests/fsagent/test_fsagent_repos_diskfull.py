"""Saving a repository with the sandbox's disk completely full.

A small real filesystem (tmpfs with a size and an inode limit) holds
``$HOME/repos`` and fsagent's state. It is filled until every write fails
with ENOSPC (blocks and inodes), and then a checkpoint must still succeed:
nothing in a save needs to write to the sandbox (no archive, no temporary
copy, the metadata cache degrading to memory). The checkpoint is then
restored into a fresh sandbox and checked: the commit, staged content, an
unstaged edit, the untracked result, an exec bit, an in-checkout symlink,
``git fsck --strict`` and ``origin``. Against the in-memory fake and a real
controller.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from fsagent.bridge.base import BridgeClient
from fsagent.repos.checkouts import RepoSavers, prepare_all, repo_status
from tests.support.controller import Tenant
from tests.support.gitrepos import (
    assert_restored,
    git,
    make_local_state,
    make_origin,
    new_repo_task,
)
from tests.support.memclient import MemoryBridgeClient
from tests.support.smallfs import assert_full, fill, small_tmpfs


def tree_listing(root: Path) -> list[tuple[str, int]]:
    """Every path under ``root`` with its size: what a save must not change."""
    return sorted((str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*") if p.name)


def overwrite_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.write(data)


@pytest.fixture(params=["fake", "controller"])
async def bridge(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[BridgeClient, Path]]:
    """A bridge client of a run whose task binds one workspace (a local bare
    origin), and that origin: the in-memory fake or a real controller."""
    origin = make_origin(tmp_path / "origin")
    if request.param == "fake":
        mem = MemoryBridgeClient()
        mem.add_repo(str(origin), primary=True)
        yield mem, origin
        return
    tenant: Tenant = request.getfixturevalue("tenant")
    task = new_repo_task(tenant)
    task.add_workspace(str(origin), primary=True)
    client = task.client(task.start_run())
    try:
        yield client, origin
    finally:
        await client.aclose()


async def current_id(client: BridgeClient) -> str | None:
    (repo,) = (await client.list_repos()).repos
    return repo.current.checkpoint_id if repo.current else None


async def saved_files(client: BridgeClient, where: Path) -> dict[str, bytes]:
    """The current checkpoint's files, fetched and verified through the bridge."""
    (repo,) = (await client.list_repos()).repos
    manifest = await client.repo_manifest(repo.workspace_id)
    files = [m for m in manifest.members if m["kind"] == "file"]
    digests = sorted({m["digest"] for m in files})
    await trio.Path(where).mkdir()
    got = await client.fetch_repo_objects(repo.workspace_id, digests, lambda i: where / str(i))
    by_digest = {}
    for i, (digest, (sha, _)) in enumerate(zip(digests, got, strict=True)):
        assert sha == digest
        by_digest[digest] = await trio.Path(where / str(i)).read_bytes()
    return {m["path"]: by_digest[m["digest"]] for m in files}


@pytest.mark.trio
async def test_checkpoint_succeeds_on_a_full_disk_and_restores_elsewhere(
    tmp_path: Path, bridge: tuple[BridgeClient, Path], caplog: pytest.LogCaptureFixture
) -> None:
    client, origin = bridge
    run = await client.get_run()
    caplog.set_level(logging.INFO, logger="fsagent")
    with small_tmpfs("48m", inodes=4096) as disk:
        home, state = disk / "home", disk / "state"
        _, _, results = await prepare_all(client, home)
        assert [r.mode for r in results] == ["clone"]
        checkout = home / "repos" / "app"
        savers = RepoSavers(client, run, home, state)
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
        first = await current_id(client)
        files = await saved_files(client, tmp_path / "first")
        assert files["results/big.bin"] == big.read_bytes()
        assert files[local.untracked_path] == local.untracked_text.encode()
        assert files[local.staged_path] == local.staged_text.encode()
        (saver,) = savers.savers.values()
        assert saver.cache.degraded is not None and saver.cache.degraded.startswith("ENOSPC")

        # A restarted saver (cache from its file, base from the controller).
        # Overwriting in place needs no new block: the agent can still change
        # a file, and the checkpoint saves it as a delta.
        overwrite_in_place(big, b"CHANGED!")
        restarted = RepoSavers(client, run, home, state)
        assert await restarted.save_all() == 0
        (again,) = restarted.savers.values()
        assert again.status["lastSave"]["full"] is False
        second = await current_id(client)
        assert second is not None and second != first
        assert (await saved_files(client, tmp_path / "second"))["results/big.bin"][:8] == (
            b"CHANGED!"
        )
        assert tree_listing(disk) == before  # the saves wrote nothing
        assert "not written" in caplog.text
        # The status file could not be replaced: it still shows the save before the fill.
        assert repo_status(home, state)[0]["lastSave"] == status_before["lastSave"]

    fresh = tmp_path / "fresh-home"
    _, _, results = await prepare_all(client, fresh)
    assert [r.mode for r in results] == ["restore"]
    restored = fresh / "repos" / "app"
    assert_restored(restored, local, str(origin))
    assert (restored / "results" / "big.bin").read_bytes()[:8] == b"CHANGED!"
    record = json.loads((restored / ".git" / "fsagent" / "binding.json").read_text())
    assert record["prepared"] == "restore" and record["checkpointId"] == second
    assert git(restored, "log", "--format=%s", "-1").strip() == "local commit"
