"""``WorktreeLister`` skips ``git ls-files`` when nothing it depends on changed.

Every test works on a real checkout with real Git: the lister's answer must
always equal :func:`worktree_paths` run at that moment, whatever changed and
however the change tries to hide (mtimes put back, changes made within the
racy margin, changes outside the working tree that Git still reads). Where
nothing Git reads changed, the lister must not run Git at all.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from fsagent.repos.capture import WorktreeLister, worktree_paths
from fsagent.scan import listing
from fsagent.scan.engine import Key, Problem, lstat_keys
from tests.support.gitrepos import git

MARGIN = 100_000_000
"""The racy margin the tests give the lister (0.1 s), to keep them fast."""

TRACKED = [
    ".gitignore",
    "README.md",
    "docs/guide.md",
    "src/app.py",
    "src/lib/deep/core.py",
    "src/lib/util.py",
]


def settle() -> None:
    """Sleep just past the margin: what changed before is no longer racy."""
    time.sleep(MARGIN / 1e9 + 0.03)


@pytest.fixture(autouse=True)
def isolated_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Git reads no configuration of this machine: a private HOME and XDG
    config directory, no system config, no GIT_* variables from outside."""
    for key in list(os.environ):
        if key.startswith("GIT_"):
            monkeypatch.delenv(key)
    home = tmp_path / "home"
    home.mkdir()
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return home


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def repo(tmp_path: Path) -> Path:
    """A checkout: tracked files in nested directories, a ``.gitignore``
    (``*.log``, ``build/``), an ignored directory with files, an empty
    directory, a directory holding only ignored files, untracked files.
    Settled: nothing in it is racy any more."""
    checkout = tmp_path / "work"
    checkout.mkdir()
    git(checkout, "init", "-q")
    write(checkout / "README.md", "# work\n")
    write(checkout / "src" / "app.py", "print('app')\n")
    write(checkout / "src" / "lib" / "util.py", "X = 1\n")
    write(checkout / "src" / "lib" / "deep" / "core.py", "Y = 2\n")
    write(checkout / "docs" / "guide.md", "guide\n")
    write(checkout / ".gitignore", "*.log\nbuild/\n")
    git(checkout, "add", "-A")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    write(checkout / "build" / "out.bin", "binary\n")
    write(checkout / "build" / "sub" / "obj.o", "object\n")
    (checkout / "empty").mkdir()
    write(checkout / "logs" / "a.log", "a\n")
    write(checkout / "logs" / "b.log", "b\n")
    write(checkout / "debug.log", "debug\n")
    write(checkout / "notes.txt", "notes\n")
    write(checkout / "scratch" / "tmp.txt", "scratch\n")
    write(checkout / ".git" / "info" / "exclude", "# local excludes\n")
    settle()
    return checkout


def check(lister: WorktreeLister, checkout: Path) -> list[str]:
    """The lister's answer equals Git's answer now; the listed paths."""
    paths, problems = lister()
    want_paths, want_problems = worktree_paths(checkout)
    assert paths == want_paths
    assert problems == want_problems
    return paths


def settled_lister(checkout: Path) -> WorktreeLister:
    """A lister that listed once and then, after settling, skipped Git."""
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    first = check(lister, checkout)
    assert lister.ran == 1
    settle()
    assert lister()[0] == first
    assert lister.ran == 1
    return lister


def put_back(path: Path, st: os.stat_result) -> None:
    """The atime and mtime ``path`` had at ``st`` (its ctime moves regardless)."""
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def rewrite_in_place(path: Path, text: str) -> None:
    """Overwrite ``path`` without replacing it (same inode), mtime put back."""
    st = os.lstat(path)
    with open(path, "r+") as f:
        f.write(text)
        f.truncate()
    put_back(path, st)


def test_nothing_changed_skips_git_and_returns_the_same_answer(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    first = lister()
    assert lister.ran == 1
    assert first == worktree_paths(checkout)
    assert sorted(first[0]) == sorted([*TRACKED, "notes.txt", "scratch/tmp.txt"])
    assert first[1] == []
    settle()
    for _ in range(3):
        again = lister()
        assert again == first
        assert again[0] is first[0]
        assert lister.ran == 1
    assert worktree_paths(checkout) == first


def test_tracked_file_content_modified_still_skips(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    before = lister()[0]
    (checkout / "src" / "app.py").write_text("print('changed, and longer')\n")
    (checkout / "notes.txt").write_text("edited notes\n")
    assert check(lister, checkout) == before
    settle()
    assert check(lister, checkout) == before
    assert lister.ran == 1


def test_new_untracked_file_in_existing_directory(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    lib = checkout / "src" / "lib"
    st = os.lstat(lib)
    write(lib / "new.py", "new\n")
    put_back(lib, st)
    assert "src/lib/new.py" in check(lister, checkout)
    settle()
    assert "src/lib/new.py" in check(lister, checkout)


def test_new_file_in_new_nested_directories(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    st = os.lstat(checkout)
    write(checkout / "a" / "b" / "c" / "new.txt", "new\n")
    put_back(checkout, st)
    assert "a/b/c/new.txt" in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    deepest = checkout / "a" / "b" / "c"
    st = os.lstat(deepest)
    write(deepest / "second.txt", "second\n")
    put_back(deepest, st)
    paths = check(lister, checkout)
    assert "a/b/c/new.txt" in paths
    assert "a/b/c/second.txt" in paths


def test_new_file_in_empty_directory(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    empty = checkout / "empty"
    st = os.lstat(empty)
    write(empty / "first.txt", "first\n")
    put_back(empty, st)
    assert "empty/first.txt" in check(lister, checkout)


def test_new_file_in_directory_holding_only_ignored_files(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    assert not [p for p in lister()[0] if p.startswith("logs/")]
    logs = checkout / "logs"
    st = os.lstat(logs)
    write(logs / "README.txt", "about the logs\n")
    put_back(logs, st)
    assert [p for p in check(lister, checkout) if p.startswith("logs/")] == ["logs/README.txt"]


def test_new_file_in_ignored_directory_stays_out(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    before = lister()[0]
    for rel in ("build/new.txt", "build/sub/new.txt", "build/sub/deeper/new.txt"):
        parent = (checkout / rel).parent
        st = os.lstat(parent) if parent.exists() else None
        write(checkout / rel, "new\n")
        if st is not None:
            put_back(parent, st)
        assert check(lister, checkout) == before
    settle()
    assert check(lister, checkout) == before


def test_gitignore_edited_in_place(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    assert "debug.log" not in lister()[0]
    gitignore = checkout / ".gitignore"
    old = gitignore.read_text()
    new = old.replace("*.log", "#.log")
    assert len(new) == len(old)
    rewrite_in_place(gitignore, new)
    paths = check(lister, checkout)
    assert {"debug.log", "logs/a.log", "logs/b.log"} <= set(paths)
    settle()
    rewrite_in_place(gitignore, old)
    paths = check(lister, checkout)
    assert "debug.log" not in paths


def test_gitignore_created_in_subdirectory(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    assert "scratch/tmp.txt" in lister()[0]
    scratch = checkout / "scratch"
    st = os.lstat(scratch)
    write(scratch / ".gitignore", "tmp.txt\n")
    put_back(scratch, st)
    paths = check(lister, checkout)
    assert "scratch/tmp.txt" not in paths
    assert "scratch/.gitignore" in paths


def test_info_exclude_edited(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    assert "notes.txt" in lister()[0]
    exclude = checkout / ".git" / "info" / "exclude"
    rewrite_in_place(exclude, "notes.txt\n")
    assert "notes.txt" not in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    rewrite_in_place(exclude, "# nothing\n")
    assert "notes.txt" in check(lister, checkout)


def test_index_changes(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    index = checkout / ".git" / "index"
    st = os.lstat(index)
    git(checkout, "add", "-f", "debug.log")
    put_back(index, st)
    assert "debug.log" in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    st = os.lstat(index)
    git(checkout, "rm", "-q", "--cached", "debug.log")
    put_back(index, st)
    assert "debug.log" not in check(lister, checkout)
    settle()
    # A tracked file that an ignore rule matches stays listed until untracked.
    write(checkout / ".gitignore", "*.log\nbuild/\ndocs/\n")
    assert "docs/guide.md" in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    st = os.lstat(index)
    git(checkout, "rm", "-q", "--cached", "docs/guide.md")
    put_back(index, st)
    assert "docs/guide.md" not in check(lister, checkout)


def test_directory_renamed(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    st = os.lstat(checkout)
    os.rename(checkout / "scratch", checkout / "scrap")
    put_back(checkout, st)
    paths = check(lister, checkout)
    assert "scrap/tmp.txt" in paths
    assert "scratch/tmp.txt" not in paths
    settle()
    check(lister, checkout)
    settle()
    src = checkout / "src"
    st = os.lstat(src)
    os.rename(src / "lib", src / "library")
    put_back(src, st)
    paths = check(lister, checkout)
    assert "src/library/util.py" in paths
    assert "src/library/deep/core.py" in paths
    assert "src/lib/util.py" in paths  # still in the index


def test_untracked_file_deleted(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    scratch = checkout / "scratch"
    st = os.lstat(scratch)
    (scratch / "tmp.txt").unlink()
    put_back(scratch, st)
    assert "scratch/tmp.txt" not in check(lister, checkout)
    settle()
    st = os.lstat(checkout)
    (checkout / "notes.txt").unlink()
    put_back(checkout, st)
    assert "notes.txt" not in check(lister, checkout)


def test_global_excludes_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    excludes_one = tmp_path / "excludes-1"
    excludes_one.write_text("# none yet\n")
    excludes_two = tmp_path / "excludes-2"
    excludes_two.write_text("scratch/\n")
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(f"[core]\n\texcludesFile = {excludes_one}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    assert {"notes.txt", "scratch/tmp.txt"} <= set(lister()[0])
    rewrite_in_place(excludes_one, "notes.txt\n")
    paths = check(lister, checkout)
    assert "notes.txt" not in paths
    assert "scratch/tmp.txt" in paths
    settle()
    check(lister, checkout)
    settle()
    # Same size: only the name of the excludes file changes.
    rewrite_in_place(gitconfig, f"[core]\n\texcludesFile = {excludes_two}\n")
    paths = check(lister, checkout)
    assert "notes.txt" in paths
    assert "scratch/tmp.txt" not in paths


def test_default_global_files_created_later(tmp_path: Path, isolated_git: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    # $XDG_CONFIG_HOME/git/ignore: read by Git without any configuration.
    write(tmp_path / "xdg" / "git" / "ignore", "notes.txt\n")
    assert "notes.txt" not in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    # ~/.gitconfig naming another excludes file (with a ~ path).
    write(isolated_git / "my-ignore", "scratch/\n")
    write(isolated_git / ".gitconfig", "[core]\n\texcludesFile = ~/my-ignore\n")
    paths = check(lister, checkout)
    assert "scratch/tmp.txt" not in paths
    assert "notes.txt" in paths
    settle()
    check(lister, checkout)
    settle()
    rewrite_in_place(isolated_git / "my-ignore", "README.md\n")  # tracked: no effect
    assert "scratch/tmp.txt" in check(lister, checkout)
    settle()
    # $XDG_CONFIG_HOME/git/config, read along with ~/.gitconfig.
    write(tmp_path / "xdg" / "git" / "config", "[core]\n\texcludesFile = ~/xdg-ignore\n")
    write(isolated_git / ".gitconfig", "# nothing\n")
    write(isolated_git / "xdg-ignore", "notes.txt\n")
    assert "notes.txt" not in check(lister, checkout)


def test_repository_config_excludes_file(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    excludes = tmp_path / "repo-excludes"
    excludes.write_text("notes.txt\n")
    config = checkout / ".git" / "config"
    st = os.lstat(config)
    with open(config, "a") as f:
        f.write(f"[core]\n\texcludesFile = {excludes}\n")
    put_back(config, st)
    assert "notes.txt" not in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    rewrite_in_place(excludes, "scratch/\n")
    paths = check(lister, checkout)
    assert "notes.txt" in paths
    assert "scratch/tmp.txt" not in paths


def test_config_include_runs_git_every_time(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    extra = checkout / ".git" / "extra.config"
    extra.write_text("# nothing yet\n")
    git(checkout, "config", "include.path", "extra.config")
    settle()
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    check(lister, checkout)
    assert lister.ran == 1
    settle()
    check(lister, checkout)
    assert lister.ran == 2
    check(lister, checkout)
    assert lister.ran == 3
    excludes = tmp_path / "included-excludes"
    excludes.write_text("notes.txt\n")
    rewrite_in_place(extra, f"[core]\n\texcludesFile = {excludes}\n")
    assert "notes.txt" not in check(lister, checkout)
    settle()
    rewrite_in_place(excludes, "scratch/\n")
    paths = check(lister, checkout)
    assert "notes.txt" in paths
    assert "scratch/tmp.txt" not in paths


def test_config_include_if_runs_git_every_time(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    extra = tmp_path / "conditional.config"
    extra.write_text("# nothing yet\n")
    git(checkout, "config", f"includeIf.gitdir:{checkout}/.git.path", str(extra))
    settle()
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    check(lister, checkout)
    settle()
    check(lister, checkout)
    check(lister, checkout)
    assert lister.ran == 3
    excludes = tmp_path / "conditional-excludes"
    excludes.write_text("notes.txt\n")
    rewrite_in_place(extra, f"[core]\n\texcludesFile = {excludes}\n")
    assert "notes.txt" not in check(lister, checkout)


def test_global_config_include_runs_git_every_time(tmp_path: Path, isolated_git: Path) -> None:
    write(isolated_git / ".gitconfig", "[include]\n\tpath = ~/more.config\n")
    checkout = repo(tmp_path)
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    check(lister, checkout)
    settle()
    check(lister, checkout)
    assert lister.ran == 2
    write(isolated_git / "ignore-notes", "notes.txt\n")
    write(isolated_git / "more.config", "[core]\n\texcludesFile = ~/ignore-notes\n")
    assert "notes.txt" not in check(lister, checkout)


def test_fsmonitor_runs_git_every_time(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    hook = tmp_path / "fsmonitor-hook"
    hook.write_text("#!/bin/sh\nexit 1\n")
    hook.chmod(0o755)
    git(checkout, "config", "core.fsmonitor", str(hook))
    settle()
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    check(lister, checkout)
    settle()
    check(lister, checkout)
    check(lister, checkout)
    assert lister.ran == 3


def test_nested_repository_runs_git_every_time(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    nested = checkout / "vendor" / "sub"
    nested.mkdir(parents=True)
    git(nested, "init", "-q")
    write(nested / "file.txt", "inside\n")
    paths, problems = lister()
    assert lister.ran == 2
    assert (paths, problems) == worktree_paths(checkout)
    assert problems == [Problem("vendor/sub", "nested_repository")]
    assert not [p for p in paths if p.startswith("vendor/")]
    settle()
    check(lister, checkout)
    assert lister.ran == 3
    check(lister, checkout)
    assert lister.ran == 4
    shutil.rmtree(checkout / "vendor")
    paths, problems = lister()
    assert problems == []
    assert (paths, problems) == worktree_paths(checkout)


def test_gitignore_not_a_regular_file_runs_git_every_time(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    rules = tmp_path / "rules"
    rules.write_text("tmp.txt\n")
    (checkout / "scratch" / ".gitignore").symlink_to(rules)
    settle()
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    check(lister, checkout)
    settle()
    check(lister, checkout)
    check(lister, checkout)
    assert lister.ran == 3
    rewrite_in_place(rules, "nothing\n")
    check(lister, checkout)


def test_changes_within_the_margin(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    scratch = checkout / "scratch"
    for i in range(4):
        lister()
        write(scratch / f"quick-{i}-a.txt", "a\n")
        write(scratch / f"quick-{i}-b.txt", "b\n")
        paths = check(lister, checkout)
        assert {f"quick-{i}-a.txt", f"quick-{i}-b.txt"} <= {
            p.removeprefix("scratch/") for p in paths
        }
        (scratch / f"quick-{i}-a.txt").unlink()
        paths = check(lister, checkout)
        assert f"scratch/quick-{i}-a.txt" not in paths
    # The same, hiding behind a restored mtime, with one settled round between.
    settle()
    check(lister, checkout)
    settle()
    st = os.lstat(scratch)
    lister()
    write(scratch / "hidden-1.txt", "1\n")
    write(scratch / "hidden-2.txt", "2\n")
    put_back(scratch, st)
    paths = check(lister, checkout)
    assert {"scratch/hidden-1.txt", "scratch/hidden-2.txt"} <= set(paths)
    write(scratch / "hidden-3.txt", "3\n")
    put_back(scratch, st)
    assert "scratch/hidden-3.txt" in check(lister, checkout)
    settle()
    assert "scratch/hidden-3.txt" in check(lister, checkout)


def test_full_always_runs_git(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    want = worktree_paths(checkout)
    for n in range(3):
        assert lister(full=True) == want
        assert lister.ran == 2 + n
    settle()
    assert lister() == want
    assert lister.ran == 4


def test_directory_replaced_by_symlink(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "outside.txt", "outside\n")
    write(elsewhere / "nested" / "deep.txt", "deep\n")
    st = os.lstat(checkout)
    shutil.rmtree(checkout / "docs")
    (checkout / "docs").symlink_to(elsewhere, target_is_directory=True)
    put_back(checkout, st)
    paths = check(lister, checkout)
    assert "docs" in paths  # the symlink, untracked
    assert "docs/guide.md" in paths  # still in the index
    assert "docs/outside.txt" not in paths
    settle()
    check(lister, checkout)
    settle()
    write(elsewhere / "later.txt", "later\n")
    assert "docs/later.txt" not in check(lister, checkout)
    settle()
    # And back: a real directory again, with new content.
    (checkout / "docs").unlink()
    write(checkout / "docs" / "fresh.md", "fresh\n")
    paths = check(lister, checkout)
    assert "docs/fresh.md" in paths
    assert "docs" not in paths


def test_tracked_directory_removed(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    st = os.lstat(checkout / "src")
    shutil.rmtree(checkout / "src" / "lib")
    put_back(checkout / "src", st)
    paths = check(lister, checkout)
    assert "src/lib/util.py" in paths  # tracked: listed from the index
    settle()
    st = os.lstat(checkout)
    shutil.rmtree(checkout / "scratch")
    put_back(checkout, st)
    assert "scratch/tmp.txt" not in check(lister, checkout)


def test_environment_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    excludes = tmp_path / "env-excludes"
    excludes.write_text("notes.txt\n")
    other = tmp_path / "other-gitconfig"
    other.write_text(f"[core]\n\texcludesFile = {excludes}\n")
    settle()
    assert "notes.txt" in check(lister, checkout)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(other))
    assert "notes.txt" not in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    monkeypatch.delenv("GIT_CONFIG_GLOBAL")
    assert "notes.txt" in check(lister, checkout)
    settle()
    # A variable Git reads without any file: the index moved elsewhere.
    alt_index = tmp_path / "alt-index"
    monkeypatch.setenv("GIT_INDEX_FILE", str(alt_index))
    paths = check(lister, checkout)
    assert "README.md" in paths  # untracked now, yet listed
    assert "debug.log" not in paths


def test_index_file_named_by_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = repo(tmp_path)
    alt_index = tmp_path / "alt-index"
    shutil.copyfile(checkout / ".git" / "index", alt_index)
    monkeypatch.setenv("GIT_INDEX_FILE", str(alt_index))
    settle()
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    assert "debug.log" not in check(lister, checkout)
    settle()
    check(lister, checkout)
    assert lister.ran == 2  # Git reads a file outside the checkout: never skipped
    git(checkout, "add", "-f", "debug.log")  # writes the index the environment names
    assert "debug.log" in check(lister, checkout)
    assert lister.ran == 3


def test_configuration_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    excludes = tmp_path / "env-excludes"
    excludes.write_text("notes.txt\n")
    settle()
    assert "notes.txt" in check(lister, checkout)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.excludesFile")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", str(excludes))
    assert "notes.txt" not in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    rewrite_in_place(excludes, "scratch/\n")
    paths = check(lister, checkout)
    assert "notes.txt" in paths
    assert "scratch/tmp.txt" not in paths
    settle()
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", str(tmp_path / "missing"))
    paths = check(lister, checkout)
    assert {"notes.txt", "scratch/tmp.txt"} <= set(paths)


def test_same_tick_edits_on_a_coarse_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a filesystem whose timestamps are coarser than the time between two
    edits, an edit in place made in the same tick as the observation leaves
    the file's key as it was: only the racy margin tells."""
    granule = MARGIN * 4 // 5

    def coarse(fd: int, paths: list[str]) -> list[Key | None]:
        return [
            None
            if k is None
            else (k[0], k[1], k[2], k[3], k[4] - k[4] % granule, k[5] - k[5] % granule)
            for k in lstat_keys(fd, paths)
        ]

    monkeypatch.setattr(listing, "lstat_keys", coarse)
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    gitignore = checkout / ".gitignore"
    old = gitignore.read_text()
    new = old.replace("*.log", "#.log")
    same_tick = False
    for _ in range(20):  # a loaded machine may push the second edit into the next tick
        # Early in a tick (file times lag the clock by up to a few ms).
        time.sleep((granule - time.time_ns() % granule + granule // 4) / 1e9)
        rewrite_in_place(gitignore, new)
        first = os.lstat(gitignore).st_ctime_ns // granule
        assert "debug.log" in lister()[0]
        rewrite_in_place(gitignore, old)
        same_tick = os.lstat(gitignore).st_ctime_ns // granule == first
        settle()
        assert "debug.log" not in check(lister, checkout)
        if same_tick:
            break
    assert same_tick


def test_default_xdg_ignore_without_xdg_variable(
    tmp_path: Path, isolated_git: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_CONFIG_HOME")
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    write(isolated_git / ".config" / "git" / "ignore", "notes.txt\n")
    assert "notes.txt" not in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    rewrite_in_place(isolated_git / ".config" / "git" / "ignore", "scratch/\n")
    paths = check(lister, checkout)
    assert "notes.txt" in paths
    assert "scratch/tmp.txt" not in paths


def test_relative_excludes_file_and_system_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = tmp_path / "system-gitconfig"
    system.write_text("# system\n")
    monkeypatch.delenv("GIT_CONFIG_NOSYSTEM")
    monkeypatch.setenv("GIT_CONFIG_SYSTEM", str(system))
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    # Relative: from the top of the working tree (where Git runs).
    rewrite_in_place(system, "[core]\n\texcludesFile = my-excludes\n")
    write(checkout / "my-excludes", "notes.txt\n")
    paths = check(lister, checkout)
    assert "notes.txt" not in paths
    assert "my-excludes" in paths
    settle()
    check(lister, checkout)
    settle()
    rewrite_in_place(checkout / "my-excludes", "scratch/\n")
    paths = check(lister, checkout)
    assert "notes.txt" in paths
    assert "scratch/tmp.txt" not in paths


def test_checkout_replaced_by_a_copy(tmp_path: Path) -> None:
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    copy = tmp_path / "copy"
    shutil.copytree(checkout, copy, symlinks=True)  # mtimes kept
    write(copy / "src" / "lib" / "copied.py", "copied\n")
    (copy / "notes.txt").unlink()
    for rel in ("", "src/lib"):
        put_back(copy / rel, os.lstat(checkout / rel))
    checkout.rename(tmp_path / "old")
    copy.rename(checkout)
    paths = check(lister, checkout)
    assert "src/lib/copied.py" in paths
    assert "notes.txt" not in paths


def test_too_many_directories_to_watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listing, "MAX_WATCHED_DIRS", 4)
    checkout = repo(tmp_path)
    lister = WorktreeLister(checkout, racy_margin_ns=MARGIN)
    check(lister, checkout)
    settle()
    check(lister, checkout)
    check(lister, checkout)
    assert lister.ran == 3
    write(checkout / "src" / "lib" / "deep" / "new.py", "new\n")
    assert "src/lib/deep/new.py" in check(lister, checkout)


def test_a_witness_that_cannot_be_looked_at_makes_git_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An lstat refused (a directory readable but not searchable, as a user
    other than root sees it) never fails the listing: Git lists, every time
    until the witness can look again, and the answer stays right."""
    checkout = repo(tmp_path)
    lister = settled_lister(checkout)
    ran = lister.ran
    real = listing.lstat_keys

    def refused(fd: int, paths: list[str]) -> list[Key | None]:
        raise PermissionError(13, "Permission denied", paths[0] if paths else "")

    monkeypatch.setattr(listing, "lstat_keys", refused)
    (checkout / "src" / "while-blind.txt").write_text("x")
    assert check(lister, checkout) == worktree_paths(checkout)[0]
    assert "src/while-blind.txt" in lister()[0]
    assert lister.ran == ran + 2
    monkeypatch.setattr(listing, "lstat_keys", real)
    (checkout / "src" / "after.txt").write_text("y")
    assert "src/after.txt" in check(lister, checkout)
    settle()
    check(lister, checkout)
    settle()
    before = lister.ran
    assert "src/after.txt" in lister()[0]
    assert lister.ran == before  # looking again, it vouches again
