"""Paths longer than LMDB's 511-byte key limit work in the mount and reach the controller.

Before state format 3 the journal and baseline tables were keyed by the path
itself, so any operation on a path of 512-1023 bytes answered EIO.
"""

from __future__ import annotations

import os
import stat

import pytest

from tests.support.bridge import start_run
from tests.support.controller import Tenant
from tests.support.mount import MountFactory

pytestmark = pytest.mark.fuse


def long_path(total: int) -> tuple[list[str], str]:
    """Directories of 200 characters and a file name adding up to ``total`` bytes."""
    dirs: list[str] = []
    left = total
    while left > 250:
        dirs.append(str(len(dirs)).ljust(200, "d"))
        left -= 201
    return dirs, "f".ljust(left, "x")


@pytest.mark.parametrize("total", [600, 1000])
def test_long_path_create_stat_write_rename_list_unlink_and_save(
    mounts: MountFactory, tenant: Tenant, total: int
) -> None:
    run = start_run(tenant)
    assert run.task is not None
    token = mounts.base / f"token-{run.run_id}"
    token.write_text(run.token)
    m = mounts.mount(tenant.controller.url, scope="task", token_file=token)
    dirs, name = long_path(total)
    parent = m.mountpoint.joinpath(*dirs)
    parent.mkdir(parents=True)
    work = "/".join([*dirs, name])
    assert len(work.encode()) == total

    small = parent / name
    small.write_bytes(b"first")
    assert stat.S_ISREG(small.stat().st_mode) and small.stat().st_size == 5
    with open(small, "ab") as fh:
        fh.write(b" and more")
    assert small.read_bytes() == b"first and more"
    big = os.urandom(100_000)  # over the inline limit: an upper file
    renamed = parent / ("g" + name[1:])
    small.rename(renamed)
    (parent / ("h" + name[1:])).write_bytes(big)
    assert sorted(os.listdir(parent)) == ["g" + name[1:], "h" + name[1:]]
    changes = m.changes()
    assert changes["/".join([*dirs, "g" + name[1:]])]["action"] == "upload"

    m.fsagent("flush", m.scope)
    assert m.changes() == {}
    folder = tenant.folder("task", run.task)
    with tenant.client() as c:
        r = c.get(folder + "/content", params={"path": "/".join([*dirs, "g" + name[1:]])})
        assert r.status_code == 200 and r.content == b"first and more"
        r = c.get(folder + "/content", params={"path": "/".join([*dirs, "h" + name[1:]])})
        assert r.status_code == 200 and r.content == big
        assert c.get(folder + "/content", params={"path": work}).status_code == 404

    renamed.unlink()
    assert os.listdir(parent) == ["h" + name[1:]]
    m.fsagent("flush", m.scope)
    with tenant.client() as c:
        r = c.get(folder + "/content", params={"path": "/".join([*dirs, "g" + name[1:]])})
        assert r.status_code == 404
