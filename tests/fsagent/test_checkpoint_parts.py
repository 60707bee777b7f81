"""A change set larger than the run's upload allowance saves, in parts.

The controller lets a run keep at most ``--max-pending-upload-bytes``
uploaded and not yet committed (429 ``upload_quota_exceeded`` past it). A
checkpoint whose uploads exceed that allowance is committed in parts, each
a checkpoint of its own (fsagent/checkpoint/ship.py, "Parts"): nothing wedges a
folder, a kill -9 between two parts loses nothing and sends nothing twice,
and a file larger than the whole allowance is refused with a stable code
while every other change saves.

In process (the memory bridge client, which holds uploads to the allowance
as the controller does): the plan, the parts' bodies, the adaptation to a
controller that does not announce its allowance, an allowance held by
others, a lost answer between two parts. With real daemons against a real
controller started with a 50 MB allowance, a FUSE mount and then a plain
directory with the same assertions: 30 random 4 MiB files in one flush, a
kill -9 between two parts, a file over the allowance; and the controller's
own rules (duplicates cost nothing, a request over the allowance is 413).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.bridge import BATCH_MEMBER_MAX
from common.types import Digest
from fsagent.checkpoint.ship import OVER_ALLOWANCE, PART_SHARE, Shipper, plan_part
from fsagent.errors import ControllerUnavailable, SaveFailed
from fsagent.repos.checkouts import RepoSavers, prepare_all
from fsagent.state.store import ROOT_INODE, Change, InodeNo, JournalSeq, Store
from tests.fsagent.test_fsagent_ship_inproc import SCOPE, hydrated, write_small
from tests.support.agentfiles import run_detail, run_receipts
from tests.support.bridge import framed
from tests.support.bridge import start_run as start_bridge_run
from tests.support.checkpoints import (
    flush_in_background,
    folder_id,
    journal,
    receipts,
    reply_of,
    status,
    try_flush,
)
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)
from tests.support.gitrepos import make_origin, new_repo_task
from tests.support.lossy_proxy import LossyProxy
from tests.support.memclient import MemoryBridgeClient
from tests.support.mount import MountFactory
from tests.system.test_checkpoints import server_files, start_run, token_file

ALLOWANCE = 50_000_000
"""The real controller's ``--max-pending-upload-bytes`` here."""
FILES = 30
FILE_SIZE = 4 << 20
AGENT_MAX_FILE = 8 << 20
"""The real controller's ``--agent-max-file-bytes`` here."""
COMMITS = r"/folders/task/checkpoints$"
UPLOADS = "PUT /bridge/v1/folders/task/uploads"


# --- in process ---------------------------------------------------------------


def change(path: str, size: int) -> Change:
    return Change(path, "upload", JournalSeq(1), None, InodeNo(1), size=size)


def test_plan_part_fits_first_in_path_order_and_always_makes_progress() -> None:
    uploads = [change("a", 40), change("b", 70), change("c", 30), change("d", 10)]
    part, rest = plan_part(uploads, 100)
    assert [c.path for c in part] == ["a", "c", "d"] and [c.path for c in rest] == ["b"]
    # A file over the budget (but within the allowance) goes alone.
    part, rest = plan_part([change("big", 150), change("x", 1)], 100)
    assert [c.path for c in part] == ["big"] and [c.path for c in rest] == ["x"]
    assert plan_part(uploads, None) == (uploads, [])
    assert plan_part([], 100) == ([], [])


def write_large(store: Store, name: str, data: bytes) -> InodeNo:
    """A file in ``upper/`` (over the batch bound: a single upload)."""
    f = store.tree.create(ROOT_INODE, name, "file", 0o644)
    store.upper.write_complete(f.ino, lambda p: p.write_bytes(data))
    f.upper, f.size = True, len(data)
    f.generation += 1
    store.tree.persist(f, touch="write")
    store.tree.drop_inline(f)
    return f.ino


def bodies(mem: MemoryBridgeClient) -> list[dict[str, Any]]:
    """The committed checkpoint bodies, in order (the memory client keeps each
    body's fingerprint: the body with the lease epoch left out)."""
    return [json.loads(seen) for (scope, _), (seen, _) in mem.receipts.items() if scope == SCOPE]


def upload_bytes(mem: MemoryBridgeClient, body: dict[str, Any], saved: set[str]) -> int:
    """Bytes of the body's puts that were uploaded (not saved before)."""
    return sum(
        len(mem.objects[e["digest"]])
        for e in body["entries"]
        if e["op"] == "put" and e["digest"] not in saved
    )


@pytest.fixture
def mem() -> MemoryBridgeClient:
    client = MemoryBridgeClient(upload_allowance=1_000_000)
    client.put_file(SCOPE, "gone.txt", b"to be deleted")
    client.put_file(SCOPE, "old.txt", b"renamed, unchanged")
    return client


@pytest.mark.trio
async def test_a_change_set_over_the_allowance_commits_in_valid_parts(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        files = {f"f{i:02d}.bin": os.urandom(100_000 + i) for i in range(30)}
        for name, data in files.items():
            write_large(store, name, data)
        small = {f"s{i}.txt": os.urandom(3000) for i in range(40)}
        for name, data in small.items():
            write_small(store, name, data)
        store.tree.create(ROOT_INODE, "dir", "directory", 0o755)
        store.tree.unlink(ROOT_INODE, "gone.txt", keep=False)
        store.tree.rename(
            ROOT_INODE, "old.txt", ROOT_INODE, "new.txt", keep_replaced=lambda _: False
        )
        saved_before = {str(e.digest) for e in mem.folder(SCOPE).entries.values() if e.digest}
        high = mem.folder(SCOPE).high_water

        result = await Shipper(store, mem, SCOPE, 1).ship_checkpoint(final=True)

        sent = bodies(mem)
        assert result.parts == len(sent) >= 6, [len(b["entries"]) for b in sent]
        assert result.entries == len(files) + len(small) + 4  # dir, gone, old and new
        budget = 1_000_000 // PART_SHARE
        assert all(upload_bytes(mem, b, saved_before) <= budget for b in sent)
        # Directories and references first, deletions last; final only on the last.
        assert {"op": "mkdir", "path": "dir"} in sent[0]["entries"]
        assert any(e["path"] == "new.txt" for e in sent[0]["entries"])
        deletes = [[e["path"] for e in b["entries"] if e["op"] == "delete"] for b in sent]
        assert deletes == [[]] * (len(sent) - 1) + [["gone.txt", "old.txt"]]
        assert [b["final"] for b in sent] == [False] * (len(sent) - 1) + [True]
        # Every part says it is part of the final save: a refused one is its receipt.
        assert [b.get("finalSave") for b in sent] == [True] * len(sent)
        assert len({b["operationId"] for b in sent}) == len(sent)
        for b in sent:
            paths = [e["path"].encode() for e in b["entries"]]
            assert paths == sorted(paths)
        assert mem.files(SCOPE) == {**files, **small, "new.txt": b"renamed, unchanged"}
        # Every change got exactly one version; nothing waits uncommitted.
        assert mem.folder(SCOPE).high_water == high + result.entries
        assert mem.pending_uploads == {}
        assert store.changes_since_baseline() == [] and store.journal.pending_checkpoint() is None
        assert store.journal.save_status()["lastSave"]["operationId"] == sent[-1]["operationId"]
    finally:
        store.close()


@pytest.mark.trio
async def test_an_allowance_not_announced_is_learnt_from_the_refusal(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    mem.announce_allowance = False
    store = await hydrated(tmp_path, mem)
    try:
        files = {f"f{i:02d}.bin": os.urandom(150_000) for i in range(20)}
        for name, data in files.items():
            write_large(store, name, data)
        shipper = Shipper(store, mem, SCOPE, 1)
        result = await shipper.ship_checkpoint()
        assert shipper.upload_allowance == 1_000_000  # from the 429's details
        assert result.parts >= 3 and result.skipped_torn == 0
        assert {p: d for p, d in mem.files(SCOPE).items() if p in files} == files
        assert store.changes_since_baseline() == []
    finally:
        store.close()


@pytest.mark.trio
async def test_a_file_over_the_whole_allowance_is_refused_and_the_rest_saves(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        huge = os.urandom(1_200_000)
        write_large(store, "huge.bin", huge)
        write_small(store, "a.txt", b"saved all the same")
        write_large(store, "b.bin", b"b" * 200_000)
        store.tree.unlink(ROOT_INODE, "gone.txt", keep=False)
        shipper = Shipper(store, mem, SCOPE, 1)
        for _ in range(2):  # refused at each checkpoint, never sent, never retried in a loop
            with pytest.raises(SaveFailed, match=OVER_ALLOWANCE) as info:
                await shipper.ship_checkpoint()
            assert info.value.refused is True
            error = store.journal.save_status()["lastError"]
            assert error["code"] == OVER_ALLOWANCE and "huge.bin" in error["message"]
        assert hashlib.sha256(huge).hexdigest() not in mem.objects
        assert mem.files(SCOPE) == {
            "old.txt": b"renamed, unchanged",
            "a.txt": b"saved all the same",
            "b.bin": b"b" * 200_000,
        }
        assert [c.path for c in store.changes_since_baseline()] == ["huge.bin"]
        assert [s for s, _ in mem.reports] == ["failed", "failed"]
        # Made smaller, it saves.
        store.tree.unlink(ROOT_INODE, "huge.bin", keep=False)
        write_large(store, "huge.bin", huge[:500_000])
        result = await shipper.ship_checkpoint()
        assert result.entries == 1 and mem.files(SCOPE)["huge.bin"] == huge[:500_000]
        assert "lastError" not in store.journal.save_status()
    finally:
        store.close()


@pytest.mark.trio
async def test_an_allowance_held_by_others_waits_then_fails_and_saves_the_rest(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        mem.retry_deadline = 0.5
        # Another folder's uploads of the same run wait for its checkpoint.
        mem.pending_uploads["0" * 64] = 1_000_000
        write_large(store, "a.bin", os.urandom(200_000))
        store.tree.create(ROOT_INODE, "dir", "directory", 0o755)
        store.tree.unlink(ROOT_INODE, "gone.txt", keep=False)
        shipper = Shipper(store, mem, SCOPE, 1)
        with pytest.raises(SaveFailed, match="upload allowance") as info:
            await shipper.ship_checkpoint()
        assert info.value.refused is False  # may pass: a later save tries again
        assert store.journal.save_status()["lastError"]["code"] == "upload_quota_exceeded"
        assert mem.folder(SCOPE).entries["dir"].kind == "directory"
        assert mem.folder(SCOPE).entries["gone.txt"].deleted
        assert [c.path for c in store.changes_since_baseline()] == ["a.bin"]
        # The other folder commits: the next save goes through.
        mem.pending_uploads.clear()
        result = await shipper.ship_checkpoint()
        assert result.entries == 1 and "a.bin" in mem.files(SCOPE)
    finally:
        store.close()


@pytest.mark.trio
async def test_a_lost_answer_between_two_parts_replays_that_part_once(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    store = await hydrated(tmp_path, mem)
    try:
        files = {f"f{i:02d}.bin": os.urandom(200_000) for i in range(10)}
        for name, data in files.items():
            write_large(store, name, data)
        high = mem.folder(SCOPE).high_water
        shipper = Shipper(store, mem, SCOPE, 1)
        # The first part's answer arrives, the second's is lost.
        original = mem.commit_checkpoint
        answered = 0

        async def second_lost(scope: str, body: dict[str, Any]) -> dict[str, Any]:
            nonlocal answered
            receipt = await original(scope, body)
            answered += 1
            if answered == 2:
                raise ControllerUnavailable("the answer was lost")
            return receipt

        mem.commit_checkpoint = second_lost  # type: ignore[method-assign]
        with pytest.raises(SaveFailed, match="lost"):
            await shipper.ship_checkpoint()
        first, second = bodies(mem)
        pending = store.journal.pending_checkpoint()
        assert pending is not None and pending["operationId"] == second["operationId"]
        left = {c.path for c in store.changes_since_baseline()}
        assert left == set(files) - {e["path"] for e in first["entries"]}
        mem.commit_checkpoint = original  # type: ignore[method-assign]
        uploads_before = mem.calls.count("upload_object")
        result = await shipper.ship_checkpoint()
        # Replayed verbatim, then only what no part saved went up.
        sent = bodies(mem)
        assert sent[:2] == [first, second]
        resent = len(files) - len(first["entries"]) - len(second["entries"])
        assert mem.calls.count("upload_object") - uploads_before == resent
        assert mem.files(SCOPE) == {
            **files,
            "gone.txt": b"to be deleted",
            "old.txt": b"renamed, unchanged",
        }
        assert mem.folder(SCOPE).high_water == high + len(files)
        assert result.parts == len(sent) - 2
        assert store.changes_since_baseline() == [] and store.journal.pending_checkpoint() is None
    finally:
        store.close()


@pytest.mark.trio
async def test_uploads_the_run_holds_cost_nothing_again(mem: MemoryBridgeClient) -> None:
    """The memory client's allowance follows the controller's rule."""

    def frames_of(data: bytes) -> Any:
        async def gen() -> Any:
            yield framed(data)

        return gen

    data = os.urandom(600_000)
    digest, _ = await mem.upload_object(SCOPE, frames_of(data))
    again, _ = await mem.upload_object(SCOPE, frames_of(data))
    assert again == digest and mem.pending_uploads == {Digest(digest): len(data)}


# --- real daemons against a controller with a 50 MB allowance -----------------------


@pytest.fixture(scope="module")
def small_allowance(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    with private_controller(
        pg_cluster,
        "fsa-parts-",
        "--max-pending-upload-bytes",
        str(ALLOWANCE),
        "--agent-max-file-bytes",
        str(AGENT_MAX_FILE),
    ) as ctl:
        yield ctl


@pytest.fixture
def lt(small_allowance: ControllerProcess) -> Tenant:
    return bootstrap_tenant(small_allowance)


@pytest.fixture
def proxy(small_allowance: ControllerProcess) -> Iterator[LossyProxy]:
    """Request it before the mounts, so it outlives them."""
    p = LossyProxy(small_allowance.url).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """FUSE mounts, then plain directories: the same parts, the same assertions."""
    return mode_mounts


def write_files(root: Path, count: int = FILES) -> dict[str, bytes]:
    files = {f"data/f{i:02d}.bin": os.urandom(FILE_SIZE) for i in range(count)}
    (root / "data").mkdir()
    for path, data in files.items():
        (root / path).write_bytes(data)
    return files


def folder_counter(ctl: ControllerProcess, tenant: Tenant, owner: str) -> int:
    """The folder's version counter: one version per row a checkpoint changed."""
    fid = folder_id(ctl, tenant.company_id, "task", owner)
    with ctl.db() as conn:
        row = conn.execute("SELECT version_counter FROM folders WHERE id = %s", (fid,)).fetchone()
    assert row is not None
    return int(row[0])


def pending_bytes(ctl: ControllerProcess, run_id: str) -> int:
    with ctl.db() as conn:
        row = conn.execute(
            "SELECT coalesce(sum(byte_size), 0) FROM run_uploads"
            " WHERE run_id = %s AND committed_at IS NULL",
            (run_id,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_controller_counts_only_new_bytes_and_refuses_what_never_fits(lt: Tenant) -> None:
    run = start_bridge_run(lt)
    with run.client() as c:
        assert c.get("/run").json()["maxPendingUploadBytes"] == ALLOWANCE
    data = os.urandom(30_000_000)
    assert run.upload("task", data).status_code == 200
    # The same content again (a retried save) costs nothing: no 429.
    assert run.upload("task", data).status_code == 200
    more = run.upload("task", os.urandom(30_000_000))
    assert more.status_code == 429, more.text
    body = more.json()
    assert body["code"] == "upload_quota_exceeded"
    assert body["details"] == [{"limit": ALLOWANCE, "pending": 30_000_000, "size": 30_000_000}]
    over = run.upload("task", os.urandom(ALLOWANCE + 1))
    assert over.status_code == 413 and over.json()["code"] == OVER_ALLOWANCE
    assert over.json()["details"] == [{"limit": ALLOWANCE, "size": ALLOWANCE + 1}]
    assert pending_bytes(lt.controller, run.run_id) == 30_000_000


@pytest.mark.fuse
def test_thirty_4mib_files_over_a_50mb_allowance_save_in_one_flush(
    mounts: MountFactory, lt: Tenant
) -> None:
    run = start_run(lt)
    m = mounts.mount(lt.controller.url, scope="task", token_file=token_file(mounts, run))
    files = write_files(m.mountpoint)
    reply = m.fsagent("flush", "task")
    assert reply["ok"] is True, reply
    parts = reply["result"]["parts"]
    per_part = ALLOWANCE // PART_SHARE // FILE_SIZE
    assert parts == -(-FILES // per_part) == 6, reply
    assert reply["result"]["entries"] == FILES + 1  # and the directory
    assert server_files(lt, "task", run["task"]) == files
    ctl = lt.controller
    assert len(receipts(ctl, lt.company_id, "task", run["task"])) == parts
    assert pending_bytes(ctl, run["run_id"]) == 0
    assert folder_counter(ctl, lt, run["task"]) == FILES + 1  # one version each
    assert journal(m) == set()
    shown = status(m)
    assert shown["lastError"] is None and shown["pendingCheckpoint"] is None
    # The final save has nothing left; the daemon stops cleanly.
    assert m.signal(signal.SIGTERM) == 0, m.stderr()


@pytest.mark.fuse
def test_kill9_between_two_parts_loses_nothing_and_sends_nothing_twice(
    proxy: LossyProxy, mounts: MountFactory, lt: Tenant
) -> None:
    ctl = lt.controller
    run = start_run(lt)
    m = mounts.mount(proxy.url, scope="task", token_file=token_file(mounts, run))
    files = write_files(m.mountpoint)
    proxy.record_bodies("POST", COMMITS)
    first = proxy.hold_next("POST", COMMITS)
    second = proxy.hold_next("POST", COMMITS)
    flusher = flush_in_background(m)
    assert first.reached.wait(180), m.stderr()
    first.release()
    # The second part uploaded and stored its body: the daemon dies before
    # the controller sees its commit.
    assert second.reached.wait(180), m.stderr()
    m.kill9()
    proxy.fail_next("POST", COMMITS)
    second.release()
    assert reply_of(flusher, 60)[0] != 0
    committed = receipts(ctl, lt.company_id, "task", run["task"])
    assert len(committed) == 1
    stored = status(m)["pendingCheckpoint"]
    assert stored is not None and stored != committed[0]
    part1 = {e["path"] for e in json.loads(proxy.bodies[0][1])["entries"]}
    assert journal(m) == set(files) - part1  # part 1 was acknowledged before the kill

    seen_before = len(proxy.seen)
    m2 = mounts.mount(
        proxy.url,
        scope="task",
        state_dir=m.state_dir,
        mountpoint=m.mountpoint,
        token_file=m.token_file,
    )
    assert server_files(lt, "task", run["task"]) == files
    after = receipts(ctl, lt.company_id, "task", run["task"])
    assert after[:2] == [committed[0], stored]  # the stored part replayed under its id
    # Each path in exactly one part; each file one version.
    by_op: dict[str, list[str]] = {}
    for _, raw in proxy.bodies:
        body = json.loads(raw)
        by_op[body["operationId"]] = [e["path"] for e in body["entries"]]
    paths = [p for op in after for p in by_op[op]]
    assert sorted(paths) == sorted([*files, "data"])
    assert folder_counter(ctl, lt, run["task"]) == FILES + 1
    # Nothing saved before the kill was uploaded again.
    resent = [s for s in proxy.seen[seen_before:] if s == UPLOADS]
    assert len(resent) == FILES - len(part1 - {"data"}) - len(by_op[stored])
    assert journal(m2) == set()
    assert status(m2)["pendingCheckpoint"] is None
    assert pending_bytes(ctl, run["run_id"]) == 0
    assert m2.signal(signal.SIGTERM) == 0, m2.stderr()


@pytest.mark.fuse
def test_a_file_over_the_allowance_is_refused_on_the_folder_and_wedges_nothing(
    mounts: MountFactory, lt: Tenant
) -> None:
    ctl = lt.controller
    run = start_run(lt)
    m = mounts.mount(ctl.url, scope="task", token_file=token_file(mounts, run))
    huge = os.urandom(ALLOWANCE + (1 << 20))
    (m.mountpoint / "huge.bin").write_bytes(huge)
    others = {f"f{i}.bin": os.urandom(FILE_SIZE) for i in range(3)}
    others["small.txt"] = os.urandom(BATCH_MEMBER_MAX // 2)
    for path, data in others.items():
        (m.mountpoint / path).write_bytes(data)
    for _ in range(2):  # at each save: refused at once, never sent
        code, reply = try_flush(m)
        assert code != 0 and reply["ok"] is False, reply
        assert OVER_ALLOWANCE in reply["error"]
        shown = status(m)
        assert shown["lastError"]["code"] == OVER_ALLOWANCE, shown
        assert "huge.bin" in shown["lastError"]["message"]
        assert server_files(lt, "task", run["task"]) == others
    assert journal(m) == {"huge.bin"}
    with ctl.db() as conn:
        held = conn.execute(
            "SELECT count(*) FROM run_uploads WHERE run_id = %s AND digest = %s",
            (run["run_id"], hashlib.sha256(huge).hexdigest()),
        ).fetchone()
    assert held == (0,)
    assert pending_bytes(ctl, run["run_id"]) == 0
    # Under the allowance, the file saves with the next flush.
    (m.mountpoint / "huge.bin").write_bytes(huge[: 10 << 20])
    assert m.fsagent("flush", "task")["ok"] is True
    assert server_files(lt, "task", run["task"])["huge.bin"] == huge[: 10 << 20]
    assert status(m)["lastError"] is None
    assert m.signal(signal.SIGTERM) == 0, m.stderr()


def folder_stop(tenant: Tenant, run_id: str, scope: str) -> dict[str, Any]:
    """The run's save state of ``scope`` as its details show it."""
    r = run_detail(tenant, run_id)
    assert r.status_code == 200, r.text
    found: dict[str, Any] = next(f for f in r.json()["folders"] if f["scope"] == scope)
    return found


def final_receipts(tenant: Tenant, run_id: str, scope: str) -> list[dict[str, Any]]:
    return [r for r in run_receipts(tenant, run_id) if r["scope"] == scope and r["final"]]


def test_a_refused_first_part_of_a_final_save_shows_the_folder_stopped(
    mounts: MountFactory, lt: Tenant
) -> None:
    """The agent folder's final save in three parts, the first refused over
    the file limit: that refusal is the final save's receipt (the parts
    after it are never sent), so the run shows the folder stopped, with the
    limit's code and its warning, and the run is not failed."""
    ctl = lt.controller
    run = start_run(lt)
    m = mounts.mount(ctl.url, scope="agent", token_file=token_file(mounts, run))
    # One file per part (each part uploads at most half the allowance); the
    # first in path order is over the agent folder's file limit.
    (m.mountpoint / "a-over.bin").write_bytes(os.urandom(AGENT_MAX_FILE + (1 << 20)))
    for name in ("b.bin", "c.bin"):
        (m.mountpoint / name).write_bytes(os.urandom(ALLOWANCE // PART_SHARE - (1 << 20)))
    # A refusal over a storage limit is a warning: the stop is clean.
    assert m.signal(signal.SIGTERM, timeout=300) == 0, m.stderr()
    got = final_receipts(lt, run["run_id"], "agent")
    assert [(r["outcome"], r["code"]) for r in got] == [
        ("refused", "AGENT_FILES_LIMIT_EXCEEDED")
    ], got
    folder = folder_stop(lt, run["run_id"], "agent")
    assert folder["stoppedAt"] is not None, folder
    assert folder["code"] == "AGENT_FILES_LIMIT_EXCEEDED", folder
    detail = run_detail(lt, run["run_id"]).json()
    assert detail["state"] != "failed", detail
    assert any(w.get("code") == "AGENT_FILES_LIMIT_EXCEEDED" for w in detail["warnings"]), detail


def test_a_final_save_given_up_on_a_file_over_the_allowance_shows_the_stop(
    mounts: MountFactory, lt: Tenant
) -> None:
    """A file over the whole upload allowance is refused in the sandbox, so
    the controller holds no receipt of it: the final save, given up, reports
    its failure, final. The folder shows the failure and the stop, not the
    part that saved."""
    ctl = lt.controller
    run = start_run(lt)
    m = mounts.mount(ctl.url, scope="task", token_file=token_file(mounts, run))
    (m.mountpoint / "huge.bin").write_bytes(os.urandom(ALLOWANCE + (1 << 20)))
    (m.mountpoint / "small.txt").write_bytes(b"saved all the same")
    assert m.signal(signal.SIGTERM, timeout=300) == 4, m.stderr()
    assert server_files(lt, "task", run["task"]) == {"small.txt": b"saved all the same"}
    got = final_receipts(lt, run["run_id"], "task")
    assert [(r["outcome"], r["code"]) for r in got] == [("failed", "SAVE_FAILED")], got
    assert OVER_ALLOWANCE in got[0]["error"] and "huge.bin" in got[0]["error"]
    folder = folder_stop(lt, run["run_id"], "task")
    assert folder["state"] == "failed" and folder["code"] == "SAVE_FAILED", folder
    assert folder["stoppedAt"] is not None, folder


@pytest.mark.trio
async def test_a_repository_over_the_allowance_uploads_nothing_and_saves_once_it_fits(
    lt: Tenant, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A repository is committed whole: one whose new contents pass the whole
    allowance is refused before a byte is sent. Before, it uploaded until the
    allowance refused it (429), and what it had uploaded held the allowance
    until it expired (an hour): the run's folders found no room either, even
    after the agent removed what was too big."""
    task = new_repo_task(lt)
    task.add_workspace(str(make_origin(tmp_path / "origin")), primary=True)
    run = task.start_run()
    home, state = tmp_path / "home", tmp_path / "state"
    client = task.client(run)
    try:
        await prepare_all(client, home)
        checkout = home / "repos" / "app"
        (checkout / "small.txt").write_bytes(b"fits")
        # Each file fits the allowance; together they do not.
        for name in ("big1.bin", "big2.bin", "big3.bin"):
            (checkout / name).write_bytes(os.urandom(ALLOWANCE * 2 // 5))
        info = await client.get_run()
        assert info.upload_allowance == ALLOWANCE
        savers = RepoSavers(client, info, home, state)
        assert await savers.save_all() == 1
        (saver,) = savers.savers.values()
        error = saver.status["lastError"]
        assert error["code"] == OVER_ALLOWANCE, error
        assert "big1.bin" in error["message"] and "nothing was uploaded" in error["message"]
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and OVER_ALLOWANCE in warned[0], warned
        caplog.clear()
        assert pending_bytes(lt.controller, run.run_id) == 0  # nothing holds the allowance
        # The run's folders keep the allowance (had two of the repository's
        # files been uploaded, this would be refused: 429).
        assert run.upload("task", os.urandom(ALLOWANCE // 2)).status_code == 200

        for name in ("big2.bin", "big3.bin"):  # the agent's fix: the next checkpoint fits
            (checkout / name).unlink()
        assert await savers.save_all() == 0
        assert saver.status["lastError"] is None
        saved = saver.status["lastSave"]
        assert saved["committed"], saved
        manifest = await client.repo_manifest(saver.workspace_id)
        paths = {m["path"] for m in manifest.members}
        assert "small.txt" in paths and "big1.bin" in paths and "big2.bin" not in paths
    finally:
        await client.aclose()
