"""Checkpoints under agent-side faults: nothing lost, nothing applied twice.

Every test drives a real fsagent mount against a real controller and
PostgreSQL, kills the daemon at a chosen point of a checkpoint or loses the
controller's answer to it, and then checks what can be observed (on a FUSE
mount and on a plain directory, with the same assertions): the bytes the
controller serves, the receipts and file versions in PostgreSQL, and the change
set left in the sandbox's journal. Controller-side faults are in
``test_checkpoint_faults_controller.py``; conflicts and refusals in
``test_checkpoint_faults_sandbox.py``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.checkpoints import (
    BIG,
    OCTET,
    flush_in_background,
    journal,
    random_file,
    receipts,
    reply_of,
    status,
    upload_in_progress,
    versions,
    wait_for,
)
from tests.support.controller import ControllerProcess, Tenant
from tests.support.lossy_proxy import LossyProxy
from tests.support.mount import FsagentMount, MountFactory
from tests.system.test_checkpoints import flush, server_files, start_run, token_file

pytestmark = pytest.mark.fuse
COMMITS = r"/checkpoints$"


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """FUSE mounts, then plain directories: the same faults, the same assertions."""
    return mode_mounts


# --- helpers -------------------------------------------------------------------


def remount(mounts: MountFactory, m: FsagentMount, controller: str) -> FsagentMount:
    """A new daemon on the same state dir and mountpoint (warm start)."""
    return mounts.mount(
        controller,
        scope=m.scope,
        state_dir=m.state_dir,
        mountpoint=m.mountpoint,
        token_file=m.token_file,
        extra=m.extra,
    )


def spool_empty(ctl: ControllerProcess) -> bool:
    return not any((ctl.data_dir / "spool").glob("bridge-*"))


@pytest.fixture
def proxy(controller: ControllerProcess) -> Iterator[LossyProxy]:
    """Request it before the mounts: it is then torn down after them, so a
    daemon's last save on stop reaches the controller instead of retrying
    against a closed port until its deadline."""
    p = LossyProxy(controller.url).start()
    try:
        yield p
    finally:
        p.stop()


def stop_dropping(p: LossyProxy) -> None:
    with p._lock:
        p.rules.clear()


def settled(p: LossyProxy, quiet: float = 0.3, timeout: float = 10) -> int:
    """Requests seen so far, once none arrived for ``quiet`` seconds (a killed
    client's last request may still be finishing upstream)."""
    deadline = time.monotonic() + timeout
    count, since = len(p.seen), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the proxy never went quiet"
        time.sleep(0.02)
        if len(p.seen) != count:
            count, since = len(p.seen), time.monotonic()
    return count


# --- kill -9 of fsagent at points of a checkpoint ------------------------------


def test_kill9_before_upload_warm_start_ships_the_write(
    mounts: MountFactory, tenant: Tenant
) -> None:
    ctl = tenant.controller
    run = start_run(tenant)
    m = mounts.mount(ctl.url, scope="task", token_file=token_file(mounts, run))
    data = random_file(m.mountpoint / "notes.bin", 300_000)
    (m.mountpoint / "dir").mkdir()
    (m.mountpoint / "dir" / "small.txt").write_bytes(b"small")
    m.kill9()
    assert server_files(tenant, "task", run["task"]) == {}
    assert journal(m) == {"notes.bin", "dir", "dir/small.txt"}
    assert status(m)["pendingCheckpoint"] is None

    m2 = remount(mounts, m, ctl.url)
    assert "warm start saved 3 earlier change(s)" in m2.stderr()
    assert server_files(tenant, "task", run["task"]) == {
        "notes.bin": data,
        "dir/small.txt": b"small",
    }
    assert (m2.mountpoint / "notes.bin").read_bytes() == data
    assert journal(m2) == set()
    assert len(receipts(ctl, tenant.company_id, "task", run["task"])) == 1


def test_kill9_mid_upload_reuses_the_operation_id(mounts: MountFactory, tenant: Tenant) -> None:
    ctl = tenant.controller
    run = start_run(tenant)
    m = mounts.mount(ctl.url, scope="task", token_file=token_file(mounts, run))
    big = random_file(m.mountpoint / "big.bin", BIG)
    (m.mountpoint / "small.txt").write_bytes(b"next to the big one")
    flusher = flush_in_background(m)
    wait_for(lambda: upload_in_progress(ctl), 60, "the upload to reach the controller")
    m.kill9()
    code, _ = reply_of(flusher, 30)
    assert code != 0  # the daemon died under it: no receipt was reported
    pending = status(m)["pendingCheckpoint"]
    assert pending is not None and pending.startswith("cp-")
    # The interrupted upload is discarded by the controller; nothing was committed.
    wait_for(lambda: spool_empty(ctl), 20, "the controller to drop the partial upload")
    assert server_files(tenant, "task", run["task"]) == {}
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == []

    m2 = remount(mounts, m, ctl.url)
    assert server_files(tenant, "task", run["task"]) == {
        "big.bin": big,
        "small.txt": b"next to the big one",
    }
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == [pending]
    assert journal(m2) == set()
    after = status(m2)
    assert after["pendingCheckpoint"] is None
    assert after["lastSave"]["operationId"] == pending


def test_kill9_after_commit_before_the_answer_replays_the_receipt(
    proxy: LossyProxy, mounts: MountFactory, tenant: Tenant
) -> None:
    ctl = tenant.controller
    run = start_run(tenant)
    m = mounts.mount(proxy.url, scope="task", token_file=token_file(mounts, run))
    data = random_file(m.mountpoint / "report.bin", 2 << 20)
    (m.mountpoint / "gone-soon.txt").write_bytes(b"x")
    # Every answer to a commit is lost while the daemon keeps retrying it.
    proxy.drop_next("POST", COMMITS, count=1_000_000)
    flusher = flush_in_background(m)
    wait_for(lambda: len(proxy.dropped) >= 2, 30, "a commit and at least one retry")
    applied = receipts(ctl, tenant.company_id, "task", run["task"])
    assert len(applied) == 1, applied
    saved_versions = versions(ctl, tenant.company_id, "task", run["task"])
    assert set(saved_versions) == {"report.bin", "gone-soon.txt"}
    pending = status(m)["pendingCheckpoint"]
    assert pending == applied[0]
    m.kill9()
    assert reply_of(flusher, 30)[0] != 0

    stop_dropping(proxy)
    seen_before = settled(proxy)
    m2 = remount(mounts, m, proxy.url)
    after_restart = proxy.seen[seen_before:]
    # Warm start replayed the committed body once; it uploaded nothing again.
    assert [s for s in after_restart if s.startswith("POST")] == [
        "POST /bridge/v1/folders/task/checkpoints"
    ]
    assert not [s for s in after_restart if s.startswith("PUT")]
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == applied
    assert versions(ctl, tenant.company_id, "task", run["task"]) == saved_versions
    assert server_files(tenant, "task", run["task"]) == {"report.bin": data, "gone-soon.txt": b"x"}
    assert journal(m2) == set()
    after = status(m2)
    assert after["pendingCheckpoint"] is None
    assert after["lastSave"]["operationId"] == applied[0]
    # A later change ships as a new operation, after the replayed one.
    (m2.mountpoint / "gone-soon.txt").unlink()
    reply = flush(m2)
    assert reply["ok"] is True and reply["result"]["operationId"] != applied[0]
    assert server_files(tenant, "task", run["task"]) == {"report.bin": data}
    assert len(receipts(ctl, tenant.company_id, "task", run["task"])) == 2
    # Stop while the proxy is still there: the final save has nothing left to do.
    assert m2.signal(signal.SIGTERM) == 0, m2.stderr()


# --- lost responses ----------------------------------------------------------


def test_lost_commit_answer_retry_is_idempotent_and_spares_a_later_writer(
    proxy: LossyProxy, mounts: MountFactory, tenant: Tenant
) -> None:
    ctl = tenant.controller
    run = start_run(tenant)
    folder = tenant.folder("task", run["task"])
    m = mounts.mount(proxy.url, scope="task", token_file=token_file(mounts, run))
    (m.mountpoint / "shared.txt").write_bytes(b"agent draft")
    (m.mountpoint / "other.txt").write_bytes(b"agent only")
    proxy.drop_next("POST", COMMITS, count=1_000_000)
    flusher = flush_in_background(m)
    wait_for(lambda: len(proxy.dropped) >= 1, 30, "the first commit to be applied")
    [op_id] = receipts(ctl, tenant.company_id, "task", run["task"])
    saved = versions(ctl, tenant.company_id, "task", run["task"])
    # While the agent still waits for its answer, a person saves a newer version.
    with tenant.client() as c:
        r = c.put(
            folder + "/content",
            params={"path": "shared.txt"},
            content=b"person's newer version",
            headers=OCTET,
        )
        assert r.status_code in (200, 201), r.text
    person_version = versions(ctl, tenant.company_id, "task", run["task"])["shared.txt"]
    assert person_version > saved["shared.txt"]
    stop_dropping(proxy)
    code, reply = reply_of(flusher, 60)
    assert code == 0 and reply["ok"] is True, reply
    assert reply["result"]["operationId"] == op_id
    assert reply["result"]["receipt"]["replayed"] is True
    assert len(proxy.dropped) >= 1
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == [op_id]
    assert versions(ctl, tenant.company_id, "task", run["task"]) == {
        "shared.txt": person_version,
        "other.txt": saved["other.txt"],
    }
    assert journal(m) == set()
    # The agent's copy is unchanged since its save: the next checkpoints never ship it.
    assert flush(m)["result"]["operationId"] is None
    (m.mountpoint / "later.txt").write_bytes(b"later")
    reply = flush(m)
    assert reply["ok"] is True and reply["result"]["entries"] == 1
    assert server_files(tenant, "task", run["task"]) == {
        "shared.txt": b"person's newer version",
        "other.txt": b"agent only",
        "later.txt": b"later",
    }
    assert versions(ctl, tenant.company_id, "task", run["task"])["shared.txt"] == person_version
    assert len(receipts(ctl, tenant.company_id, "task", run["task"])) == 2
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert server_files(tenant, "task", run["task"])["shared.txt"] == b"person's newer version"
