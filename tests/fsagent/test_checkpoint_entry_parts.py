"""A change set with more entries than one checkpoint may name saves, in parts.

The controller refuses a checkpoint naming more than ``--max-checkpoint-entries``
entries (400 ``too_many``) or creating more than ``--max-checkpoint-rows``
rows. An agent that replaces a large tree within one save interval (``rm -rf
node_modules && npm install``) lists a deletion for every old path and an
upload for every new one: before, such a change set was refused at every
save, for the rest of the run. The shipper now plans its parts within both
bounds, which the run info announces (fsagent/checkpoint/ship.py, "Parts"): a deletion
under a deleted directory is acknowledged with that directory, not named,
and when the entries still need several parts the deletions go first, so no
part leaves the folder holding old and new trees at once (the agent folder's
entry limit would refuse that, though the saved state is within it).

In process (the memory bridge client, which refuses what the controller
refuses) the plan, and with real daemons against a real controller started
with a bound of 20 entries, a FUSE mount and then a plain directory: a task
folder replaces a tree; an agent folder (whose entry limit is 20 too) replaces
its files in one checkpoint, since its save is saved whole or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsagent.checkpoint.ship import PartRoom, Shipper, delete_units
from fsagent.state.store import ROOT_INODE, BaseEntry, Change, JournalSeq, Store
from tests.fsagent.test_fsagent_ship_inproc import SCOPE, hydrated, write_small
from tests.support.agentfiles import (
    agent_files,
    flush_reply,
    mount_agent,
    new_agent,
    run_detail,
    run_receipts,
    start_agent_run,
)
from tests.support.checkpoints import folder_id
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)
from tests.support.memclient import MemoryBridgeClient
from tests.support.mount import MountFactory
from tests.system.test_checkpoints import server_files, start_run, token_file

CAP = 20
"""Entries one checkpoint may name here (and the agent folder's entry limit)."""


# --- the plan -----------------------------------------------------------------


def deletion(path: str, kind: str) -> Change:
    return Change(path, "delete", JournalSeq(1), BaseEntry(kind, None, 0, False, 1))  # type: ignore[arg-type]


def test_deletions_under_a_deleted_directory_ride_with_it() -> None:
    changes = [
        deletion("d/y/z", "file"),
        deletion("d", "directory"),
        deletion("d/x", "file"),
        deletion("d/y", "directory"),
        deletion("dx", "file"),  # beside d, not below it
        deletion("e", "file"),
        deletion("e/f", "file"),  # a file e held no e/f: it is its own unit
    ]
    units = [[c.path for c in unit] for unit in delete_units(changes)]
    assert units == [["d", "d/x", "d/y", "d/y/z"], ["dx"], ["e"], ["e/f"]]


def test_a_part_holds_its_entries_and_rows_and_always_makes_progress() -> None:
    room = PartRoom(entries=10, rows=5)
    assert room.take("a/b/c")  # rows a, a/b, a/b/c
    assert room.take("a/b/d")  # + a/b/d
    assert not room.take("x/y")  # + x, x/y: 6 rows
    assert room.take("a/e")  # + a/e: 5 rows
    assert not room.take("a/f") and room.taken == 3
    one = PartRoom(entries=1, rows=1)
    assert one.take("deep/er/path") and not one.take("z")
    room = PartRoom(entries=2, rows=100)
    assert room.take("p") and room.take("q") and not room.take("r")


def remove_tree(store: Store, name: str) -> None:
    d = store.tree.lookup(ROOT_INODE, name)
    assert d is not None
    for child, _ in store.tree.children(d):
        store.tree.unlink(d, child, keep=False)
    store.tree.unlink(ROOT_INODE, name, keep=False)


def bodies(mem: MemoryBridgeClient) -> list[dict[str, Any]]:
    """The committed checkpoint bodies, in order (lease epoch left out)."""
    return [json.loads(seen) for (scope, _), (seen, _) in mem.receipts.items() if scope == SCOPE]


@pytest.mark.trio
async def test_a_replaced_tree_saves_in_parts_within_the_entry_bound(tmp_path: Path) -> None:
    mem = MemoryBridgeClient(checkpoint_entries=CAP)
    store = await hydrated(tmp_path, mem)
    try:
        old = store.tree.create(ROOT_INODE, "old", "directory", 0o755)
        for i in range(30):
            write_small(store, f"f{i:02}", f"old {i}".encode(), parent=old.ino)
        first = await Shipper(store, mem, SCOPE, 1).ship_checkpoint()
        assert first.parts == 2 and first.entries == 31  # old/ and its 30 files
        assert len(mem.files(SCOPE)) == 30
        sent_before = len(mem.receipts)

        # rm -rf old && a new tree, within one interval: 30 + 1 + 45 + 6 changes.
        remove_tree(store, "old")
        new = {f"n{i:02}": f"new {i}".encode() for i in range(45)}
        for name, data in new.items():
            write_small(store, name, data)
        pkg = store.tree.create(ROOT_INODE, "pkg", "directory", 0o755)
        for i in range(5):
            write_small(store, f"m{i}", b"module", parent=pkg.ino)
        assert len(store.changes_since_baseline()) == 31 + 45 + 6

        result = await Shipper(store, mem, SCOPE, 1).ship_checkpoint(final=True)
        sent = bodies(mem)[sent_before:]
        # One deletion names the whole old tree; 1 + 45 + 6 entries in 3 parts.
        assert [len(b["entries"]) for b in sent] == [CAP, CAP, 12], sent
        assert result.parts == 3 and result.entries == 52
        deletes = [[e["path"] for e in b["entries"] if e["op"] == "delete"] for b in sent]
        assert deletes == [["old"], [], []], deletes
        for b in sent:
            paths = [e["path"].encode() for e in b["entries"]]
            assert paths == sorted(paths)
        assert [b["final"] for b in sent] == [False, False, True]
        expected = {**new, **{f"pkg/m{i}": b"module" for i in range(5)}}
        assert mem.files(SCOPE) == expected
        assert store.changes_since_baseline() == [] and store.journal.pending_checkpoint() is None
    finally:
        store.close()


# --- real daemons, a real controller ------------------------------------------


@pytest.fixture(scope="module")
def capped(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller whose checkpoints name at most 20 entries and whose agent
    folders hold at most 20."""
    flags = ("--max-checkpoint-entries", str(CAP), "--agent-max-entries", str(CAP))
    with private_controller(pg_cluster, "fsa-entparts-", *flags) as ctl:
        yield ctl


@pytest.fixture
def ct(capped: ControllerProcess) -> Tenant:
    return bootstrap_tenant(capped)


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """A FUSE mount, then a plain directory: the same contract."""
    return mode_mounts


def write_tree(root: Path, name: str, count: int, text: str) -> dict[str, bytes]:
    (root / name).mkdir()
    files = {f"{name}/f{i:02}.js": f"{text} {i}".encode() for i in range(count)}
    for path, data in files.items():
        (root / path).write_bytes(data)
    return files


def remove(root: Path, name: str) -> None:
    for child in (root / name).iterdir():
        child.unlink()
    (root / name).rmdir()


@pytest.mark.fuse
def test_a_task_folder_replacing_a_large_tree_saves_every_change(
    mounts: MountFactory, ct: Tenant
) -> None:
    run = start_run(ct)
    m = mounts.mount(ct.controller.url, scope="task", token_file=token_file(mounts, run))
    root = m.mountpoint
    write_tree(root, "node_modules", 30, "v1")
    code, reply = flush_reply(m)
    assert code == 0 and reply["ok"] is True, reply
    assert reply["result"]["parts"] == 2, reply

    remove(root, "node_modules")
    files = write_tree(root, "node_modules", 25, "v2")  # the same directory, new files
    files |= write_tree(root, "dist", 25, "build")
    code, reply = flush_reply(m)
    assert code == 0 and reply["ok"] is True, reply
    assert reply["result"]["parts"] >= 3, reply
    assert server_files(ct, "task", run["task"]) == files
    fid = folder_id(ct.controller, ct.company_id, "task", run["task"])
    with ct.controller.db() as conn:
        sizes = conn.execute(
            "SELECT (result->>'entries')::int FROM receipts"
            " WHERE folder_id = %s AND operation_id LIKE 'cp-%%'",
            (fid,),
        ).fetchall()
    assert sizes and all(0 < n <= CAP for (n,) in sizes), sizes
    assert m.signal(15) == 0, m.stderr()
    assert server_files(ct, "task", run["task"]) == files


@pytest.mark.fuse
def test_an_agent_folder_replacing_its_files_within_its_limit_saves(
    mounts: MountFactory, ct: Tenant
) -> None:
    """12 notes replaced by 12 others: 24 changes, more than another folder's
    checkpoint may name, for a folder that holds 13 entries before and after.
    An agent folder's checkpoint may name twice its entry limit: the save is
    one checkpoint, whole (split, a part would hold 25, over the limit)."""
    agent = new_agent(ct)
    run = start_agent_run(ct, agent, user=ct.user_id)
    m = mount_agent(mounts, run)
    root = m.mountpoint
    for i in range(12):
        (root / f"old{i:02}.md").write_bytes(f"old note {i}".encode())
    code, reply = flush_reply(m)
    assert code == 0 and reply["ok"] is True, reply

    for i in range(12):
        (root / f"old{i:02}.md").unlink()
    files = {f"new{i:02}.md": f"new note {i}".encode() for i in range(12)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    code, reply = flush_reply(m)
    assert code == 0 and reply["ok"] is True, reply
    assert reply["result"]["parts"] == 1 and reply["result"]["entries"] == 24, reply
    assert agent_files(ct, agent) == {"AGENTS.md": b"", **files}
    assert [r["outcome"] for r in run_receipts(ct, run.run_id)] == ["saved"] * 2
    detail = run_detail(ct, run.run_id).json()
    assert detail["state"] != "failed" and detail["warnings"] == [], detail
    assert m.signal(15) == 0, m.stderr()
    assert agent_files(ct, agent) == {"AGENTS.md": b"", **files}
