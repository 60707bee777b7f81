"""Plain-directory mode in process: the scan, the state, the shared shipper,
hydration and warm start against the in-memory bridge client, on a real
directory (no FUSE, no controller; each test well under a few seconds).

The same contract runs end to end against a real controller in
test_checkpoints.py and test_checkpoint_faults*.py (both modes) and in
test_fsagent_dirmode.py (refusals, a sandbox without FUSE).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from common.limits import MAX_ENTRIES, MAX_FILE_BYTES
from common.types import Digest
from fsagent.dirmode.fs import open_root
from fsagent.dirmode.scan import ENTRY_LIMIT_ENV, TICK_NS, entry_limit, scan_directory
from fsagent.dirmode.serve import DirShipper, hydrate_directory, take_incoming, warm_start
from fsagent.dirmode.store import DirStore
from fsagent.errors import ObjectUnavailable, StateModeMismatch
from fsagent.state.records import EMPTY_DIGEST
from fsagent.state.store import Store
from tests.support.memclient import MemoryBridgeClient, new_run

SCOPE = "task"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Served:
    """A dir-mode collection in process: its directory, state and shipper."""

    def __init__(self, tmp: Path, mem: MemoryBridgeClient) -> None:
        self.root = tmp / "task"
        self.root.mkdir(exist_ok=True)
        self.mem = mem
        self.fd = open_root(self.root)
        self.store = DirStore.open(tmp / "state")
        self.store.attach(self.fd)
        self.shipper = DirShipper(self.store, mem, SCOPE, 1)

    def close(self) -> None:
        self.store.close()
        os.close(self.fd)

    async def save(self, *, final: bool = False) -> dict[str, Any]:
        result = await self.shipper.ship_checkpoint(final=final)
        return {**result.to_json(), "dir": self.shipper.last_report}

    def changes(self) -> dict[str, str]:
        self.store.rescan(record=False)
        return {c.path: c.action for c in self.store.changes_since_baseline()}


@pytest.fixture
def mem() -> MemoryBridgeClient:
    client = MemoryBridgeClient()
    client.put_file(SCOPE, "keep.txt", b"kept")
    client.put_file(SCOPE, "edit.txt", b"before")
    client.put_file(SCOPE, "gone.txt", b"to be deleted")
    client.put_file(SCOPE, "docs/move-me.txt", b"moved, never uploaded again")
    client.put_file(SCOPE, "docs/twin.txt", b"kept")  # same digest as keep.txt
    client.put_file(SCOPE, "bin/tool", b"#!/bin/sh\n", executable=True)
    client.put_file(SCOPE, "empty", b"")
    return client


async def served(tmp_path: Path, mem: MemoryBridgeClient) -> Served:
    s = Served(tmp_path, mem)
    await hydrate_directory(s.store, mem, SCOPE, s.fd, 4)
    return s


def uploaded(mem: MemoryBridgeClient) -> int:
    return sum(1 for c in mem.calls if c in ("upload_object", "upload_batch"))


# --- hydration -----------------------------------------------------------------------


@pytest.mark.trio
async def test_hydration_places_every_file_and_the_first_scan_reads_none(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    s = await served(tmp_path, mem)
    try:
        assert (s.root / "docs" / "twin.txt").read_bytes() == b"kept"
        assert (s.root / "keep.txt").read_bytes() == b"kept"
        assert (s.root / "empty").read_bytes() == b""
        assert os.stat(s.root / "bin" / "tool").st_mode & 0o777 == 0o755
        assert os.stat(s.root / "keep.txt").st_mode & 0o777 == 0o644
        assert os.stat(s.root / "keep.txt").st_nlink == 1  # a shared object is copied, never linked
        assert list((tmp_path / "state" / "objects").iterdir()) == []
        scan = s.store.rescan()
        assert scan.stats.hashed == 0 and scan.stats.cache_hits == 7
        assert s.store.changes_since_baseline() == []
        assert (await s.save())["operationId"] is None
    finally:
        s.close()


@pytest.mark.trio
async def test_hydration_downloads_with_bounded_concurrency(tmp_path: Path) -> None:
    mem = MemoryBridgeClient()
    for i in range(24):  # 6 objects, each at 4 paths: copies in one directory at once
        mem.put_file(SCOPE, f"f{i:02}", f"object {i % 6}".encode())
    inner = mem.fetch_object
    running = peak = 0

    async def fetch(scope: str, digest: Digest, dest: Path) -> tuple[str, int]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await trio.sleep(0.01)
            return await inner(scope, digest, dest)
        finally:
            running -= 1

    mem.fetch_object = fetch  # type: ignore[method-assign]
    s = Served(tmp_path, mem)
    try:
        await hydrate_directory(s.store, mem, SCOPE, s.fd, 3)
        assert peak == 3
        assert sorted(os.listdir(s.root)) == [f"f{i:02}" for i in range(24)]  # no staging left
        assert all((s.root / f"f{i:02}").read_bytes() == f"object {i % 6}".encode()
                   for i in range(24))  # fmt: skip
    finally:
        s.close()


@pytest.mark.trio
async def test_a_forged_object_fails_the_hydration_which_starts_over(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    digest = sha(b"before")
    mem.objects[digest] = b"forged!"
    s = Served(tmp_path, mem)
    try:
        with pytest.raises(ObjectUnavailable, match="refusing to place it"):
            await hydrate_directory(s.store, mem, SCOPE, s.fd, 2)
        assert not (s.root / "edit.txt").exists()
        assert s.store.hydrating() and not s.store.journal.baseline().hydrated
        assert [p.name for p in (tmp_path / "state" / "objects").iterdir()] == []
        mem.objects[digest] = b"before"
        await hydrate_directory(s.store, mem, SCOPE, s.fd, 2)  # over what the first one placed
        assert (s.root / "edit.txt").read_bytes() == b"before"
        assert not s.store.hydrating() and s.changes() == {}
    finally:
        s.close()


# --- checkpoints ----------------------------------------------------------------------


@pytest.mark.trio
async def test_a_checkpoint_hashes_only_changed_files_and_ships_renames_as_references(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    s = await served(tmp_path, mem)
    try:
        (s.root / "edit.txt").write_bytes(b"after")
        (s.root / "new.txt").write_bytes(b"new")
        (s.root / "gone.txt").unlink()
        os.rename(s.root / "docs" / "move-me.txt", s.root / "moved.txt")
        os.chmod(s.root / "keep.txt", 0o755)
        (s.root / "newdir").mkdir()
        before = uploaded(mem)
        reply = await s.save()
        assert reply["entries"] == 7  # edit, new, gone, move (2), keep's exec bit, newdir
        assert reply["dir"]["scan"]["hashed"] == 4  # edit, new, moved, keep (its ctime moved)
        assert uploaded(mem) - before == 1  # new.txt and edit.txt go up in one batch
        assert mem.files(SCOPE) == {
            "keep.txt": b"kept", "edit.txt": b"after", "new.txt": b"new",
            "moved.txt": b"moved, never uploaded again", "docs/twin.txt": b"kept",
            "bin/tool": b"#!/bin/sh\n", "empty": b"",
        }  # fmt: skip
        assert mem.folder(SCOPE).entries["keep.txt"].executable is True
        assert s.changes() == {}
        again = s.store.rescan()
        assert again.stats.hashed == 0  # what the last scan read is trusted now
    finally:
        s.close()


@pytest.mark.trio
async def test_a_file_changing_while_read_is_left_for_the_next_checkpoint(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    s = await served(tmp_path, mem)
    busy = s.root / "busy.bin"
    try:
        busy.write_bytes(b"A" * 100_000)
        (s.root / "calm.txt").write_bytes(b"calm")
        rewrites = 0

        def rewrite(path: str) -> None:
            nonlocal rewrites
            if path == "busy.bin":  # every read: the second half changes under the reader
                rewrites += 1
                with open(busy, "r+b") as fh:
                    fh.seek(50_000)
                    fh.write(b"B" * 50_000)

        s.store.after_read = rewrite
        reply = await s.save()
        assert rewrites and reply["entries"] == 1
        assert reply["dir"]["retrying"] == ["busy.bin"]
        assert "busy.bin" not in mem.files(SCOPE) and mem.files(SCOPE)["calm.txt"] == b"calm"
        s.store.after_read = None
        reply = await s.save()
        assert reply["entries"] == 1 and reply["dir"]["retrying"] == []
        assert mem.files(SCOPE)["busy.bin"] == b"A" * 50_000 + b"B" * 50_000
    finally:
        s.close()


@pytest.mark.trio
async def test_a_file_changed_after_the_scan_is_not_uploaded(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    s = await served(tmp_path, mem)
    try:
        (s.root / "late.txt").write_bytes(b"first version")
        opener = s.store.upper.open_read

        def change_then_open(ino: int) -> Any:
            (s.root / "late.txt").write_bytes(b"second version, longer")
            return opener(ino)

        s.store.upper.open_read = change_then_open  # type: ignore[method-assign]
        result = await s.shipper.ship_checkpoint()
        assert result.skipped_torn == 1 and "late.txt" not in mem.files(SCOPE)
        assert s.changes() == {"late.txt": "upload"}
        s.store.upper.open_read = opener  # type: ignore[method-assign]
        assert (await s.save())["entries"] == 1
        assert mem.files(SCOPE)["late.txt"] == b"second version, longer"
    finally:
        s.close()


@pytest.mark.trio
async def test_links_special_files_bad_names_and_huge_files_are_refused_by_name(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not the agent's to save")
    s = await served(tmp_path, mem)
    root = s.root
    try:
        os.symlink(outside / "secret", root / "link")
        os.symlink(outside, root / "linked-dir")
        os.link(root / "keep.txt", root / "hard")
        os.mkfifo(root / "fifo")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(root / "sock"))
        fd = os.open(root / "huge.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(fd, MAX_FILE_BYTES + 1)  # sparse: no GiB is written
        os.close(fd)
        (root / "bad\\name").write_bytes(b"x")
        (root / ".fsagent").write_bytes(b"reserved")
        os.mkdir(root / "bad\x01dir")
        (root / "bad\x01dir" / "inside.txt").write_bytes(b"never listed")
        (root / "edit.txt").unlink()
        os.symlink(outside / "secret", root / "edit.txt")  # a saved file replaced by a link
        (root / "fine.txt").write_bytes(b"saved anyway")
        reply = await s.save()
        refused = {r["path"]: r["reason"] for r in reply["dir"]["refused"]}
        assert refused == {
            ".fsagent": "invalid_name: path segment '.fsagent' is reserved",
            "bad\\name": "invalid_name: path contains forbidden character U+005C",
            "bad\x01dir": "invalid_name: path contains forbidden character U+0001",
            "edit.txt": "symlink",
            "fifo": "special_file",
            "hard": "hard_link",
            "keep.txt": "hard_link",
            "huge.bin": "file_too_large",
            "link": "symlink",
            "linked-dir": "symlink",
            "sock": "special_file",
        }
        assert reply["dir"]["refusedCount"] == 11
        # The valid change is saved; nothing refused is, and no saved file was
        # deleted because something unsavable took its place.
        assert reply["entries"] == 1
        assert mem.files(SCOPE)["fine.txt"] == b"saved anyway"
        assert mem.files(SCOPE)["edit.txt"] == b"before"
        assert mem.files(SCOPE)["keep.txt"] == b"kept"
        assert b"not the agent's to save" not in mem.objects.values()
        assert s.store.scan_report()["refusedCount"] == 11  # type: ignore[index]
        # Once the refused things are gone, what replaced them is an ordinary change.
        for name in ("link", "linked-dir", "hard", "fifo", "sock", "huge.bin", "edit.txt"):
            os.unlink(root / name)
        assert s.changes() == {"edit.txt": "delete"}
    finally:
        s.close()


def test_the_entry_limit_keeps_saved_paths_and_admits_new_ones_in_path_order(
    tmp_path: Path,
) -> None:
    root = tmp_path / "d"
    (root / "new-dir").mkdir(parents=True)
    for name in ("a", "b", "z-saved"):
        (root / name).write_bytes(name.encode())
    (root / "new-dir" / "child").write_bytes(b"c")
    fd = open_root(root)
    try:
        scan = scan_directory(fd, {}, saved={"z-saved"}, max_entries=3)
    finally:
        os.close(fd)
    assert sorted(scan.entries) == ["a", "b", "z-saved"]
    assert scan.problems == {"new-dir": "entry_limit", "new-dir/child": "entry_limit"}


@pytest.mark.parametrize(
    ("value", "limit"),
    [("7", 7), ("", MAX_ENTRIES), ("0", MAX_ENTRIES), ("-3", MAX_ENTRIES), ("many", MAX_ENTRIES),
     (str(MAX_ENTRIES + 1), MAX_ENTRIES)],
)  # fmt: skip
def test_the_test_entry_limit_only_lowers_the_limit(
    value: str, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENTRY_LIMIT_ENV, value)
    assert entry_limit() == limit


def test_a_file_moved_between_directories_during_the_walk_is_still_found(tmp_path: Path) -> None:
    root = tmp_path / "d"
    for d in ("a", "b"):
        (root / d).mkdir(parents=True)
        (root / d / "trigger").write_bytes(d.encode())
    (root / "b" / "x").write_bytes(b"moving")
    (root / "gone").write_bytes(b"old")
    moved: list[str] = []

    def move_into_listed(path: str) -> None:
        # Hashing a/trigger means a is listed: move x from the other one into it.
        here = path.split("/")[0]
        other = "b" if here == "a" else "a"
        if path.endswith("trigger") and not moved and (root / other / "x").exists():
            os.rename(root / other / "x", root / here / "x")
            moved.append(f"{here}/x")

    fd = open_root(root)
    try:
        first = scan_directory(fd, {})
        (root / "gone").unlink()
        for d in ("a", "b"):  # new contents: read again (and the hook fires)
            (root / d / "trigger").write_bytes(b"again " + d.encode())
        scan = scan_directory(fd, first.entries, after_read=move_into_listed)
    finally:
        os.close(fd)
    assert moved and scan.stable
    [where] = moved
    assert where in scan.entries and scan.entries[where].digest == sha(b"moving")
    assert {"a/x", "b/x"} - {where} & set(scan.entries) == set()
    assert "gone" not in scan.entries


@pytest.mark.trio
async def test_deletions_wait_for_a_scan_that_holds_still(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    s = await served(tmp_path, mem)
    try:
        (s.root / "gone.txt").unlink()
        (s.root / "docs" / "churn-0").write_bytes(b"0")
        count = 0

        def churn(path: str) -> None:
            nonlocal count
            if path.startswith("docs/churn-"):  # every file read adds another one
                count += 1
                (s.root / "docs" / f"churn-{count}").write_bytes(str(count).encode())

        s.store.after_read = churn
        reply = await s.save()
        assert reply["dir"]["stable"] is False and "docs" in reply["dir"]["retrying"]
        assert "gone.txt" in mem.files(SCOPE)  # not deleted from an unsteady listing
        s.store.after_read = None
        await s.save()
        assert "gone.txt" not in mem.files(SCOPE)
        assert {p for p in mem.files(SCOPE) if p.startswith("docs/churn-")} == {
            f"docs/churn-{i}" for i in range(count + 1)
        }
    finally:
        s.close()


@pytest.mark.trio
async def test_at_most_one_checkpoint_is_in_flight(tmp_path: Path, mem: MemoryBridgeClient) -> None:
    """Checkpoints asked for at once (the periodic loop, a flush, the final
    save) run one after the other: a scan never starts while another
    checkpoint's scan or commit is in flight, and each ships what the
    one before it left."""
    s = await served(tmp_path, mem)
    events: list[str] = []
    in_flight = peak = 0
    rescan, commit = s.store.rescan, mem.commit_checkpoint

    def slow_scan(*, record: bool = True) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        events.append("scan")
        time.sleep(0.05)  # in the worker thread: the others would start now, if they could
        return rescan(record=record)

    async def slow_commit(scope: str, body: dict[str, Any]) -> dict[str, Any]:
        nonlocal in_flight
        await trio.sleep(0.05)
        receipt = await commit(scope, body)
        events.append("commit " + ",".join(sorted(e["path"] for e in body["entries"])))
        # Written while this checkpoint is still in flight: the next one's to ship.
        (s.root / f"after-{len(events)}.txt").write_bytes(b"later")
        in_flight -= 1
        return receipt

    s.store.rescan = slow_scan  # type: ignore[method-assign]
    mem.commit_checkpoint = slow_commit  # type: ignore[method-assign]
    try:
        (s.root / "first.txt").write_bytes(b"first")
        results = []

        async def save(final: bool) -> None:
            results.append(await s.shipper.ship_checkpoint(final=final))

        async with trio.open_nursery() as nursery:
            for final in (False, False, True):
                nursery.start_soon(save, final)
        assert peak == 1, events
        assert events == [
            "scan", "commit first.txt", "scan", "commit after-2.txt", "scan", "commit after-4.txt",
        ]  # fmt: skip
        assert [r.entries for r in results] == [1, 1, 1]
        assert {p for p in mem.files(SCOPE) if p.startswith(("first", "after"))} == {
            "first.txt", "after-2.txt", "after-4.txt",
        }  # fmt: skip
    finally:
        s.close()


# --- warm start -------------------------------------------------------------------------


@pytest.mark.trio
async def test_warm_start_ships_local_changes_then_takes_the_servers_elsewhere(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    s = await served(tmp_path, mem)
    (s.root / "edit.txt").write_bytes(b"local edit")
    (s.root / "docs" / "local-new.txt").write_bytes(b"new here")
    s.close()  # the daemon stopped before saving them
    mem.put_file(SCOPE, "edit.txt", b"server edit (older than ours, shipped first)")
    mem.put_file(SCOPE, "keep.txt", b"server changed keep")
    mem.put_file(SCOPE, "added.txt", b"server added", executable=True)
    folder = mem.folder(SCOPE)
    folder.entries["gone.txt"] = replace(
        folder.entries["gone.txt"], deleted=True, version=folder.bump()
    )
    again = Served(tmp_path, mem)
    try:
        again.store.load()
        await warm_start(again.store, mem, again.shipper, SCOPE)
        root = again.root
        assert (root / "edit.txt").read_bytes() == b"local edit"
        assert mem.files(SCOPE)["edit.txt"] == b"local edit"
        assert (root / "keep.txt").read_bytes() == b"server changed keep"
        assert (root / "added.txt").read_bytes() == b"server added"
        assert os.stat(root / "added.txt").st_mode & 0o100
        assert not (root / "gone.txt").exists()
        assert (root / "docs" / "local-new.txt").read_bytes() == b"new here"
        assert again.changes() == {}
        assert again.store.rescan().stats.hashed == 0
    finally:
        again.close()


@pytest.mark.trio
async def test_incoming_changes_never_follow_a_link_put_in_a_directorys_place(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    s = await served(tmp_path, mem)
    try:
        os.rename(s.root / "docs", tmp_path / "docs-elsewhere")
        os.symlink(outside, s.root / "docs")
        mem.put_file(SCOPE, "docs/twin.txt", b"would land outside")
        mem.put_file(SCOPE, "docs/new.txt", b"would land outside too")
        await take_incoming(s.store, mem, SCOPE)
        assert list(outside.iterdir()) == []
        assert (s.root / "docs").is_symlink()
    finally:
        s.close()


# --- the state dir ----------------------------------------------------------------------


@pytest.mark.trio
async def test_a_long_path_survives_a_restart_and_its_deletion_ships(tmp_path: Path) -> None:
    mem = MemoryBridgeClient()
    long_path = "/".join(["d" * 200] * 3) + "/file.txt"  # over LMDB's 511-byte key limit
    mem.put_file(SCOPE, long_path, b"deep")
    s = Served(tmp_path, mem)
    await hydrate_directory(s.store, mem, SCOPE, s.fd, 2)
    s.close()
    again = Served(tmp_path, mem)
    try:
        again.store.load()
        assert long_path in again.store.saved()
        assert again.changes() == {}
        os.unlink(again.root / long_path)
        assert (await again.save())["entries"] == 1
        assert long_path not in mem.files(SCOPE)
    finally:
        again.close()


def test_a_state_dir_serves_one_mode(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "fuse")
    store.dir.claim_mode("fuse", "a test mount works", "/home/a/task")
    store.close()
    dir_store = DirStore.open(tmp_path / "fuse")
    try:
        with pytest.raises(StateModeMismatch, match="served in fuse mode"):
            dir_store.dir.claim_mode("dir", "/dev/fuse missing", "/home/a/task")
    finally:
        dir_store.close()
    dir_store = DirStore.open(tmp_path / "dir")
    dir_store.dir.claim_mode("dir", "/dev/fuse missing", "/home/a/task")
    dir_store.close()
    store = Store.open(tmp_path / "dir")
    try:
        with pytest.raises(StateModeMismatch, match="served in dir mode"):
            store.dir.claim_mode("fuse", "--mode fuse", "/home/a/task")
        assert store.dir.mode_record() == {
            "mode": "dir", "reason": "/dev/fuse missing", "path": "/home/a/task",
        }  # fmt: skip
    finally:
        store.close()


def test_a_file_changed_within_a_tick_is_read_after_it(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    (root / "fresh").write_bytes(b"just written")
    fd = open_root(root)
    try:
        scan = scan_directory(fd, {})
    finally:
        os.close(fd)
    entry = scan.entries["fresh"]
    assert entry.verified_ns - max(entry.mtime_ns, entry.ctime_ns) >= TICK_NS
    assert entry.digest == sha(b"just written") and entry.digest != EMPTY_DIGEST


@pytest.mark.trio
async def test_a_server_change_that_cannot_be_placed_is_asked_for_again(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    s = await served(tmp_path, mem)
    try:
        since = s.store.journal.baseline().high_water
        mem.put_file(SCOPE, "keep.txt/inner", b"below a file")  # no parent directory here
        mem.put_file(SCOPE, "fine.txt", b"placed")
        assert await take_incoming(s.store, mem, SCOPE) == 1
        assert "server change at keep.txt/inner not applied" in caplog.text
        assert (s.root / "fine.txt").read_bytes() == b"placed"
        assert s.store.journal.baseline().high_water == since  # the next start asks again
        folder = mem.folder(SCOPE)
        folder.entries["keep.txt/inner"] = replace(
            folder.entries["keep.txt/inner"], deleted=True, version=folder.bump()
        )
        # Asked again: fine.txt comes back as already placed, the bad entry is gone.
        assert await take_incoming(s.store, mem, SCOPE) == 0
        assert s.store.journal.baseline().high_water == folder.high_water
        assert (s.root / "keep.txt").read_bytes() == b"kept" and s.changes() == {}
    finally:
        s.close()


@pytest.mark.trio
async def test_the_agents_instruction_entry_is_never_deleted_by_a_save(tmp_path: Path) -> None:
    mem = MemoryBridgeClient(new_run(agent_entry="AGENTS.md"))
    mem.put_file("agent", "AGENTS.md", b"# how to work")
    mem.put_file("agent", "notes/a.md", b"a")
    root = tmp_path / "agent"
    root.mkdir()
    fd = open_root(root)
    store = DirStore.open(tmp_path / "state")
    try:
        store.attach(fd)
        store.protected = "AGENTS.md"
        await hydrate_directory(store, mem, "agent", fd, 2)
        shipper = DirShipper(store, mem, "agent", 1)
        (root / "AGENTS.md").unlink()
        (root / "notes" / "b.md").write_bytes(b"b")
        result = await shipper.ship_checkpoint()
        assert result.entries == 1 and mem.files("agent")["notes/b.md"] == b"b"
        assert mem.files("agent")["AGENTS.md"] == b"# how to work"
        [refused] = (shipper.last_report or {})["refused"]
        assert refused["path"] == "AGENTS.md" and refused["reason"].startswith("entry_protected")
        (root / "AGENTS.md").mkdir()  # a directory in its place is not saved either
        (root / "AGENTS.md" / "x").write_bytes(b"x")
        assert (await shipper.ship_checkpoint()).entries == 0
        assert "AGENTS.md/x" not in mem.files("agent")
        shutil.rmtree(root / "AGENTS.md")
        (root / "AGENTS.md").write_bytes(b"# rewritten")  # a new content saves as ever
        assert (await shipper.ship_checkpoint()).entries == 1
        assert mem.files("agent")["AGENTS.md"] == b"# rewritten"
    finally:
        store.close()
        os.close(fd)


@pytest.mark.trio
async def test_the_agent_folder_saves_entries_past_the_scan_limit_for_the_controller_to_judge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its 100,000 entries are a limit of the save, not of writes: the
    scan admits what another collection refuses by name (``entry_limit``)."""
    monkeypatch.setenv(ENTRY_LIMIT_ENV, "3")
    shipped: dict[str, dict[str, bytes]] = {}
    for scope, entry in (("agent", "AGENTS.md"), ("task", None)):
        mem = MemoryBridgeClient(new_run(agent_entry=entry))
        if entry is not None:
            mem.put_file(scope, entry, b"# how to work")
        root = tmp_path / scope
        root.mkdir()
        fd = open_root(root)
        store = DirStore.open(tmp_path / f"state-{scope}")
        try:
            store.attach(fd)
            store.protected = entry
            await hydrate_directory(store, mem, scope, fd, 2)
            for i in range(5):
                (root / f"f{i}.md").write_bytes(b"%d" % i)
            shipper = DirShipper(store, mem, scope, 1)
            await shipper.ship_checkpoint()
            shipped[scope] = mem.files(scope)
            refused = (shipper.last_report or {}).get("refused", [])
            if entry is None:
                assert [(r["path"], r["reason"]) for r in refused] == [
                    ("f3.md", "entry_limit"),
                    ("f4.md", "entry_limit"),
                ]
            else:
                assert refused == []
        finally:
            store.close()
            os.close(fd)
    assert sorted(shipped["agent"]) == ["AGENTS.md", "f0.md", "f1.md", "f2.md", "f3.md", "f4.md"]
    assert sorted(shipped["task"]) == ["f0.md", "f1.md", "f2.md"]
