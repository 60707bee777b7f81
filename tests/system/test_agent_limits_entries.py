"""More entries in the agent folder within one interval than one checkpoint may
name (its limit: 100,000 files and folders): the save is refused as
the agent folder's entry limit, ``AGENT_FILES_LIMIT_EXCEEDED`` naming
``entries``, not as a malformed request. The run gets a warning and is not
failed; fsagent drops the refused body, so once the agent has removed files
its next save goes through, and at stop its later notes are saved.

The per-checkpoint bound and the entry limit are lowered by the controller's
flags (20 each) so that a few files reach them through real daemons (a FUSE
mount, then a plain directory); one test posts a checkpoint of 100,001 new
entries to a controller with the defaults."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.limits import AGENT_MAX_ENTRIES
from tests.support.agentfiles import (
    agent_files,
    flush_reply,
    folder_counters,
    mount_agent,
    new_agent,
    run_detail,
    run_receipts,
    start_agent_run,
)
from tests.support.bridge import start_run
from tests.support.checkpoints import assert_local_copy_discarded, status
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)
from tests.support.mount import MountFactory

CAP = 20


@pytest.fixture(scope="module")
def capped(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller whose checkpoints name at most 20 entries and whose agent
    folders hold at most 20."""
    flags = ("--max-checkpoint-entries", str(CAP), "--agent-max-entries", str(CAP))
    with private_controller(pg_cluster, "fsa-agentent-", *flags) as ctl:
        yield ctl


@pytest.fixture
def ct(capped: ControllerProcess) -> Tenant:
    return bootstrap_tenant(capped)


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """A FUSE mount, then a plain directory: the same contract."""
    return mode_mounts


def write_many(root: Path, count: int = 45) -> dict[str, bytes]:
    """``count`` small files in a new directory ``many/``: with it, more
    entries than one checkpoint of an agent folder may name (twice its limit)."""
    (root / "many").mkdir()
    files = {f"many/f{i:02}.txt": f"file {i}".encode() for i in range(count)}
    for path, data in files.items():
        (root / path).write_bytes(data)
    return files


OVER = {"limit": "entries", "max": CAP, "value": 46}
"""The refusal's details: many/ and its 45 files."""


def assert_warned_not_failed(tenant: Tenant, run_id: str) -> None:
    detail = run_detail(tenant, run_id).json()
    assert detail["state"] != "failed" and detail["error"] is None, detail
    [warning] = detail["warnings"]
    assert warning["code"] == "AGENT_FILES_LIMIT_EXCEEDED" and warning["limit"] == "entries"


@pytest.mark.fuse
def test_too_many_entries_for_one_checkpoint_is_the_entry_limit_and_cleaning_up_saves(
    mounts: MountFactory, ct: Tenant
) -> None:
    agent = new_agent(ct)
    run = start_agent_run(ct, agent, user=ct.user_id)
    m = mount_agent(mounts, run)
    root = m.mountpoint
    files = write_many(root)
    code, reply = flush_reply(m)
    assert code == 0 and reply["ok"] is True and reply["saved"] is False, reply
    assert (reply["code"], reply["details"]) == ("AGENT_FILES_LIMIT_EXCEEDED", [OVER]), reply
    assert agent_files(ct, agent) == {"AGENTS.md": b""}
    [refused] = run_receipts(ct, run.run_id)
    assert (refused["outcome"], refused["code"]) == ("refused", "AGENT_FILES_LIMIT_EXCEEDED")
    assert refused["details"] == [OVER], refused
    assert_warned_not_failed(ct, run.run_id)
    # The refused body is not kept for a replay: the next save lists afresh.
    assert status(m)["pendingCheckpoint"] is None

    # The agent removes files with ordinary tools and goes on writing.
    for i in range(10, 45):
        (root / f"many/f{i:02}.txt").unlink()
        del files[f"many/f{i:02}.txt"]
    (root / "notes.md").write_bytes(b"what I learned")
    code, reply = flush_reply(m)
    assert code == 0 and reply["ok"] is True, reply
    expected = {"AGENTS.md": b"", **files, "notes.md": b"what I learned"}
    assert agent_files(ct, agent) == expected

    # At stop, its later notes are saved too.
    (root / "later.md").write_bytes(b"written after the cleanup")
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert "fsagent: final save: 1 change(s) saved" in m.stderr(), m.stderr()
    assert agent_files(ct, agent) == {**expected, "later.md": b"written after the cleanup"}
    receipts = run_receipts(ct, run.run_id)
    assert [(r["outcome"], r["final"]) for r in receipts] == [
        ("refused", False), ("saved", False), ("saved", True),
    ]  # fmt: skip
    detail = run_detail(ct, run.run_id).json()
    assert detail["state"] != "failed" and detail["warnings"] == [], detail


@pytest.mark.fuse
def test_too_many_entries_at_the_stop_is_a_warning_and_the_last_save_stays(
    mounts: MountFactory, ct: Tenant
) -> None:
    agent = new_agent(ct)
    run = start_agent_run(ct, agent, user=ct.user_id)
    m = mount_agent(mounts, run)
    (m.mountpoint / "keep.md").write_bytes(b"saved by a flush")
    code, reply = flush_reply(m)
    assert code == 0, reply
    saved = agent_files(ct, agent)
    write_many(m.mountpoint)
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert "warning: agent folder not saved, over its storage limit" in m.stderr()
    assert agent_files(ct, agent) == saved
    receipts = run_receipts(ct, run.run_id)
    assert [(r["outcome"], r["final"]) for r in receipts] == [("saved", False), ("refused", True)]
    assert receipts[-1]["code"] == "AGENT_FILES_LIMIT_EXCEEDED"
    assert receipts[-1]["details"] == [OVER]
    assert_warned_not_failed(ct, run.run_id)
    assert_local_copy_discarded(m.state_dir)  # the local copy is discarded, as ever


def checkpoint_of(n: int, op: str = "mkdir") -> list[dict[str, Any]]:
    return [{"op": op, "path": f"d{i:06}"} for i in range(n)]


def test_the_default_entry_limit_refuses_a_checkpoint_of_100001_new_entries(
    tenant: Tenant,
) -> None:
    """With the controller's defaults: an agent folder checkpoint that would
    leave 100,001 entries and more is the entry limit at 100,000 (the folder
    would hold them and AGENTS.md: an agent folder's checkpoint may name
    twice its limit, so it is checked against the folder, whole); another
    folder's checkpoint of that size is still a malformed request."""
    run = start_run(tenant)
    before = folder_counters(tenant, "agent", run.agent)
    entries = checkpoint_of(AGENT_MAX_ENTRIES + 1)
    r = run.commit("agent", entries)
    assert r.status_code == 422 and r.json()["code"] == "agent_files_limit_exceeded", r.text
    assert r.json()["details"] == [
        {"limit": "entries", "max": AGENT_MAX_ENTRIES, "value": AGENT_MAX_ENTRIES + 2}
    ]
    assert folder_counters(tenant, "agent", run.agent) == before
    [receipt] = run_receipts(tenant, run.run_id)
    assert (receipt["outcome"], receipt["code"]) == ("refused", "AGENT_FILES_LIMIT_EXCEEDED")
    assert_warned_not_failed(tenant, run.run_id)

    r = run.commit("task", entries)
    assert r.status_code == 400, r.text
    assert r.json()["details"] == [
        {"field": "entries", "code": "too_many", "message": "at most 100000 entries per checkpoint"}
    ]
