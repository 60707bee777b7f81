"""Checkpoints under faults: nothing lost, nothing applied twice.

Every test drives a real fsagent mount against a real controller and
PostgreSQL, breaks something at a chosen point of a checkpoint (the daemon,
the network answer, the controller, its database connections, the lease, the
sandbox disk, the user's membership) and then checks what can be observed:
the bytes the controller serves, the receipts and file versions in
PostgreSQL, and the change set left in the sandbox's journal.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fsagent.cli import collection_status
from fsagent.store import Store
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    world_searchable_tmpdir,
)
from tests.support.lossy_proxy import LossyProxy
from tests.support.mount import REPO, FsagentMount, MountFactory
from tests.test_checkpoints import flush, server_files, start_run, token_file

pytestmark = pytest.mark.fuse
OCTET = {"Content-Type": "application/octet-stream"}
COMMITS = r"/checkpoints$"
BIG = 150 << 20


# --- helpers -------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def folder_id(ctl: ControllerProcess, company: str, scope: str, owner: str) -> int | None:
    with ctl.db() as conn:
        row = conn.execute(
            "SELECT id FROM folders WHERE company_id = %s AND scope = %s AND owner_id = %s",
            (company, scope, owner),
        ).fetchone()
    return None if row is None else int(row[0])


def receipts(ctl: ControllerProcess, company: str, scope: str, owner: str) -> list[str]:
    """Checkpoint receipts of the folder, oldest first (REST writes keep their own)."""
    fid = folder_id(ctl, company, scope, owner)
    if fid is None:
        return []
    with ctl.db() as conn:
        rows = conn.execute(
            "SELECT operation_id FROM receipts WHERE folder_id = %s AND operation_id LIKE 'cp-%%'"
            " ORDER BY created_at",
            (fid,),
        ).fetchall()
    return [r[0] for r in rows]


def versions(ctl: ControllerProcess, company: str, scope: str, owner: str) -> dict[str, int]:
    """Live path → server version."""
    fid = folder_id(ctl, company, scope, owner)
    if fid is None:
        return {}
    with ctl.db() as conn:
        rows = conn.execute(
            "SELECT path, version FROM files WHERE folder_id = %s AND deleted_at IS NULL",
            (fid,),
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def flush_argv(m: FsagentMount) -> list[str]:
    return [
        sys.executable,
        *("-m", "fsagent.cli", "flush", m.scope),
        *("--state-dir", str(m.state_dir), "--json"),
    ]


def try_flush(m: FsagentMount, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    """`fsagent flush` that may fail: (exit code, reply)."""
    out = subprocess.run(flush_argv(m), capture_output=True, timeout=timeout, cwd=REPO)
    return out.returncode, json.loads(out.stdout or b"{}")


def flush_in_background(m: FsagentMount) -> subprocess.Popen[bytes]:
    return subprocess.Popen(flush_argv(m), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)


def reply_of(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, dict[str, Any]]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, json.loads(out or b"{}")


def status(m: FsagentMount) -> dict[str, Any]:
    """What `fsagent status --json` reports for the mount's state dir (same code, in process)."""
    return collection_status(m.state_dir)


def journal(m: FsagentMount) -> set[str]:
    """Paths in the state dir's change set since the baseline (`fsagent changes`, in process)."""
    store = Store.open(m.state_dir, readonly=True)
    try:
        return {c.path for c in store.changes_since_baseline()}
    finally:
        store.close()


def status_cli(m: FsagentMount) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "status", "--state-dir", str(m.state_dir), "--json"],
        capture_output=True,
        check=True,
        cwd=REPO,
    )
    row: dict[str, Any] = json.loads(out.stdout)["collections"][0]
    return row


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


def upload_in_progress(ctl: ControllerProcess, at_least: int = 8 << 20) -> bool:
    """The controller is spooling an upload and has received ``at_least`` bytes of it."""
    for spool in (ctl.data_dir / "spool").glob("bridge-*"):
        try:
            if spool.stat().st_size >= at_least:
                return True
        except FileNotFoundError:
            continue
    return False


def spool_empty(ctl: ControllerProcess) -> bool:
    return not any((ctl.data_dir / "spool").glob("bridge-*"))


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


@pytest.fixture
def proxy(controller: ControllerProcess) -> Iterator[LossyProxy]:
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


@pytest.fixture(scope="module")
def own_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller of this module alone, so killing it leaves the shared one up."""
    ctl = ControllerProcess(pg_cluster.create_database(), world_searchable_tmpdir("fsa-cpf-"))
    ctl.start()
    try:
        yield ctl
    finally:
        ctl.stop()


def new_tenant(ctl: ControllerProcess) -> Tenant:
    out = ctl.admin(
        "bootstrap",
        *("--company-name", f"co-{uuid.uuid4().hex[:8]}"),
        *("--email", f"owner-{uuid.uuid4().hex[:10]}@example.com"),
    )
    return Tenant(ctl, out["company_id"], out["user_id"], out["token"])


# --- 1. kill -9 of fsagent at points of a checkpoint ------------------------------


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
    mounts: MountFactory, tenant: Tenant, proxy: LossyProxy
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


# --- 2. lost responses ----------------------------------------------------------


def test_lost_commit_answer_retry_is_idempotent_and_spares_a_later_writer(
    mounts: MountFactory, tenant: Tenant, proxy: LossyProxy
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


# --- 3. controller restart mid-checkpoint -----------------------------------------


def test_controller_kill9_mid_upload_then_restart_converges(
    mounts: MountFactory, own_controller: ControllerProcess
) -> None:
    ctl = own_controller
    tenant = new_tenant(ctl)
    run = start_run(tenant)
    m = mounts.mount(
        ctl.url,
        scope="task",
        token_file=token_file(mounts, run),
        extra=["--retry-deadline", "120"],
    )
    big = random_file(m.mountpoint / "big.bin", BIG)
    (m.mountpoint / "small.txt").write_bytes(b"small")
    flusher = flush_in_background(m)
    wait_for(lambda: upload_in_progress(ctl), 60, "the upload to reach the controller")
    ctl.kill()
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == []
    ctl.start()
    code, reply = reply_of(flusher, 150)
    assert code == 0 and reply["ok"] is True, reply
    [op_id] = receipts(ctl, tenant.company_id, "task", run["task"])
    assert reply["result"]["operationId"] == op_id
    assert server_files(tenant, "task", run["task"]) == {"big.bin": big, "small.txt": b"small"}
    assert journal(m) == set()


# --- 4. PostgreSQL connection loss -------------------------------------------------


def terminate_backends(pg_cluster: PgCluster, ctl: ControllerProcess) -> int:
    dbname = psycopg.conninfo.conninfo_to_dict(ctl.database_url)["dbname"]
    with psycopg.connect(pg_cluster.admin_url(), autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchone()
    return 0 if row is None else int(row[0])


def test_database_connection_loss_between_and_during_checkpoints(
    mounts: MountFactory, own_controller: ControllerProcess, pg_cluster: PgCluster
) -> None:
    ctl = own_controller
    tenant = new_tenant(ctl)
    run = start_run(tenant)
    m = mounts.mount(
        ctl.url,
        scope="task",
        token_file=token_file(mounts, run),
        extra=["--retry-deadline", "60"],
    )
    expected: dict[str, bytes] = {}
    op_ids: list[str] = []
    for i in range(3):
        expected[f"f{i}.txt"] = f"round {i}".encode()
        (m.mountpoint / f"f{i}.txt").write_bytes(expected[f"f{i}.txt"])
        assert terminate_backends(pg_cluster, ctl) >= 1
        reply = flush(m)
        assert reply["ok"] is True, reply
        op_ids.append(reply["result"]["operationId"])
    # Connections die again and again while a checkpoint is being saved.
    expected["during.bin"] = random_file(m.mountpoint / "during.bin", 24 << 20)
    (m.mountpoint / "f0.txt").write_bytes(b"rewritten")
    expected["f0.txt"] = b"rewritten"
    flusher = flush_in_background(m)
    killed = 0
    for _ in range(4):
        if flusher.poll() is not None:
            break
        killed += terminate_backends(pg_cluster, ctl)
        time.sleep(0.25)
    code, reply = reply_of(flusher, 90)
    assert code == 0 and reply["ok"] is True, reply
    assert killed >= 1
    op_ids.append(reply["result"]["operationId"])
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == op_ids
    assert server_files(tenant, "task", run["task"]) == expected
    assert journal(m) == set()


# --- 5. two sandboxes on one task ----------------------------------------------------


def test_two_sandboxes_later_write_wins_and_unchanged_files_never_overwrite(
    mounts: MountFactory, tenant: Tenant
) -> None:
    ctl = tenant.controller
    run_a = start_run(tenant, "--sandbox", f"sb-a-{uuid.uuid4().hex[:8]}")
    task = run_a["task"]
    run_b = ctl.admin(
        "start-run",
        tenant.company_id,
        *("--agent", run_a["agent"], "--task", task),
        *("--sandbox", f"sb-b-{uuid.uuid4().hex[:8]}"),
    )
    with tenant.client() as c:
        for path in ("f.txt", "both.txt"):
            r = c.put(
                tenant.folder("task", task) + "/content",
                params={"path": path},
                content=b"base",
                headers=OCTET,
            )
            assert r.status_code == 201, r.text
    a = mounts.mount(ctl.url, scope="task", token_file=token_file(mounts, run_a))
    b = mounts.mount(ctl.url, scope="task", token_file=token_file(mounts, run_b))
    (a.mountpoint / "f.txt").write_bytes(b"A changed f")
    (a.mountpoint / "both.txt").write_bytes(b"A's both")
    assert (b.mountpoint / "f.txt").read_bytes() == b"base"  # B only reads f
    (b.mountpoint / "g.txt").write_bytes(b"B wrote g")
    (b.mountpoint / "both.txt").write_bytes(b"B's both")
    assert flush(a)["ok"] is True
    after_a = versions(ctl, tenant.company_id, "task", task)
    reply_b = flush(b)
    assert reply_b["ok"] is True and reply_b["result"]["entries"] == 2  # g and both, never f
    after_b = versions(ctl, tenant.company_id, "task", task)
    assert server_files(tenant, "task", task) == {
        "f.txt": b"A changed f",  # B's stale copy of f did not overwrite it
        "both.txt": b"B's both",  # both changed it: the later accepted save wins
        "g.txt": b"B wrote g",
    }
    assert after_b["f.txt"] == after_a["f.txt"]
    assert after_b["both.txt"] > after_a["both.txt"]
    # Stopping saves nothing more from either side.
    assert a.signal(signal.SIGTERM) == 0 and b.signal(signal.SIGTERM) == 0
    assert versions(ctl, tenant.company_id, "task", task) == after_b
    assert len(receipts(ctl, tenant.company_id, "task", task)) == 4  # two flushes, two finals


# --- 6. stale lease -----------------------------------------------------------------


def test_new_run_for_the_sandbox_fences_the_old_mount(mounts: MountFactory, tenant: Tenant) -> None:
    ctl = tenant.controller
    sandbox = f"sb-{uuid.uuid4().hex[:8]}"
    old = start_run(tenant, "--sandbox", sandbox)
    task = old["task"]
    m = mounts.mount(ctl.url, scope="task", token_file=token_file(mounts, old))
    (m.mountpoint / "a.txt").write_bytes(b"saved before the new lease")
    assert flush(m)["ok"] is True
    before = versions(ctl, tenant.company_id, "task", task)
    before_receipts = receipts(ctl, tenant.company_id, "task", task)
    (m.mountpoint / "a.txt").write_bytes(b"written under the old lease")
    (m.mountpoint / "b.txt").write_bytes(b"new under the old lease")
    new = ctl.admin(
        "start-run",
        tenant.company_id,
        "--agent",
        old["agent"],
        "--task",
        task,
        "--sandbox",
        sandbox,
    )
    assert new["lease_epoch"] == old["lease_epoch"] + 1
    code, reply = try_flush(m)
    assert code != 0 and reply["ok"] is False, reply
    assert "401" in reply["error"] or "stale_lease" in reply["error"], reply
    assert versions(ctl, tenant.company_id, "task", task) == before
    assert receipts(ctl, tenant.company_id, "task", task) == before_receipts
    assert server_files(tenant, "task", task) == {"a.txt": b"saved before the new lease"}
    shown = status_cli(m)
    assert shown["lastError"] is not None
    assert shown["lastError"]["message"] in reply["error"]
    assert shown["unsavedChanges"] == 2
    assert set(m.changes()) == {"a.txt", "b.txt"}
    # The final save is refused as well: the daemon says so and keeps the state.
    assert m.signal(signal.SIGTERM) != 0
    assert set(m.changes()) == {"a.txt", "b.txt"}
    assert server_files(tenant, "task", task) == {"a.txt": b"saved before the new lease"}


# --- 7. sandbox disk full -------------------------------------------------------------


@pytest.fixture
def small_disk(mounts: MountFactory) -> Iterator[Path]:
    """A 64 MiB tmpfs for the state dir; unmounted after the test's mounts stop."""
    where = mounts.base / "small-disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        mounts.close()
        subprocess.run(["umount", "-l", str(where)], check=False)


def write_synced(path: Path, data: bytes) -> OSError | None:
    """Write, fsync and close as a careful agent does; the error it got, if any."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc
    return None


def test_disk_full_agent_gets_enospc_and_the_final_save_keeps_what_was_written(
    mounts: MountFactory, tenant: Tenant, small_disk: Path
) -> None:
    run = start_run(tenant)
    m = mounts.mount(
        tenant.controller.url,
        scope="task",
        state_dir=small_disk / "state",
        token_file=token_file(mounts, run),
    )
    written: dict[str, bytes] = {}
    failed: dict[str, bytes] = {}
    for i in range(40):  # 40 x 4 MiB cannot fit on 64 MiB
        name, data = f"out{i:02}.bin", os.urandom(4 << 20)
        error = write_synced(m.mountpoint / name, data)
        if error is not None:
            assert error.errno == errno.ENOSPC, error
            failed[name] = data
            break
        written[name] = data
    assert failed and len(written) >= 8, sorted(written)
    # Metadata changes still work on a full disk: that is how an agent makes room.
    os.rename(m.mountpoint / "out00.bin", m.mountpoint / "first.bin")
    written["first.bin"] = written.pop("out00.bin")
    # Shrinking a file frees its blocks at once; an odd size leaves room that
    # ends inside a write request rather than on its boundary.
    keep = (1 << 20) + (36 << 10)
    os.truncate(m.mountpoint / "out01.bin", keep)
    written["out01.bin"] = written["out01.bin"][:keep]
    # A file a little larger than the room left: its last write request is cut
    # short by the disk. The agent must hear of it, or all of it must be saved.
    vfs = os.statvfs(small_disk)
    room = vfs.f_bavail * vfs.f_frsize
    assert room >= 1 << 20, room
    tail = os.urandom(room + 8192)
    error = write_synced(m.mountpoint / "tail.bin", tail)
    if error is None:
        written["tail.bin"] = tail
    else:
        assert error.errno == errno.ENOSPC, error
        failed["tail.bin"] = tail

    assert m.signal(signal.SIGTERM, timeout=120) == 0, m.stderr()
    saved = server_files(tenant, "task", run["task"])
    assert {k: v for k, v in saved.items() if k not in failed} == written
    # A failed file's writeback was cut short. The kernel's writeback cache
    # keeps its own size and pages for it (the mount may show all it was
    # given), while fsagent holds what reached the disk: what is saved is a
    # prefix of what the agent wrote, never other bytes.
    for path, data in failed.items():
        partial = saved.get(path)
        assert partial is None or data.startswith(partial), (path, len(partial))
    assert journal(m) == set()  # everything on the full disk was saved


# --- 8. user folder of a removed member ---------------------------------------------------


def test_revoked_membership_refuses_the_user_folder_save_and_keeps_the_copy(
    mounts: MountFactory, tenant: Tenant
) -> None:
    ctl = tenant.controller
    user_id, _ = tenant.new_member()
    run = start_run(tenant, "--user", user_id)
    m = mounts.mount(ctl.url, scope="user", token_file=token_file(mounts, run))
    (m.mountpoint / "mine.txt").write_bytes(b"saved while a member")
    assert flush(m)["ok"] is True
    before = versions(ctl, tenant.company_id, "user", user_id)
    before_receipts = receipts(ctl, tenant.company_id, "user", user_id)
    (m.mountpoint / "mine.txt").write_bytes(b"written after removal")
    ctl.admin("remove-member", tenant.company_id, user_id)

    code, reply = try_flush(m)
    assert code != 0 and reply["ok"] is False, reply
    assert "403" in reply["error"] and "membership_revoked" in reply["error"], reply
    assert versions(ctl, tenant.company_id, "user", user_id) == before
    assert receipts(ctl, tenant.company_id, "user", user_id) == before_receipts
    # The sandbox keeps its copy and still lists the change.
    assert set(m.changes()) == {"mine.txt"}
    assert (m.mountpoint / "mine.txt").read_bytes() == b"written after removal"
    assert "membership_revoked" in status(m)["lastError"]["message"]
    # /sync of the run's task folder shows the run failed, with the reason.
    with tenant.client() as c:
        runs = c.get(tenant.folder("task", run["task"]) + "/sync").json()["runs"]
    [shown] = [r for r in runs if r["runId"] == run["run_id"]]
    assert shown["state"] == "failed" and "membership_revoked" in shown["error"], shown
    # Stopping cannot save it either: the daemon exits non-zero and the state dir keeps it.
    assert m.signal(signal.SIGTERM) != 0
    assert set(m.changes()) == {"mine.txt"}
    assert versions(ctl, tenant.company_id, "user", user_id) == before
