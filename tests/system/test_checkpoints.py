"""Checkpoints end to end: a real fsagent mount saving to a real controller.

Every test runs twice: on a FUSE mount and on a plain directory (dir mode),
with the same assertions (the ``mounts`` fixture below)."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from fsagent.state.store import Store
from tests.support.checkpoints import journal
from tests.support.controller import Tenant
from tests.support.mount import FsagentMount, MountFactory

pytestmark = pytest.mark.fuse
OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """FUSE mounts, then plain directories (tests.support.fixtures.mode_mounts)."""
    return mode_mounts


def start_run(tenant: Tenant, *extra: str) -> dict[str, Any]:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    run = ctl.admin("start-run", tenant.company_id, "--agent", agent, "--task", task, *extra)
    return {**run, "task": task, "agent": agent, "project": project}


def token_file(mounts: MountFactory, run: dict[str, Any]) -> Path:
    path = mounts.base / f"token-{run['run_id']}"
    path.write_text(run["token"])
    return path


def server_files(tenant: Tenant, scope: str, owner: str) -> dict[str, bytes]:
    folder = tenant.folder(scope, owner)
    out: dict[str, bytes] = {}
    with tenant.client() as c:
        cursor = None
        while True:
            params = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            body = c.get(folder + "/", params=params).json()
            for e in body["entries"]:
                if e["kind"] == "file":
                    out[e["path"]] = c.get(folder + "/content", params={"path": e["path"]}).content
            cursor = body["nextCursor"]
            if cursor is None:
                return out


def flush(m: FsagentMount, final: bool = False) -> dict[str, Any]:
    args = ["flush", m.scope, *(["--final"] if final else [])]
    result: dict[str, Any] = m.fsagent(*args)
    return result


def test_flush_ships_writes_renames_deletes_and_exec_bits(
    mounts: MountFactory, tenant: Tenant
) -> None:
    run = start_run(tenant)
    with tenant.client() as c:
        c.put(
            tenant.folder("task", run["task"]) + "/content",
            params={"path": "saved/old.txt"},
            content=b"unchanged content",
            headers=OCTET,
        )
        c.put(
            tenant.folder("task", run["task"]) + "/content",
            params={"path": "gone.txt"},
            content=b"to be deleted",
            headers=OCTET,
        )
    m = mounts.mount(tenant.controller.url, scope="task", token_file=token_file(mounts, run))
    root = m.mountpoint
    (root / "src").mkdir()
    (root / "src" / "main.py").write_bytes(b"print('hi')\n")
    big = os.urandom(9 << 20)
    (root / "big.bin").write_bytes(big)
    os.rename(root / "saved" / "old.txt", root / "saved" / "new.txt")
    (root / "gone.txt").unlink()
    (root / "run.sh").write_bytes(b"#!/bin/sh\necho ok\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "tmp.txt").write_bytes(b"short-lived")
    (root / "tmp.txt").unlink()

    reply = flush(m)
    assert reply["ok"] is True, reply
    assert reply["result"]["entries"] >= 5
    assert server_files(tenant, "task", run["task"]) == {
        "src/main.py": b"print('hi')\n",
        "big.bin": big,
        "saved/new.txt": b"unchanged content",
        "run.sh": b"#!/bin/sh\necho ok\n",
    }
    with tenant.client() as c:
        entries = {
            e["path"]: e for e in c.get(tenant.folder("task", run["task"]) + "/").json()["entries"]
        }
        assert entries["run.sh"]["executable"] is True
        trash = c.get(tenant.folder("task", run["task"]) + "/", params={"trash": "true"}).json()[
            "entries"
        ]
        assert {e["path"] for e in trash} == {"gone.txt", "saved/old.txt"}
        sync = c.get(tenant.folder("task", run["task"]) + "/sync").json()["runs"][0]
        assert sync["state"] == "saved" and sync["lastSavedAt"]
    # The rename shipped as a reference: only one upload of the unchanged bytes ever happened.
    with tenant.controller.db() as conn:
        uploads = {
            r[0]
            for r in conn.execute(
                "SELECT digest FROM run_uploads WHERE run_id = %s", (run["run_id"],)
            )
        }
    assert hashlib.sha256(b"unchanged content").hexdigest() not in uploads
    assert m.changes() == {}
    assert flush(m)["result"]["operationId"] is None  # nothing left to save


def test_sigterm_final_save_and_periodic_checkpoints(mounts: MountFactory, tenant: Tenant) -> None:
    run = start_run(tenant)
    m = mounts.mount(
        tenant.controller.url,
        scope="task",
        token_file=token_file(mounts, run),
        extra=["--checkpoint-interval", "1"],
    )
    (m.mountpoint / "periodic.txt").write_bytes(b"tick")
    deadline = time.monotonic() + 20
    while server_files(tenant, "task", run["task"]).get("periodic.txt") != b"tick":
        assert time.monotonic() < deadline, m.stderr()
        time.sleep(0.2)
    # Written through mmap-free plain I/O, never flushed explicitly: SIGTERM saves it.
    with open(m.mountpoint / "last.txt", "wb") as f:
        f.write(b"written just before stop")
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert server_files(tenant, "task", run["task"]) == {
        "periodic.txt": b"tick",
        "last.txt": b"written just before stop",
    }
    with tenant.client() as c:
        sync = c.get(tenant.folder("task", run["task"]) + "/sync").json()["runs"][0]
    assert sync["finalCheckpointAt"] is not None and sync["state"] == "saved"


def test_refresh_waits_for_the_final_save(mounts: MountFactory, tenant: Tenant) -> None:
    run = start_run(tenant)
    folder = tenant.folder("task", run["task"])
    with tenant.client() as c:
        c.put(folder + "/content", params={"path": "shared.txt"}, content=b"v1", headers=OCTET)
    m = mounts.mount(tenant.controller.url, scope="task", token_file=token_file(mounts, run))
    assert (m.mountpoint / "shared.txt").read_bytes() == b"v1"
    (m.mountpoint / "mine.txt").write_bytes(b"agent work")
    with tenant.client() as c:
        c.put(
            folder + "/content",
            params={"path": "shared.txt"},
            content=b"v2 by a person",
            headers=OCTET,
        )
        r = c.post(folder + "/refresh", json={"runId": run["run_id"]})
        assert r.status_code == 202
    # No background refresh while the agent works: the mount still shows v1.
    assert (m.mountpoint / "shared.txt").read_bytes() == b"v1"
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert "refresh applied" in m.stderr()
    assert server_files(tenant, "task", run["task"]) == {
        "shared.txt": b"v2 by a person",
        "mine.txt": b"agent work",
    }
    with tenant.client() as c:
        sync = c.get(folder + "/sync").json()["runs"][0]
    assert sync["refreshRequested"] is False
    # The state dir took v2 after the final save (not at the next start).
    assert journal(m) == set()
    store = Store.open(m.state_dir, readonly=True)
    try:
        base = store.journal.base_entry("shared.txt")
    finally:
        store.close()
    assert base is not None and base.digest == hashlib.sha256(b"v2 by a person").hexdigest()
    if m.mode == "dir":  # the directory itself is the sandbox's copy
        assert (m.mountpoint / "shared.txt").read_bytes() == b"v2 by a person"


def test_warm_start_keeps_own_saved_files_and_takes_others(
    mounts: MountFactory, tenant: Tenant
) -> None:
    run = start_run(tenant)
    folder = tenant.folder("task", run["task"])
    m = mounts.mount(tenant.controller.url, scope="task", token_file=token_file(mounts, run))
    (m.mountpoint / "own.txt").write_bytes(b"saved by the sandbox")
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    with tenant.client() as c:
        c.put(
            folder + "/content",
            params={"path": "theirs.txt"},
            content=b"by a person",
            headers=OCTET,
        )
    again = mounts.mount(
        tenant.controller.url,
        scope="task",
        token_file=token_file(mounts, run),
        state_dir=m.state_dir,
        mountpoint=m.mountpoint,
        extra=["--prefetch", "0"],
    )
    # Only the other writer's file came in; the sandbox's own file kept its local copy.
    assert "took 1 newer change(s)" in again.stderr(), again.stderr()
    assert (again.mountpoint / "own.txt").read_bytes() == b"saved by the sandbox"
    assert (again.mountpoint / "theirs.txt").read_bytes() == b"by a person"
    fetched = [hashlib.sha256(b"by a person").hexdigest()]
    if again.mode == "dir":
        fetched = []  # placed into the directory: nothing is kept beside it
    assert [p.name for p in (again.state_dir / "objects").iterdir()] == fetched
