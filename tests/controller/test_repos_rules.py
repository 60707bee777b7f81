"""The repository checkpoint rule book (common/repos.py) as pure functions:
members, whole trees, symlink resolution, portable config, names and refs.
The same rules over HTTP, with nothing published, are in test_repos_unsafe.py."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest

from common.repos import (
    MAX_SYMLINK_HOPS,
    RULES,
    RepoMember,
    checkout_name,
    checkout_name_problem,
    delta_tree_problem,
    is_dotgit_name,
    member_problem,
    parse_member,
    portable_config,
    ref_problem,
    tree_problem,
)
from controller.repomanifest import (
    MAX_CHAIN,
    MIN_CARRIED,
    Manifest,
    Plan,
    apply_delta,
    parse_request,
    plan_checkpoint,
    prepare_spare,
)
from tests.support.repos import dir_member, file_member, link_member, members_of, small_repo


def tree(extra: list[dict[str, Any]], drop: tuple[str, ...] = ()) -> dict[str, RepoMember]:
    members = [m for m in members_of(small_repo()) if m["path"] not in drop] + extra
    for m in members:
        assert member_problem(m) is None, m
    return {m["path"]: parse_member(m) for m in members}


def test_a_small_repository_is_accepted() -> None:
    assert tree_problem(tree([])) is None


@pytest.mark.parametrize(
    ("member", "rule"),
    [
        ("not a dict", "member_malformed"),
        ({"path": "a", "kind": "file"}, "member_malformed"),
        ({**file_member("a", b"x"), "mode": 0o644}, "member_malformed"),
        ({**file_member("a", b"x"), "byteSize": -1}, "member_malformed"),
        ({**file_member("a", b"x"), "byteSize": True}, "member_malformed"),
        ({**file_member("a", b"x"), "digest": "ABC"}, "member_malformed"),
        ({**file_member("a", b"x"), "executable": "yes"}, "member_malformed"),
        ({**file_member("a", b"x"), "byteSize": (1 << 30) + 1}, "file_too_large"),
        (file_member("../a", b"x"), "path_invalid"),
        (file_member("/etc/passwd", b"x"), "path_invalid"),
        (file_member("a/./b", b"x"), "path_invalid"),
        (file_member("a\x00b", b"x"), "path_invalid"),
        ({"path": "s", "kind": "socket"}, "kind_not_allowed"),
        ({"path": "p", "kind": "fifo"}, "kind_not_allowed"),
        ({"path": "d", "kind": "device"}, "kind_not_allowed"),
        (file_member(".git", b"gitdir: /elsewhere/.git\n"), "git_file"),
        (link_member(".git", "/elsewhere/.git"), "symlink_absolute"),
        (file_member(".git/objects/info/alternates", b"/srv/o\n"), "git_alternates"),
        (file_member(".git/objects/info/ALTERNATES", b"/srv/o\n"), "git_alternates"),
        (file_member(".git/objects/info/http-alternates", b"x"), "git_alternates"),
        (file_member(".git/commondir", b".."), "git_commondir"),
        (file_member(".git/gitdir", b"/x"), "git_gitdir"),
        (file_member(".git/worktrees/w/gitdir", b"/x"), "git_worktrees"),
        (dir_member(".git/modules"), "git_modules"),
        (file_member(".git/modules/sub/config", b"x"), "git_modules"),
        (file_member(".git/config", b"[core]\n"), "git_member_not_allowed"),
        (file_member(".git/hooks/post-checkout", b"#!/bin/sh"), "git_member_not_allowed"),
        (file_member(".git/info/exclude", b"x"), "git_member_not_allowed"),
        (dir_member(".git/HEAD"), "git_member_not_allowed"),
        (file_member(".git/objects", b"x"), "git_member_not_allowed"),
        (file_member(".GIT/config", b"x"), "git_case_alias"),
        (file_member(".Git/hooks/pre-commit", b"x"), "git_case_alias"),
        (file_member("git~1/config", b"x"), "git_case_alias"),
        (file_member(".git\u200c/config", b"x"), "git_case_alias"),
        (file_member(".git. /config", b"x"), "git_case_alias"),
        (file_member(".git::$INDEX_ALLOCATION/config", b"x"), "git_case_alias"),
        (file_member("vendor/.git/config", b"x"), "nested_git_dir"),
        (dir_member("vendor/.GiT"), "nested_git_dir"),
        (link_member("abs", "/etc/passwd"), "symlink_absolute"),
        (link_member("up", "../outside"), "symlink_escapes_checkout"),
        (link_member("a/b/up", "../../.."), "symlink_escapes_checkout"),
        (link_member("self", "."), "symlink_escapes_checkout"),
        (link_member("g", ".git/config"), "symlink_into_git_dir"),
        (link_member("g", ".GIT/hooks"), "symlink_into_git_dir"),
        (link_member("sub/g", "../.git"), "symlink_into_git_dir"),
        (link_member(".git/refs/heads/x", "main"), "symlink_in_git_dir"),
        (link_member("empty", ""), "symlink_target_invalid"),
        (link_member("ctl", "a\nb"), "symlink_target_invalid"),
        (link_member("long", "a/" * 2048 + "b"), "symlink_target_invalid"),
    ],
)
def test_member_problem_names_the_rule(member: Any, rule: str) -> None:
    assert rule in RULES
    assert member_problem(member) == rule


@pytest.mark.parametrize(
    "member",
    [
        dir_member(".git"),
        file_member(".git/HEAD", b"ref: refs/heads/main\n"),
        file_member(".git/packed-refs", b"x"),
        file_member(".git/objects/pack/pack-1.pack", b"PACK"),
        file_member(".git/objects/info/packs", b"P pack-1.pack\n"),
        file_member(".git/refs/tags/v1", b"x"),
        file_member(".git/logs/HEAD", b"x"),
        file_member(".gitignore", b"node_modules\n"),
        file_member(".github/workflows/ci.yml", b"x"),
        file_member("docs/.gitkeep", b""),
        link_member("docs/readme", "../README.md"),
        link_member("lib/current", "v2"),
        link_member("dangling", "nowhere/at/all"),
        {
            "path": "bin/tool",
            "kind": "file",
            "digest": "0" * 64,
            "byteSize": 1 << 30,
            "executable": True,
        },
    ],
)
def test_ordinary_members_pass(member: dict[str, Any]) -> None:
    assert member_problem(member) is None


def test_dotgit_aliases() -> None:
    for name in (
        ".git",
        ".GIT",
        ".gIt",
        "git~1",
        "GIT~1",
        ".git.",
        ".git ",
        ".g\u200cit",
        ".git\ufeff",
    ):
        assert is_dotgit_name(name), name
    for name in (".gitignore", ".github", "git", "xgit", ".git-x", "git~2"):
        assert not is_dotgit_name(name), name


@pytest.mark.parametrize(
    ("extra", "drop", "where", "rule"),
    [
        ([], (".git/HEAD",), ".git/HEAD", "git_head_missing"),
        ([file_member("README.md/x", b"x")], (), "README.md/x", "parent_not_directory"),
        (
            [link_member("lnk", "src"), file_member("lnk/evil.py", b"x")],
            (),
            "lnk/evil.py",
            "parent_not_directory",
        ),
        # Each link alone resolves inside; through s1/s2/s3/b (-> s1) the
        # second leaves the checkout.
        (
            [link_member("s1/s2/s3/b", "../.."), link_member("s1/s2/s3/c", "b/../../x")],
            (),
            "s1/s2/s3/c",
            "symlink_escapes_checkout",
        ),
        (
            [link_member("a/b/c/l1", "../.."), link_member("a/b/c/l2", "l1/../.git")],
            (),
            "a/b/c/l2",
            "symlink_into_git_dir",
        ),
        (
            [link_member("l1", "l2"), link_member("l2", "l1")],
            (),
            "l1",
            "symlink_loop",
        ),
    ],
)
def test_tree_problem_names_the_member_and_rule(
    extra: list[dict[str, Any]], drop: tuple[str, ...], where: str, rule: str
) -> None:
    assert tree_problem(tree(extra, drop)) == (where, rule)


def test_link_chains_inside_the_checkout_pass() -> None:
    chain = [link_member(f"c/l{i}", f"l{i + 1}") for i in range(MAX_SYMLINK_HOPS - 1)]
    chain.append(link_member(f"c/l{MAX_SYMLINK_HOPS - 1}", "../src/main.py"))
    assert tree_problem(tree(chain)) is None
    longer = [*chain[:-1], link_member(f"c/l{MAX_SYMLINK_HOPS - 1}", f"l{MAX_SYMLINK_HOPS}")]
    longer.append(link_member(f"c/l{MAX_SYMLINK_HOPS}", "../src/main.py"))
    assert tree_problem(tree(longer)) == ("c/l0", "symlink_loop")


def test_too_many_members() -> None:
    members = tree([])
    for i in range(100_001 - len(members)):
        members[f"d/{i}"] = RepoMember(f"d/{i}", "dir")
    assert tree_problem(members) == (None, "too_many_members")


def test_portable_config_keeps_only_portable_keys() -> None:
    pairs = [
        ("core.repositoryformatversion", "0"),
        ("core.bare", "false"),
        ("core.filemode", "true"),
        ("core.fsmonitor", "touch /tmp/pwned"),
        ("core.hooksPath", "/tmp/hooks"),
        ("core.sshCommand", "sh -c evil"),
        ("core.attributesFile", "/etc/passwd"),
        ("include.path", "/etc/gitconfig"),
        ("includeIf.gitdir:/x/.path", "/tmp/evil"),
        ("remote.origin.url", "https://attacker.example/x.git"),
        ("Extensions.ObjectFormat", "SHA256"),
        ("branch.main.remote", "origin"),
        ("branch.main.merge", "refs/heads/main"),
        ("branch.Feature/X.remote", "."),
        ("branch.Feature/X.merge", "refs/heads/Feature/X"),
        ("branch.evil.remote", "-uorigin"),
        ("branch.evil.merge", "main"),
        ("branch.-x.remote", "origin"),
        ("branch.main.pushRemote", "attacker"),
        ("core.repositoryformatversion", "9"),
    ]
    assert portable_config(pairs) == [
        ("branch.Feature/X.merge", "refs/heads/Feature/X"),
        ("branch.Feature/X.remote", "."),
        ("branch.main.merge", "refs/heads/main"),
        ("branch.main.remote", "origin"),
        ("core.repositoryformatversion", "0"),
        ("extensions.objectformat", "sha256"),
    ]


def test_checkout_names_and_refs() -> None:
    assert checkout_name("https://h/o/app.git") == "app"
    assert checkout_name("git@h:o/My App.git") == "My-App"
    assert checkout_name("/srv/x/") == "x"
    assert checkout_name("https://h/.git") == "repo"
    assert len(checkout_name("https://h/" + "a" * 300)) == 100
    assert checkout_name_problem("app") is None
    for bad in ("", ".git", "-x", "a/b", "a b", "é", "x" * 101):
        assert checkout_name_problem(bad) is not None, bad
    for ok in ("main", "feature/x-1", "release/2.0", "v1.2.3"):
        assert ref_problem(ok) is None, ok
    for bad in (
        "",
        "-x",
        "a..b",
        "a b",
        "x.lock",
        "a/",
        "/a",
        "a//b",
        "@",
        "x@{1}",
        "a~1",
        ".x",
        "a/.b",
    ):
        assert ref_problem(bad) is not None, bad


NAMES = ("a", "b", "c")
TARGETS = ("a", "b/c", "..", "../..", "../a", "b/../..", "a/../b", ".git", "c/../.git", "../../x")


def random_member(rng: random.Random) -> RepoMember:
    path = "/".join(rng.choice(NAMES) for _ in range(rng.randint(1, 3)))
    kind = rng.choice(("file", "file", "dir", "symlink"))
    if kind == "file":
        content = rng.choice((b"1", b"22", b"333", b"4444"))  # one size per digest
        return parse_member(file_member(path, content, rng.random() < 0.3))
    if kind == "symlink":
        return parse_member(link_member(path, rng.choice(TARGETS)))
    return RepoMember(path, "dir")


def random_tree(rng: random.Random) -> dict[str, RepoMember]:
    """A valid checkpoint of up to 8 random members beside small_repo's."""
    members = tree([])
    for _ in range(rng.randint(0, 8)):
        member = random_member(rng)
        trial = {**members, member.path: member}
        if tree_problem(trial) is None:
            members = trial
    return members


def test_a_delta_is_judged_and_counted_as_its_whole_checkpoint() -> None:
    """Random deltas on random valid checkpoints: the delta's verdict
    (delta_tree_problem on apply_delta's index) is tree_problem's on the
    whole result, and the delta's bookkeeping is the whole result's."""
    rng = random.Random(20261204)
    judged = refused = 0
    while judged < 3000:
        members = random_tree(rng)
        base = Manifest.whole(members, ())
        paths = list(members)
        removed = rng.sample(paths, rng.randint(0, min(3, len(paths))))
        changed: dict[str, RepoMember] = {}
        for _ in range(rng.randint(0, 4)):
            member = random_member(rng)
            if member.path not in removed:
                changed[member.path] = member
        delta = apply_delta(base, changed, removed, ())
        result = delta.manifest
        verdict = delta_tree_problem(
            result.members, result.index, changed.values(), delta.links_changed
        )
        whole = tree_problem(result.members)
        assert (verdict is None) == (whole is None), (members, removed, changed, verdict, whole)
        judged += 1
        refused += whole is not None
        again = Manifest.whole(result.members, ())
        assert (result.sizes, result.counts, result.files, result.byte_size) == (
            again.sizes,
            again.counts,
            again.files,
            again.byte_size,
        )
        assert result.index.below == again.index.below
        assert result.index.links == again.index.links
        assert delta.added_digests == again.counts.keys() - base.counts.keys()
        assert delta.dropped_digests == base.counts.keys() - again.counts.keys()
    assert 300 < refused < 2700  # both verdicts were exercised


def test_a_delta_manifest_is_stored_as_one_until_the_chain_is_long_or_carries_much() -> None:
    base = Manifest.whole(tree([]), ())
    digest = "ab" * 32

    def plan_of(on: Manifest, count: int) -> Plan:
        members = [dir_member(f"d/{i}") for i in range(count)]
        body = {"operationId": "op", "leaseEpoch": 1, "base": str(uuid.UUID(int=1))}
        req = parse_request({**body, "members": members, "removed": [], "config": []})
        return plan_checkpoint(req, body["base"], on, digest)

    small = plan_of(base, 10)
    assert small.delta_of == digest and small.manifest.chain == (digest,)
    assert small.manifest.carried == 10
    assert plan_of(base, MIN_CARRIED + 1).delta_of is None  # carries too much: whole
    long = Manifest.whole(tree([]), ())
    object.__setattr__(long, "chain", tuple(f"{i:064x}" for i in range(MAX_CHAIN - 1)))
    whole = plan_of(long, 1)
    assert whole.delta_of is None and whole.manifest.chain == ()
    assert whole.current_objects == (*long.chain, digest)  # all let go at its commit


def test_a_delta_from_copies_made_ahead_is_the_delta_from_fresh_copies() -> None:
    """prepare_spare's copies (made after a commit is answered) give the same
    result as copies made in the delta, leave the base as it was, and serve
    one delta only."""
    rng = random.Random(20261205)
    for round_no in range(300):
        members = random_tree(rng)
        base = Manifest.whole(members, ())
        if round_no % 3 == 0:
            base.fragments()  # encoded before the copies
        before = (dict(base.members), dict(base.sizes), dict(base.counts))
        before_index = (dict(base.index.below), dict(base.index.links))
        prepare_spare(base)
        if round_no % 3 == 1:
            base.fragments()  # encoded after the copies: the delta copies them then
        paths = list(members)
        removed = rng.sample(paths, rng.randint(0, min(3, len(paths))))
        changed = {
            m.path: m for m in (random_member(rng) for _ in range(4)) if m.path not in removed
        }
        ahead = apply_delta(base, changed, removed, ()).manifest
        assert "tables" not in base.spare  # taken
        fresh = apply_delta(base, changed, removed, ()).manifest  # copies made now
        assert dict(ahead.members) == dict(fresh.members)
        assert (ahead.sizes, ahead.counts, ahead.files, ahead.byte_size) == (
            fresh.sizes,
            fresh.counts,
            fresh.files,
            fresh.byte_size,
        )
        assert ahead.index.below == fresh.index.below and ahead.index.links == fresh.index.links
        assert (ahead.encoded is None) == (base.encoded is None)
        if base.encoded is not None:
            assert ahead.encoded == fresh.encoded
            assert ahead.fragments() == Manifest.whole(ahead.members, ()).fragments()
        # The base is what it was: the delta changed copies only.
        assert (dict(base.members), dict(base.sizes), dict(base.counts)) == before
        assert (dict(base.index.below), dict(base.index.links)) == before_index
