"""A failed final save, then a new run of the same sandbox on the same state
dir. The old run's stored checkpoint carries its lease epoch, which the
controller fences (``stale_lease``) whoever sends it: the new run's first save
lists the changes afresh under a new operation id and its own lease, and saves
them, and its later saves go through.

With real daemons against a real controller, a FUSE mount and then a plain
directory with the same assertions, three ways in:

- the controller down at the old run's stop, once its final save had uploaded
  its files and stored its body (the controller stopped and started again);
- a newer run started while the old daemon still ran: its final save is
  fenced;
- the old final save applied by the controller but every answer to it lost:
  the new run sends the same changes once more, which the controller takes as
  a later save of the same bytes (a deleted file stays deleted, with one trash
  entry, and a directory keeps its version).

In process (the memory bridge client): the rule, a replay under the same run
that stays verbatim, and a refusal of the body's contents that drops it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fsagent.checkpoint.ship import Shipper
from fsagent.errors import ControllerRefused, SaveFailed
from fsagent.state.hydrate import hydrate_manifest
from fsagent.state.store import ROOT_INODE, Store
from tests.fsagent.test_fsagent_ship_inproc import write_small
from tests.support.checkpoints import receipts, versions
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    world_searchable_tmpdir,
)
from tests.support.lossy_proxy import Hold, LossyProxy
from tests.support.memclient import MemoryBridgeClient
from tests.support.mount import REPO, FsagentMount, MountFactory
from tests.system.test_checkpoints import flush, server_files, start_run, token_file

COMMITS = r"/folders/task/checkpoints$"
EVERYTHING = r"."


# --- in process: the rule ----------------------------------------------------------

SCOPE = "task"


@pytest.fixture
def mem() -> MemoryBridgeClient:
    client = MemoryBridgeClient()
    client.put_file(SCOPE, "gone.txt", b"to be deleted")
    return client


async def hydrated(tmp_path: Path, mem: MemoryBridgeClient) -> Store:
    store = Store.open(tmp_path / "state")
    await hydrate_manifest(store, mem, SCOPE)
    return store


def new_lease(mem: MemoryBridgeClient) -> int:
    """A newer run of the sandbox: the lease epoch moves on."""
    mem.run = replace(mem.run, lease_epoch=mem.run.lease_epoch + 1)
    return mem.run.lease_epoch


@pytest.mark.trio
@pytest.mark.parametrize("applied", [False, True])
async def test_a_body_of_an_older_lease_is_listed_again_under_the_new_run(
    tmp_path: Path, mem: MemoryBridgeClient, applied: bool
) -> None:
    """The old run's body never reached the controller, or it was applied and
    the answer lost: either way the new run lists the changes afresh and
    saves them under its own lease and a new operation id."""
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"written by the old run")
        store.tree.create(ROOT_INODE, "dir", "directory", 0o755)
        store.tree.unlink(ROOT_INODE, "gone.txt", keep=False)
        if applied:
            mem.lose_next("commit_checkpoint")
        else:
            mem.fail_next("commit_checkpoint")
        with pytest.raises(SaveFailed):
            await Shipper(store, mem, SCOPE, mem.run.lease_epoch).ship_checkpoint(final=True)
        stored = store.journal.pending_checkpoint()
        assert stored is not None and stored["state"] == "committing"
        assert list(mem.receipts) == ([(SCOPE, stored["operationId"])] if applied else [])
        high = mem.folder(SCOPE).high_water

        epoch = new_lease(mem)
        result = await Shipper(store, mem, SCOPE, epoch).ship_checkpoint()
        assert result.receipt is not None and result.entries == 3
        assert result.operation_id not in (None, stored["operationId"])
        assert mem.files(SCOPE) == {"a.txt": b"written by the old run"}
        assert mem.folder(SCOPE).entries["dir"].kind == "directory"
        # Applied before, the same changes are a later save of the same bytes:
        # the file gets a new version, the deletion and the directory none.
        assert mem.folder(SCOPE).high_water == high + (1 if applied else 3)
        assert store.journal.pending_checkpoint() is None and store.changes_since_baseline() == []
        assert "lastError" not in store.journal.save_status()
        assert [state for state, _ in mem.reports] == ["failed"]  # the old run's failure only
    finally:
        store.close()


@pytest.mark.trio
async def test_a_failure_with_nothing_left_to_send_is_cleared_by_an_empty_checkpoint(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    """The old run's final save had nothing to send and still failed (the
    controller down): the new run lists nothing afresh, yet its next save
    sends an empty checkpoint, so that ``fsagent status`` and the controller
    both show the folder saved again. With no failure standing, a save with
    nothing to send sends nothing."""
    store = await hydrated(tmp_path, mem)
    try:
        mem.fail_next("commit_checkpoint")
        with pytest.raises(SaveFailed):
            await Shipper(store, mem, SCOPE, mem.run.lease_epoch).ship_checkpoint(final=True)
        assert "lastError" in store.journal.save_status()

        shipper = Shipper(store, mem, SCOPE, new_lease(mem))
        result = await shipper.ship_checkpoint()
        assert result.receipt is not None and result.entries == 0
        assert (SCOPE, result.operation_id) in mem.receipts
        assert "lastError" not in store.journal.save_status()
        assert store.journal.pending_checkpoint() is None

        commits = mem.calls.count("commit_checkpoint")
        again = await shipper.ship_checkpoint()
        assert again.receipt is None and mem.calls.count("commit_checkpoint") == commits
    finally:
        store.close()


@pytest.mark.trio
async def test_a_body_of_this_run_is_still_replayed_verbatim(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    """Under the same lease a lost answer is answered by the first receipt:
    nothing is applied twice, whatever was written since."""
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"first")
        shipper = Shipper(store, mem, SCOPE, mem.run.lease_epoch)
        mem.lose_next("commit_checkpoint")
        with pytest.raises(SaveFailed, match="lost the response"):
            await shipper.ship_checkpoint()
        stored = store.journal.pending_checkpoint()
        assert stored is not None
        high = mem.folder(SCOPE).high_water
        write_small(store, "a.txt", b"second")  # the listing would differ now
        # A new daemon of the same run (a warm start): the same body, once more.
        result = await Shipper(store, mem, SCOPE, mem.run.lease_epoch).ship_checkpoint()
        assert mem.calls.count("commit_checkpoint") == 3  # lost, replayed, the next one
        assert list(mem.receipts) == [(SCOPE, stored["operationId"]), (SCOPE, result.operation_id)]
        assert mem.folder(SCOPE).high_water == high + 1  # only the newer a.txt
        assert mem.files(SCOPE)["a.txt"] == b"second"
    finally:
        store.close()


@pytest.mark.trio
async def test_a_refusal_of_the_stored_body_drops_it_and_a_fenced_one_keeps_it(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    """A body refused for what it holds can never succeed as stored, and was
    not applied: the next save lists afresh. A refusal of the run's
    authority keeps it (the run may not save anything anyway)."""
    store = await hydrated(tmp_path, mem)
    try:
        write_small(store, "a.txt", b"content")
        shipper = Shipper(store, mem, SCOPE, mem.run.lease_epoch)
        mem.lose_next("commit_checkpoint")  # stored as committing
        with pytest.raises(SaveFailed):
            await shipper.ship_checkpoint()
        refusal = ControllerRefused("too many", 400, "validation_error")
        mem.fail_next("commit_checkpoint", exc=refusal)
        with pytest.raises(SaveFailed, match="too many") as info:
            await shipper.ship_checkpoint()
        assert info.value.refused is True and info.value.over_limit is False
        assert store.journal.pending_checkpoint() is None
        result = await shipper.ship_checkpoint()
        assert result.receipt is not None and result.entries == 1

        write_small(store, "b.txt", b"fenced")
        mem.run = replace(mem.run, active=False)
        with pytest.raises(SaveFailed, match="stale lease"):
            await shipper.ship_checkpoint()
        kept = store.journal.pending_checkpoint()
        assert kept is not None and kept["state"] == "committing"
    finally:
        store.close()


# --- real daemons -----------------------------------------------------------------


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """FUSE mounts, then plain directories: the same lifecycle, the same assertions."""
    return mode_mounts


@pytest.fixture(scope="module")
def own_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller of this module alone, so stopping it leaves the shared one up."""
    ctl = ControllerProcess(pg_cluster.create_database(), world_searchable_tmpdir("fsa-lcp-"))
    ctl.start()
    try:
        yield ctl
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


@pytest.fixture
def own_proxy(own_controller: ControllerProcess) -> Iterator[LossyProxy]:
    """In front of :func:`own_controller`; request it before the mounts, so it
    outlives them."""
    p = LossyProxy(own_controller.url).start()
    try:
        yield p
    finally:
        p.stop()
        if own_controller.proc is not None and own_controller.proc.poll() is not None:
            own_controller.start()  # a test stopped it and failed before starting it again


@pytest.fixture
def proxy(controller: ControllerProcess) -> Iterator[LossyProxy]:
    """In front of the shared controller; request it before the mounts."""
    p = LossyProxy(controller.url).start()
    try:
        yield p
    finally:
        p.stop()


def pending_record(m: FsagentMount) -> dict[str, Any] | None:
    """The state dir's pending checkpoint, as the daemon left it (it is stopped)."""
    store = Store.open(m.state_dir, readonly=True)
    try:
        return store.journal.pending_checkpoint()
    finally:
        store.close()


def status_json(m: FsagentMount) -> dict[str, Any]:
    """``fsagent status --json`` of the mount's state dir, as a person runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "status", "--state-dir", str(m.state_dir), "--json"],
        capture_output=True,
        check=True,
        cwd=REPO,
        timeout=120,
    )
    row: dict[str, Any] = json.loads(out.stdout)["collections"][0]
    return row


def old_run_work(m: FsagentMount) -> dict[str, bytes]:
    """What the old run saves with a flush, then changes before its stop (new
    bytes, a changed file, a deletion, a directory); the files as they are."""
    root = m.mountpoint
    (root / "kept.txt").write_bytes(b"saved by the old run's flush")
    (root / "gone.txt").write_bytes(b"deleted before the stop")
    assert flush(m)["ok"] is True
    old_bin = os.urandom(300_000)
    (root / "old-run.bin").write_bytes(old_bin)
    (root / "kept.txt").write_bytes(b"changed by the old run before its stop")
    (root / "gone.txt").unlink()
    (root / "dir").mkdir()
    (root / "dir" / "small.txt").write_bytes(b"small, in a new directory")
    return {
        "kept.txt": b"changed by the old run before its stop",
        "old-run.bin": old_bin,
        "dir/small.txt": b"small, in a new directory",
    }


OLD_CHANGES = 5
"""old-run.bin, kept.txt, gone.txt (a deletion), dir and dir/small.txt."""


def stop_at_the_commit(m: FsagentMount, proxy: LossyProxy) -> Hold:
    """SIGTERM the daemon and hold its final save's commit at the proxy (its
    files uploaded, its body stored); returns the hold."""
    hold = proxy.hold_next("POST", COMMITS)
    assert m.proc is not None
    m.proc.send_signal(signal.SIGTERM)
    assert hold.reached.wait(60), m.stderr()
    return hold


def assert_stored_by(m: FsagentMount, run: dict[str, Any]) -> str:
    """The state dir holds the old run's final body, under its lease; its id."""
    stored = pending_record(m)
    assert stored is not None and stored["state"] == "committing", stored
    assert stored["body"]["leaseEpoch"] == run["lease_epoch"] and stored["body"]["final"] is True
    assert status_json(m)["lastError"] is not None
    op_id: str = stored["operationId"]
    return op_id


def new_run_of(tenant: Tenant, old: dict[str, Any], sandbox: str) -> dict[str, Any]:
    new = tenant.controller.admin(
        "start-run", tenant.company_id,
        "--agent", old["agent"], "--task", old["task"], "--sandbox", sandbox,
    )  # fmt: skip
    assert new["lease_epoch"] == old["lease_epoch"] + 1
    return {**new, "task": old["task"], "agent": old["agent"]}


def new_daemon(
    mounts: MountFactory, m: FsagentMount, run: dict[str, Any], controller: str
) -> FsagentMount:
    """The new run's daemon on the old one's state dir and mountpoint (warm start)."""
    return mounts.mount(
        controller,
        scope="task",
        state_dir=m.state_dir,
        mountpoint=m.mountpoint,
        token_file=token_file(mounts, run),
    )


def new_run_saves(m2: FsagentMount, tenant: Tenant, expected: dict[str, bytes]) -> str:
    """The new run's own writes are saved too, and nothing shows an error; the
    flush's operation id."""
    new_bin = os.urandom(200_000)
    (m2.mountpoint / "new-run.bin").write_bytes(new_bin)
    (m2.mountpoint / "kept.txt").write_bytes(b"changed again by the new run")
    expected.update({"new-run.bin": new_bin, "kept.txt": b"changed again by the new run"})
    reply = flush(m2)
    assert reply["ok"] is True and reply["result"]["entries"] == 2, reply
    shown = status_json(m2)
    assert shown["lastError"] is None and shown["pendingCheckpoint"] is None, shown
    assert shown["unsavedChanges"] == 0, shown
    op_id: str = reply["result"]["operationId"]
    return op_id


def test_controller_down_at_the_stop_then_a_new_run_saves_both_runs_files(
    own_proxy: LossyProxy, own_controller: ControllerProcess, mounts: MountFactory
) -> None:
    ctl = own_controller
    tenant = bootstrap_tenant(ctl)
    sandbox = f"sb-{uuid.uuid4().hex[:8]}"
    old = start_run(tenant, "--sandbox", sandbox)
    task = old["task"]
    m = mounts.mount(
        own_proxy.url, scope="task", token_file=token_file(mounts, old),
        extra=["--retry-deadline", "3"],
    )  # fmt: skip
    expected = old_run_work(m)
    [flushed] = receipts(ctl, tenant.company_id, "task", task)
    hold = stop_at_the_commit(m, own_proxy)
    ctl.stop()  # the controller goes down between the uploads and the commit
    for method in ("GET", "POST", "PUT"):  # ... and stays unreachable
        own_proxy.fail_next(method, EVERYTHING, 1_000_000)
    hold.release()
    assert m.proc is not None and m.proc.wait(timeout=120) != 0, m.stderr()
    assert "final save FAILED" in m.stderr()
    stored = assert_stored_by(m, old)

    ctl.start()
    new = new_run_of(tenant, old, sandbox)
    m2 = new_daemon(mounts, m, new, ctl.url)
    assert f"warm start saved {OLD_CHANGES} earlier change(s)" in m2.stderr(), m2.stderr()
    assert "stale_lease" not in m2.stderr()
    assert server_files(tenant, "task", task) == expected
    [_, rebuilt] = receipts(ctl, tenant.company_id, "task", task)
    assert rebuilt not in (flushed, stored)  # the stored body was never applied
    last = new_run_saves(m2, tenant, expected)
    assert server_files(tenant, "task", task) == expected
    assert receipts(ctl, tenant.company_id, "task", task) == [flushed, rebuilt, last]
    assert m2.signal(signal.SIGTERM) == 0, m2.stderr()
    assert server_files(tenant, "task", task) == expected


def test_a_newer_run_fences_the_old_final_save_then_saves_both_runs_files(
    proxy: LossyProxy, mounts: MountFactory, tenant: Tenant
) -> None:
    ctl = tenant.controller
    sandbox = f"sb-{uuid.uuid4().hex[:8]}"
    old = start_run(tenant, "--sandbox", sandbox)
    task = old["task"]
    m = mounts.mount(proxy.url, scope="task", token_file=token_file(mounts, old))
    expected = old_run_work(m)
    [flushed] = receipts(ctl, tenant.company_id, "task", task)
    hold = stop_at_the_commit(m, proxy)
    new = new_run_of(tenant, old, sandbox)  # while the old daemon still runs
    hold.release()
    assert m.proc is not None and m.proc.wait(timeout=120) != 0, m.stderr()
    assert "401" in m.stderr() or "stale_lease" in m.stderr(), m.stderr()
    stored = assert_stored_by(m, old)
    assert receipts(ctl, tenant.company_id, "task", task) == [flushed]

    m2 = new_daemon(mounts, m, new, proxy.url)
    assert f"warm start saved {OLD_CHANGES} earlier change(s)" in m2.stderr(), m2.stderr()
    assert server_files(tenant, "task", task) == expected
    [_, rebuilt] = receipts(ctl, tenant.company_id, "task", task)
    assert rebuilt != stored
    last = new_run_saves(m2, tenant, expected)
    assert server_files(tenant, "task", task) == expected
    assert receipts(ctl, tenant.company_id, "task", task) == [flushed, rebuilt, last]
    assert m2.signal(signal.SIGTERM) == 0, m2.stderr()


def trashed(tenant: Tenant, task: str, path: str) -> int:
    """Trash entries of the task folder at ``path``."""
    with tenant.controller.db() as db:
        row = db.execute(
            "SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
            " WHERE d.company_id = %s AND d.scope = 'task' AND d.owner_id = %s"
            " AND f.path = %s AND f.deleted_at IS NOT NULL",
            (tenant.company_id, task, path),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_an_old_final_save_applied_with_its_answers_lost_is_sent_again_harmlessly(
    proxy: LossyProxy, mounts: MountFactory, tenant: Tenant
) -> None:
    """The controller applied the old run's final save; every answer to it
    (the first and each replay) was lost. The new run cannot know: it sends
    the same changes once more, a later save of the same bytes."""
    ctl = tenant.controller
    sandbox = f"sb-{uuid.uuid4().hex[:8]}"
    old = start_run(tenant, "--sandbox", sandbox)
    task = old["task"]
    m = mounts.mount(
        proxy.url, scope="task", token_file=token_file(mounts, old),
        extra=["--retry-deadline", "3"],
    )  # fmt: skip
    expected = old_run_work(m)
    [flushed] = receipts(ctl, tenant.company_id, "task", task)
    proxy.drop_next("POST", COMMITS, 1_000_000)
    assert m.signal(signal.SIGTERM, timeout=120) != 0, m.stderr()
    assert "final save FAILED" in m.stderr()
    stored = assert_stored_by(m, old)
    assert receipts(ctl, tenant.company_id, "task", task) == [flushed, stored]  # applied
    assert server_files(tenant, "task", task) == expected
    before = versions(ctl, tenant.company_id, "task", task)
    assert trashed(tenant, task, "gone.txt") == 1
    proxy.clear_rules()

    new = new_run_of(tenant, old, sandbox)
    m2 = new_daemon(mounts, m, new, proxy.url)
    assert f"warm start saved {OLD_CHANGES} earlier change(s)" in m2.stderr(), m2.stderr()
    [_, _, rebuilt] = receipts(ctl, tenant.company_id, "task", task)
    after = versions(ctl, tenant.company_id, "task", task)
    assert server_files(tenant, "task", task) == expected  # byte for byte, as saved before
    # The files were put again (a new version, the same bytes); the deletion
    # and the directory found nothing to do.
    assert set(after) == set(before) == {"kept.txt", "old-run.bin", "dir", "dir/small.txt"}
    assert all(after[p] > before[p] for p in ("kept.txt", "old-run.bin", "dir/small.txt"))
    assert after["dir"] == before["dir"]
    assert trashed(tenant, task, "gone.txt") == 1
    assert status_json(m2)["lastError"] is None
    last = new_run_saves(m2, tenant, expected)
    assert server_files(tenant, "task", task) == expected
    assert receipts(ctl, tenant.company_id, "task", task) == [flushed, stored, rebuilt, last]
    assert m2.signal(signal.SIGTERM) == 0, m2.stderr()
