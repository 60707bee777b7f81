"""Batched checkpoints under faults: the controller killed while batches are
streaming, batch answers lost on the way back, and a batch body cut off mid
stream. Nothing is published before the commit, and the replay converges on
exactly one receipt with every file's bytes. The mount tests run on a FUSE
mount, then on a plain directory, with the same assertions."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from common.bridge import PREFIX, encode_batch
from tests.support.bridge import start_run as bridge_run
from tests.support.checkpoints import (
    flush_in_background,
    folder_id,
    journal,
    receipts,
    reply_of,
    status,
    wait_for,
)
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    world_searchable_tmpdir,
)
from tests.support.lossy_proxy import LossyProxy
from tests.support.mount import FsagentMount, MountFactory
from tests.system.test_checkpoints import flush, start_run, token_file

pytestmark = pytest.mark.fuse
BATCHES = r"/uploads/batch$"


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """FUSE mounts, then plain directories: the same faults, the same assertions."""
    return mode_mounts


@pytest.fixture(scope="module")
def own_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller of this module alone, so killing it leaves the shared one up."""
    ctl = ControllerProcess(pg_cluster.create_database(), world_searchable_tmpdir("fsa-bf-"))
    ctl.start()
    try:
        yield ctl
    finally:
        ctl.stop()


def write_many(m: FsagentMount, files: int, dirs: int = 20) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for d in range(dirs):
        (m.mountpoint / f"d{d:02d}").mkdir()
    for i in range(files):
        path = f"d{i % dirs:02d}/f{i:05d}.bin"
        out[path] = os.urandom(1000 + i % 3000)
        (m.mountpoint / path).write_bytes(out[path])
    return out


def live_digests(ctl: ControllerProcess, company: str, owner: str) -> dict[str, str]:
    fid = folder_id(ctl, company, "task", owner)
    if fid is None:
        return {}
    with ctl.db() as db:
        rows = db.execute(
            "SELECT path, digest FROM files WHERE folder_id = %s AND kind = 'file'"
            " AND deleted_at IS NULL",
            (fid,),
        ).fetchall()
    return {r[0]: r[1] for r in rows}


def uploads(ctl: ControllerProcess, run_id: str) -> list[str]:
    with ctl.db() as db:
        rows = db.execute("SELECT digest FROM run_uploads WHERE run_id = %s", (run_id,)).fetchall()
    return [r[0] for r in rows]


def expected_digests(files: dict[str, bytes]) -> dict[str, str]:
    return {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}


def test_controller_killed_mid_batches_publishes_nothing_and_the_replay_converges(
    mounts: MountFactory, own_controller: ControllerProcess
) -> None:
    ctl = own_controller
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    m = mounts.mount(
        ctl.url, scope="task", token_file=token_file(mounts, run), extra=["--retry-deadline", "120"]
    )
    files = write_many(m, 3000)
    flusher = flush_in_background(m)
    wait_for(lambda: len(uploads(ctl, run["run_id"])) > 0, 60, "a first batch to be registered")
    ctl.kill()
    registered = len(uploads(ctl, run["run_id"]))
    assert 0 < registered < len(files), "the kill must land while batches are streaming"
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == []
    assert live_digests(ctl, tenant.company_id, run["task"]) == {}
    ctl.start()
    code, reply = reply_of(flusher, 180)
    assert code == 0 and reply["ok"] is True, reply
    [op_id] = receipts(ctl, tenant.company_id, "task", run["task"])
    assert reply["result"]["operationId"] == op_id
    assert live_digests(ctl, tenant.company_id, run["task"]) == expected_digests(files)
    assert sorted(uploads(ctl, run["run_id"])) == sorted(set(expected_digests(files).values()))
    assert journal(m) == set()


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


def test_lost_batch_answers_are_retried_and_register_each_object_once(
    proxy: LossyProxy, mounts: MountFactory, tenant: Tenant
) -> None:
    ctl = tenant.controller
    run = start_run(tenant)
    m = mounts.mount(proxy.url, scope="task", token_file=token_file(mounts, run))
    files = write_many(m, 600, dirs=3)
    proxy.drop_next("PUT", BATCHES, count=2)
    reply = flush(m)
    assert reply["ok"] is True, reply
    assert len(proxy.dropped) == 2
    batches = [s for s in proxy.seen if s.endswith("/uploads/batch")]
    assert len(batches) >= 3, batches  # two lost answers, and their retries
    assert not [s for s in proxy.seen if s.endswith("/uploads")]  # no single uploads
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == [reply["result"]["operationId"]]
    assert live_digests(ctl, tenant.company_id, run["task"]) == expected_digests(files)
    digests = uploads(ctl, run["run_id"])
    assert len(digests) == len(set(digests)) == len(set(expected_digests(files).values()))
    assert journal(m) == set()


def test_a_batch_body_cut_off_mid_stream_registers_and_keeps_nothing(tenant: Tenant) -> None:
    ctl = tenant.controller
    run = bridge_run(tenant)
    members = [os.urandom(4000) for _ in range(200)]
    body = encode_batch(members)
    head = (
        f"PUT {PREFIX}/folders/task/uploads/batch HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {run.token}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", ctl.port)) as s:
        s.sendall(head + body[: len(body) // 2])
        time.sleep(0.5)
    spool = ctl.data_dir / "spool"

    def settled() -> bool:
        return not any(spool.glob("batch-*"))

    wait_for(settled, 10, "the cut-off batch's spool file to be removed")
    assert uploads(ctl, run.run_id) == []
    objects = ctl.data_dir / "objects" / "objects" / tenant.company_id
    assert not objects.exists() or not any(p.is_file() for p in objects.rglob("*"))
    # The same batch sent whole afterwards is stored and answered in member order.
    with run.client() as c:
        r = c.put("/folders/task/uploads/batch", content=body)
    assert r.status_code == 200, r.text
    got: list[Any] = r.json()["objects"]
    assert [o["digest"] for o in got] == [hashlib.sha256(m).hexdigest() for m in members]


def test_fsagent_killed_mid_batches_publishes_nothing_and_the_warm_start_converges(
    proxy: LossyProxy, mounts: MountFactory, tenant: Tenant
) -> None:
    """kill -9 of the daemon with two batches registered and the rest being
    retried: nothing is published, and the warm start commits the pending
    checkpoint once with every file's bytes."""
    ctl = tenant.controller
    run = start_run(tenant)
    m = mounts.mount(proxy.url, scope="task", token_file=token_file(mounts, run))
    files = write_many(m, 800, dirs=4)
    # Two batches get through, every later one is refused until the kill.
    proxy.fail_next("PUT", BATCHES, count=1_000_000, after=2)
    flusher = flush_in_background(m)
    wait_for(
        lambda: len(proxy.failed) >= 2 and len(uploads(ctl, run["run_id"])) > 0,
        60,
        "a batch to be registered and later ones to be refused and retried",
    )
    pending = status(m)["pendingCheckpoint"]
    m.kill9()
    assert reply_of(flusher, 30)[0] != 0
    registered = uploads(ctl, run["run_id"])
    assert 0 < len(registered) < len(files), "the kill must land while batches are streaming"
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == []
    assert live_digests(ctl, tenant.company_id, run["task"]) == {}
    assert pending is not None and pending.startswith("cp-")

    proxy.clear_rules()
    m2 = mounts.mount(
        proxy.url,
        scope=m.scope,
        state_dir=m.state_dir,
        mountpoint=m.mountpoint,
        token_file=m.token_file,
        extra=m.extra,
    )
    assert receipts(ctl, tenant.company_id, "task", run["task"]) == [pending]
    assert live_digests(ctl, tenant.company_id, run["task"]) == expected_digests(files)
    assert sorted(uploads(ctl, run["run_id"])) == sorted(set(expected_digests(files).values()))
    assert journal(m2) == set()
    assert status(m2)["pendingCheckpoint"] is None
    # The bytes behind the digests, through the API, for a sample of files.
    folder = tenant.folder("task", run["task"])
    with tenant.client() as c:
        for path in list(files)[::80]:
            got = c.get(folder + "/content", params={"path": path})
            assert got.status_code == 200 and got.content == files[path]
