"""Repository checkouts end to end: real Git, a real controller (PostgreSQL,
local-disk storage), fsagent's HTTP bridge client and its CLI.

The in-process twins of most of these (tests/fsagent/test_fsagent_repos_inproc.py)
pin the protocol decisions against the fake; here the same flows must hold
against the controller's own validation, storage and fencing."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from fsagent.bridge.http import HttpBridgeClient
from fsagent.commands.envfile import read_env_file
from fsagent.errors import ControllerRefused, GitLockHeld, RepoSaveFailed
from fsagent.repos.checkouts import RepoSavers, prepare_all, repo_status
from fsagent.repos.prepare import SETUP_RECORD
from fsagent.repos.save import RepoSaver
from tests.support.constants import REPO
from tests.support.controller import Tenant
from tests.support.demo import check_demo_agent
from tests.support.gitrepos import (
    RepoTask,
    assert_restored,
    git,
    make_local_state,
    make_origin,
    new_repo_task,
    path_state,
)
from tests.support.procs import free_port
from tests.support.tmp import private_tmpdir, world_searchable_tmpdir

SETUP = 'echo ran >> "$SETUP_COUNT"'


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return make_origin(tmp_path / "origin")


@pytest.fixture
def setup_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "setup-count"
    monkeypatch.setenv("SETUP_COUNT", str(path))
    return path


def setup_runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def repo_task(tenant: Tenant) -> RepoTask:
    return new_repo_task(tenant)


async def save_now(client: HttpBridgeClient, home: Path, state: Path) -> RepoSaver:
    run = await client.get_run()
    savers = RepoSavers(client, run, home, state)
    assert await savers.save_all() == 0
    (saver,) = savers.savers.values()
    return saver


def people_repos(tenant: Tenant, task: str) -> list[dict[str, Any]]:
    with tenant.client() as c:
        r = c.get(f"/api/companies/{tenant.company_id}/tasks/{task}/repos")
        assert r.status_code == 200, r.text
        rows: list[dict[str, Any]] = r.json()["repos"]
        return rows


@pytest.mark.trio
async def test_clone_save_warm_start_then_restore_in_a_replacement_sandbox(
    tmp_path: Path, origin: Path, repo_task: RepoTask, setup_count: Path
) -> None:
    repo_task.add_workspace(str(origin), primary=True, setup=SETUP)
    first_run = repo_task.start_run(sandbox="sandbox-a")
    home_a, state_a = tmp_path / "a" / "home", tmp_path / "a" / "state"
    client = repo_task.client(first_run)
    try:
        _, _, results = await prepare_all(client, home_a)
        assert [(r.name, r.mode, r.setup) for r in results] == [("app", "clone", "done")]
        checkout = home_a / "repos" / "app"
        local = make_local_state(checkout)
        saver = await save_now(client, home_a, state_a)
        saved = saver.status["lastSave"]
        assert saved["committed"] and saved["full"]

        # Warm start: nothing touched, setup not run again.
        index = (checkout / ".git" / "index").read_bytes()
        _, _, results = await prepare_all(client, home_a)
        assert [(r.mode, r.setup) for r in results] == [("warm", "skipped")]
        assert (checkout / ".git" / "index").read_bytes() == index
        assert git(checkout, "symbolic-ref", "--short", "HEAD").strip() == "work"
        assert (checkout / local.edited_path).read_text() == local.edited_text
        assert setup_runs(setup_count) == 1
    finally:
        await client.aclose()
    (row,) = people_repos(repo_task.tenant, repo_task.task)
    assert row["state"] == "saved" and row["checkpointId"] == saved["checkpointId"]

    shutil.rmtree(tmp_path / "a")  # the sandbox is gone, and with it the source
    replacement = repo_task.start_run(sandbox="sandbox-b")
    home_b = tmp_path / "b" / "home"
    client = repo_task.client(replacement)
    try:
        _, _, results = await prepare_all(client, home_b)
    finally:
        await client.aclose()
    assert [(r.mode, r.setup) for r in results] == [("restore", "done")]
    restored = home_b / "repos" / "app"
    assert_restored(restored, local, str(origin))
    assert json.loads((restored / SETUP_RECORD).read_text())["state"] == "done"
    assert setup_runs(setup_count) == 2


@pytest.mark.trio
async def test_only_changes_travel_and_an_unchanged_checkout_sends_nothing(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    home, state = tmp_path / "home", tmp_path / "state"
    client = repo_task.client(run)
    try:
        await prepare_all(client, home)
        checkout = home / "repos" / "app"
        await trio.sleep(1.1)  # the clone is then old enough to be cached
        saver = await save_now(client, home, state)
        first = saver.status["lastSave"]
        assert await RepoSavers(client, await client.get_run(), home, state).save_all() == 0
        (checkout / "README.md").write_text("# app, changed\n")
        (checkout / "new.txt").write_text("new\n")
        (checkout / "docs" / "guide.md").unlink()
        again = await saver.checkpoint()
        assert again.committed and not again.full
        assert (again.changed, again.removed, again.uploaded) == (2, 1, 2)
        assert again.scan.hashed == 2
        unchanged = await saver.checkpoint()
        assert not unchanged.committed and unchanged.checkpoint_id == again.checkpoint_id
        manifest = await client.repo_manifest(saver.workspace_id)
        paths = {m["path"] for m in manifest.members}
        assert "new.txt" in paths and "docs/guide.md" not in paths
        assert manifest.checkpoint_id == again.checkpoint_id != first["checkpointId"]
    finally:
        await client.aclose()


def run_uploads(tenant: Tenant, run_id: str) -> dict[str, int]:
    """What the controller recorded as uploaded by the run: digest -> size."""
    with tenant.controller.db() as db:
        rows = db.execute(
            "SELECT digest, byte_size FROM run_uploads WHERE run_id = %s", (run_id,)
        ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def carried_state(checkout: Path, paths: set[str]) -> dict[str, tuple[str, bool, bytes]]:
    """What a checkpoint holds of each of ``paths`` that exists: kind, exec bit, contents."""
    out = {}
    for path in paths:
        if not os.path.lexists(checkout / path):
            continue
        kind, mode, _, data = path_state(checkout / path)
        out[path] = (kind, bool(mode & 0o100), data)
    return out


@pytest.mark.trio
async def test_a_new_commit_sends_only_its_new_objects(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    """After a checkpoint, a commit adds a few loose objects and changes a few
    of Git's files: only those travel, never the clone's pack again."""
    git(origin, "repack", "-adq")  # the clone then holds one pack, as a remote clone does
    ws = repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    home, state = tmp_path / "home", tmp_path / "state"
    client = repo_task.client(run)
    bodies: list[dict[str, Any]] = []
    commit = client.commit_repo_checkpoint

    async def recording(workspace: str, body: dict[str, Any]) -> dict[str, Any]:
        bodies.append(body)
        return await commit(workspace, body)

    client.commit_repo_checkpoint = recording  # type: ignore[method-assign]
    try:
        await prepare_all(client, home)
        checkout = home / "repos" / "app"
        await trio.sleep(1.1)  # the clone is then old enough to be cached
        saver = await save_now(client, home, state)
        base = {str(m["path"]): m for m in (await client.repo_manifest(ws)).members}
        before = carried_state(checkout, set(base))
        uploaded_before = run_uploads(repo_task.tenant, run.run_id)
        assert set(uploaded_before) == {m["digest"] for m in base.values() if "digest" in m}
        objects_before = set(git(checkout, "rev-list", "--all", "--objects").split("\n"))
        (pack,) = [p for p in base if p.endswith(".pack")]

        (checkout / "src" / "feature.py").write_text("feature = True\n")
        git(checkout, "add", "src/feature.py")
        git(checkout, "commit", "-q", "-m", "a feature")
        objects_after = set(git(checkout, "rev-list", "--all", "--objects").split("\n"))
        new_objects = {line.split()[0] for line in objects_after - objects_before}
        assert len(new_objects) == 4  # the blob, src's tree, the root tree, the commit
        outcome = await saver.checkpoint()
    finally:
        await client.aclose()
    assert outcome.committed and not outcome.full
    after = carried_state(checkout, set(base) | {str(m["path"]) for m in bodies[-1]["members"]})
    changed = {p for p, was in after.items() if before.get(p) != was}
    sent = {str(m["path"]): m for m in bodies[-1]["members"]}
    assert set(sent) == changed
    loose = {f".git/objects/{o[:2]}/{o[2:]}" for o in new_objects}
    assert loose <= changed and "src/feature.py" in changed
    assert {".git/index", ".git/refs/heads/main", ".git/logs/HEAD"} <= changed
    assert pack not in changed and not any(p.endswith((".pack", ".idx")) for p in changed)
    assert bodies[-1]["removed"] == []

    # On the controller: exactly the new contents arrived, once each.
    new_digests = {m["digest"] for m in sent.values() if m["kind"] == "file"} - set(uploaded_before)
    uploaded = run_uploads(repo_task.tenant, run.run_id)
    assert set(uploaded) - set(uploaded_before) == new_digests
    assert outcome.uploaded == len(new_digests)
    assert outcome.uploaded_bytes == sum(uploaded[d] for d in new_digests)
    assert base[pack]["digest"] in uploaded_before  # sent once, with the first checkpoint


@pytest.mark.trio
async def test_a_tree_mutated_during_the_scan_is_retried_and_never_committed_torn(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    ws = repo_task.add_workspace(str(origin))
    run = repo_task.start_run()
    home = tmp_path / "home"
    client = repo_task.client(run)
    try:
        _, listing, _ = await prepare_all(client, home)
        checkout = home / "repos" / "app"
        (checkout / "data.txt").write_text("old " * 5000)
        mutated: list[str] = []

        def mutate_between_read_and_recheck(full: str) -> None:
            if full.endswith("/data.txt") and not mutated:
                time.sleep(0.02)
                (checkout / "data.txt").write_text("new " * 5000)
                mutated.append(full)

        saver = RepoSaver(
            client,
            await client.get_run(),
            listing.repos[0],
            checkout,
            None,
            threads=1,
            after_read=mutate_between_read_and_recheck,
        )
        outcome = await saver.checkpoint()
        assert mutated and outcome.attempts == 2
        manifest = await client.repo_manifest(ws)
        (data,) = [m for m in manifest.members if m["path"] == "data.txt"]
        dest = tmp_path / "fetched"
        ((sha, size),) = await client.fetch_repo_objects(ws, [data["digest"]], lambda i: dest)
        assert dest.read_text() == "new " * 5000 and sha == data["digest"] and size == 20000
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_a_git_lock_refuses_the_save_until_it_is_released(
    tmp_path: Path, origin: Path, repo_task: RepoTask, caplog: pytest.LogCaptureFixture
) -> None:
    repo_task.add_workspace(str(origin))
    run = repo_task.start_run()
    home, state = tmp_path / "home", tmp_path / "state"
    client = repo_task.client(run)
    try:
        _, listing, _ = await prepare_all(client, home)
        checkout = home / "repos" / "app"
        (checkout / ".git" / "index.lock").write_text("")
        saver = RepoSaver(
            client, await client.get_run(), listing.repos[0], checkout, state / "repos" / "w"
        )
        with caplog.at_level(logging.WARNING), pytest.raises(GitLockHeld, match=r"index\.lock"):
            await saver.checkpoint()
        (row,) = people_repos(repo_task.tenant, repo_task.task)
        assert row["checkpointId"] is None and row["state"] == "failed"
        assert "index.lock" in row["error"]
        (checkout / ".git" / "index.lock").unlink()
        outcome = await saver.checkpoint()
        assert outcome.committed
        (row,) = people_repos(repo_task.tenant, repo_task.task)
        assert row["state"] == "saved" and row["checkpointId"] == outcome.checkpoint_id
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_another_tasks_checkout_at_the_path_is_refused(
    tmp_path: Path, origin: Path, tenant: Tenant, caplog: pytest.LogCaptureFixture
) -> None:
    one = new_repo_task(tenant)
    one.add_workspace(str(origin))
    home = tmp_path / "home"
    client = one.client(one.start_run())
    try:
        await prepare_all(client, home)
    finally:
        await client.aclose()
    record = (home / "repos" / "app" / ".git" / "fsagent" / "binding.json").read_text()
    other = new_repo_task(tenant)  # another project and task, same checkout name
    other.add_workspace(str(origin))
    client = other.client(other.start_run())
    try:
        with caplog.at_level(logging.WARNING):
            _, _, results = await prepare_all(client, home)
    finally:
        await client.aclose()
    assert [r.mode for r in results] == ["refused"]
    assert (home / "repos" / "app" / ".git" / "fsagent" / "binding.json").read_text() == record


@pytest.mark.trio
async def test_a_superseded_run_cannot_move_the_pointer(
    tmp_path: Path, origin: Path, repo_task: RepoTask, caplog: pytest.LogCaptureFixture
) -> None:
    repo_task.add_workspace(str(origin))
    old = repo_task.start_run(sandbox="same-sandbox")
    home, state = tmp_path / "home", tmp_path / "state"
    old_client = repo_task.client(old)
    try:
        await prepare_all(old_client, home)
        saver = await save_now(old_client, home, state)
        newer = repo_task.start_run(sandbox="same-sandbox")  # a newer lease on this sandbox
        (home / "repos" / "app" / "late.txt").write_text("too late\n")
        with caplog.at_level(logging.WARNING), pytest.raises(RepoSaveFailed):
            await saver.checkpoint()
        # The old run's token answers 401 now: the saver stops for good, not
        # every cadence, and says why.
        assert saver.fenced is not None and "401" in saver.fenced
        sent: list[str] = []

        async def count(request: Any) -> None:
            sent.append(f"{request.method} {request.url.path}")

        old_client._http.event_hooks["request"].append(count)
        with caplog.at_level(logging.WARNING), pytest.raises(RepoSaveFailed, match="newer run"):
            await saver.checkpoint()
        assert sent == []
        savers = RepoSavers(old_client, saver.run, home, state)  # a restarted saver
        with caplog.at_level(logging.WARNING), pytest.raises(ControllerRefused):
            await savers.save_all()
        assert savers.fenced is not None and len(sent) == 1  # the listing, refused
        with pytest.raises(RepoSaveFailed):
            await savers.save_all()
        assert len(sent) == 1
    finally:
        await old_client.aclose()
    (status,) = repo_status(home, state)
    assert status["state"] == "fenced" and "401" in status["lastError"]["message"]
    (row,) = people_repos(repo_task.tenant, repo_task.task)
    assert row["checkpointId"] == saver.status["lastSave"]["checkpointId"]
    new_client = repo_task.client(newer)
    try:
        manifest = await new_client.repo_manifest(saver.workspace_id)
    finally:
        await new_client.aclose()
    assert "late.txt" not in {m["path"] for m in manifest.members}


def fsagent(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsagent.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


def test_the_repos_commands(
    tmp_path: Path, origin: Path, repo_task: RepoTask, setup_count: Path
) -> None:
    repo_task.add_workspace(str(origin), primary=True, setup=SETUP)
    repo_task.add_workspace(str(origin), name="second")
    repo_task.set_branch("task-7")
    run = repo_task.start_run()
    base = private_tmpdir("fsa-rc-")
    (base / "token").write_text(run.token)
    home, state = base / "home", base / "state"
    ctl = ["--controller", repo_task.tenant.controller.url, "--token-file", str(base / "token")]
    where = ["--home", str(home), "--state-root", str(state)]

    prepared = fsagent("repos", "prepare", *where, *ctl, "--json")
    assert prepared.returncode == 0, prepared.stderr
    modes = {r["name"]: (r["mode"], r["setup"]) for r in json.loads(prepared.stdout)["repos"]}
    assert modes == {"app": ("clone", "done"), "second": ("clone", "none")}
    assert git(home / "repos" / "app", "symbolic-ref", "--short", "HEAD").strip() == "task-7"
    assert git(home / "repos" / "second", "symbolic-ref", "--short", "HEAD").strip() == "main"

    (home / "repos" / "app" / "out.txt").write_text("output\n")
    saved = fsagent("repos", "checkpoint", "app", *where, *ctl, "--json")
    assert saved.returncode == 0, saved.stderr
    (one,) = json.loads(saved.stdout)["repos"]
    assert one["name"] == "app" and one["committed"]

    (home / "repos" / "second" / ".git" / "HEAD.lock").write_text("")
    refused = fsagent("repos", "checkpoint", *where, *ctl, "--lock-wait", "0")
    assert refused.returncode == 4
    assert "second: not saved" in refused.stdout and "HEAD.lock" in refused.stdout

    status = fsagent("repos", "status", *where, "--json")
    rows = {r["name"]: r for r in json.loads(status.stdout)["repos"]}
    assert rows["app"]["state"] == "saved"
    assert rows["app"]["lastSave"]["checkpointId"] == one["checkpointId"]
    assert rows["app"]["setup"]["state"] == "done"
    assert rows["second"]["state"] == "waiting"
    text = fsagent("repos", "status", *where)
    assert "second: waiting" in text.stdout and "HEAD.lock" in text.stdout

    os.unlink(home / "repos" / "second" / ".git" / "HEAD.lock")
    # watch: a save on the cadence, then the final save at SIGTERM.
    with open(base / "watch.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsagent.cli", "repos", "watch", *where, *ctl,
             "--interval", "1"],
            cwd=REPO, stdout=log, stderr=log,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            rows = {r["name"]: r for r in repo_status(home, state)}
            if rows["second"]["state"] == "saved":
                break
            assert proc.poll() is None and time.monotonic() < deadline, rows
            time.sleep(0.2)
        (home / "repos" / "app" / "final.txt").write_text("saved at stop\n")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (base / "watch.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = {r["name"]: r for r in people_repos(repo_task.tenant, repo_task.task)}
    assert rows["app"]["state"] == rows["second"]["state"] == "saved"
    client = repo_task.client(run)

    async def final_members() -> set[str]:
        try:
            ws = next(r.workspace_id for r in (await client.list_repos()).repos if r.name == "app")
            return {m["path"] for m in (await client.repo_manifest(ws)).members}
        finally:
            await client.aclose()

    assert "final.txt" in trio.run(final_members)


@pytest.mark.fuse
def test_up_prepares_the_checkout_saves_it_and_names_it_in_the_env_file(
    origin: Path, repo_task: RepoTask
) -> None:
    repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    base = private_tmpdir("fsa-upr-")
    (base / "token").write_text(run.token)
    home, state, env_file = base / "home", base / "state", base / "env"
    with open(base / "up.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsagent.cli", "up", "--home", str(home), "--controller",
             repo_task.tenant.controller.url, "--token-file", str(base / "token"),
             "--state-root", str(state), "--env-file", str(env_file)],
            cwd=REPO, stdout=log, stderr=log,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not env_file.exists():
            assert proc.poll() is None, (base / "up.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        env = read_env_file(env_file)  # values are quoted (fsagent/commands/envfile.py)
        assert env["PAPERCLIP_REPOS_DIR"] == str(home / "repos")
        assert env["PAPERCLIP_PRIMARY_REPO"] == str(home / "repos" / "app")
        checkout = home / "repos" / "app"
        assert git(checkout, "rev-parse", "HEAD") == git(origin, "rev-parse", "main")
        (checkout / "agent-notes.md").write_text("written while the agent ran\n")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, (base / "up.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for scope in ("task", "agent", "user", "project"):
            subprocess.run(["fusermount3", "-u", "-z", str(home / scope)], capture_output=True,
                           check=False)  # fmt: skip
    client = repo_task.client(run)

    async def saved_paths() -> set[str]:
        try:
            (repo,) = (await client.list_repos()).repos
            return {m["path"] for m in (await client.repo_manifest(repo.workspace_id)).members}
        finally:
            await client.aclose()

    assert "agent-notes.md" in trio.run(saved_paths)  # the final save at stop


def unit_command(unit: str, key: str) -> list[str]:
    """A systemd unit's command line (``key=``), continuation lines joined,
    without the ``-`` (ignore failure) prefix."""
    text = unit.split(f"\n{key}=", 1)[1]
    lines = [text.split("\n", 1)[0]]
    rest = text.split("\n", 1)[1]
    while lines[-1].endswith("\\"):
        line, rest = rest.split("\n", 1)
        lines.append(line)
    return shlex.split(" ".join(line.rstrip("\\") for line in lines).lstrip("-"))


def test_the_systemd_unit_prepares_watches_and_saves_at_stop(
    tmp_path: Path, origin: Path, repo_task: RepoTask
) -> None:
    unit = (REPO / "packaging" / "systemd" / "fsagent-repos.service").read_text()
    verify_dir = tmp_path / "units"
    verify_dir.mkdir()
    local = unit.replace("/opt/fsagent/venv/bin/fsagent", str(REPO / ".venv" / "bin" / "fsagent"))
    (verify_dir / "fsagent-repos.service").write_text(local)
    verified = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(verify_dir / "fsagent-repos.service")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr

    repo_task.add_workspace(str(origin), primary=True)
    run = repo_task.start_run()
    base = private_tmpdir("fsa-ru-")
    (base / "token").write_text(run.token)
    config = {"FSAGENT_HOME": str(base / "home"), "FSAGENT_TOKEN_FILE": str(base / "token"),
              "FSAGENT_CONTROLLER": repo_task.tenant.controller.url}  # fmt: skip

    def argv(key: str) -> list[str]:
        words = unit_command(unit, key)
        assert words[0] == "/opt/fsagent/venv/bin/fsagent" and words[1] == "repos"
        return [re.sub(r"\$\{(\w+)\}", lambda m: config[m.group(1)], w) for w in words[1:]]

    prepare = fsagent(*argv("ExecStartPre"))
    assert prepare.returncode == 0, prepare.stderr
    checkout = base / "home" / "repos" / "app"
    assert (checkout / ".git" / "fsagent" / "binding.json").exists()
    (checkout / "from-the-unit.txt").write_text("saved at stop\n")
    with open(base / "watch.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fsagent.cli", *argv("ExecStart")],
                                cwd=REPO, stdout=log, stderr=log)  # fmt: skip
    try:
        deadline = time.monotonic() + 60  # started: the cadence is 180 s, so only the stop saves
        while b"fsagent repos: saving" not in (base / "watch.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, (
                base / "watch.log"
            ).read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (base / "watch.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (row,) = people_repos(repo_task.tenant, repo_task.task)
    assert row["state"] == "saved"
    client = repo_task.client(run)

    async def saved_paths() -> set[str]:
        try:
            return {m["path"] for m in (await client.repo_manifest(row["workspaceId"])).members}
        finally:
            await client.aclose()

    assert "from-the-unit.txt" in trio.run(saved_paths)


class Demo:
    """``make demo`` (controller.demo) started and stopped like a person would."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.home = base / "home"
        self.runs = 0

    def start(self) -> None:
        # A port for each start: between two starts another test's server may
        # take a port that was free, and would answer this demo's health check.
        self.port = free_port()
        self.runs += 1
        self.log = self.base / f"demo-{self.runs}.out"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controller.demo", "--data-dir", str(self.base / "data"),
                 "--home", str(self.home), "--listen", f"127.0.0.1:{self.port}",
                 "--checkpoint-interval", "600"],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while "Press Ctrl-C" not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, self.log.read_text(errors="replace")
            assert time.monotonic() < deadline, self.log.read_text(errors="replace")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for scope in ("task", "agent", "user", "project"):
            subprocess.run(["fusermount3", "-u", "-z", str(self.home / scope)],
                           capture_output=True, check=False)  # fmt: skip
        assert self.proc.returncode == 0, self.log.read_text(errors="replace")


@pytest.mark.fuse
def test_the_demo_keeps_a_commit_across_restarts_and_restores_a_deleted_home() -> None:
    demo = Demo(world_searchable_tmpdir("fsa-demo-"))
    checkout = demo.home / "repos" / "demo-app"
    demo.start()
    try:
        assert f"Repository:  {checkout}" in demo.log.read_text()
        check_demo_agent(demo.log.read_text(), demo.home)
        (checkout / "notes.md").write_text("a person's change\n")
        git(checkout, "add", "notes.md")
        git(checkout, "commit", "-q", "-m", "a person's commit")
        commit = git(checkout, "rev-parse", "HEAD").strip()
    finally:
        demo.stop()
    demo.start()
    try:
        assert "repository demo-app: warm" in demo.log.read_text()
        check_demo_agent(demo.log.read_text(), demo.home)  # kept, not written twice
        assert git(checkout, "rev-parse", "HEAD").strip() == commit
    finally:
        demo.stop()
    shutil.rmtree(demo.home)
    demo.start()
    try:
        assert "repository demo-app: restore" in demo.log.read_text()
        assert git(checkout, "rev-parse", "HEAD").strip() == commit
        assert git(checkout, "status", "--porcelain") == ""
        assert git(checkout, "remote", "get-url", "origin").strip() == str(
            demo.base / "data" / "demo-app.git"
        )
    finally:
        demo.stop()
