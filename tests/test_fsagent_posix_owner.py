"""Owners, the full mode and atime: kept per inode, local only, upgraded from format 3."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import lmdb
import pytest

from common.types import Digest, FileVersion
from fsagent.records import Inode, process_owner
from fsagent.store import MARKER, ROOT_INODE, STATE_FORMAT, ManifestRow, Store
from tests.support.mount import MountFactory

OTHER = 65534
THIRD = 23456
"""A uid with no passwd entry: a process can still run as it."""


def _as(uid: int, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/usr/bin/python3", "-c", code], capture_output=True, text=True, user=uid, group=uid,
        cwd="/", check=False, timeout=60,
    )  # fmt: skip


def _needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to change owners and act as other users")


def test_format_3_state_dir_is_upgraded_with_owners_and_atime(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = Store.open(root)
    store.hydrate(
        [ManifestRow("docs/a.txt", "file", Digest("ab" * 32), 3, True, FileVersion(1))], 1
    )
    docs = store.lookup(ROOT_INODE, "docs")
    assert docs is not None
    new = store.create(docs, "new.txt", "file", 0o640)
    store.close()
    # Rewrite it as the format-3 code left it: inode records of version 1.
    env = lmdb.open(str(root / "db"), max_dbs=8)
    inodes, meta = env.open_db(b"inodes"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        for key, raw in list(txn.cursor(db=inodes)):
            rec = json.loads(raw)
            txn.put(key, json.dumps([1, *rec[1:11]]).encode(), db=inodes)
        txn.put(b"format", b"3", db=meta)
    env.close()
    (root / MARKER).write_text(json.dumps({"kind": "fsagent-state", "format": 3}) + "\n")

    ro = Store.open(root, readonly=True)  # fsagent status: read as is, nothing rewritten
    old = ro.get(new.ino)
    assert (old.uid, old.gid) == process_owner() and old.atime_ns == old.mtime_ns
    assert old.mode == 0o640
    ro.close()
    assert json.loads((root / MARKER).read_text())["format"] == 3

    Store.open(root).close()
    assert json.loads((root / MARKER).read_text())["format"] == STATE_FORMAT == 5
    env = lmdb.open(str(root / "db"), max_dbs=8, readonly=True, lock=False)
    with env.begin() as txn:
        records = [json.loads(v) for _, v in txn.cursor(db=env.open_db(b"inodes", txn=txn))]
    env.close()
    assert len(records) == 4 and all(r[0] == 2 for r in records)
    up = Store.open(root)
    upgraded = up.get(new.ino)
    assert (upgraded.uid, upgraded.gid, upgraded.atime_ns) == (*process_owner(), old.mtime_ns)
    a_txt = up.lookup(docs, "a.txt")
    assert a_txt is not None and up.get(a_txt).executable
    assert [(c.path, c.action) for c in up.changes_since_baseline()] == [("docs/new.txt", "upload")]
    up.close()


def test_owner_record_round_trips() -> None:
    inode = Inode(7, "file", 0o4755, 1, 10, 20, ROOT_INODE, "x", None, True, 0, 5, 6, 3)  # type: ignore[arg-type]
    assert Inode.decode(7, inode.encode()) == inode
    assert (inode.uid, inode.gid, inode.atime_ns) == (5, 6, 3)


@pytest.mark.fuse
def test_owner_full_mode_and_atime_are_kept_locally_and_survive_a_remount(
    mounts: MountFactory,
) -> None:
    _needs_root()
    src = mounts.source({"agent": {"saved.txt": b"saved", "tool": b"#!/bin/sh\n"}})
    m = mounts.mount(src)
    mp = m.mountpoint
    saved, tool, shared = mp / "saved.txt", mp / "tool", mp / "shared"
    os.chown(saved, OTHER, 100)
    os.utime(saved, ns=(1_000_000_007, 2_000_000_009))
    os.chmod(tool, 0o4644)  # saved without the exec bit: that stays as saved
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o3777)
    assert (saved.stat().st_uid, saved.stat().st_gid) == (OTHER, 100)
    assert (saved.stat().st_atime_ns, saved.stat().st_mtime_ns) == (1_000_000_007, 2_000_000_009)
    assert stat.S_IMODE(tool.stat().st_mode) == 0o4644
    # Owner, group, atime and special bits are not shipped: the saved files are unchanged.
    changes = m.changes()
    assert "saved.txt" not in changes and "tool" not in changes, changes
    # chown of a setuid file clears setuid, as on Linux.
    os.chown(tool, 0, 0)
    assert stat.S_IMODE(tool.stat().st_mode) == 0o644
    os.chmod(tool, 0o6755)
    assert m.signal(15) == 0
    again = mounts.mount(src, state_dir=m.state_dir, mountpoint=mp)
    st = (again.mountpoint / "saved.txt").stat()
    assert (st.st_uid, st.st_gid, st.st_atime_ns, st.st_mtime_ns) == (
        OTHER, 100, 1_000_000_007, 2_000_000_009,
    )  # fmt: skip
    assert stat.S_IMODE((again.mountpoint / "tool").stat().st_mode) == 0o6755
    assert stat.S_IMODE((again.mountpoint / "shared").stat().st_mode) == 0o3777
    assert (again.mountpoint / "saved.txt").read_bytes() == b"saved"


@pytest.mark.fuse
def test_times_are_committed_behind_and_by_fsync_before_a_crash(mounts: MountFactory) -> None:
    """Time-only changes are committed in batches (within WRITE_BEHIND_S) and
    by an fsync; after kill -9 they are there, and the bytes always are."""
    src = mounts.source()
    m = mounts.mount(src)
    waited, synced = m.mountpoint / "waited", m.mountpoint / "synced"
    for f in (waited, synced):
        f.write_bytes(b"data of " + f.name.encode())
    os.utime(synced, ns=(3_000_000_007, 4_000_000_009))
    fd = os.open(synced, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.utime(waited, ns=(1_000_000_007, 2_000_000_009))
    time.sleep(0.5)  # well past the write-behind delay
    m.kill9()
    again = mounts.mount(src, state_dir=m.state_dir, mountpoint=m.mountpoint)
    for f, times in ((waited, (1_000_000_007, 2_000_000_009)),
                     (synced, (3_000_000_007, 4_000_000_009))):  # fmt: skip
        st = (again.mountpoint / f.name).stat()
        assert (st.st_atime_ns, st.st_mtime_ns) == times, f.name
        assert (again.mountpoint / f.name).read_bytes() == b"data of " + f.name.encode()


@pytest.mark.fuse
def test_other_users_in_handed_setgid_and_sticky_directories(mounts: MountFactory) -> None:
    _needs_root()
    m = mounts.mount(extra=["--allow-other"])
    os.chmod(mounts.base, 0o755)
    mp = m.mountpoint
    handed, group_dir, sticky = mp / "handed", mp / "group", mp / "tmp"
    for d in (handed, group_dir, sticky):
        d.mkdir()
    os.chown(handed, OTHER, OTHER)
    os.chown(group_dir, 0, 100)
    os.chmod(group_dir, 0o2777)
    os.chmod(sticky, 0o1777)

    # A directory handed to a user is that user's to fill; entries are theirs.
    res = _as(OTHER, f"import os; open('{handed}/f', 'w').write('hi'); os.mkdir('{handed}/sub')")
    assert res.returncode == 0, res.stderr
    f = (handed / "f").stat()
    assert (f.st_uid, f.st_gid, stat.S_IMODE(f.st_mode)) == (OTHER, OTHER, 0o644)
    assert (handed / "sub").stat().st_uid == OTHER
    # ... and not another user's.
    res = _as(THIRD, f"open('{handed}/g', 'w')")
    assert "PermissionError" in res.stderr
    # A setgid directory gives new entries its group; subdirectories inherit the bit.
    res = _as(OTHER, f"import os; open('{group_dir}/f', 'w'); os.mkdir('{group_dir}/sub')")
    assert res.returncode == 0, res.stderr
    assert (group_dir / "f").stat().st_gid == 100
    sub = (group_dir / "sub").stat()
    assert sub.st_gid == 100 and sub.st_mode & stat.S_ISGID
    # A sticky directory protects its entries from other users.
    assert _as(OTHER, f"open('{sticky}/mine', 'w').write('x')").returncode == 0
    res = _as(THIRD, f"import os; os.unlink('{sticky}/mine')")
    assert "PermissionError" in res.stderr and (sticky / "mine").exists()
    res = _as(THIRD, f"import os; os.rename('{sticky}/mine', '{sticky}/taken')")
    assert "PermissionError" in res.stderr
    assert _as(OTHER, f"import os; os.unlink('{sticky}/mine')").returncode == 0
    # A write by a user without CAP_FSETID clears setuid and setgid; root's does not.
    prog = handed / "prog"
    prog.write_bytes(b"x")
    os.chown(prog, OTHER, OTHER)
    os.chmod(prog, 0o6777)
    with open(prog, "ab") as fh:
        fh.write(b"root")
    assert stat.S_IMODE(prog.stat().st_mode) == 0o6777
    assert _as(OTHER, f"open('{prog}', 'ab').write(b'user')").returncode == 0
    assert stat.S_IMODE(prog.stat().st_mode) == 0o777
    assert prog.read_bytes() == b"xrootuser"


def _mount_options(mountpoint: Path) -> set[str]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mountpoint):
            return set(fields[-1].split(","))
    raise AssertionError(f"{mountpoint} is not mounted")


@pytest.mark.fuse
def test_root_only_mount_checks_exec_itself_without_default_permissions(
    mounts: MountFactory,
) -> None:
    """As root without --allow-other only root reaches the mount, so the kernel's
    mode checks (and the directory GETATTR after each change they cost) are off;
    exec of a file without any exec bit is still refused, as for root natively."""
    _needs_root()
    private = mounts.mount()
    shared = mounts.mount(extra=["--allow-other"])
    assert "default_permissions" not in _mount_options(private.mountpoint)
    assert "default_permissions" in _mount_options(shared.mountpoint)
    script = private.mountpoint / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    os.chmod(script, 0o644)
    assert not os.access(script, os.X_OK)
    assert os.access(script, os.R_OK | os.W_OK)
    with pytest.raises(PermissionError):
        subprocess.run([str(script)], check=False)
    os.chmod(script, 0o700)
    assert os.access(script, os.X_OK)
    assert subprocess.run([str(script)], capture_output=True, text=True).stdout == "ran\n"
    locked = private.mountpoint / "locked"
    locked.write_bytes(b"root may")
    os.chmod(locked, 0)
    with open(locked, "ab") as fh:  # root passes mode checks, as on a native filesystem
        fh.write(b" write")
    assert locked.read_bytes() == b"root may write"
    # With one user (no --allow-other), root's chown is stored and shows in stat.
    os.chown(locked, OTHER, 100)
    assert (locked.stat().st_uid, locked.stat().st_gid) == (OTHER, 100)


def test_fsync_skips_the_store_sync_only_while_an_upper_file_records_are_durable(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "s")
    f = store.create(ROOT_INODE, "wal", "file", 0o644)
    epoch = store.durable_epoch()
    store.mark_durable(f.ino, epoch)
    assert store.is_durable(f.ino)
    store.rename(ROOT_INODE, "wal", ROOT_INODE, "wal2", keep_replaced=lambda _: False)
    assert not store.is_durable(f.ino)  # the new path's journal entry is not durable yet
    store.mark_durable(f.ino, epoch)  # a sync that began before the rename proves nothing
    assert not store.is_durable(f.ino)
    store.mark_durable(f.ino, store.durable_epoch())
    store.acknowledge([], high_water=1)
    assert not store.is_durable(f.ino)  # acknowledged entries come back with the next write
    store.mark_durable(f.ino, store.durable_epoch())
    store.drop_inline(store.get(f.ino))
    assert not store.is_durable(f.ino)
    store.close()
