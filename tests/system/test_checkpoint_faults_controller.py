"""Checkpoints under controller-side faults: the controller killed mid-upload
and restarted, and its PostgreSQL connections terminated between and during
checkpoints. Each test runs on a controller of this module alone, drives a real
fsagent mount (a FUSE mount, then a plain directory, with the same
assertions), and checks the bytes served, the receipts in PostgreSQL and the
change set left in the sandbox's journal.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.support.checkpoints import (
    BIG,
    flush_in_background,
    journal,
    random_file,
    receipts,
    reply_of,
    upload_in_progress,
    wait_for,
)
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    world_searchable_tmpdir,
)
from tests.support.mount import MountFactory
from tests.system.test_checkpoints import flush, server_files, start_run, token_file

pytestmark = pytest.mark.fuse


# --- helpers -------------------------------------------------------------------


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """FUSE mounts, then plain directories: the same faults, the same assertions."""
    return mode_mounts


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


# --- controller restart mid-checkpoint -----------------------------------------


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


# --- PostgreSQL connection loss -------------------------------------------------


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
