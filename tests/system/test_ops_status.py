"""`fsagent status --json`: unsaved bytes and files, and the live figures of a running mount."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fsagent.control import protocol as control
from tests.support.bridge import start_run
from tests.support.controller import Tenant
from tests.support.lossy_proxy import LossyProxy
from tests.support.mount import FsagentMount, MountFactory

pytestmark = pytest.mark.fuse


def test_status_reports_unsaved_work_and_live_figures(tenant: Tenant, mounts: MountFactory) -> None:
    run = start_run(tenant)
    token = mounts.base / "token"
    token.write_text(run.token)
    m = mounts.mount(tenant.controller.url, "task", token_file=token)
    (m.mountpoint / "small.txt").write_bytes(b"s" * 100)
    (m.mountpoint / "big.bin").write_bytes(b"b" * 5000)
    (m.mountpoint / "dir").mkdir()

    (row,) = m.fsagent("status")["collections"]
    assert row["state"] == "mounted"
    assert row["unsavedFiles"] == 2
    assert row["unsavedBytes"] == 5100
    assert row["unsavedChanges"] == 3
    live = row["live"]
    assert live["queueDepth"] == 0
    assert live["lastCheckpoint"] is None
    fuse = live["fuse"]
    assert fuse["requests"] >= 3
    # New files arrive as MKNOD in the kernel's "no open" mode, as CREATE with handles.
    ops = fuse["byOperation"]
    assert ops.get("create", 0) + ops.get("mknod", 0) == 2, ops
    assert fuse["byOperation"]["mkdir"] == 1
    assert fuse["latencyMs"]["samples"] >= 3
    assert 0 <= fuse["latencyMs"]["p50"] <= fuse["latencyMs"]["p90"] <= fuse["latencyMs"]["p99"]

    assert m.fsagent("flush")["ok"]
    (row,) = m.fsagent("status")["collections"]
    assert row["unsavedFiles"] == 0 and row["unsavedBytes"] == 0
    last = row["live"]["lastCheckpoint"]
    assert last["entries"] == 3
    assert last["bytes"] == 5100
    assert last["seconds"] > 0


def test_stats_is_a_control_command() -> None:
    assert control.parse_request(b'{"cmd": "stats"}') == ("stats", False)
    with pytest.raises(control.BadRequest, match="flush, ping, stats"):
        control.parse_request(b'{"cmd": "nope"}')


def live_queue_depth(m: FsagentMount) -> int:
    (row,) = m.fsagent("status")["collections"]
    return int(row["live"]["queueDepth"])


def test_queue_depth_counts_a_held_checkpoint_and_the_one_waiting(
    tenant: Tenant, mounts: MountFactory
) -> None:
    """While the controller holds a checkpoint's commit, status shows it in
    flight (1), a second flush waiting behind it (2), and 0 once both saved."""
    proxy = LossyProxy(tenant.controller.url).start()
    try:
        run = start_run(tenant)
        token = mounts.base / "token"
        token.write_text(run.token)
        m = mounts.mount(proxy.url, "task", token_file=token)
        (m.mountpoint / "a.txt").write_bytes(b"first")
        hold = proxy.hold_next("POST", r"/checkpoints$")
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(m.fsagent, "flush")
            assert hold.reached.wait(60), proxy.seen
            assert live_queue_depth(m) == 1
            (m.mountpoint / "b.txt").write_bytes(b"second")
            second = pool.submit(m.fsagent, "flush")
            deadline = time.monotonic() + 60
            while (depth := live_queue_depth(m)) != 2:
                assert depth == 1 and time.monotonic() < deadline, depth
                time.sleep(0.05)
            assert not first.done() and not second.done()
            hold.release()
            assert first.result(timeout=120)["ok"] and second.result(timeout=120)["ok"]
        (row,) = m.fsagent("status")["collections"]
        assert row["live"]["queueDepth"] == 0 and row["unsavedFiles"] == 0
        with tenant.client() as c:
            folder = tenant.folder("task", run.task or "")
            for name, body in (("a.txt", b"first"), ("b.txt", b"second")):
                got = c.get(f"{folder}/content", params={"path": name})
                assert (got.status_code, got.content) == (200, body)
    finally:
        # The daemon's stop saves through the proxy: with the proxy gone first
        # it would retry a dead address until the teardown's deadlines.
        mounts.close()
        proxy.stop()
