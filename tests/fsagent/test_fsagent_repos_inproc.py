"""Repository checkouts against the in-memory bridge client: real Git, real
files, the controller's contract without a controller (the same flows run
against a real one in test_fsagent_repos.py).

Prepare (clone, warm, restore, refusals), checkpoints (delta, only missing
contents, no-op, base_mismatch, replay after a lost answer, fencing), the
stability rules (a tree mutated during the scan, Git locks, unsupported
layouts) and the metadata cache's effect on a real checkout."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from fsagent.bridge.base import RepoBinding
from fsagent.errors import (
    CheckoutUnsupported,
    ControllerRefused,
    GitLockHeld,
    RepoSaveFailed,
    TreeUnstable,
)
from fsagent.repos.checkouts import RepoSavers, describe_prepare, prepare_all, repo_status, watch
from fsagent.repos.prepare import BINDING_RECORD, SETUP_RECORD, prepare_repo
from fsagent.repos.save import RepoSaver
from tests.support.gitrepos import assert_restored, git, make_local_state, make_origin
from tests.support.memclient import MemoryBridgeClient

SETUP = 'echo ran >> "$SETUP_COUNT"; mkdir -p node_modules/dep && echo x > node_modules/dep/x.js'


class Sandbox:
    """One sandbox: a home (with ``repos/``) and fsagent's state root."""

    def __init__(self, root: Path) -> None:
        self.home = root / "home"
        self.state = root / "state"
        self.home.mkdir(parents=True)

    @property
    def repos(self) -> Path:
        return self.home / "repos"


@pytest.fixture
def setup_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "setup-count"
    monkeypatch.setenv("SETUP_COUNT", str(path))
    return path


def runs_of_setup(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return make_origin(tmp_path / "origin")


@pytest.fixture
def mem(origin: Path) -> MemoryBridgeClient:
    client = MemoryBridgeClient()
    client.add_repo(str(origin), primary=True, setup_command=SETUP)
    return client


def only_binding(mem: MemoryBridgeClient) -> RepoBinding:
    (repo,) = mem.repos.values()
    return repo.binding


async def saver_for(mem: MemoryBridgeClient, box: Sandbox, **kw: Any) -> RepoSaver:
    listing = await mem.list_repos()
    (binding,) = listing.repos
    state_dir = box.state / "repos" / binding.workspace_id
    return RepoSaver(mem, mem.run, binding, box.repos / binding.name, state_dir, **kw)


@pytest.mark.trio
async def test_clone_checkpoint_then_restore_in_a_replacement_sandbox(
    tmp_path: Path, origin: Path, mem: MemoryBridgeClient, setup_count: Path
) -> None:
    first = Sandbox(tmp_path / "first")
    _, _, results = await prepare_all(mem, first.home)
    assert [(r.mode, r.setup) for r in results] == [("clone", "done")]
    checkout = first.repos / "app"
    assert runs_of_setup(setup_count) == 1
    state = make_local_state(checkout)

    saver = await saver_for(mem, first)
    outcome = await saver.checkpoint()
    assert outcome.committed and outcome.full and outcome.attempts == 1
    saved = mem.repo_files(only_binding(mem).workspace_id)
    assert saved[state.untracked_path] == state.untracked_text.encode()
    assert "node_modules/dep/index.js" not in saved and "debug.log" not in saved
    assert ".git/config" not in saved and ".git/fsagent/binding.json" not in saved
    assert not any(p.startswith(".git/hooks") for p in saved)

    shutil.rmtree(tmp_path / "first")  # the sandbox is gone
    second = Sandbox(tmp_path / "second")
    _, _, results = await prepare_all(mem, second.home)
    assert [(r.mode, r.setup) for r in results] == [("restore", "done")]
    restored = second.repos / "app"
    assert_restored(restored, state, str(origin))
    assert runs_of_setup(setup_count) == 2  # dependencies come back by running setup again
    assert (restored / "node_modules" / "dep" / "x.js").exists()
    assert not [p for p in second.repos.iterdir() if p.name.startswith(".")]  # no temp dirs


@pytest.mark.trio
async def test_warm_start_keeps_branch_edits_and_completed_setup(
    tmp_path: Path, mem: MemoryBridgeClient, setup_count: Path
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    state = make_local_state(checkout)
    await (await saver_for(mem, box)).checkpoint()
    index_before = (checkout / ".git" / "index").read_bytes()

    _, _, results = await prepare_all(mem, box.home)
    assert [(r.mode, r.setup) for r in results] == [("warm", "skipped")]
    assert runs_of_setup(setup_count) == 1
    assert git(checkout, "symbolic-ref", "--short", "HEAD").strip() == "work"
    assert git(checkout, "rev-parse", "HEAD").strip() == state.commit
    assert (checkout / state.edited_path).read_text() == state.edited_text
    assert (checkout / ".git" / "index").read_bytes() == index_before
    assert (checkout / "node_modules" / "dep" / "index.js").exists()  # nothing cleaned


@pytest.mark.trio
async def test_primary_checkout_honours_the_task_branch(tmp_path: Path, origin: Path) -> None:
    mem = MemoryBridgeClient()
    mem.add_repo(str(origin), "existing", primary=True, branch="feature")
    mem.add_repo(str(origin), "fresh", primary=False, ref="feature")
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    existing = box.repos / "existing"
    assert git(existing, "symbolic-ref", "--short", "HEAD").strip() == "feature"
    assert git(existing, "rev-parse", "--abbrev-ref", "@{upstream}").strip() == "origin/feature"
    assert git(box.repos / "fresh", "symbolic-ref", "--short", "HEAD").strip() == "feature"

    new = MemoryBridgeClient()
    new.add_repo(str(origin), "newbranch", primary=True, branch="task-42", ref="main")
    await prepare_all(new, box.home)
    created = box.repos / "newbranch"
    assert git(created, "symbolic-ref", "--short", "HEAD").strip() == "task-42"
    assert git(created, "rev-parse", "HEAD") == git(created, "rev-parse", "origin/main")


@pytest.mark.trio
async def test_a_remote_head_naming_a_missing_branch_is_a_clone_with_a_warning(
    tmp_path: Path, origin: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The remote's HEAD names refs/heads/missing: Git clones, checks nothing
    out and only warns. The clone is kept (its branches are all there) and
    says so with a stable code and Git's message, in prepare's result and
    line and in ``repos status``; an empty remote is an ordinary clone."""
    git(origin, "symbolic-ref", "HEAD", "refs/heads/missing")
    empty = tmp_path / "empty.git"
    git(tmp_path, "init", "-q", "--bare", str(empty))
    mem = MemoryBridgeClient()
    mem.add_repo(str(origin), "app", primary=True)
    mem.add_repo(str(empty), "blank", primary=False)
    box = Sandbox(tmp_path / "box")
    _, _, results = await prepare_all(mem, box.home)
    app, blank = sorted(results, key=lambda r: r.name)
    assert (app.mode, app.setup, app.ok) == ("clone", "none", True)
    assert app.warning is not None and app.warning["code"] == "remote_head_missing", app
    assert app.warning["message"] == (
        "the remote's HEAD names branch missing, which the remote does not have:"
        " nothing is checked out (the remote has feature, main; e.g. git checkout feature)"
    )
    assert "remote HEAD refers to nonexistent ref" in app.warning["git"], app.warning
    checkout = box.repos / "app"
    assert git(checkout, "symbolic-ref", "HEAD").strip() == "refs/heads/missing"
    assert sorted(p.name for p in checkout.iterdir()) == [".git"]  # nothing checked out
    assert describe_prepare(app).endswith(
        f"; warning [remote_head_missing]: {app.warning['message']} (git: {app.warning['git']})"
    )
    assert app.to_json()["warning"] == app.warning
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"app: {app.warning['message']}"
    ]
    [row] = [r for r in repo_status(box.home, box.state) if r["name"] == "app"]
    assert row["warning"] == app.warning
    # The agent checks out a branch: the clone had it all along.
    git(checkout, "checkout", "-q", "main")
    assert (checkout / "src" / "main.py").read_text() == "print('hello')\n"
    # An empty remote has nothing to check out: no warning.
    assert (blank.mode, blank.warning) == ("clone", None), blank


@pytest.mark.trio
async def test_binding_mismatch_is_refused_and_left_untouched(
    tmp_path: Path, origin: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    record = (checkout / BINDING_RECORD).read_text()

    other_task = MemoryBridgeClient()  # another run, another task, same checkout name
    other_task.add_repo(str(origin), primary=True)
    with caplog.at_level(logging.WARNING):
        _, _, results = await prepare_all(other_task, box.home)
    assert [r.mode for r in results] == ["refused"]
    assert "not of this task's workspace" in str(results[0].message)
    assert (checkout / BINDING_RECORD).read_text() == record

    unknown = box.repos / "stranger"
    unknown.mkdir()
    (unknown / "notes.txt").write_text("mine")
    other_task.add_repo(str(origin), "stranger")
    with caplog.at_level(logging.WARNING):
        _, _, results = await prepare_all(other_task, box.home)
    assert [r.mode for r in results] == ["refused", "refused"]
    assert "stranger exists and is not a checkout" in caplog.text
    assert (unknown / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(unknown)) == ["notes.txt"]


@pytest.mark.trio
async def test_delta_checkpoints_send_only_changes_and_missing_contents(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    bodies: list[dict[str, Any]] = []
    commit = mem.commit_repo_checkpoint

    async def recording(ws: str, body: dict[str, Any]) -> dict[str, Any]:
        bodies.append(body)
        return await commit(ws, body)

    mem.commit_repo_checkpoint = recording  # type: ignore[method-assign]
    saver = await saver_for(mem, box)
    first = await saver.checkpoint()
    assert first.full and bodies[0]["base"] is None and bodies[0]["removed"] == []

    unchanged = await saver.checkpoint()
    assert not unchanged.committed and len(bodies) == 1  # nothing changed: nothing sent

    (checkout / "notes.txt").write_text("new file\n")
    (checkout / "docs" / "guide.md").unlink()
    (checkout / "copy-of-readme.md").write_bytes((checkout / "README.md").read_bytes())
    mem.calls.clear()
    second = await saver.checkpoint()
    body = bodies[-1]
    assert body["base"] == first.checkpoint_id and not second.full
    assert sorted(m["path"] for m in body["members"]) == ["copy-of-readme.md", "notes.txt"]
    assert body["removed"] == ["docs/guide.md"]
    assert second.uploaded == 1  # the copy's content was saved already
    assert mem.repo(only_binding(mem).workspace_id).current == second.checkpoint_id
    files = mem.repo_files(only_binding(mem).workspace_id)
    assert files["notes.txt"] == b"new file\n" and "docs/guide.md" not in files
    assert body["operationId"].startswith("rcp-")


@pytest.mark.trio
async def test_a_lost_commit_answer_is_replayed_with_the_same_operation(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    saver = await saver_for(mem, box)
    mem.lose_next("commit_repo_checkpoint")
    with caplog.at_level(logging.WARNING), pytest.raises(RepoSaveFailed):
        await saver.checkpoint()
    repo = mem.repo(only_binding(mem).workspace_id)
    assert len(repo.saved) == 1  # applied, answer lost
    again = await saver.checkpoint()
    assert again.committed and again.checkpoint_id == repo.current and len(repo.saved) == 1
    assert [r[0] for r in repo.reports] == ["failed"]


@pytest.mark.trio
async def test_base_mismatch_sends_the_whole_checkpoint(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    saver = await saver_for(mem, box)
    await saver.checkpoint()
    repo = mem.repo(only_binding(mem).workspace_id)
    repo.current = None  # another writer moved the pointer (here: back to nothing)
    (box.repos / "app" / "more.txt").write_text("more\n")
    outcome = await saver.checkpoint()
    assert outcome.committed and outcome.full
    assert "more.txt" in mem.repo_files(repo.binding.workspace_id)
    assert len(mem.repo_files(repo.binding.workspace_id)) > 10


@pytest.mark.trio
async def test_a_stale_lease_fences_the_saver(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    saver = await saver_for(mem, box)
    mem.fail_next(
        "commit_repo_checkpoint",
        exc=ControllerRefused("stale", 409, "stale_lease"),
    )
    with caplog.at_level(logging.WARNING), pytest.raises(RepoSaveFailed):
        await saver.checkpoint()
    assert saver.fenced is not None
    calls = len(mem.calls)
    with caplog.at_level(logging.WARNING), pytest.raises(RepoSaveFailed, match="newer run"):
        await saver.checkpoint()
    assert len(mem.calls) == calls  # nothing more sent
    assert mem.repo(only_binding(mem).workspace_id).current is None


@pytest.mark.trio
async def test_a_superseded_runs_401_fences_every_saver_and_stops_sending(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    savers = RepoSavers(mem, mem.run, box.home, box.state)
    assert await savers.save_all() == 0
    (box.repos / "app" / "late.txt").write_text("late\n")
    superseded = ControllerRefused("The run was superseded", 401, "unauthenticated")
    mem.fail_next("commit_repo_checkpoint", exc=superseded)
    with caplog.at_level(logging.WARNING):
        assert await savers.save_all() == 1
    assert savers.fenced is not None and "superseded" in savers.fenced
    assert "report_repo_state" not in mem.calls  # the controller would refuse it too
    calls = len(mem.calls)
    with pytest.raises(RepoSaveFailed, match="can no longer save"):
        await savers.save_all()
    (saver,) = savers.savers.values()
    with pytest.raises(RepoSaveFailed, match="the run ended or a newer run"):
        await saver.checkpoint()
    assert len(mem.calls) == calls  # nothing more sent
    (row,) = repo_status(box.home, box.state)
    assert row["state"] == "fenced"
    assert "superseded" in row["lastError"]["message"]
    assert "late.txt" not in mem.repo_files(saver.workspace_id)


@pytest.mark.trio
async def test_a_401_on_the_listing_fences_the_savers_status_files(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    assert await RepoSavers(mem, mem.run, box.home, box.state).save_all() == 0
    # A new process of the same run (a restarted unit): no saver made yet.
    savers = RepoSavers(mem, mem.run, box.home, box.state)
    mem.fail_next("list_repos", exc=ControllerRefused("The run has ended", 401, "unauthenticated"))
    with caplog.at_level(logging.WARNING), pytest.raises(ControllerRefused):
        await savers.save_all()
    calls = len(mem.calls)
    with pytest.raises(RepoSaveFailed):
        await savers.save_all()
    assert len(mem.calls) == calls
    (row,) = repo_status(box.home, box.state)
    assert row["state"] == "fenced" and "has ended" in row["lastError"]["message"]
    assert row["lastSave"]["committed"]  # the last good save is still shown


@pytest.mark.trio
@pytest.mark.parametrize("refused", ["get_run", "list_repos"])
async def test_a_fenced_watch_stops_its_cadence_and_skips_the_final_save(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture, refused: str
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    assert await RepoSavers(mem, mem.run, box.home, box.state).save_all() == 0
    mem.fail_next(refused, exc=ControllerRefused("The run has ended", 401, "unauthenticated"))
    calls = len(mem.calls)
    codes: list[int] = []
    with caplog.at_level(logging.WARNING):
        async with trio.open_nursery() as nursery:

            async def run_watch() -> None:
                codes.append(await watch(mem, box.home, box.state, 0.02, ready=ready))

            ready = trio.Event()
            nursery.start_soon(run_watch)
            await ready.wait()
            await trio.sleep(0.5)  # 25 cadences
            os.kill(os.getpid(), signal.SIGTERM)
    assert codes == [4]
    assert len(mem.calls) - calls <= 2  # get_run and at most one listing, then nothing
    (row,) = repo_status(box.home, box.state)
    assert row["state"] == "fenced"


@pytest.mark.trio
async def test_other_refusals_do_not_fence(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    savers = RepoSavers(mem, mem.run, box.home, box.state)
    mem.fail_next("commit_repo_checkpoint", exc=ControllerRefused("no", 403, "forbidden"))
    with caplog.at_level(logging.WARNING):
        assert await savers.save_all() == 1
    assert savers.fenced is None
    assert [r[0] for r in mem.repo(only_binding(mem).workspace_id).reports] == ["failed"]
    assert await savers.save_all() == 0


@pytest.mark.trio
async def test_a_tree_mutated_during_the_scan_is_retried_never_torn(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    (checkout / "data.txt").write_text("v1 " * 1000)
    mutations = []

    def mutate_once(full: str) -> None:
        # Between the read and the re-check of data.txt, once: a deterministic race.
        if full.endswith("/data.txt") and not mutations:
            time.sleep(0.02)
            with open(full, "w") as fh:
                fh.write("v2 " * 1000)
            mutations.append(full)

    saver = await saver_for(mem, box, threads=1, after_read=mutate_once)
    outcome = await saver.checkpoint()
    assert mutations and outcome.attempts == 2
    assert mem.repo_files(only_binding(mem).workspace_id)["data.txt"] == b"v2 " * 1000


@pytest.mark.trio
async def test_a_commit_during_the_scan_is_retried_and_saved_whole(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    """The verify rechecks all of .git: a commit that lands while the working
    tree is read (new objects, a moved ref, a new reflog line) is scanned again."""
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    await trio.sleep(1.1)  # past the racy margin: .git's files are cached, not read again
    saver = await saver_for(mem, box, threads=1)
    assert (await saver.checkpoint()).committed
    (checkout / "data.txt").write_text("data\n")  # the one file the next scan reads
    committed: list[str] = []

    def commit_once(full: str) -> None:
        if full.endswith("/data.txt") and not committed:
            git(checkout, "commit", "-q", "--allow-empty", "-m", "during the scan")
            committed.append(git(checkout, "rev-parse", "HEAD").strip())

    saver.after_read = commit_once
    outcome = await saver.checkpoint()
    assert committed and outcome.attempts == 2
    files = mem.repo_files(only_binding(mem).workspace_id)
    assert files[".git/refs/heads/main"].decode().strip() == committed[0]


@pytest.mark.trio
async def test_a_tree_that_never_settles_fails_visibly_and_commits_nothing(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    (checkout / "busy.txt").write_text("0")
    count = [0]

    def always(full: str) -> None:
        if full.endswith("/busy.txt"):
            count[0] += 1
            time.sleep(0.02)
            (checkout / "busy.txt").write_text(str(count[0]))

    saver = await saver_for(mem, box, threads=1, after_read=always)
    with caplog.at_level(logging.WARNING), pytest.raises(TreeUnstable, match="4 scans"):
        await saver.checkpoint()
    repo = mem.repo(only_binding(mem).workspace_id)
    assert repo.current is None and "commit_repo_checkpoint" not in mem.calls
    assert repo.reports and repo.reports[-1][0] == "failed"
    (row,) = repo_status(box.home, box.state)
    assert row["state"] == "failed" and "kept changing" in row["lastError"]["message"]


@pytest.mark.trio
async def test_a_change_between_scan_and_upload_starts_over(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    big = checkout / "big.bin"
    big.write_bytes(b"a" * 200_000)
    saver = await saver_for(mem, box)
    upload = mem.upload_repo_object
    changed = []

    async def racing_upload(ws: str, frames: Any) -> tuple[str, int]:
        if not changed:  # the file changes after the scan, before its bytes are read
            await trio.sleep(0.02)
            big.write_bytes(b"b" * 200_000)
            changed.append(True)
        return await upload(ws, frames)

    mem.upload_repo_object = racing_upload  # type: ignore[method-assign]
    outcome = await saver.checkpoint()
    assert outcome.attempts == 2
    assert mem.repo_files(only_binding(mem).workspace_id)["big.bin"] == b"b" * 200_000


@pytest.mark.trio
async def test_a_git_lock_refuses_the_checkpoint_until_released(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    saver = await saver_for(mem, box)
    for lock in (".git/index.lock", ".git/refs/heads/main.lock", ".git/packed-refs.lock"):
        (checkout / lock).write_text("")
        with caplog.at_level(logging.WARNING), pytest.raises(GitLockHeld, match=lock):
            await saver.checkpoint()
        assert mem.repo(only_binding(mem).workspace_id).current is None
        (row,) = repo_status(box.home, box.state)
        assert row["state"] == "waiting"
        (checkout / lock).unlink()
    outcome = await saver.checkpoint()
    assert outcome.committed
    assert not any(p.endswith(".lock") for p in mem.repo_files(only_binding(mem).workspace_id))


@pytest.mark.trio
async def test_unsafe_and_unsupported_members(
    tmp_path: Path, origin: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    (checkout / "outside").symlink_to("../../elsewhere")
    (checkout / "into-git").symlink_to(".git/config")
    (checkout / "absolute").symlink_to("/etc/passwd")
    (checkout / "s").mkdir()
    (checkout / "t").mkdir()
    (checkout / "t" / "f.txt").write_text("t's file")
    (checkout / "s" / "b").symlink_to("../t")  # inside: t
    (checkout / "s" / "c").symlink_to("b/../../x")  # lexically x, but through b: outside
    git(checkout, "init", "-q", "nested")
    (checkout / "nested" / "f.txt").write_text("nested repo's file")
    (checkout / "docs" / "guide.md").unlink()
    os.mkfifo(checkout / "docs" / "guide.md")  # a tracked file replaced by a FIFO
    saver = await saver_for(mem, box)
    outcome = await saver.checkpoint()
    reasons = {p.path: p.reason for p in outcome.problems}
    assert reasons == {
        "outside": "symlink_escapes_checkout",
        "into-git": "symlink_into_git_dir",
        "absolute": "symlink_absolute",
        "nested": "nested_repository",
        "s/c": "symlink_escapes_checkout",
        "docs/guide.md": "special_file",
    }
    files = mem.repo_files(only_binding(mem).workspace_id)
    assert not any(p.startswith("nested/") for p in files)
    saved = mem.repo(only_binding(mem).workspace_id).members()
    assert saved["s/b"] == {"path": "s/b", "kind": "symlink", "target": "../t"}
    assert "s/c" not in saved

    # A checkout whose .git is a file (a linked worktree) cannot be saved at all.
    worktree = box.repos / "app-wt"
    git(checkout, "worktree", "add", "-q", str(worktree), "HEAD")
    binding = only_binding(mem)
    other = RepoSaver(mem, mem.run, binding, worktree, None)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckoutUnsupported, match="not a dir"):
        await other.checkpoint()


@pytest.mark.trio
async def test_changes_git_is_told_to_ignore_are_still_saved(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    """The scan trusts nothing Git records about the working tree: a change
    behind assume-unchanged, skip-worktree or core.fileMode=false is saved."""
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    await trio.sleep(1.1)  # past the racy margin: the clone's files are cached
    saver = await saver_for(mem, box)
    assert (await saver.checkpoint()).committed
    git(checkout, "update-index", "--assume-unchanged", "README.md")
    git(checkout, "update-index", "--skip-worktree", "src/main.py")
    git(checkout, "config", "core.fileMode", "false")
    (checkout / "README.md").write_text("# hidden by assume-unchanged\n")
    (checkout / "src" / "main.py").write_text("print('hidden by skip-worktree')\n")
    (checkout / "docs" / "guide.md").chmod(0o755)  # hidden by core.fileMode=false
    assert git(checkout, "status", "--porcelain") == ""  # Git itself sees nothing
    outcome = await saver.checkpoint()
    assert outcome.committed and outcome.changed >= 3
    workspace = only_binding(mem).workspace_id
    files = mem.repo_files(workspace)
    assert files["README.md"] == b"# hidden by assume-unchanged\n"
    assert files["src/main.py"] == b"print('hidden by skip-worktree')\n"
    assert mem.repo(workspace).members()["docs/guide.md"]["executable"] is True


@pytest.mark.trio
async def test_metadata_cache_skips_unchanged_files(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    checkout = box.repos / "app"
    for i in range(50):
        (checkout / f"file{i}.txt").write_text(f"content {i}\n")
    await trio.sleep(1.1)  # past the racy margin: files this old are cached
    saver = await saver_for(mem, box)
    first = await saver.checkpoint()
    files = first.scan.hashed + first.scan.cache_hits
    assert first.scan.hashed > 50

    (checkout / "file7.txt").write_text("changed\n")
    second = await saver.checkpoint()
    assert second.scan.hashed == 1 and second.scan.cache_hits == files - 1
    assert second.changed == 1

    # A fresh process (the one-shot command) loads the saved cache.
    again = await saver_for(mem, box)
    await trio.sleep(1.1)
    third = await again.checkpoint()
    assert not third.committed and third.scan.hashed <= 1


@pytest.mark.trio
async def test_restore_refuses_a_corrupt_object_and_publishes_nothing(
    tmp_path: Path, mem: MemoryBridgeClient
) -> None:
    box = Sandbox(tmp_path / "a")
    await prepare_all(mem, box.home)
    await (await saver_for(mem, box)).checkpoint()
    ws = only_binding(mem).workspace_id
    readme = next(m for p, m in mem.repo(ws).members().items() if p == "README.md")
    mem.objects[readme["digest"]] = b"forged bytes"

    fresh = Sandbox(tmp_path / "b")
    listing = await mem.list_repos()
    result = await prepare_repo(mem, mem.run, listing.repos[0], fresh.repos)
    assert result.mode == "failed" and "digest" in str(result.message)
    assert sorted(os.listdir(fresh.repos)) == []


@pytest.mark.trio
async def test_setup_failure_is_recorded_and_not_retried_on_warm_starts(
    tmp_path: Path, origin: Path, setup_count: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mem = MemoryBridgeClient()
    mem.add_repo(str(origin), setup_command='echo ran >> "$SETUP_COUNT"; echo oops >&2; exit 3')
    box = Sandbox(tmp_path)
    caplog.set_level(logging.WARNING)
    _, _, results = await prepare_all(mem, box.home)
    assert [(r.mode, r.setup, r.ok) for r in results] == [("clone", "failed", False)]
    assert "setup exited with 3" in caplog.text
    checkout = box.repos / "app"
    record = json.loads((checkout / SETUP_RECORD).read_text())
    assert record["state"] == "failed" and record["exitCode"] == 3
    assert "oops" in (checkout / ".git" / "fsagent" / "setup.log").read_text()

    _, _, results = await prepare_all(mem, box.home)
    assert [(r.mode, r.setup) for r in results] == [("warm", "failed")]
    assert runs_of_setup(setup_count) == 1
    _, _, results = await prepare_all(mem, box.home, retry_setup=True)
    assert runs_of_setup(setup_count) == 2


@pytest.mark.trio
async def test_savers_cover_prepared_checkouts_only(
    tmp_path: Path, origin: Path, mem: MemoryBridgeClient
) -> None:
    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    later = mem.add_repo(str(origin), "later")  # added after the start: prepared next time
    savers = RepoSavers(mem, mem.run, box.home, box.state)
    assert [s.binding.name for s in await savers.refresh()] == ["app"]
    assert await savers.save_all() == 0
    assert mem.repo(later).current is None


def test_only_git_object_and_pack_names_count_as_immutable() -> None:
    from fsagent.repos.capture import git_immutable

    obj = "ab" + "c" * 38
    pack = "pack-" + "0" * 40
    assert git_immutable(f".git/objects/{obj[:2]}/{obj[2:]}")
    assert git_immutable(f".git/objects/pack/{pack}.pack")
    assert git_immutable(f".git/objects/pack/{pack}.idx")
    for mutable in (
        ".git/index",
        ".git/HEAD",
        ".git/refs/heads/main",
        ".git/objects/info/commit-graph",
        ".git/objects/pack/multi-pack-index",
        f".git/objects/pack/{pack}.keep",
        f".git/objects/{obj[:2]}/tmp_obj_x",
        f"src/.git/objects/{obj[:2]}/{obj[2:]}",
        f".git/objects/{obj[:2]}/{obj[2:].upper()}",
    ):
        assert not git_immutable(mutable), mutable


def test_restore_fetches_large_objects_a_few_at_a_time() -> None:
    from common.repos import FETCH_BATCH_MAX
    from fsagent.repos.prepare import FETCH_BATCH_BYTES, fetch_batches

    def member(size: int) -> list[dict[str, Any]]:
        return [{"byteSize": size}]

    small = {f"{i:064x}": member(100) for i in range(FETCH_BATCH_MAX + 5)}
    groups = fetch_batches(small)
    assert [len(g) for g in groups] == [FETCH_BATCH_MAX, 5]
    big = {f"{i:064x}": member(FETCH_BATCH_BYTES // 3 + 1) for i in range(5)}
    huge = {"f" * 64: member(FETCH_BATCH_BYTES * 4)}
    groups = fetch_batches({**big, **huge})
    assert [len(g) for g in groups] == [2, 2, 1, 1]
    assert groups[-1] == ["f" * 64]
    assert sorted(d for g in groups for d in g) == sorted({**big, **huge})


@pytest.mark.trio
async def test_read_batch_writes_and_verifies_members_of_any_size(tmp_path: Path) -> None:
    import hashlib

    from common.bridge import encode_batch
    from fsagent.bridge.base import BadBatch
    from fsagent.bridge.http import read_batch

    datas = [b"", b"small", os.urandom(9 << 20), b"x" * 70_000]  # the big one spans 3 frames
    body = encode_batch(datas)

    async def chunks(data: bytes, size: int = 100_000) -> Any:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    got = await read_batch(chunks(body), len(datas), lambda i: tmp_path / f"m{i}")
    assert got == [(hashlib.sha256(d).hexdigest(), len(d)) for d in datas]
    assert [(tmp_path / f"m{i}").read_bytes() for i in range(len(datas))] == datas

    with pytest.raises(BadBatch, match="ended early"):
        await read_batch(chunks(body[:-10]), len(datas), lambda i: tmp_path / f"t{i}")
    with pytest.raises(BadBatch, match="members"):
        await read_batch(chunks(body), 3, lambda i: tmp_path / f"c{i}")
    forged = bytearray(body)
    forged[-20] ^= 0xFF  # inside the last member's frame
    with pytest.raises(BadBatch):
        await read_batch(chunks(bytes(forged)), len(datas), lambda i: tmp_path / f"f{i}")
    with pytest.raises(BadBatch, match="after the last"):
        await read_batch(chunks(body + b"junk"), len(datas), lambda i: tmp_path / f"j{i}")


@pytest.mark.trio
async def test_a_git_failure_is_a_visible_failed_save(
    tmp_path: Path, mem: MemoryBridgeClient, caplog: pytest.LogCaptureFixture
) -> None:
    from fsagent.errors import GitCommandFailed

    box = Sandbox(tmp_path)
    await prepare_all(mem, box.home)
    (box.repos / "app" / ".git" / "index").write_bytes(b"DIRC not really an index")
    savers = RepoSavers(mem, mem.run, box.home, box.state)
    with caplog.at_level(logging.WARNING):
        assert await savers.save_all() == 1  # counted, not raised: the watch goes on
        (saver,) = savers.savers.values()
        with pytest.raises(GitCommandFailed, match="git ls-files"):
            await saver.checkpoint()
    (row,) = repo_status(box.home, box.state)
    assert row["state"] == "failed" and "index" in row["lastError"]["message"]
    assert mem.repo(only_binding(mem).workspace_id).current is None
