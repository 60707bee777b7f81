"""Checkpoints that meet another writer or are refused: two sandboxes on one
task, a stale lease, a full sandbox disk, and the user folder of a removed
member. Each test drives real fsagent mounts against the shared controller and
checks that nothing is lost, nothing stale overwrites newer bytes, and a
refused save keeps its change set in the sandbox. All but the disk-full test
(whose sandbox disk is the FUSE state dir) also run on plain directories; dir
mode has a disk-full test of its own, where the directory and the state dir
share the full disk.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.checkpoints import OCTET, journal, receipts, status, try_flush, versions
from tests.support.controller import Tenant
from tests.support.mount import REPO, FsagentMount, MountFactory, mount_factory
from tests.support.smallfs import assert_full, fill, free_fill, small_tmpfs
from tests.system.test_checkpoints import flush, server_files, start_run, token_file

pytestmark = pytest.mark.fuse


def status_cli(m: FsagentMount) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "status", "--state-dir", str(m.state_dir), "--json"],
        capture_output=True,
        check=True,
        cwd=REPO,
    )
    row: dict[str, Any] = json.loads(out.stdout)["collections"][0]
    return row


# --- two sandboxes on one task ----------------------------------------------------


def test_two_sandboxes_later_write_wins_and_unchanged_files_never_overwrite(
    mode_mounts: MountFactory, tenant: Tenant
) -> None:
    mounts = mode_mounts  # once with FUSE mounts, once with plain directories
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


# --- stale lease -----------------------------------------------------------------


def test_new_run_for_the_sandbox_fences_the_old_mount(
    mode_mounts: MountFactory, tenant: Tenant
) -> None:
    mounts = mode_mounts  # once with FUSE mounts, once with plain directories
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
    # Fenced: the next save fails at once, without asking the controller again.
    code, again = try_flush(m)
    assert code != 0 and again["error"].startswith("not saved, "), again
    assert "newer run holds the lease" in again["error"] or "run has ended" in again["error"]
    # The final save is refused as well: the daemon says so and keeps the state.
    assert m.signal(signal.SIGTERM) != 0
    assert set(m.changes()) == {"a.txt", "b.txt"}
    assert server_files(tenant, "task", task) == {"a.txt": b"saved before the new lease"}


# --- sandbox disk full -------------------------------------------------------------


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


def files_on_disk(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_disk_full_in_dir_mode_the_final_save_saves_what_the_directory_holds(
    tenant: Tenant,
) -> None:
    """Dir mode on a full disk: the collection's directory and its state dir on
    one small filesystem, filled by the agent's writes (the kernel's own
    ENOSPC: nothing of fsagent's is in the write path) and then to the last
    block and inode. The final save still saves exactly what the directory
    holds: reading needs no room, and the state dir's commits use the space
    its LMDB file keeps in reserve (fsagent.state.statedir.GuardedEnv)."""
    run = start_run(tenant)
    with small_tmpfs() as disk, mount_factory(mode="dir") as mounts:
        m = mounts.mount(
            tenant.controller.url,
            scope="task",
            state_dir=disk / "state",
            mountpoint=disk / "task",
            token_file=token_file(mounts, run),
        )
        (m.mountpoint / "notes.txt").write_bytes(b"saved before the disk filled")
        assert flush(m)["ok"] is True
        for i in range(40):  # 40 x 4 MiB cannot fit on 64 MiB
            error = write_synced(m.mountpoint / f"out{i:02}.bin", os.urandom(4 << 20))
            if error is not None:
                assert error.errno == errno.ENOSPC, error
                break
        else:
            raise AssertionError("the disk never filled")
        assert i >= 8, i
        os.rename(m.mountpoint / "out00.bin", m.mountpoint / "first.bin")
        (m.mountpoint / "notes.txt").unlink()
        fill(disk)  # what the agent left: not a block, not an inode
        assert_full(disk)
        on_disk = files_on_disk(m.mountpoint)  # the cut-short file as far as it got
        assert m.signal(signal.SIGTERM, timeout=120) == 0, m.stderr()
        assert f"final save: {len(on_disk) + 1} change(s) saved" in m.stderr()
        assert server_files(tenant, "task", run["task"]) == on_disk
        assert journal(m) == set()
        free_fill(disk)


# --- user folder of a removed member ---------------------------------------------------


def test_revoked_membership_refuses_the_user_folder_save_and_keeps_the_copy(
    mode_mounts: MountFactory, tenant: Tenant
) -> None:
    mounts = mode_mounts  # once with FUSE mounts, once with plain directories
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
