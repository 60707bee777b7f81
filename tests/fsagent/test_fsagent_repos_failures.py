"""Repository saves and restores that must fail, or wait, without harm: real
Git, a real controller (PostgreSQL, local-disk storage) and fsagent's HTTP
bridge client, with ``fsagent repos`` processes where a second saver is
another process.

The in-process twins (tests/fsagent/test_fsagent_repos_inproc.py) pin the same
decisions against the fake; here the controller's own answers drive them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from controller.storage.base import object_key
from fsagent.bridge.http import HttpBridgeClient
from fsagent.errors import ControllerRefused
from fsagent.repos.checkouts import RepoSavers, prepare_all, repo_status, repos_state_root
from tests.support.constants import REPO
from tests.support.controller import PgCluster, Tenant, bootstrap_tenant, private_controller
from tests.support.gitrepos import (
    RepoTask,
    Sandbox,
    assert_restored,
    checkout_snapshot,
    make_local_state,
    make_origin,
    new_repo_task,
)


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return make_origin(tmp_path / "origin")


@pytest.fixture
def repo_task(tenant: Tenant) -> RepoTask:
    return new_repo_task(tenant)


def holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (a directory it locks, say)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fds)
    except FileNotFoundError:
        return False
    for name in names:
        try:
            if os.readlink(fds / name) == str(path):
                return True
        except OSError:
            continue  # closed meanwhile
    return False


@pytest.mark.trio
async def test_two_savers_of_one_checkout_never_checkpoint_at_once(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    """A save held mid-scan keeps another process's ``fsagent repos
    checkpoint`` waiting on the sandbox's save lock: it sends nothing until
    the first save has committed, then finds the checkout saved by it."""
    repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    box = Sandbox(tmp_path / "box", repo_task)
    box.start(run)
    client = repo_task.client(run)
    other: subprocess.Popen[str] | None = None
    try:
        await prepare_all(client, box.home)
        checkout = box.home / "repos" / "app"
        savers = RepoSavers(client, await client.get_run(), box.home, box.state)
        assert await savers.save_all() == 0
        (saver,) = savers.savers.values()
        first = saver.status["lastSave"]["checkpointId"]

        (checkout / "held.txt").write_text("read while the other saver waits\n")
        reading, release = threading.Event(), threading.Event()

        def hold(full: str) -> None:
            if full.endswith("/held.txt") and not reading.is_set():
                reading.set()
                assert release.wait(120), "never released"

        saver.after_read = hold
        failed: list[int] = []
        async with trio.open_nursery() as nursery:

            async def save() -> None:
                failed.append(await savers.save_all())

            nursery.start_soon(save)
            try:
                assert await trio.to_thread.run_sync(reading.wait, 120)
                other = await trio.to_thread.run_sync(
                    lambda: subprocess.Popen(
                        box.argv("checkpoint", "--json"),
                        cwd=REPO,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
                lock_dir = repos_state_root(box.state)
                deadline = time.monotonic() + 120
                while not holds_open(other.pid, lock_dir):  # at the lock now
                    assert other.poll() is None, other.communicate()
                    assert time.monotonic() < deadline
                    await trio.sleep(0.05)
                await trio.sleep(1.5)
                assert other.poll() is None  # still waiting for the first save
                assert repo_task.people_repos()["app"]["checkpointId"] == first
            finally:
                release.set()
        assert failed == [0]
        second = saver.status["lastSave"]
        assert second["committed"] and not second["full"] and second["changed"] == 1
        assert second["checkpointId"] != first
        assert other is not None
        out, err = await trio.to_thread.run_sync(lambda: other.communicate(timeout=120))
    finally:
        await client.aclose()
        if other is not None and other.poll() is None:
            other.kill()
            other.communicate()
    assert other.returncode == 0, out + err
    (result,) = json.loads(out)["repos"]
    # The waiting saver ran after the commit: nothing left to send.
    assert result["ok"] and not result["committed"]
    assert result["checkpointId"] == second["checkpointId"]
    assert repo_task.people_repos()["app"]["checkpointId"] == second["checkpointId"]


@pytest.mark.trio
async def test_a_save_whose_uploads_expired_is_refused_visibly_then_uploads_again(
    tmp_path: Path, origin: Path, pg_cluster: PgCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Uploads pin their objects for --repo-upload-ttl: a commit sent after
    that is refused 422 unknown_content, which the repository shows as its
    error; the next save asks again what is missing, uploads it all again and
    commits."""
    with private_controller(pg_cluster, "fsa-repottl-", "--repo-upload-ttl", "3") as ctl:
        task = new_repo_task(bootstrap_tenant(ctl))
        task.add_workspace(str(origin), primary=True)
        run = task.start_run()
        home, state = tmp_path / "home", tmp_path / "state"
        client = task.client(run)
        commit = client.commit_repo_checkpoint
        answers: list[str] = []

        async def late_once(workspace: str, body: dict[str, Any]) -> dict[str, Any]:
            if not answers:
                await trio.sleep(3.5)  # the uploads' pins expire meanwhile
            try:
                receipt = await commit(workspace, body)
            except ControllerRefused as exc:
                answers.append(f"{exc.status} {exc.code}")
                raise
            answers.append("200")
            return receipt

        client.commit_repo_checkpoint = late_once  # type: ignore[method-assign]
        try:
            await prepare_all(client, home)
            savers = RepoSavers(client, await client.get_run(), home, state)
            with caplog.at_level(logging.WARNING):
                assert await savers.save_all() == 1
            assert answers == ["422 unknown_content"]
            row = task.people_repos()["app"]
            assert row["state"] == "failed" and row["checkpointId"] is None
            assert "unknown_content" in row["error"], row["error"]
            (status,) = repo_status(home, state)
            assert (
                status["state"] == "failed" and "unknown_content" in status["lastError"]["message"]
            )
            assert "lastSave" not in status or status["lastSave"] is None

            (saver,) = savers.savers.values()
            outcome = await saver.checkpoint()
            assert answers == ["422 unknown_content", "200"]
            manifest = await client.repo_manifest(saver.workspace_id)
        finally:
            await client.aclose()
        assert outcome.committed and outcome.full
        digests = {m["digest"] for m in manifest.members if m["kind"] == "file"}
        assert outcome.uploaded == len(digests)  # every expired upload sent again
        assert manifest.checkpoint_id == outcome.checkpoint_id
        row = task.people_repos()["app"]
        assert row["state"] == "saved" and row["error"] is None
        assert row["checkpointId"] == outcome.checkpoint_id


def checkpoint_count(task: RepoTask) -> int:
    with task.tenant.controller.db() as db:
        row = db.execute(
            "SELECT count(*) FROM repo_checkpoints WHERE task_id = %s", (task.task,)
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.trio
async def test_a_refused_checkpoint_leaves_the_checkout_and_the_saved_one_as_they_were(
    tmp_path: Path, origin: Path, repo_task: RepoTask, caplog: pytest.LogCaptureFixture
) -> None:
    """The controller refuses a checkpoint with an unsafe member (here the
    escaping link this saver leaves out, sent as a saver with laxer rules
    would send it): not a byte, mode or mtime of the checkout changes, the
    previous checkpoint stays current, and the refusal names the member and
    the rule. The next save, with the link left out, commits its delta."""
    ws = repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    home, state = tmp_path / "home", tmp_path / "state"
    client = repo_task.client(run)
    commit = client.commit_repo_checkpoint
    refused: list[dict[str, Any]] = []

    async def laxer_once(workspace: str, body: dict[str, Any]) -> dict[str, Any]:
        if refused:
            return await commit(workspace, body)
        unsafe = {"path": "outside", "kind": "symlink", "target": "../../elsewhere"}
        body = {**body, "members": [*body["members"], unsafe]}
        try:
            return await commit(workspace, body)
        except ControllerRefused as exc:
            refused.append({"status": exc.status, "code": exc.code, "message": str(exc)})
            raise

    try:
        await prepare_all(client, home)
        checkout = home / "repos" / "app"
        savers = RepoSavers(client, await client.get_run(), home, state)
        assert await savers.save_all() == 0
        (saver,) = savers.savers.values()
        first = saver.status["lastSave"]["checkpointId"]
        saved_first = {m["path"]: m for m in (await client.repo_manifest(ws)).members}
        make_local_state(checkout)
        (checkout / "outside").symlink_to("../../elsewhere")
        count = checkpoint_count(repo_task)

        before = checkout_snapshot(checkout)
        client.commit_repo_checkpoint = laxer_once  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING):
            assert await savers.save_all() == 1
        assert checkout_snapshot(checkout) == before
        (answer,) = refused
        assert (answer["status"], answer["code"]) == (422, "unsafe_repo_member")
        assert "outside" in answer["message"] and "symlink_escapes_checkout" in answer["message"]
        row = repo_task.people_repos()["app"]
        assert row["state"] == "failed" and row["checkpointId"] == first
        assert "symlink_escapes_checkout" in row["error"], row["error"]
        assert checkpoint_count(repo_task) == count
        current = await client.repo_manifest(ws)
        assert current.checkpoint_id == first
        assert {m["path"]: m for m in current.members} == saved_first
        (status,) = repo_status(home, state)
        assert status["state"] == "failed"
        assert status["lastSave"]["checkpointId"] == first

        outcome = await saver.checkpoint()
        assert checkout_snapshot(checkout) == before
        saved = {m["path"] for m in (await client.repo_manifest(ws)).members}
    finally:
        await client.aclose()
    assert outcome.committed and not outcome.full and outcome.checkpoint_id != first
    assert {(p.path, p.reason) for p in outcome.problems} == {
        ("outside", "symlink_escapes_checkout")
    }
    assert "outside" not in saved and "results/result.txt" in saved
    assert repo_task.people_repos()["app"]["checkpointId"] == outcome.checkpoint_id
    assert checkpoint_count(repo_task) == count + 1


@pytest.mark.trio
@pytest.mark.parametrize("damage", ["other-bytes", "truncated"])
async def test_a_restore_meeting_a_corrupt_stored_object_publishes_nothing(
    tmp_path: Path,
    origin: Path,
    repo_task: RepoTask,
    damage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stored object damaged on the controller's disk (other bytes of the
    same size, which the controller serves as they are, or cut short, which
    ends its stream early) fails the restore: no checkout and no temporary
    directory are left in ``repos/``. With the object repaired, the same
    sandbox restores."""
    ws = repo_task.add_workspace(str(origin), primary=True)
    client = repo_task.client(repo_task.start_run(sandbox="sandbox-a"))
    try:
        await prepare_all(client, tmp_path / "a" / "home")
        local = make_local_state(tmp_path / "a" / "home" / "repos" / "app")
        savers = RepoSavers(client, await client.get_run(), tmp_path / "a" / "home", tmp_path / "a")
        assert await savers.save_all() == 0
        (saver,) = savers.savers.values()
        saved = saver.status["lastSave"]["checkpointId"]
        members = (await client.repo_manifest(ws)).members
    finally:
        await client.aclose()
    (result,) = [m for m in members if m["path"] == local.untracked_path]
    tenant = repo_task.tenant
    stored = (
        tenant.controller.data_dir / "objects" / object_key(tenant.company_id, result["digest"])
    )
    original = stored.read_bytes()
    assert hashlib.sha256(original).hexdigest() == result["digest"]  # stored as it is
    mode = stored.stat().st_mode
    stored.chmod(0o600)
    if damage == "other-bytes":
        stored.write_bytes(bytes(b ^ 0x20 for b in original))
    else:
        stored.write_bytes(original[:-3])

    home = tmp_path / "b" / "home"
    run = repo_task.start_run(sandbox="sandbox-b")
    # A stream cut short looks like a network failure, so it is retried: briefly here.
    client = HttpBridgeClient(tenant.controller.url, run.token, retry_deadline=2)
    try:
        with caplog.at_level(logging.WARNING):
            _, _, results = await prepare_all(client, home)
        (failed,) = results
        assert (failed.mode, failed.ok) == ("failed", False)
        if damage == "other-bytes":
            assert failed.message and failed.message.startswith(
                f"ObjectUnavailable: object {result['digest'][:12]} for {local.untracked_path} "
                "did not match its digest"
            ), failed.message
        else:
            assert failed.message and "gave up after" in failed.message, failed.message
            assert f"object {result['digest']} has {len(original) - 3} bytes" in (
                tenant.controller.log()
            )
        assert sorted(os.listdir(home / "repos")) == []  # nothing published, no temp dir
        row = repo_task.people_repos()["app"]
        assert row["state"] == "saved" and row["checkpointId"] == saved

        stored.write_bytes(original)
        stored.chmod(mode)
        _, _, results = await prepare_all(client, home)
    finally:
        stored.write_bytes(original)  # the shared controller's store is left whole
        stored.chmod(mode)
        await client.aclose()
    assert [(r.mode, r.ok) for r in results] == [("restore", True)]
    assert sorted(os.listdir(home / "repos")) == ["app"]
    assert_restored(home / "repos" / "app", local, str(origin))


@pytest.mark.trio
async def test_a_tree_that_keeps_changing_fails_visibly_after_three_retries(
    tmp_path: Path, origin: Path, repo_task: RepoTask, caplog: pytest.LogCaptureFixture
) -> None:
    """A file rewritten every time the scan reads it: four scans (the first
    and three retries), then a failure people see; nothing is committed and
    the previous checkpoint stays current. Once the file settles, it saves."""
    ws = repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    home, state = tmp_path / "home", tmp_path / "state"
    client = repo_task.client(run)
    commit = client.commit_repo_checkpoint
    commits: list[str] = []

    async def counted(workspace: str, body: dict[str, Any]) -> dict[str, Any]:
        commits.append(str(body["base"]))
        return await commit(workspace, body)

    client.commit_repo_checkpoint = counted  # type: ignore[method-assign]
    try:
        await prepare_all(client, home)
        checkout = home / "repos" / "app"
        savers = RepoSavers(client, await client.get_run(), home, state)
        assert await savers.save_all() == 0
        (saver,) = savers.savers.values()
        first = saver.status["lastSave"]["checkpointId"]
        count = checkpoint_count(repo_task)
        (checkout / "busy.txt").write_text("0")
        reads = [0]

        def rewrite(full: str) -> None:
            if full.endswith("/busy.txt"):
                reads[0] += 1
                time.sleep(0.02)
                (checkout / "busy.txt").write_text(str(reads[0]))

        saver.after_read = rewrite
        with caplog.at_level(logging.WARNING):
            assert await savers.save_all() == 1
        assert reads[0] == 4 and commits == ["None"]  # only the first save's commit
        assert "kept changing during 4 scans (busy.txt)" in caplog.text
        row = repo_task.people_repos()["app"]
        assert row["state"] == "failed" and row["checkpointId"] == first
        assert "kept changing during 4 scans" in row["error"], row["error"]
        assert checkpoint_count(repo_task) == count
        (status,) = repo_status(home, state)
        assert status["state"] == "failed" and "busy.txt" in status["lastError"]["message"]
        assert (await client.repo_manifest(ws)).checkpoint_id == first

        saver.after_read = None
        outcome = await saver.checkpoint()
        manifest = await client.repo_manifest(ws)
        (busy,) = [m for m in manifest.members if m["path"] == "busy.txt"]
        dest = tmp_path / "fetched"
        ((digest, _),) = await client.fetch_repo_objects(ws, [busy["digest"]], lambda i: dest)
    finally:
        await client.aclose()
    assert outcome.committed and not outcome.full and outcome.attempts == 1
    assert commits == ["None", first]
    assert digest == busy["digest"] and dest.read_text() == "4"
    assert repo_task.people_repos()["app"]["state"] == "saved"
