"""Every unsafe repository checkpoint is refused by the controller with the
member and the rule (422 ``unsafe_repo_member``), publishes nothing, and leaves
the previous checkpoint current; the binding shows the refusal. Real
controller and PostgreSQL, checkpoint bodies built here."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from common.limits import GiB
from tests.support.controller import ControllerProcess, bootstrap_tenant
from tests.support.repos import (
    RepoRun,
    dir_member,
    file_member,
    link_member,
    members_of,
    repo_run,
    sha,
    small_repo,
)


@dataclass
class Case:
    id: str
    extra: list[dict[str, Any]]
    where: str | None
    rule: str
    drop: tuple[str, ...] = ()
    uploads: tuple[bytes, ...] = ()


CASES = [
    Case(
        "gitdir-pointer-file",
        [file_member(".git", b"gitdir: /x\n")],
        ".git",
        "git_file",
        drop=(".git",),
    ),
    Case(
        "alternates",
        [file_member(".git/objects/info/alternates", b"/srv\n")],
        ".git/objects/info/alternates",
        "git_alternates",
    ),
    Case(
        "http-alternates",
        [file_member(".git/objects/info/http-alternates", b"x")],
        ".git/objects/info/http-alternates",
        "git_alternates",
    ),
    Case("commondir", [file_member(".git/commondir", b"..")], ".git/commondir", "git_commondir"),
    Case("gitdir", [file_member(".git/gitdir", b"/x")], ".git/gitdir", "git_gitdir"),
    Case(
        "worktrees",
        [file_member(".git/worktrees/w/gitdir", b"/x")],
        ".git/worktrees/w/gitdir",
        "git_worktrees",
    ),
    Case(
        "modules", [file_member(".git/modules/s/HEAD", b"x")], ".git/modules/s/HEAD", "git_modules"
    ),
    Case(
        "config-file",
        [file_member(".git/config", b"[core]\n\tfsmonitor = evil\n")],
        ".git/config",
        "git_member_not_allowed",
    ),
    Case(
        "hooks",
        [file_member(".git/hooks/post-checkout", b"#!/bin/sh\n")],
        ".git/hooks/post-checkout",
        "git_member_not_allowed",
    ),
    Case("case-alias-GIT", [file_member(".GIT/config", b"x")], ".GIT/config", "git_case_alias"),
    Case(
        "case-alias-Git-hooks",
        [file_member(".Git/hooks/pre-commit", b"x")],
        ".Git/hooks/pre-commit",
        "git_case_alias",
    ),
    Case(
        "hfs-alias", [file_member(".g\u200cit/config", b"x")], ".g\u200cit/config", "git_case_alias"
    ),
    Case("ntfs-short-name", [file_member("git~1/config", b"x")], "git~1/config", "git_case_alias"),
    Case(
        "nested-git-dir",
        [file_member("vendor/.git/config", b"x")],
        "vendor/.git/config",
        "nested_git_dir",
    ),
    Case("symlink-absolute", [link_member("abs", "/etc/passwd")], "abs", "symlink_absolute"),
    Case("symlink-escapes", [link_member("up", "../outside")], "up", "symlink_escapes_checkout"),
    Case("symlink-into-git", [link_member("g", ".git/config")], "g", "symlink_into_git_dir"),
    Case("symlink-into-GIT-alias", [link_member("g", ".GIT/hooks")], "g", "symlink_into_git_dir"),
    Case(
        "symlink-inside-git",
        [link_member(".git/refs/heads/x", "main")],
        ".git/refs/heads/x",
        "symlink_in_git_dir",
    ),
    Case(
        "symlink-chain-escapes",
        [link_member("s1/s2/s3/b", "../.."), link_member("s1/s2/s3/c", "b/../../x")],
        "s1/s2/s3/c",
        "symlink_escapes_checkout",
    ),
    Case(
        "symlink-chain-into-git",
        [link_member("a/b/c/l1", "../.."), link_member("a/b/c/l2", "l1/../.git")],
        "a/b/c/l2",
        "symlink_into_git_dir",
    ),
    Case("symlink-loop", [link_member("l1", "l2"), link_member("l2", "l1")], "l1", "symlink_loop"),
    Case("socket", [{"path": "run.sock", "kind": "socket"}], "run.sock", "kind_not_allowed"),
    Case("fifo", [{"path": "pipe", "kind": "fifo"}], "pipe", "kind_not_allowed"),
    Case("device", [{"path": "dev", "kind": "device"}], "dev", "kind_not_allowed"),
    Case(
        "under-a-symlink",
        [link_member("lnk", "src"), file_member("lnk/evil.py", b"x")],
        "lnk/evil.py",
        "parent_not_directory",
    ),
    Case("under-a-file", [file_member("README.md/x", b"x")], "README.md/x", "parent_not_directory"),
    Case("traversal", [file_member("../x", b"x")], "../x", "path_invalid"),
    Case("absolute-path", [file_member("/etc/x", b"x")], "/etc/x", "path_invalid"),
    Case("dot-segment", [file_member("a/./b", b"x")], "a/./b", "path_invalid"),
    Case(
        "file-over-1-GiB",
        [{**file_member("big", b"x"), "byteSize": GiB + 1}],
        "big",
        "file_too_large",
    ),
    Case(
        "size-lies",
        [{**file_member("f", b"abc"), "byteSize": 4}],
        "f",
        "size_mismatch",
        uploads=(b"abc",),
    ),
    Case("extra-field", [{**file_member("f", b"abc"), "mode": 0o4755}], "f", "member_malformed"),
    Case("no-HEAD", [], ".git/HEAD", "git_head_missing", drop=(".git/HEAD",)),
    Case("duplicate", [file_member("README.md", b"other")], "README.md", "duplicate_member"),
]


@dataclass
class World:
    run: RepoRun
    ws: str
    first: dict[str, Any]

    def checkpoints(self) -> int:
        with self.run.tenant.controller.db() as db:
            row = db.execute(
                "SELECT count(*) FROM repo_checkpoints WHERE task_id = %s", (self.run.task,)
            ).fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture(scope="module")
def world(controller: ControllerProcess) -> Iterator[World]:
    run = repo_run(bootstrap_tenant(controller))
    ws = run.ws()
    yield World(run, ws, run.save(ws, small_repo()))


def assert_refused(world: World, body: dict[str, Any], where: str | None, rule: str) -> None:
    assert body["code"] == "unsafe_repo_member", body
    assert (body["path"], body["rule"]) == (where, rule)
    assert body["details"] == [{"path": where, "rule": rule}]
    current = world.run.manifest(world.ws).json()
    assert current["checkpointId"] == world.first["checkpointId"]
    assert sorted(m["path"] for m in current["members"]) == sorted(small_repo())
    (listed,) = world.run.listing()["repos"]
    assert listed["current"]["checkpointId"] == world.first["checkpointId"]
    with world.run.tenant.client() as c:
        (shown,) = c.get(
            f"/api/companies/{world.run.tenant.company_id}/tasks/{world.run.task}/repos"
        ).json()["repos"]
    assert shown["state"] == "failed" and rule in shown["error"]
    assert shown["checkpointId"] == world.first["checkpointId"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_unsafe_checkpoint_is_refused_and_publishes_nothing(world: World, case: Case) -> None:
    before = world.checkpoints()
    if case.uploads:
        world.run.upload_all(world.ws, list(case.uploads))
    members = [m for m in members_of(small_repo()) if m["path"] not in case.drop] + case.extra
    r = world.run.commit(world.ws, members)
    assert r.status_code == 422, r.text
    assert_refused(world, r.json(), case.where, case.rule)
    assert world.checkpoints() == before


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if not c.drop and c.rule != "duplicate_member"],
    ids=[c.id for c in CASES if not c.drop and c.rule != "duplicate_member"],
)
def test_a_delta_is_held_to_the_same_rules(world: World, case: Case) -> None:
    if case.uploads:
        world.run.upload_all(world.ws, list(case.uploads))
    r = world.run.commit(world.ws, case.extra, base=world.first["checkpointId"])
    assert r.status_code == 422, r.text
    assert_refused(world, r.json(), case.where, case.rule)


def test_a_delta_is_validated_as_the_whole_checkpoint_it_makes(world: World) -> None:
    """Each half is harmless alone: the link arrives first, the escape through
    it in a later delta."""
    run, ws = world.run, world.ws
    extra = [*members_of(small_repo()), link_member("s1/s2/s3/b", "../..")]
    first = run.commit(ws, extra)
    assert first.status_code == 200, first.text
    base = first.json()["checkpointId"]
    r = run.commit(ws, [link_member("s1/s2/s3/c", "b/../../x")], base=base)
    assert r.status_code == 422 and (r.json()["path"], r.json()["rule"]) == (
        "s1/s2/s3/c",
        "symlink_escapes_checkout",
    )
    # Likewise a file below a symlink of the base, and removing HEAD.
    for extra_members, removed, where, rule in [
        ([file_member("s1/s2/s3/b/x", b"x")], [], "s1/s2/s3/b/x", "parent_not_directory"),
        ([], [".git/HEAD"], ".git/HEAD", "git_head_missing"),
    ]:
        r = run.commit(ws, extra_members, base=base, removed=removed)
        assert r.status_code == 422 and (r.json()["path"], r.json()["rule"]) == (where, rule)
    assert run.manifest(ws).json()["checkpointId"] == base
    # Put the fixture's checkpoint back for the other tests of the module.
    again = run.commit(ws, members_of(small_repo()))
    assert again.status_code == 200
    world.first = again.json()


def test_too_many_members_and_malformed_bodies(world: World) -> None:
    run, ws = world.run, world.ws
    members = members_of(small_repo()) + [dir_member(f"d/{i}") for i in range(100_001)]
    r = run.commit(ws, members)
    assert r.status_code == 422 and (r.json()["path"], r.json()["rule"]) == (
        None,
        "too_many_members",
    )
    for bad in (
        {"members": "x"},
        {"members": [], "removed": ["a"]},
        {"members": [], "config": [["a"]]},
        {"members": [], "config": "x"},
        {"members": [], "base": "not-an-id"},
        {"members": [], "extra": 1},
    ):
        body = {"operationId": "op", "leaseEpoch": run.lease_epoch, **bad}
        with run.client() as c:
            r = c.post(f"/repos/{ws}/checkpoints", json=body)
        assert r.status_code == 400 and r.json()["code"] == "validation_error", (bad, r.text)
    # A removed path must be in the base.
    r = run.commit(ws, [], base=world.first["checkpointId"], removed=["nope.txt"])
    assert r.status_code == 400 and r.json()["details"][0]["code"] == "not_in_base"
    assert run.manifest(ws).json()["checkpointId"] == world.first["checkpointId"]


def test_a_digest_no_one_uploaded_is_unknown_content(world: World) -> None:
    run, ws = world.run, world.ws
    stranger = b"never uploaded by this run"
    r = run.commit(ws, [*members_of(small_repo()), file_member("new.txt", stranger)])
    assert r.status_code == 422 and r.json()["code"] == "unknown_content"
    assert r.json()["details"] == [{"digest": sha(stranger)}]
    assert run.manifest(ws).json()["checkpointId"] == world.first["checkpointId"]
