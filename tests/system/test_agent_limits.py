"""An agent folder's storage limits are sync-validation limits
(checked when a save commits, never at write time): an API save over one is 422 and changes nothing; a
run's save over one saves none of its agent-folder changes, says why in its
receipt and warns, and the next run gets the previous folder; the run's local
copy is discarded at stop (a refusal there is a warning: exit 0); saves are
per checkpoint; an over-limit folder restores and warns until it is back
under, and never lets an unsafe path or a link through; transient failures
get three attempts, then a failure receipt.
Real controller, PostgreSQL and FUSE (the run-save tests also on a plain
directory, dir mode, with the same assertions); the limits are lowered by the
controller's flags so that a few small files reach them."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.bridge import PREFIX
from common.limits import AGENT_MAX_FILE_BYTES, GiB, MiB
from fsagent.checkpoint.lifecycle import FINAL_PAUSE_ENV, final_pause
from tests.support.agentfiles import (
    AgentRun,
    agent_files,
    flush_reply,
    folder_counters,
    mount_agent,
    new_agent,
    operate,
    put,
    run_detail,
    run_receipts,
    start_agent_run,
    unit_stop,
)
from tests.support.bridge import Run, api_client
from tests.support.checkpoints import assert_local_copy_discarded
from tests.support.constants import REPO
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    parse_api_time,
    private_controller,
    world_searchable_tmpdir,
)
from tests.support.fixtures import MODES
from tests.support.lossy_proxy import LossyProxy
from tests.support.mount import FsagentMount, MountFactory

FILE_MAX, TOTAL_MAX, ENTRIES_MAX = 1000, 5000, 10
SMALL_LIMITS = (
    "--agent-max-file-bytes", str(FILE_MAX),
    "--agent-max-total-bytes", str(TOTAL_MAX),
    "--agent-max-entries", str(ENTRIES_MAX),
)  # fmt: skip
EXIT_SAVE_FAILED = 4


@pytest.fixture(scope="module")
def small(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller whose agent folders hold 10 entries, 1000 bytes per file, 5000 in all."""
    with private_controller(pg_cluster, "fsa-agentlim-", *SMALL_LIMITS) as ctl:
        yield ctl


@pytest.fixture
def st(small: ControllerProcess) -> Tenant:
    return bootstrap_tenant(small)


def flush_text(m: FsagentMount) -> subprocess.CompletedProcess[str]:
    """``fsagent flush SCOPE`` against the mount, as a person runs it (no --json)."""
    return subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "flush", m.scope, "--state-dir", str(m.state_dir)],
        capture_output=True, text=True, check=False, cwd=REPO, timeout=600,
    )  # fmt: skip


def limit_detail(r: Any) -> dict[str, Any]:
    assert r.status_code == 422 and r.json()["code"] == "agent_files_limit_exceeded", r.text
    detail: dict[str, Any] = r.json()["details"][0]
    return detail


def test_api_saves_over_each_limit_are_422_and_change_nothing(st: Tenant) -> None:
    agent = new_agent(st)
    task_project = st.controller.admin("create-project", st.company_id, "p")["id"]
    task = st.controller.admin("create-task", st.company_id, task_project, "t")["id"]
    with st.client() as c:
        before = folder_counters(st, "agent", agent)
        r = put(c, st, "agent", agent, "big.bin", b"b" * (FILE_MAX + 1))
        assert limit_detail(r) == {
            "limit": "fileBytes", "max": FILE_MAX, "value": FILE_MAX + 1, "path": "big.bin",
        }  # fmt: skip
        assert folder_counters(st, "agent", agent) == before
        # The limits are the agent folder's alone.
        assert put(c, st, "task", task, "big.bin", b"b" * (FILE_MAX + 1)).status_code == 201

        for i in range(5):  # 5000 bytes: at the limit, allowed
            assert put(c, st, "agent", agent, f"f{i}.bin", b"x" * FILE_MAX).status_code == 201
        before = folder_counters(st, "agent", agent)
        r = put(c, st, "agent", agent, "one-more.txt", b"!")
        assert limit_detail(r) == {"limit": "totalBytes", "max": TOTAL_MAX, "value": TOTAL_MAX + 1}
        # Growing an existing file counts too; shrinking one is always fine.
        r = put(c, st, "agent", agent, "f0.bin", b"x" * FILE_MAX + b"!")
        assert limit_detail(r)["limit"] == "fileBytes"
        assert folder_counters(st, "agent", agent) == before
        assert put(c, st, "agent", agent, "f0.bin", b"small").status_code == 200

        # Entries: AGENTS.md and f0..f4 are 6; four folders make 10.
        for name in ("d1", "d2", "d3", "d4"):
            r = operate(c, st, "agent", agent, action="mkdir", path=name)
            assert r.status_code == 200, r.text
        r = operate(c, st, "agent", agent, action="mkdir", path="d5")
        assert limit_detail(r) == {"limit": "entries", "max": ENTRIES_MAX, "value": ENTRIES_MAX + 1}
        # A restore from the trash brings entries back, so it is checked as well.
        assert operate(c, st, "agent", agent, action="delete", path="d4").status_code == 200
        assert operate(c, st, "agent", agent, action="mkdir", path="d5").status_code == 200
        trashed = c.get(st.folder("agent", agent) + "/", params={"trash": "true"}).json()
        d4 = next(e for e in trashed["entries"] if e["path"] == "d4")
        r = operate(c, st, "agent", agent, action="restore", fileId=d4["id"])
        assert limit_detail(r)["limit"] == "entries"
        # A move adds nothing.
        assert operate(c, st, "agent", agent, action="move", path="d5", to="d6").status_code == 200
    listed = agent_files(st, agent)
    assert set(listed) == {"AGENTS.md", "f0.bin", "f1.bin", "f2.bin", "f3.bin", "f4.bin"}


def wait_for_receipts(tenant: Tenant, run_id: str, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while len(got := run_receipts(tenant, run_id)) < n:
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    return got


def write_past(root: Path, limit: str) -> dict[str, Any]:
    """The agent's writes that take the folder past ``limit`` (besides editing
    keep.md and adding notes/new.md); the refusal's expected details."""
    if limit == "fileBytes":
        (root / "big.bin").write_bytes(os.urandom(FILE_MAX * 3))
        return {"limit": "fileBytes", "max": FILE_MAX, "value": FILE_MAX * 3, "path": "big.bin"}
    if limit == "totalBytes":
        for i in range(6):  # each under the per-file limit, together over the total
            (root / f"part{i}.bin").write_bytes(b"p" * 999)
        return {"limit": "totalBytes", "max": TOTAL_MAX, "value": 17 + 3 + 6 * 999}
    for i in range(7):  # 2 saved entries, notes/ and notes/new.md, and these: 11
        (root / f"e{i}.txt").write_bytes(b"e")
    return {"limit": "entries", "max": ENTRIES_MAX, "value": ENTRIES_MAX + 1}


@pytest.mark.fuse
@pytest.mark.parametrize("limit", ["fileBytes", "totalBytes", "entries"])
def test_a_run_save_over_a_limit_saves_none_of_its_agent_changes(
    mode_mounts: MountFactory, st: Tenant, limit: str
) -> None:
    mounts = mode_mounts  # a FUSE mount, then a plain directory: the same contract
    agent = new_agent(st)
    with st.client() as c:
        assert put(c, st, "agent", agent, "keep.md", b"saved before").status_code == 201
    saved = agent_files(st, agent)
    run = start_agent_run(st, agent, user=st.user_id)
    m = mount_agent(mounts, run)
    root = m.mountpoint
    # The agent writes past the limit while it runs: nothing stops it.
    (root / "keep.md").write_bytes(b"edited by the run")
    (root / "notes").mkdir()
    (root / "notes" / "new.md").write_bytes(b"new")
    expected = write_past(root, limit)
    # A recorded refusal and a warning of the run, not a failed save: the
    # daemon exits 0 (so its unit and `fsagent up` stop cleanly).
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert "warning: agent folder not saved, over its storage limit" in m.stderr()
    assert "discarded" in m.stderr()

    assert agent_files(st, agent) == saved  # none of the run's agent changes
    receipt = run_receipts(st, run.run_id)[-1]
    assert receipt["outcome"] == "refused" and receipt["final"] is True, receipt
    assert receipt["code"] == "AGENT_FILES_LIMIT_EXCEEDED"
    assert receipt["details"] == [expected]
    # A warning of the run, which does not fail it.
    detail = run_detail(st, run.run_id).json()
    assert detail["state"] != "failed", detail
    [warning] = detail["warnings"]
    assert warning["code"] == "AGENT_FILES_LIMIT_EXCEEDED" and warning["limit"] == limit
    assert warning.get("path") == expected.get("path")
    with st.client() as c:
        sync = c.get(st.folder("agent", agent) + "/sync").json()
    mine = next(r for r in sync["runs"] if r["runId"] == run.run_id)
    assert [w["code"] for w in mine["warnings"]] == ["AGENT_FILES_LIMIT_EXCEEDED"]
    # A diagnostic of the run, never an error on the current files.
    assert mine["error"] is None and mine["state"] != "failed", mine
    # The local copy is gone: no archive, nothing left to ship later.
    assert_local_copy_discarded(m.state_dir)
    if m.mode == "dir":  # the directory itself is the local copy
        assert list(m.mountpoint.iterdir()) == []

    # The next run gets the previous saved folder.
    run.end()
    nxt = start_agent_run(st, agent, user=st.user_id)
    m2 = mount_agent(mounts, nxt, state_dir=m.state_dir)
    assert sorted(p.name for p in m2.mountpoint.iterdir()) == ["AGENTS.md", "keep.md"]
    assert (m2.mountpoint / "keep.md").read_bytes() == b"saved before"
    assert run_detail(st, nxt.run_id).json()["warnings"] == []
    assert m2.signal(signal.SIGTERM) == 0, m2.stderr()


@pytest.mark.fuse
def test_a_periodic_save_over_a_limit_is_retried_once_the_agent_cleans_up(
    mode_mounts: MountFactory, st: Tenant
) -> None:
    mounts = mode_mounts  # a FUSE mount, then a plain directory: the same contract
    agent = new_agent(st)
    run = start_agent_run(st, agent, user=st.user_id)
    m = mount_agent(mounts, run)
    for i in range(5):  # 4995 bytes, and 900 more: over the 5000-byte total
        (m.mountpoint / f"part{i}.bin").write_bytes(b"p" * 999)
    (m.mountpoint / "part5.bin").write_bytes(b"p" * 5)
    (m.mountpoint / "extra.bin").write_bytes(b"e" * 900)
    # Refused over the limit: a warning of the run with its own code, not a
    # failed save (exit 0, as at stop), naming the limit.
    code, reply = flush_reply(m)
    assert code == 0, reply
    assert (reply["ok"], reply["saved"], reply["final"]) == (True, False, False), reply
    assert reply["code"] == "AGENT_FILES_LIMIT_EXCEEDED", reply
    assert reply["details"] == [{"limit": "totalBytes", "max": TOTAL_MAX, "value": 5900}], reply
    assert "agent_files_limit_exceeded" in reply["warning"] and "error" not in reply, reply
    assert agent_files(st, agent) == {"AGENTS.md": b""}
    said = flush_text(m)
    assert said.returncode == 0, (said.stdout, said.stderr)
    assert said.stdout.startswith(
        "not saved (AGENT_FILES_LIMIT_EXCEEDED: totalBytes 5900 > 5000), a warning of the run"
    ), said.stdout
    (m.mountpoint / "extra.bin").unlink()
    code, reply = flush_reply(m)
    assert code == 0 and reply["ok"] is True, reply
    assert len(agent_files(st, agent)) == 7  # AGENTS.md and part0-5
    receipts = run_receipts(st, run.run_id)
    # The later success does not erase the earlier refusals (one per flush).
    assert [r["outcome"] for r in receipts] == ["refused", "refused", "saved"]
    assert receipts[0]["details"][0]["limit"] == "totalBytes"
    # At the limit (5000 of 5000 bytes): the run's current warning says so.
    warnings = run_detail(st, run.run_id).json()["warnings"]
    assert [(w["code"], w["limit"]) for w in warnings] == [("AGENT_FILES_AT_LIMIT", "totalBytes")]
    saved = agent_files(st, agent)

    # Saves are per checkpoint: what the periodic save took stays saved when
    # the final one is refused; the refusal leaves unsaved only the changes
    # since it (docs/users/agent-folders.md).
    (m.mountpoint / "part0.bin").write_bytes(b"q" * 999)
    (m.mountpoint / "late.md").write_bytes(b"late")
    stopped = unit_stop(m)  # the fsagent@agent unit's stop: `fsagent flush --final`
    assert stopped.returncode == 0, (stopped.stdout, stopped.stderr)
    assert "final save refused, a warning of the run" in stopped.stdout
    assert "agent_files_limit_exceeded" in stopped.stdout
    assert m.proc is not None and m.proc.wait(timeout=60) == 0, m.stderr()
    assert "warning: agent folder not saved, over its storage limit" in m.stderr()
    assert agent_files(st, agent) == saved
    receipts = run_receipts(st, run.run_id)
    assert [(r["outcome"], r["final"]) for r in receipts] == [
        ("refused", False), ("refused", False), ("saved", False), ("refused", True),
    ]  # fmt: skip
    assert receipts[-1]["code"] == "AGENT_FILES_LIMIT_EXCEEDED"
    assert receipts[-1]["details"] == [{"limit": "totalBytes", "max": TOTAL_MAX, "value": 5004}]
    detail = run_detail(st, run.run_id).json()
    assert detail["state"] != "failed" and detail["error"] is None, detail
    assert [w["code"] for w in detail["warnings"]] == ["AGENT_FILES_LIMIT_EXCEEDED"]
    assert_local_copy_discarded(m.state_dir)
    run.end()
    nxt = start_agent_run(st, agent, user=st.user_id)
    m2 = mount_agent(mounts, nxt, state_dir=m.state_dir)
    assert {p.name: p.read_bytes() for p in m2.mountpoint.iterdir()} == saved
    assert m2.signal(signal.SIGTERM) == 0, m2.stderr()


@pytest.mark.fuse
def test_the_final_save_refused_over_a_limit_answers_flush_with_a_warning(
    mode_mounts: MountFactory, st: Tenant
) -> None:
    """`fsagent flush --final --json` says what happened: not saved, not failed."""
    mounts = mode_mounts  # a FUSE mount, then a plain directory: the same contract
    agent = new_agent(st)
    run = start_agent_run(st, agent, user=st.user_id)
    m = mount_agent(mounts, run)
    (m.mountpoint / "big.bin").write_bytes(b"b" * (FILE_MAX + 1))
    code, reply = flush_reply(m, final=True)
    assert code == 0, reply
    assert reply["ok"] is True and reply["saved"] is False and reply["error"] is None, reply
    assert reply["final"] is True and "agent_files_limit_exceeded" in reply["warning"], reply
    assert reply["code"] == "AGENT_FILES_LIMIT_EXCEEDED", reply
    assert m.proc is not None and m.proc.wait(timeout=60) == 0, m.stderr()
    assert agent_files(st, agent) == {"AGENTS.md": b""}
    [receipt] = run_receipts(st, run.run_id)
    assert (receipt["outcome"], receipt["final"]) == ("refused", True), receipt


@pytest.fixture(scope="module")
def over_limit(pg_cluster: PgCluster) -> Iterator[tuple[Tenant, dict[str, str]]]:
    """A controller whose agent folders were saved under the default limits
    (three 2000-byte files each, one agent per mode), then restarted with
    :data:`SMALL_LIMITS`: each folder is over them. Started and restarted
    once for both modes."""
    tmp = world_searchable_tmpdir("fsa-overlimit-")
    ctl = ControllerProcess(pg_cluster.create_database(), tmp)
    try:
        ctl.start()
        tenant = bootstrap_tenant(ctl)
        agents = {mode: new_agent(tenant, f"over-{mode}") for mode in MODES}
        with tenant.client() as c:
            for agent in agents.values():
                for name in ("a.bin", "b.bin", "c.bin"):
                    assert put(c, tenant, "agent", agent, name, b"z" * 2000).status_code == 201
        ctl.stop()
        ctl.extra_args = list(SMALL_LIMITS)
        ctl.start()
        yield tenant, agents
    finally:
        ctl.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.fuse
def test_an_over_limit_folder_restores_and_warns_on_each_run_until_back_under(
    mode_mounts: MountFactory, over_limit: tuple[Tenant, dict[str, str]]
) -> None:
    """Saved under generous limits, the folder is over the lowered ones: every
    file is still restored, each run warns, and the agent can clean up. Over
    a limit, unsafe paths and links are refused as ever: a save that shrinks
    the folder is taken, never its unsafe part."""
    mounts = mode_mounts  # a FUSE mount, then a plain directory: the same contract
    tenant, agents = over_limit
    agent = agents[mounts.mode]
    run = start_agent_run(tenant, agent, user=tenant.user_id)
    m = mount_agent(mounts, run)
    assert sorted(p.name for p in m.mountpoint.iterdir()) == [
        "AGENTS.md", "a.bin", "b.bin", "c.bin",
    ]  # fmt: skip
    assert (m.mountpoint / "c.bin").read_bytes() == b"z" * 2000
    warned = {(w["code"], w["limit"]) for w in run_detail(tenant, run.run_id).json()["warnings"]}
    assert warned == {
        ("AGENT_FILES_AT_LIMIT", "fileBytes"),
        ("AGENT_FILES_AT_LIMIT", "totalBytes"),
    }
    refuses_unsafe_paths_over_a_limit(tenant, run)
    # Cleaning up step by step: each save that shrinks the folder is taken.
    secret = mounts.base / "secret"
    secret.write_bytes(b"outside the folder")
    if m.mode == "fuse":
        with pytest.raises(OSError) as link_exc:
            os.symlink(secret, m.mountpoint / "link")
        assert link_exc.value.errno == errno.EPERM
    else:  # a plain directory takes the link; the save never does
        os.symlink(secret, m.mountpoint / "link")
    (m.mountpoint / "a.bin").unlink()
    (m.mountpoint / "b.bin").unlink()
    assert m.fsagent("flush", "agent")["ok"] is True
    warnings = run_detail(tenant, run.run_id).json()["warnings"]
    still = [w["limit"] for w in warnings if w["code"] == "AGENT_FILES_AT_LIMIT"]
    assert still == ["fileBytes"]
    assert agent_files(tenant, agent) == {"AGENTS.md": b"", "c.bin": b"z" * 2000}
    shrunk = run_receipts(tenant, run.run_id)[-1]
    assert shrunk["outcome"] == "saved", shrunk
    if m.mode == "dir":
        assert [(r["path"], r["code"], r.get("by")) for r in shrunk["refusedEntries"]] == [
            ("link", "symlink", "sandbox")
        ]
        assert [w["code"] for w in warnings] == ["SANDBOX_REFUSED", "AGENT_FILES_AT_LIMIT"]
        (m.mountpoint / "link").unlink()
    (m.mountpoint / "c.bin").write_bytes(b"small now")
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert run_detail(tenant, run.run_id).json()["warnings"] == []
    run.end()
    again = start_agent_run(tenant, agent, user=tenant.user_id)
    with ctl_bridge(tenant, again) as c:
        assert c.get("/run").json()["warnings"] == []


UNSAFE_PATHS = ("../escape.bin", "notes/../a.bin", "./a.bin", "a.bin/", "/etc/passwd", "a//b")


def refuses_unsafe_paths_over_a_limit(tenant: Tenant, run: AgentRun) -> None:
    """Saves that would shrink the over-limit folder (a deletion) but carry an
    unsafe path: each is 400 and changes nothing, through the run's checkpoint
    route and through the API bridge."""
    before = agent_files(tenant, run.agent)
    counters = folder_counters(tenant, "agent", run.agent)
    bridged = Run(tenant, run.run_id, run.token, run.lease_epoch, run.agent, run.task, None)
    up = bridged.upload("agent", b"z" * 2000)
    assert up.status_code == 200, up.text
    digest = up.json()["digest"]
    for path in UNSAFE_PATHS:
        r = bridged.commit(
            "agent",
            [
                {"op": "delete", "path": "b.bin"},
                {"op": "put", "path": path, "digest": digest, "executable": False},
            ],
        )
        assert r.status_code == 400 and r.json()["code"] == "validation_error", (path, r.text)
        assert r.json()["details"][0]["field"].endswith("path"), r.text
        r = bridged.commit("agent", [{"op": "delete", "path": path}])
        assert r.status_code == 400 and r.json()["code"] == "validation_error", (path, r.text)
    with api_client(tenant, run.token) as c:
        for path in UNSAFE_PATHS:
            r = put(c, tenant, "agent", run.agent, path, b"x")
            assert r.status_code == 400 and r.json()["code"] == "invalid_path", (path, r.text)
            r = operate(c, tenant, "agent", run.agent, action="delete", path=path)
            assert r.status_code == 400 and r.json()["code"] == "invalid_path", (path, r.text)
    assert agent_files(tenant, run.agent) == before
    assert folder_counters(tenant, "agent", run.agent) == counters


def ctl_bridge(tenant: Tenant, run: AgentRun) -> httpx.Client:
    return httpx.Client(
        base_url=tenant.controller.url + PREFIX,
        headers={"Authorization": f"Bearer {run.token}"},
        timeout=60,
    )


@pytest.mark.fuse
def test_a_300_mib_file_is_written_and_refused_only_at_save(
    mounts: MountFactory, tenant: Tenant
) -> None:
    """With the default limits: fsagent takes a 300 MiB file in the agent folder
    (still EFBIG past 1 GiB, like every collection); the save is refused."""
    agent = new_agent(tenant)
    run = start_agent_run(tenant, agent, user=tenant.user_id)
    m = mount_agent(mounts, run)
    big = m.mountpoint / "model.bin"
    with open(big, "wb") as fh:
        fh.truncate(300 * MiB)  # sparse: zeros the upload compresses to almost nothing
        fh.seek(300 * MiB - 5)
        fh.write(b"tail!")
    assert big.stat().st_size == 300 * MiB
    with open(m.mountpoint / "huge.bin", "wb") as fh:
        with pytest.raises(OSError) as exc:
            fh.truncate(GiB + 1)
        assert exc.value.errno == errno.EFBIG
    (m.mountpoint / "huge.bin").unlink()
    assert m.signal(signal.SIGTERM, timeout=300) == 0, m.stderr()
    receipt = run_receipts(tenant, run.run_id)[-1]
    assert receipt["code"] == "AGENT_FILES_LIMIT_EXCEEDED"
    assert receipt["details"] == [
        {"limit": "fileBytes", "max": AGENT_MAX_FILE_BYTES, "value": 300 * MiB, "path": "model.bin"}
    ]
    assert agent_files(tenant, agent) == {"AGENTS.md": b""}


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


COMMITS = r"/folders/agent/checkpoints$"


@pytest.mark.fuse
@pytest.mark.parametrize("failures", [2, 100])
def test_transient_failures_get_three_attempts_then_a_failure_receipt(
    proxy: LossyProxy, mode_mounts: MountFactory, tenant: Tenant, failures: int
) -> None:
    mounts = mode_mounts  # a FUSE mount, then a plain directory: the same contract
    agent = new_agent(tenant)
    run = start_agent_run(tenant, agent, user=tenant.user_id)
    # The same three attempts, 0.05 s and 0.1 s apart instead of 2 s and 4 s
    # (the default: test_the_final_save_pauses_2s_then_4s_unless_shortened).
    mounts.env = {**(os.environ if mounts.env is None else mounts.env), FINAL_PAUSE_ENV: "0.05"}
    # One request per attempt (no retries within one): attempts are countable.
    m = mount_agent(mounts, run, controller=proxy.url, extra=["--retry-deadline", "0"])
    (m.mountpoint / "work.md").write_bytes(b"the run's work")
    proxy.fail_next("POST", COMMITS, failures)
    code = m.signal(signal.SIGTERM, timeout=120)
    receipts = run_receipts(tenant, run.run_id)
    if failures == 2:  # the third attempt saves
        assert code == 0, m.stderr()
        assert len(proxy.failed) == 2
        assert agent_files(tenant, agent) == {"AGENTS.md": b"", "work.md": b"the run's work"}
        assert [r["outcome"] for r in receipts] == ["saved"]
    else:
        assert code == EXIT_SAVE_FAILED, m.stderr()
        assert len(proxy.failed) == 3
        assert agent_files(tenant, agent) == {"AGENTS.md": b""}
        [receipt] = receipts
        assert receipt["outcome"] == "failed" and receipt["final"] is True, receipt
        assert "after 3 attempt(s)" in receipt["error"]
        assert receipt["operationId"] and receipt["operationId"].startswith("cp-")
    assert_local_copy_discarded(m.state_dir)  # discarded either way
    if m.mode == "dir":  # the directory itself is the local copy
        assert list(m.mountpoint.iterdir()) == []


def test_the_final_save_pauses_2s_then_4s_unless_shortened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(FINAL_PAUSE_ENV, raising=False)
    assert [final_pause(a) for a in (1, 2, 3, 5, 9)] == [2.0, 4.0, 8.0, 30.0, 30.0]
    monkeypatch.setenv(FINAL_PAUSE_ENV, "0.05")
    assert [final_pause(a) for a in (1, 2)] == [0.05, 0.1]
    for never_longer in ("3", "60", "-1", "nan", "inf", "", "soon"):
        monkeypatch.setenv(FINAL_PAUSE_ENV, never_longer)
        assert [final_pause(a) for a in (1, 2)] == [2.0, 4.0], never_longer


def test_a_runs_api_saves_of_its_agent_folder_each_leave_a_receipt(st: Tenant) -> None:
    """Sandbox code's writes to the run's agent folder through the API bridge
    are save attempts of the run: each records a receipt, saved or refused
    (with code, and for a limit the warning), like its checkpoints; writes by
    people and to folders that are not the run's leave none."""
    agent = new_agent(st)
    other = new_agent(st, "other")
    run = start_agent_run(st, agent, user=st.user_id)
    started = datetime.now(UTC)
    with api_client(st, run.token) as c:
        assert (
            put(c, st, "agent", agent, "notes.md", b"n", **{"Idempotency-Key": "k-put"}).status_code
            == 201
        )
        assert operate(c, st, "agent", agent, action="mkdir", path="memory").status_code == 200
        over = put(c, st, "agent", agent, "big.bin", b"b" * (FILE_MAX + 1),
                   **{"Idempotency-Key": "k-big"})  # fmt: skip
        limit_detail(over)
        protected = operate(c, st, "agent", agent, action="delete", path="AGENTS.md")
        assert protected.status_code == 409 and protected.json()["code"] == "entry_protected"
        # Not the run's agent folder: 404, and no receipt of the run.
        assert put(c, st, "agent", other, "x.md", b"x").status_code == 404
    with st.client() as owner:  # a person's write is no save of the run
        assert put(owner, st, "agent", agent, "by-owner.md", b"o").status_code == 201
    receipts = run_receipts(st, run.run_id)
    assert [(r["outcome"], r["code"], r["operationId"], r["filesChanged"]) for r in receipts] == [
        ("saved", None, "k-put", 1),
        ("saved", None, None, 1),
        ("refused", "AGENT_FILES_LIMIT_EXCEEDED", "k-big", 0),
        ("refused", "ENTRY_PROTECTED", None, 0),
    ]
    for r in receipts:
        assert (r["runId"], r["scope"], r["ownerId"], r["final"]) == (
            run.run_id, "agent", agent, False,
        ), r  # fmt: skip
        at = parse_api_time(r["at"])
        assert started - timedelta(seconds=5) <= at <= datetime.now(UTC) + timedelta(seconds=5)
    refused = receipts[2]
    assert refused["details"] == [
        {"limit": "fileBytes", "max": FILE_MAX, "value": FILE_MAX + 1, "path": "big.bin"}
    ]
    [warning] = refused["warnings"]
    assert warning["code"] == "AGENT_FILES_LIMIT_EXCEEDED" and warning["path"] == "big.bin"
    # A warning of the run, which goes on; the later refusal of another kind
    # does not clear what the folder still earns (it is under every limit now).
    detail = run_detail(st, run.run_id).json()
    assert detail["state"] != "failed" and detail["warnings"] == [], detail
    assert agent_files(st, agent) == {"AGENTS.md": b"", "notes.md": b"n", "by-owner.md": b"o"}
