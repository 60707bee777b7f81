"""A mountpoint that no daemon serves refuses writes; what landed underneath is adopted.

(fsagent.mountguard) A FUSE daemon's restart detaches the dead mount first;
until the new mount serves, the path names the directory underneath. Writes
there used to succeed, fsync and all, and vanish under the new mount.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import time

import pytest

from fsagent.mountguard import release
from tests.support.bridge import start_run
from tests.support.controller import Tenant
from tests.support.mount import MountFactory

pytestmark = [pytest.mark.fuse]


@pytest.fixture
def mounts(mounts_in_both_modes: MountFactory) -> MountFactory:
    return mounts_in_both_modes


def test_an_unserved_mountpoint_refuses_writes(mounts: MountFactory) -> None:
    m = mounts.mount()
    (m.mountpoint / "kept").write_bytes(b"saved in the collection")
    m.kill9()  # the dead mount is detached: the path is the directory underneath
    with pytest.raises(OSError) as info:
        (m.mountpoint / "lost").write_bytes(b"would vanish under the next mount")
    # Root passes permission checks; the immutable flag stops it all the same.
    assert info.value.errno == (errno.EPERM if os.geteuid() == 0 else errno.EACCES)
    assert os.listdir(m.mountpoint) == []
    again = mounts.mount(m.controller, state_dir=m.state_dir, mountpoint=m.mountpoint)
    assert (again.mountpoint / "kept").read_bytes() == b"saved in the collection"
    assert again.stop() == 0
    # A clean stop leaves the guard too: a write after the stop fails loudly.
    with pytest.raises(OSError):
        (m.mountpoint / "after-stop").write_bytes(b"x")
    release(m.mountpoint)
    (m.mountpoint / "after-release").write_bytes(b"the owner's directory again")
    assert (m.mountpoint / "after-release").read_bytes() == b"the owner's directory again"
    (m.mountpoint / "after-release").unlink()


def test_what_was_written_underneath_is_adopted_and_saved(
    mounts: MountFactory, tenant: Tenant
) -> None:
    """Files written under the mountpoint while no daemon served it (before
    the guard existed, or in the moment between a dead mount's detach and the
    guard) are taken into the collection once it serves, then saved; a link
    (which a collection cannot hold) stays underneath."""
    token = mounts.base / "token"
    run = start_run(tenant)
    token.write_text(run.token)
    task = run.task
    assert task is not None
    mp = mounts.base / "task"
    (mp / "notes" / "deep").mkdir(parents=True)
    written = {
        "top.txt": b"written while nothing served the folder",
        "notes/a.md": os.urandom(70_000),  # beyond the inline limit: an upper file
        "notes/deep/b.bin": b"",
    }
    for rel, data in written.items():
        with open(mp / rel, "wb") as fh:
            fh.write(data)
            os.fsync(fh.fileno())
    os.symlink("top.txt", mp / "link")
    m = mounts.mount(tenant.controller.url, "task", mountpoint=mp, token_file=token)
    deadline = time.monotonic() + 120  # adoption follows the mount, from a worker thread
    while "adopted 3 file(s)" not in m.stderr():
        assert time.monotonic() < deadline, m.stderr()
        time.sleep(0.05)
    for rel, data in written.items():
        assert (mp / rel).read_bytes() == data, rel
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    release(mp)
    assert os.listdir(mp) == ["link"]  # adopted files gone from underneath; the link kept
    (mp / "link").unlink()
    folder = tenant.folder("task", task)
    with tenant.client() as c:
        for rel, data in written.items():
            got = c.get(folder + "/content", params={"path": rel})
            assert got.status_code == 200, (rel, got.text)
            assert hashlib.sha256(got.content).digest() == hashlib.sha256(data).digest(), rel
