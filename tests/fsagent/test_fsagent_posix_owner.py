"""Owners, the full mode and atime: kept per inode, local only, upgraded from format 3.

The mount tests run in both of fsagent's FUSE modes (``mounts_in_both_modes``).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest

from common.types import Digest, FileVersion
from fsagent.state.records import Inode, process_owner
from fsagent.state.store import MARKER, ROOT_INODE, STATE_FORMAT, ManifestRow, Store
from tests.support.mount import MountFactory, mount_as_user, system_python_matches

OTHER = 65534
THIRD = 23456
"""A uid with no passwd entry: a process can still run as it."""
GROUP = 4242
"""A supplementary group of the caller in the unprivileged test (no group entry needed)."""


@pytest.fixture
def mounts(mounts_in_both_modes: MountFactory) -> MountFactory:
    return mounts_in_both_modes


def _as(uid: int, code: str, groups: list[int] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/usr/bin/python3", "-c", code], capture_output=True, text=True, user=uid, group=uid,
        extra_groups=groups or [], cwd="/", check=False, timeout=60,
    )  # fmt: skip


def _json_as(uid: int, code: str, groups: list[int] | None = None) -> dict[str, Any]:
    """Run ``code`` as ``uid``; what it printed last, as JSON."""
    res = _as(uid, code, groups)
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout.splitlines()[-1])
    return out


TRY = """
import errno, json, os, sys
def attempt(fn, *args):
    try:
        fn(*args)
        return 0
    except OSError as exc:
        return exc.errno
"""
"""Prelude of the scripts below: ``attempt`` gives 0 or the errno of a call."""


def _needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to change owners and act as other users")


def test_format_3_state_dir_is_upgraded_with_owners_and_atime(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = Store.open(root)
    store.tree.hydrate(
        [ManifestRow("docs/a.txt", "file", Digest("ab" * 32), 3, True, FileVersion(1))], 1
    )
    docs = store.tree.lookup(ROOT_INODE, "docs")
    assert docs is not None
    new = store.tree.create(docs, "new.txt", "file", 0o640)
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
    a_txt = up.tree.lookup(docs, "a.txt")
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
def test_mtimes_of_files_written_through_a_shared_mmap_survive_a_clean_remount(
    mounts: MountFactory,
) -> None:
    """With the writeback cache the kernel owns a file's mtime: it stamps it
    when a mapped page is first written, and its page write-back (WRITE)
    may reach the daemon after the SETATTR carrying that mtime. The mtime
    seen before a clean unmount is the one after the remount, to the ns."""
    src = mounts.source()
    m = mounts.mount(src)
    paths = [m.mountpoint / f"mapped{k:02}.bin" for k in range(20)]
    for k, p in enumerate(paths):
        with open(p, "w+b") as fh:
            fh.truncate(8192)
            with mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_SHARED) as mapped:
                mapped[:6] = b"mapped"
                mapped[4096:4098] = b"%02d" % k
    before = {p.name: p.stat().st_mtime_ns for p in paths}
    assert m.signal(15) == 0, m.stderr()
    again = mounts.mount(src, state_dir=m.state_dir, mountpoint=m.mountpoint)
    after = {p.name: (again.mountpoint / p.name).stat().st_mtime_ns for p in paths}
    assert after == before
    for k, p in enumerate(paths):
        data = (again.mountpoint / p.name).read_bytes()
        assert (len(data), data[:6], data[4096:4098]) == (8192, b"mapped", b"%02d" % k)


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
    """The mount's own options (noatime) and its superblock's (default_permissions)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mountpoint):
            return set(fields[5].split(",")) | set(fields[-1].split(","))
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
    f = store.tree.create(ROOT_INODE, "wal", "file", 0o644)
    epoch = store.dir.durable_epoch()
    store.dir.mark_durable(f.ino, epoch)
    assert store.dir.is_durable(f.ino)
    store.tree.rename(ROOT_INODE, "wal", ROOT_INODE, "wal2", keep_replaced=lambda _: False)
    assert not store.dir.is_durable(f.ino)  # the new path's journal entry is not durable yet
    store.dir.mark_durable(f.ino, epoch)  # a sync that began before the rename proves nothing
    assert not store.dir.is_durable(f.ino)
    store.dir.mark_durable(f.ino, store.dir.durable_epoch())
    store.acknowledge([], high_water=1)
    assert not store.dir.is_durable(f.ino)  # acknowledged entries come back with the next write
    store.dir.mark_durable(f.ino, store.dir.durable_epoch())
    store.tree.drop_inline(store.get(f.ino))
    assert not store.dir.is_durable(f.ino)
    store.close()


@pytest.mark.fuse
def test_unprivileged_daemon_leaves_chown_to_the_kernels_rules(mounts: MountFactory) -> None:
    """docs/users/fsagent.md ("POSIX metadata"): without --allow-other, fsagent running as an
    unprivileged user, a chown to another uid fails with EPERM and a chgrp
    works for that user's own groups (and only those); what passes is stored."""
    _needs_root()
    if not system_python_matches():
        pytest.skip("no system python with the same ABI as the venv")
    src = mounts.source({"agent": {"saved.txt": b"saved", "docs/a.txt": b"a"}})
    m = mount_as_user(mounts, src, OTHER)
    mp = m.mountpoint
    script = f"""
mine, saved, docs = "{mp}/mine", "{mp}/saved.txt", "{mp}/docs"
open(mine, "w").write("x")
out = {{
    "chown other uid": attempt(os.chown, mine, {THIRD}, -1),
    "chown root": attempt(os.chown, mine, 0, -1),
    "chgrp own group": attempt(os.chown, mine, -1, {GROUP}),
    "gid": os.stat(mine).st_gid,
    "chgrp other group": attempt(os.chown, mine, -1, {THIRD}),
    "chown to self": attempt(os.chown, mine, {OTHER}, {OTHER}),
    "saved chown other uid": attempt(os.chown, saved, {THIRD}, -1),
    "saved chgrp own group": attempt(os.chown, saved, -1, {GROUP}),
    "dir chgrp own group": attempt(os.chown, docs, -1, {GROUP}),
    "dir chown other uid": attempt(os.chown, docs, {THIRD}, {GROUP}),
}}
for name, path in (("saved", saved), ("docs", docs), ("mine", mine)):
    st = os.stat(path)
    out[name + " owner"] = [st.st_uid, st.st_gid]
print(json.dumps(out))
"""
    got = _json_as(OTHER, TRY + script, groups=[GROUP])
    assert got == {
        "chown other uid": errno.EPERM,
        "chown root": errno.EPERM,
        "chgrp own group": 0,
        "gid": GROUP,
        "chgrp other group": errno.EPERM,
        "chown to self": 0,
        "saved chown other uid": errno.EPERM,
        "saved chgrp own group": 0,
        "dir chgrp own group": 0,
        "dir chown other uid": errno.EPERM,
        # Saved (hydrated) entries belong to the user running fsagent.
        "saved owner": [OTHER, GROUP],
        "docs owner": [OTHER, GROUP],
        "mine owner": [OTHER, OTHER],
    }
    # What the kernel let through is in the state dir (read while mounted, as status does).
    store = Store.open(m.state_dir, readonly=True)
    try:
        owners = {}
        for name in ("saved.txt", "docs", "mine"):
            ino = store.tree.lookup(ROOT_INODE, name)
            assert ino is not None, name
            node = store.get(ino)
            owners[name] = (node.uid, node.gid)
    finally:
        store.close()
    assert owners == {"saved.txt": (OTHER, GROUP), "docs": (OTHER, GROUP), "mine": (OTHER, OTHER)}


SPECIAL_BITS = {
    # name: (owner, mode set by root, who acts, action, mode expected after it)
    "written by its owner": (OTHER, 0o6777, OTHER, "append", 0o777),
    "written by another user": (0, 0o6777, OTHER, "append", 0o777),
    "setgid without group exec, written": (OTHER, 0o2666, OTHER, "append", 0o2666),
    "truncated by path": (OTHER, 0o6777, OTHER, "truncate", 0o777),
    "truncated by another user": (0, 0o6777, OTHER, "truncate", 0o777),
    "ftruncated": (OTHER, 0o6755, OTHER, "ftruncate", 0o755),
    "opened with O_TRUNC": (OTHER, 0o4755, OTHER, "o_trunc", 0o755),
    "written by root": (OTHER, 0o6777, 0, "append", 0o6777),
    "truncated by root": (OTHER, 0o6777, 0, "truncate", 0o6777),
    "chown, group exec": (OTHER, 0o2755, 0, "chown", 0o755),
    "chown, setuid and setgid": (OTHER, 0o6775, 0, "chown", 0o775),
    "chown, setgid without group exec": (OTHER, 0o2644, 0, "chown", 0o2644),
    "chgrp, setgid and group exec": (OTHER, 0o2755, 0, "chgrp", 0o755),
    "chown of a directory": (OTHER, 0o2755, 0, "chown dir", 0o2755),
}
"""Linux's rules for setuid and setgid: a write or truncate by a process
without CAP_FSETID clears setuid, and setgid when group exec is set (without
it the bit means mandatory locking, kept for a writer in the file's group);
root's write keeps both; chown or chgrp of a file clears setuid, and setgid
with group exec; a directory keeps them."""

ACT = """
def act(path, action):
    if action == "append":
        with open(path, "ab") as fh:
            fh.write(b"more")
    elif action == "truncate":
        os.truncate(path, 3)
    elif action == "ftruncate":
        fd = os.open(path, os.O_WRONLY)
        os.ftruncate(fd, 0)
        os.close(fd)
    elif action == "o_trunc":
        with open(path, "wb") as fh:
            fh.write(b"new")
    elif action in ("chown", "chown dir"):
        os.chown(path, 0, 0)
    elif action == "chgrp":
        os.chown(path, -1, 100)
"""


@pytest.mark.fuse
def test_setuid_and_setgid_are_cleared_on_write_truncate_and_chown(mounts: MountFactory) -> None:
    """Each rule of SPECIAL_BITS, asserted one by one on the mount (root with
    --allow-other, a second uid writing), the same on a native directory, and
    the result still there after a remount."""
    _needs_root()
    m = mounts.mount(extra=["--allow-other"])
    os.chmod(mounts.base, 0o755)
    roots = {"mount": m.mountpoint / "bits", "native": mounts.base / "native-bits"}
    for root in roots.values():
        root.mkdir()
        os.chmod(root, 0o777)
        for i, (owner, mode, _, action, _) in enumerate(SPECIAL_BITS.values()):
            p = root / f"c{i}"
            if action == "chown dir":
                p.mkdir()
            else:
                p.write_bytes(b"0123456789")
            os.chown(p, owner, owner)
            os.chmod(p, mode)  # after the chown, which would clear the bits
    namespace: dict[str, object] = {"os": os}
    exec(ACT, namespace)  # the same actions, for root in this process
    by_user = [(i, c[3]) for i, c in enumerate(SPECIAL_BITS.values()) if c[2] == OTHER]
    for root in roots.values():
        for i, (_, _, who, action, _) in enumerate(SPECIAL_BITS.values()):
            if who == 0:
                namespace["act"](str(root / f"c{i}"), action)  # type: ignore[operator]
        res = _as(OTHER, "import os\n" + ACT + "".join(
            f"act({str(root / f'c{i}')!r}, {action!r})\n" for i, action in by_user
        ))  # fmt: skip
        assert res.returncode == 0, res.stderr

    def modes(root: Path) -> dict[str, str]:
        return {name: oct(stat.S_IMODE((root / f"c{i}").stat().st_mode))
                for i, name in enumerate(SPECIAL_BITS)}  # fmt: skip

    expected = {name: oct(c[4]) for name, c in SPECIAL_BITS.items()}
    assert modes(roots["native"]) == expected  # the rules as this kernel applies them natively
    assert modes(roots["mount"]) == expected
    sizes = {name: (roots["mount"] / f"c{i}").stat().st_size
             for i, name in enumerate(SPECIAL_BITS) if SPECIAL_BITS[name][3] != "chown dir"}  # fmt: skip
    assert sizes["truncated by path"] == 3 and sizes["ftruncated"] == 0
    assert sizes["opened with O_TRUNC"] == 3 and sizes["written by root"] == 14
    assert (roots["mount"] / "c0").read_bytes() == b"0123456789more"
    assert m.signal(15) == 0
    again = mounts.mount(state_dir=m.state_dir, mountpoint=m.mountpoint, extra=["--allow-other"],
                         source=m.controller)  # fmt: skip
    assert modes(again.mountpoint / "bits") == expected


@pytest.mark.fuse
def test_reads_leave_atime_alone_and_utimensat_sets_it(mounts: MountFactory) -> None:
    """docs/users/fsagent.md: the mount is noatime, so no read changes atime (a first read
    that fetches saved content, a read of a changed inline or upper copy, a
    cached read, a listing); utimensat sets it, and it survives a remount."""
    src = mounts.source({"agent": {"saved.txt": b"saved bytes", "docs/a.txt": b"a"}})
    m = mounts.mount(src)
    mp = m.mountpoint
    assert "noatime" in _mount_options(mp)
    (mp / "small").write_bytes(b"inline contents")
    (mp / "large").write_bytes(os.urandom(300_000))  # over INLINE_MAX: an upper copy
    paths = [mp / "saved.txt", mp / "small", mp / "large", mp / "docs"]
    for k, p in enumerate(paths):
        os.utime(p, ns=(1_000_000_000 + k, 2_000_000_000 + k))

    def read_everything() -> None:
        for p in paths:
            if p.is_dir():
                assert os.listdir(p) == ["a.txt"]
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # this read reaches fsagent
                assert len(os.read(fd, 1 << 20)) > 0
            finally:
                os.close(fd)
            assert len(p.read_bytes()) > 0  # and this one is served from the page cache

    def atimes() -> list[int]:
        return [p.stat().st_atime_ns for p in paths]

    read_everything()
    assert atimes() == [1_000_000_000 + k for k in range(4)]
    assert [p.stat().st_mtime_ns for p in paths] == [2_000_000_000 + k for k in range(4)]
    for k, p in enumerate(paths):  # utimensat of atime alone (mtime UTIME_OMIT)
        os.utime(p, ns=(5_000_000_000 + k, p.stat().st_mtime_ns))
    read_everything()
    assert atimes() == [5_000_000_000 + k for k in range(4)]
    assert m.signal(15) == 0
    again = mounts.mount(src, state_dir=m.state_dir, mountpoint=mp)
    read_everything()
    assert atimes() == [5_000_000_000 + k for k in range(4)]
    assert again.changes().keys() == {"small", "large"}  # times are never shipped
