"""Real Git repositories for the repository tests and benchmarks: a local bare
origin with history, checkouts with every kind of local state, and the
checks a restored checkout must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsagent.bridge.http import HttpBridgeClient
from tests.support.bridge import Run
from tests.support.constants import REPO
from tests.support.controller import Tenant

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "Test Author",
    "GIT_AUTHOR_EMAIL": "author@example.com",
    "GIT_COMMITTER_NAME": "Test Author",
    "GIT_COMMITTER_EMAIL": "author@example.com",
}


def git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    """Run git in ``cwd`` (an identity set, no user or system config); its stdout."""
    env = {
        **os.environ,
        **GIT_IDENTITY,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
    }
    proc = subprocess.run(
        ["git", "-c", "init.defaultBranch=main", "-c", "protocol.file.allow=always", *args],
        cwd=cwd,
        env=env,
        input=input,
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"git {' '.join(args)} failed in {cwd}: {proc.stderr.decode(errors='replace')}"
        )
    return proc.stdout.decode(errors="replace")


def make_origin(where: Path, name: str = "app") -> Path:
    """A bare repository ``where/<name>.git`` with two commits on ``main`` and a
    ``feature`` branch: a README, an executable script, a symlink, a
    ``.gitignore`` that ignores ``node_modules/`` and ``*.log``."""
    work = where / f"{name}-seed"
    work.mkdir(parents=True)
    git(work, "init", "-q")
    (work / "README.md").write_text("# app\n")
    (work / "run.sh").write_text("#!/bin/sh\necho run\n")
    (work / "run.sh").chmod(0o755)
    (work / "docs").mkdir()
    (work / "docs" / "guide.md").write_text("guide\n")
    (work / "guide-link").symlink_to("docs/guide.md")
    (work / ".gitignore").write_text("node_modules/\n*.log\n")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "first")
    (work / "src").mkdir()
    (work / "src" / "main.py").write_text("print('hello')\n")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "second")
    git(work, "branch", "feature")
    bare = where / f"{name}.git"
    git(where, "clone", "-q", "--bare", str(work), str(bare))
    return bare


@dataclass
class LocalState:
    """What a test does to a checkout, to find it all again after a restore."""

    commit: str
    staged_path: str = "src/staged.py"
    staged_text: str = "staged = True\n"
    untracked_path: str = "results/result.txt"
    untracked_text: str = "the result\n"
    edited_path: str = "README.md"
    edited_text: str = "# app, edited but not staged\n"
    exec_path: str = "tools/build.sh"
    link_path: str = "latest"
    link_target: str = "results/result.txt"
    branch: str = "work"


def make_local_state(checkout: Path) -> LocalState:
    """A local branch with a new commit, a staged file, an unstaged edit, an
    untracked result, a new executable and an in-checkout symlink, plus
    ignored dependencies (which a checkpoint must leave out)."""
    git(checkout, "checkout", "-q", "-b", "work")
    (checkout / "tools").mkdir()
    (checkout / "tools" / "build.sh").write_text("#!/bin/sh\nmake\n")
    (checkout / "tools" / "build.sh").chmod(0o755)
    git(checkout, "add", "tools/build.sh")
    git(checkout, "commit", "-q", "-m", "local commit")
    commit = git(checkout, "rev-parse", "HEAD").strip()
    state = LocalState(commit)
    (checkout / state.staged_path).write_text(state.staged_text)
    git(checkout, "add", state.staged_path)
    (checkout / state.edited_path).write_text(state.edited_text)
    (checkout / "results").mkdir()
    (checkout / state.untracked_path).write_text(state.untracked_text)
    (checkout / state.link_path).symlink_to(state.link_target)
    (checkout / "node_modules" / "dep").mkdir(parents=True, exist_ok=True)
    (checkout / "node_modules" / "dep" / "index.js").write_text("module.exports = 1\n")
    (checkout / "debug.log").write_text("ignored\n")
    return state


def assert_restored(checkout: Path, state: LocalState, origin_url: str) -> None:
    """Everything :func:`make_local_state` did is there again, and nothing ignored."""
    assert git(checkout, "rev-parse", "HEAD").strip() == state.commit
    assert git(checkout, "symbolic-ref", "--short", "HEAD").strip() == state.branch
    assert git(checkout, "show", f":{state.staged_path}") == state.staged_text
    assert git(checkout, "diff", "--cached", "--name-only").split() == [state.staged_path]
    assert (checkout / state.edited_path).read_text() == state.edited_text
    assert git(checkout, "diff", "--name-only").split() == [state.edited_path]
    assert (checkout / state.untracked_path).read_text() == state.untracked_text
    assert os.access(checkout / state.exec_path, os.X_OK)
    assert os.readlink(checkout / state.link_path) == state.link_target
    assert not (checkout / "node_modules" / "dep" / "index.js").exists()  # ignored: not saved
    assert not (checkout / "debug.log").exists()
    git(checkout, "fsck", "--strict", "--no-dangling")
    assert git(checkout, "remote", "get-url", "origin").strip() == origin_url
    status = git(checkout, "status", "--porcelain").splitlines()
    assert sorted(status) == sorted(
        [
            f"A  {state.staged_path}",
            f" M {state.edited_path}",
            "?? latest",
            "?? results/",
        ]
    ), status


@dataclass
class RepoTask:
    """A project with workspaces on a real controller, and one task of it."""

    tenant: Tenant
    project: str
    task: str
    agent: str

    def add_workspace(
        self,
        repo_url: str,
        *,
        name: str | None = None,
        ref: str | None = None,
        primary: bool = False,
        setup: str | None = None,
    ) -> str:
        """``controller admin add-workspace``; the workspace id (bound at the next run start)."""
        args = ["add-workspace", self.project, "--repo-url", repo_url]
        if name:
            args += ["--name", name]
        if ref:
            args += ["--ref", ref]
        if primary:
            args.append("--primary")
        if setup:
            args += ["--setup", setup]
        return str(self.tenant.controller.admin(*args)["workspace_id"])

    def set_branch(self, branch: str) -> None:
        self.tenant.controller.admin("set-task-branch", self.task, branch)

    def start_run(self, sandbox: str | None = None) -> Run:
        """``controller admin start-run`` for the task (binds its workspaces)."""
        args = ["start-run", self.tenant.company_id, "--agent", self.agent, "--task", self.task]
        if sandbox:
            args += ["--sandbox", sandbox]
        out = self.tenant.controller.admin(*args)
        return Run(
            self.tenant,
            out["run_id"],
            out["token"],
            out["lease_epoch"],
            self.agent,
            self.task,
            self.project,
        )

    def client(self, run: Run) -> HttpBridgeClient:
        return HttpBridgeClient(self.tenant.controller.url, run.token, retry_deadline=30)

    def people_repos(self) -> dict[str, dict[str, Any]]:
        """The task's repositories as people see them (last save, state, error), by name."""
        with self.tenant.client() as c:
            r = c.get(f"/api/companies/{self.tenant.company_id}/tasks/{self.task}/repos")
        assert r.status_code == 200, r.text
        return {row["name"]: row for row in r.json()["repos"]}


def new_repo_task(tenant: Tenant) -> RepoTask:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, f"p-{uuid.uuid4().hex[:6]}")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    return RepoTask(tenant, project, task, agent)


def checkout_snapshot(root: Path) -> dict[str, tuple[str, int, int, bytes]]:
    """Every path under ``root`` (``.git`` included, links not followed) with
    its kind, mode, mtime and contents (a link's target): what must be the
    same when nothing was allowed to touch the checkout."""
    out: dict[str, tuple[str, int, int, bytes]] = {}
    paths = [root]
    for top, dirs, files in os.walk(root):  # links to directories are not followed
        paths += [Path(top, name) for name in dirs + files]
    for path in paths:
        out[str(path.relative_to(root))] = path_state(path)
    return out


def path_state(path: Path) -> tuple[str, int, int, bytes]:
    """One path's kind, mode, mtime and contents (a link's target; a directory: none)."""
    st = path.lstat()
    if path.is_symlink():
        return "symlink", st.st_mode, st.st_mtime_ns, os.readlink(path).encode()
    if path.is_dir():
        return "dir", st.st_mode, st.st_mtime_ns, b""
    return "file", st.st_mode, st.st_mtime_ns, path.read_bytes()


class Sandbox:
    """One sandbox's home and state root, and the token file of its current run."""

    def __init__(self, root: Path, task: RepoTask) -> None:
        self.root = root
        self.task = task
        self.home = root / "home"
        self.state = root / "state"
        root.mkdir(parents=True, exist_ok=True)

    def start(self, run: Run) -> None:
        """A new run of the sandbox: its token replaces the last one."""
        (self.root / "token").write_text(run.token)
        (self.root / "token").chmod(0o600)

    def argv(self, *args: str) -> list[str]:
        """The command line of ``fsagent repos ...`` for this sandbox."""
        return [sys.executable, "-m", "fsagent.cli", "repos", *args, "--home", str(self.home),
                "--state-root", str(self.state), "--controller", self.task.tenant.controller.url,
                "--token-file", str(self.root / "token")]  # fmt: skip

    def repos(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``fsagent repos ...`` in a process of its own."""
        return subprocess.run(
            self.argv(*args), capture_output=True, text=True, cwd=REPO, timeout=timeout,
            check=False,
        )  # fmt: skip

    def prepare(self) -> dict[str, tuple[str, str]]:
        """``fsagent repos prepare``; (mode, setup) by checkout name."""
        done = self.repos("prepare", "--json")
        assert done.returncode == 0, done.stderr
        return {r["name"]: (r["mode"], r["setup"]) for r in json.loads(done.stdout)["repos"]}

    def checkpoint(self) -> dict[str, dict[str, Any]]:
        """``fsagent repos checkpoint`` of every prepared checkout; results by name."""
        done = self.repos("checkpoint", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        return {r["name"]: r for r in json.loads(done.stdout)["repos"]}
