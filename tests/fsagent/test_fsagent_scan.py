"""The scan engine (fsagent/scan/engine.py) on real files: members and digests, the
stable-read rules, the before/after fingerprint, and the metadata cache
(hits counted, invalidation, persistence, degradation on a full disk)."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from fsagent.errors import MemberChanged
from fsagent.scan import engine as scan_module
from fsagent.scan.engine import (
    MetadataCache,
    ScanResult,
    StatKey,
    TreeScan,
    hash_stable,
    open_member,
    scan_tree,
    walk_tree,
)
from tests.support.smallfs import assert_full, fill, free_fill, small_tmpfs


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(root: Path, rel: str, data: bytes, mode: int = 0o644) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def lister(root: Path) -> list[str]:
    return walk_tree(root)


def scan(root: Path, cache: MetadataCache | None = None, **kw: Any) -> ScanResult:
    return scan_tree(root, lambda: lister(root), cache, **kw)


def test_members_digests_exec_bits_links_and_problems(tmp_path: Path) -> None:
    write(tmp_path, "a.txt", b"alpha")
    write(tmp_path, "bin/run", b"#!/bin/sh\necho hi\n", 0o755)
    write(tmp_path, "big.bin", os.urandom(3 << 20))
    (tmp_path / "link").symlink_to("a.txt")
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        result = scan_tree(tmp_path, lambda: [*lister(tmp_path), "missing.txt"])
    assert result.stable
    by_path = {m.path: m for m in result.members}
    assert set(by_path) == {"a.txt", "bin", "bin/run", "big.bin", "link", "empty"}
    assert by_path["a.txt"].to_json() == {
        "path": "a.txt",
        "kind": "file",
        "digest": sha(b"alpha"),
        "byteSize": 5,
        "executable": False,
    }
    assert by_path["bin/run"].executable and by_path["bin/run"].digest == sha(
        b"#!/bin/sh\necho hi\n"
    )
    assert by_path["big.bin"].digest == sha((tmp_path / "big.bin").read_bytes())
    assert by_path["link"].to_json() == {"path": "link", "kind": "symlink", "target": "a.txt"}
    assert by_path["empty"].kind == "dir"
    assert [(p.path, p.reason) for p in result.problems] == [
        ("fifo", "special_file"),
        ("sock", "special_file"),
    ]
    assert [m.path for m in result.members] == sorted(by_path)
    assert result.stats.hashed == 3 and result.stats.cache_hits == 0


def test_rules_refuse_names_links_and_sizes_without_reading(tmp_path: Path) -> None:
    write(tmp_path, "ok.txt", b"ok")
    write(tmp_path, "bad\u202etxt", b"x")
    write(tmp_path, "huge.bin", b"y" * 100)
    (tmp_path / "escape").symlink_to("../outside")
    result = scan_tree(
        tmp_path,
        lambda: lister(tmp_path),
        path_rule=lambda p: "forbidden_character" if "\u202e" in p else None,
        link_rule=lambda p, t: "symlink_escapes_checkout" if t.startswith("..") else None,
        max_file_bytes=50,
    )
    assert [m.path for m in result.members] == ["ok.txt"]
    assert {(p.path, p.reason) for p in result.problems} == {
        ("bad\u202etxt", "forbidden_character"),
        ("huge.bin", "file_too_large"),
        ("escape", "symlink_escapes_checkout"),
    }
    assert result.stats.hashed == 1


def test_a_symlinked_parent_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    write(outside, "secret.txt", b"not part of the tree")
    root = tmp_path / "root"
    root.mkdir()
    (root / "dir").symlink_to(outside)
    result = scan_tree(root, lambda: ["dir/secret.txt", "dir"])
    assert [m.to_json() for m in result.members] == [
        {"path": "dir", "kind": "symlink", "target": str(outside)}
    ]
    assert [(p.path, p.reason) for p in result.problems] == [
        ("dir/secret.txt", "below_non_directory:dir")
    ]
    assert result.stats.hashed == 0


def test_a_file_changed_while_read_is_unstable(tmp_path: Path) -> None:
    write(tmp_path, "a.txt", b"first version")
    write(tmp_path, "b.txt", b"steady")

    def mutate(full: str) -> None:
        if full.endswith("a.txt"):
            with open(full, "ab") as fh:
                fh.write(b" and more")

    result = scan(tmp_path, after_read=mutate)
    assert not result.stable
    assert result.unstable == ["a.txt"]


def test_a_same_size_rewrite_while_read_is_unstable(tmp_path: Path) -> None:
    path = write(tmp_path, "a.txt", b"AAAA")

    def rewrite(full: str) -> None:
        time.sleep(0.02)  # past the coarse clock's tick, as any real later write is
        with open(full, "r+b") as fh:
            fh.write(b"BBBB")

    result = scan_tree(tmp_path, lambda: ["a.txt"], after_read=rewrite)
    assert result.unstable == ["a.txt"]
    assert path.read_bytes() == b"BBBB"


def test_a_file_added_or_removed_during_the_scan_is_unstable(tmp_path: Path) -> None:
    write(tmp_path, "a.txt", b"a")
    write(tmp_path, "gone.txt", b"g")

    def churn(full: str) -> None:
        (tmp_path / "new.txt").write_bytes(b"new")
        (tmp_path / "gone.txt").unlink(missing_ok=True)

    result = scan_tree(tmp_path, lambda: lister(tmp_path), after_read=churn, threads=1)
    assert "new.txt" in result.unstable and "gone.txt" in result.unstable


def test_a_file_replaced_by_rename_during_the_scan_is_unstable(tmp_path: Path) -> None:
    write(tmp_path, "a.txt", b"one")
    write(tmp_path, "z.txt", b"two")

    def replace_a(full: str) -> None:
        if full.endswith("z.txt"):
            write(tmp_path, "a.tmp", b"uno")
            os.replace(tmp_path / "a.tmp", tmp_path / "a.txt")

    result = scan_tree(tmp_path, lambda: ["a.txt", "z.txt"], after_read=replace_a, threads=1)
    assert result.unstable == ["a.txt"]


def test_hash_stable_never_blocks_on_a_fifo_swapped_in(tmp_path: Path) -> None:
    path = write(tmp_path, "a.txt", b"data")
    before = StatKey.of(os.lstat(path))
    path.unlink()
    os.mkfifo(path)  # nobody writes it: a blocking open would hang
    started = time.monotonic()
    assert hash_stable(str(path), before) is None
    assert time.monotonic() - started < 1


def test_hash_stable_refuses_a_link_swapped_in(tmp_path: Path) -> None:
    path = write(tmp_path, "a.txt", b"data")
    write(tmp_path, "other.txt", b"other")
    before = StatKey.of(os.lstat(path))
    path.unlink()
    path.symlink_to("other.txt")
    assert hash_stable(str(path), before) is None


def test_cache_skips_unchanged_files_and_catches_every_change(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for i in range(20):
        write(root, f"d{i % 3}/f{i}.txt", f"file {i}".encode())
    cache = MetadataCache()
    first = scan_tree(root, lambda: lister(root), cache, racy_margin_ns=0)
    assert first.stats.hashed == 20 and len(cache) == 20

    again = scan_tree(root, lambda: lister(root), cache, racy_margin_ns=0)
    assert again.stats.hashed == 0 and again.stats.cache_hits == 20
    assert [m.to_json() for m in again.members] == [m.to_json() for m in first.members]

    time.sleep(0.02)
    write(root, "d0/f0.txt", b"FILE 0")  # same size, new bytes
    old = os.lstat(root / "d1/f1.txt")
    write(root, "d1/f1.txt", b"file 1!")
    os.utime(root / "d1/f1.txt", ns=(old.st_atime_ns, old.st_mtime_ns))  # mtime put back
    write(root, "d2/f2.tmp", b"file Z")
    os.replace(root / "d2/f2.tmp", root / "d2/f2.txt")  # a new inode
    (root / "d0/f3.txt").unlink()
    third = scan_tree(root, lambda: lister(root), cache, racy_margin_ns=0)
    assert third.stats.hashed == 3 and third.stats.cache_hits == 16
    digests = {m.path: m.digest for m in third.members}
    assert digests["d0/f0.txt"] == sha(b"FILE 0")
    assert digests["d1/f1.txt"] == sha(b"file 1!")
    assert digests["d2/f2.txt"] == sha(b"file Z")
    assert "d0/f3.txt" not in digests and len(cache) == 19


def test_files_changed_just_before_the_scan_are_not_cached(tmp_path: Path) -> None:
    write(tmp_path, "fresh.txt", b"written a moment ago")
    cache = MetadataCache()
    scan_tree(tmp_path, lambda: ["fresh.txt"], cache)  # the default margin
    assert len(cache) == 0
    again = scan_tree(tmp_path, lambda: ["fresh.txt"], cache)
    assert again.stats.hashed == 1


def test_cache_persists_and_a_damaged_file_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "tree"
    for i in range(5):
        write(root, f"f{i}", bytes([i]) * 100)
    file = tmp_path / "state" / "metacache"
    cache = MetadataCache.load(file)
    scan_tree(root, lambda: lister(root), cache, racy_margin_ns=0)
    assert cache.save() and file.exists()
    reloaded = MetadataCache.load(file)
    result = scan_tree(root, lambda: lister(root), reloaded, racy_margin_ns=0)
    assert result.stats.hashed == 0 and result.stats.cache_hits == 5

    file.write_bytes(file.read_bytes()[:-3])
    with caplog.at_level(logging.WARNING, logger="fsagent.scan"):
        damaged = MetadataCache.load(file)
    assert len(damaged) == 0 and "damaged" in caplog.text
    assert scan_tree(root, lambda: lister(root), damaged).stats.hashed == 5


def test_open_member_checks_the_file_is_still_the_scanned_one(tmp_path: Path) -> None:
    write(tmp_path, "a.txt", b"before")
    (member,) = scan_tree(tmp_path, lambda: ["a.txt"]).members
    fd = open_member(tmp_path, member)
    try:
        assert os.read(fd, 100) == b"before"
    finally:
        os.close(fd)
    time.sleep(0.02)
    write(tmp_path, "a.txt", b"after!")
    with pytest.raises(MemberChanged):
        open_member(tmp_path, member)


def test_stat_key_is_what_identifies_a_version(tmp_path: Path) -> None:
    path = write(tmp_path, "a", b"x")
    k1 = StatKey.of(os.lstat(path))
    os.chmod(path, 0o755)
    assert StatKey.of(os.lstat(path)) != k1  # a mode change is a new key (the exec bit)


@pytest.mark.allow_warning_logs
def test_cache_degrades_to_memory_on_a_full_disk_and_recovers(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for i in range(10):
        write(root, f"f{i}", os.urandom(1000))
    with small_tmpfs("4m") as state:
        file = state / "metacache"
        cache = MetadataCache.load(file)
        fill(state)
        assert_full(state)
        first = scan_tree(root, lambda: lister(root), cache, racy_margin_ns=0)
        assert first.stable and len(first.members) == 10
        assert cache.save() is False
        assert cache.degraded is not None and cache.degraded.startswith("ENOSPC")
        assert not file.exists() and not file.with_name("metacache.tmp").exists()
        # In memory it still skips every unchanged file.
        second = scan_tree(root, lambda: lister(root), cache, racy_margin_ns=0)
        assert second.stats.hashed == 0 and second.stats.cache_hits == 10
        free_fill(state)
        assert cache.save() is True and cache.degraded is None
        assert len(MetadataCache.load(file)) == 10


def test_immutable_names_are_trusted_from_the_cache_without_a_read(tmp_path: Path) -> None:
    write(tmp_path, "obj/aa", b"object one")
    write(tmp_path, "obj/bb", b"object two")
    write(tmp_path, "work.txt", b"work")
    cache = MetadataCache()

    def is_object(path: str) -> bool:
        return path.startswith("obj/")

    def run() -> ScanResult:
        return scan_tree(
            tmp_path, lambda: lister(tmp_path), cache, racy_margin_ns=0, immutable=is_object
        )

    first = run()
    assert first.stats.hashed == 3
    time.sleep(0.02)
    # Rewriting an object in place breaks Git's own rule; it shows that an
    # object known by name is neither lstat'ed nor read again.
    write(tmp_path, "obj/aa", b"OBJECT ONE")
    write(tmp_path, "work.txt", b"WORK")
    second = run()
    digests = {m.path: m.digest for m in second.members}
    assert digests["obj/aa"] == sha(b"object one") and digests["work.txt"] == sha(b"WORK")
    assert second.stats.hashed == 1
    (tmp_path / "obj" / "bb").unlink()  # a removal is still seen: the listing names paths
    write(tmp_path, "obj/cc", b"object three")  # and a new object is read once
    third = run()
    assert {m.path for m in third.members if m.kind == "file"} == {"obj/aa", "obj/cc", "work.txt"}
    assert third.stats.hashed == 1


def test_a_guess_of_the_listing_changes_nothing_but_the_order_of_work(tmp_path: Path) -> None:
    for i in range(30):
        write(tmp_path, f"d{i % 4}/f{i}", bytes([i]) * 10)
    plain = scan_tree(tmp_path, lambda: lister(tmp_path))
    (tmp_path / "d1" / "f1").unlink()
    write(tmp_path, "d9/new", b"new")
    guessed = scan_tree(tmp_path, lambda: lister(tmp_path), guess=plain.paths)
    expected = scan_tree(tmp_path, lambda: lister(tmp_path))
    assert guessed.stable and guessed.paths == expected.paths
    assert [m.to_json() for m in guessed.members] == [m.to_json() for m in expected.members]
    assert "d1/f1" in plain.paths and "d1/f1" not in guessed.paths


def narrow_scan(root: Path, cache: MetadataCache | None = None, **kw: Any) -> TreeScan:
    """A scan whose verify rechecks only ``meta/`` and the files it read."""

    def meta() -> list[str]:
        return [p for p in lister(root) if p == "meta" or p.startswith("meta/")]

    return TreeScan(
        root, lambda: lister(root), cache, recheck="meta", relist=meta, racy_margin_ns=0, **kw
    )


def test_a_narrowed_verify_rechecks_its_scope_and_the_files_read(tmp_path: Path) -> None:
    write(tmp_path, "meta/HEAD", b"ref: main")
    write(tmp_path, "meta/refs/main", b"1111")
    write(tmp_path, "work/a.txt", b"a")
    write(tmp_path, "work/z.txt", b"z")
    cache = MetadataCache()
    first = narrow_scan(tmp_path, cache, threads=1)
    first.read()
    assert first.verify().stable and len(cache) == 4

    # In scope: a member rewritten, added or removed after the read is unstable.
    for change in (
        lambda: write(tmp_path, "meta/HEAD", b"ref: other"),
        lambda: write(tmp_path, "meta/refs/new", b"2222"),
        lambda: (tmp_path / "meta" / "refs" / "new").unlink(),
    ):
        scan = narrow_scan(tmp_path, cache)
        scan.read()
        time.sleep(0.02)
        change()
        result = scan.verify()
        assert not result.stable and result.unstable[0].startswith("meta/")

    # Out of scope: a file the scan did not read (a cache hit) keeps what the
    # scan saw, whole; the next scan saves its change.
    scan = narrow_scan(tmp_path, cache)
    result = scan.read()
    assert result.stats.hashed == 0
    time.sleep(0.02)
    write(tmp_path, "work/a.txt", b"A")
    write(tmp_path, "work/new.txt", b"new")
    verified = scan.verify()
    assert verified.stable
    digests = {m.path: m.digest for m in verified.members}
    assert digests["work/a.txt"] == sha(b"a") and "work/new.txt" not in digests
    again = narrow_scan(tmp_path, cache, previous=scan)
    again.read()
    digests = {m.path: m.digest for m in again.verify().members}
    assert digests["work/a.txt"] == sha(b"A") and digests["work/new.txt"] == sha(b"new")


def test_a_narrowed_verify_rechecks_a_file_it_read(tmp_path: Path) -> None:
    write(tmp_path, "meta/HEAD", b"ref: main")
    write(tmp_path, "work/a.txt", b"one")
    write(tmp_path, "work/z.txt", b"two")

    def replace_a(full: str) -> None:  # a.txt is read before z.txt (threads=1)
        if full.endswith("z.txt"):
            write(tmp_path, "work/a.tmp", b"uno")
            os.replace(tmp_path / "work" / "a.tmp", tmp_path / "work" / "a.txt")

    scan = narrow_scan(tmp_path, threads=1, after_read=replace_a)
    scan.read()
    assert scan.verify().unstable == ["work/a.txt"]

    def remove_a(full: str) -> None:
        if full.endswith("z.txt"):
            (tmp_path / "work" / "a.txt").unlink(missing_ok=True)

    scan = narrow_scan(tmp_path, threads=1, after_read=remove_a)
    scan.read()
    assert scan.verify().unstable == ["work/a.txt"]


def test_a_parent_swapped_for_a_link_after_a_read_is_unstable(tmp_path: Path) -> None:
    write(tmp_path, "meta/HEAD", b"ref: main")
    write(tmp_path, "work/a.txt", b"inside")
    write(tmp_path, "outside/a.txt", b"secret")

    def swap(full: str) -> None:
        if full.endswith("work/a.txt") and (tmp_path / "work").is_dir():
            (tmp_path / "work").rename(tmp_path / "work.old")
            (tmp_path / "work").symlink_to("outside")

    scan = TreeScan(
        tmp_path,
        lambda: ["meta", "meta/HEAD", "work/a.txt"],
        None,
        recheck="meta",
        relist=lambda: ["meta", "meta/HEAD"],
        after_read=swap,
        threads=1,
    )
    scan.read()
    assert "work" in scan.verify().unstable


def test_recheck_and_relist_go_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        TreeScan(tmp_path, lambda: [], recheck="meta")


def reusing_scan(
    root: Path, cache: MetadataCache, previous: TreeScan | None, **kw: Any
) -> TreeScan:
    scan = TreeScan(root, lambda: lister(root), cache, previous=previous, **kw)
    scan.read()
    return scan


def test_a_scan_uses_the_last_scans_members_again_only_for_unchanged_keys(tmp_path: Path) -> None:
    for i in range(300):  # several runs of REUSE_RUN paths
        write(tmp_path, f"d{i % 7}/f{i:03}.txt", f"file {i}".encode())
    cache = MetadataCache()
    first = reusing_scan(tmp_path, cache, None, racy_margin_ns=0)
    first_members = first.verify().members
    second = reusing_scan(tmp_path, cache, first, racy_margin_ns=0)
    result = second.verify()
    assert result.stats.hashed == 0 and result.stats.cache_hits == 300
    assert all(a is b for a, b in zip(result.members, first_members, strict=True))

    time.sleep(0.02)
    old = os.lstat(tmp_path / "d3/f150.txt")
    write(tmp_path, "d3/f150.txt", b"FILE 150")  # same size, mtime put back
    os.utime(tmp_path / "d3/f150.txt", ns=(old.st_atime_ns, old.st_mtime_ns))
    write(tmp_path, "d0/f000.txt", b"now longer")
    write(tmp_path, "d6/new.txt", b"new")  # the listing changes
    (tmp_path / "d2/f002.txt").unlink()
    (tmp_path / "d4/f004.txt").unlink()
    (tmp_path / "d4/f004.txt").symlink_to("f011.txt")  # a file becomes a link
    third = reusing_scan(tmp_path, cache, second, racy_margin_ns=0)
    after = third.verify()
    assert after.stable and after.stats.hashed == 3
    by_path = {m.path: m for m in after.members}
    assert by_path["d3/f150.txt"].digest == sha(b"FILE 150")
    assert by_path["d0/f000.txt"].digest == sha(b"now longer")
    assert by_path["d6/new.txt"].digest == sha(b"new")
    assert by_path["d4/f004.txt"].kind == "symlink" and "d2/f002.txt" not in by_path
    fresh = scan(tmp_path, MetadataCache())
    assert [m.to_json() for m in after.members] == [m.to_json() for m in fresh.members]
    unchanged = {m.path: m for m in result.members}
    changed = {"d3/f150.txt", "d0/f000.txt", "d6/new.txt", "d4/f004.txt"}
    files = [m for m in after.members if m.kind == "file" and m.path not in changed]
    assert len(files) == 296 and all(m is unchanged[m.path] for m in files)


def test_files_changed_just_before_a_scan_are_read_again_by_the_next(tmp_path: Path) -> None:
    for i in range(200):
        write(tmp_path, f"d/f{i:03}.txt", f"file {i}".encode())
    cache = MetadataCache()
    first = reusing_scan(tmp_path, cache, None)  # the default margin: nothing cached
    assert first.verify().stats.hashed == 200
    second = reusing_scan(tmp_path, cache, first)
    assert second.verify().stats.hashed == 200  # not used again: not known to be whole
    path = tmp_path / "d/f007.txt"
    with open(path, "r+b") as fh:  # the same size, maybe the same timestamps
        fh.write(b"FILE")
    third = reusing_scan(tmp_path, cache, second)
    digests = {m.path: m.digest for m in third.verify().members}
    assert digests["d/f007.txt"] == sha(b"FILE 7")


def test_a_parent_replaced_by_a_link_hides_what_the_last_scan_saw_below_it(
    tmp_path: Path,
) -> None:
    for i in range(200):
        write(tmp_path, f"work/f{i:03}.txt", f"file {i}".encode())
    write(tmp_path, "outside/f000.txt", b"secret")
    names = [f"work/f{i:03}.txt" for i in range(200)]
    cache = MetadataCache()
    first = TreeScan(tmp_path, lambda: names, cache, racy_margin_ns=0)
    first.read()
    first.verify()
    (tmp_path / "work").rename(tmp_path / "work.old")
    (tmp_path / "work").symlink_to("work.old")  # the same files, through a link
    again = TreeScan(tmp_path, lambda: names, cache, racy_margin_ns=0, previous=first)
    result = again.read()
    assert result.members == []
    assert {p.path for p in result.problems} == set(names)
    assert {p.reason for p in result.problems} == {"below_non_directory:work"}


def test_the_cache_file_keeps_unchanged_records_and_rewrites_changed_ones(tmp_path: Path) -> None:
    file = tmp_path / "cache"
    cache = MetadataCache(file)
    key = StatKey(1, 2, 3, 0o100644, 4, 5)
    cache.put("a", key, sha(b"a"))
    cache.put("b", key, sha(b"b"))
    assert cache.save()
    cache.put("b", key._replace(ino=9), sha(b"B"))
    cache.put("c", key, sha(b"c"))
    cache.retain({"b", "c"})
    assert cache.save()
    loaded = MetadataCache.load(file)
    assert len(loaded) == 2 and loaded.get("a", key) is None
    assert loaded.get("b", key._replace(ino=9)) == sha(b"B") and loaded.get("c", key) == sha(b"c")
    loaded.put("d", key, sha(b"d"))
    assert loaded.save()
    assert MetadataCache.load(file).get("b", key._replace(ino=9)) == sha(b"B")
    assert len(MetadataCache.load(file)) == 3


def test_a_chain_of_scans_using_the_last_one_sees_what_a_fresh_scan_sees(tmp_path: Path) -> None:
    """Random changes between scans (contents of the same size with the mtime
    put back, growth, removals, new files, a file made a link or a
    directory, a directory renamed): each scan that uses the last one gives
    the members a scan with an empty cache gives."""
    rng = random.Random(1234)
    root = tmp_path / "tree"
    for i in range(400):
        write(root, f"d{i % 9}/s{i % 4}/f{i:03}.txt", f"file {i:03}".encode())
    cache = MetadataCache()
    last: TreeScan | None = None
    for _ in range(25):
        scan = TreeScan(root, lambda: lister(root), cache, racy_margin_ns=0, previous=last)
        scan.read()
        result = scan.verify()
        fresh = scan_tree(root, lambda: lister(root), MetadataCache())
        assert result.stable
        assert [m.to_json() for m in result.members] == [m.to_json() for m in fresh.members]
        assert [(p.path, p.reason) for p in result.problems] == [
            (p.path, p.reason) for p in fresh.problems
        ]
        last = scan
        time.sleep(0.02)  # past the coarse clock's tick
        files = sorted(
            p for p in lister(root) if (root / p).is_file() and not (root / p).is_symlink()
        )
        for _ in range(rng.randint(0, 12)):
            if not files:
                break
            path = root / rng.choice(files)
            if not path.is_file() or path.is_symlink():
                continue
            op = rng.randrange(7)
            if op == 0:
                old = os.stat(path)
                path.write_bytes(bytes(b ^ 1 for b in path.read_bytes()))
                os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
            elif op == 1:
                with open(path, "ab") as fh:
                    fh.write(b"+")
            elif op == 2:
                path.unlink()
            elif op == 3:
                write(path.parent, f"new{rng.randrange(10**6)}.txt", b"new")
            elif op == 4:
                path.unlink()
                path.symlink_to("elsewhere") if rng.random() < 0.5 else path.mkdir()
            elif op == 5:
                parent = path.parent
                parent.rename(parent.with_name(parent.name + "x"))
            else:
                write(path.parent, f"n{rng.randrange(10**6)}/deep/new.txt", b"deep")


def test_a_path_added_below_a_link_is_hidden_by_a_scan_using_the_last_one(tmp_path: Path) -> None:
    for i in range(50):
        write(tmp_path, f"work/f{i:02}.txt", f"file {i}".encode())
    write(tmp_path, "outside/x.txt", b"secret")
    (tmp_path / "new").symlink_to("outside")
    names = [f"work/f{i:02}.txt" for i in range(50)]
    cache = MetadataCache()
    first = TreeScan(tmp_path, lambda: names, cache, racy_margin_ns=0)
    first.read()
    first.verify()
    more = [*names, "new/x.txt", "work/sub/y.txt"]  # only additions
    again = TreeScan(tmp_path, lambda: more, cache, racy_margin_ns=0, previous=first)
    result = again.read()
    assert "new/x.txt" not in {m.path for m in result.members}
    assert [(p.path, p.reason) for p in result.problems] == [
        ("new/x.txt", "below_non_directory:new"),
        ("work/sub/y.txt", "below_non_directory:work/sub"),
    ]


def _cache_of(file: Path, count: int) -> MetadataCache:
    cache = MetadataCache.load(file)
    for i in range(count):
        cache.put(
            f"dir/file-{i}", (1, i, 10, 0o100644, i, i), hashlib.sha256(b"%d" % i).hexdigest()
        )
    return cache


def _entries(cache: MetadataCache) -> dict[str, tuple[tuple[int, ...], str]]:
    return dict(cache._entries)


def test_cache_file_grows_by_a_frame_per_save_and_is_rewritten_when_entries_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "metacache"
    cache = _cache_of(file, 100)
    assert cache.save()
    whole = file.stat().st_size
    assert whole > 100 * 80
    cache.put("dir/file-7", (1, 7, 11, 0o100644, 70, 70), "ab" * 32)  # changed
    cache.put("new-0", (1, 500, 1, 0o100644, 5, 5), "cd" * 32)  # added
    assert cache.save()
    grown = file.stat().st_size
    assert whole < grown < whole + 400  # one frame of two records, not the whole file
    assert _entries(MetadataCache.load(file)) == _entries(cache)
    assert MetadataCache.load(file).get("dir/file-7", (1, 7, 11, 0o100644, 70, 70)) == "ab" * 32
    assert cache.save() and file.stat().st_size == grown  # nothing new: nothing written

    cache.retain({f"dir/file-{i}" for i in range(50)})  # entries go: written whole
    assert cache.save()
    assert file.stat().st_size < whole
    reloaded = MetadataCache.load(file)
    assert len(reloaded) == 50 and _entries(reloaded) == _entries(cache)

    # Appended frames are bounded: past twice the whole size, written whole again.
    monkeypatch.setattr(scan_module, "CACHE_SLACK", 0)
    sizes = []
    for round_no in range(60):
        cache.put(f"dir/file-{round_no % 50}", (2, round_no, 1, 0o100644, 9, 9), "ef" * 32)
        assert cache.save()
        sizes.append(file.stat().st_size)
    assert max(sizes) <= 2 * sizes[0] + 200
    assert any(b < a for a, b in itertools.pairwise(sizes))  # a rewrite happened
    assert _entries(MetadataCache.load(file)) == _entries(cache)


@pytest.mark.allow_warning_logs
def test_a_torn_or_damaged_frame_keeps_what_precedes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = tmp_path / "metacache"
    cache = _cache_of(file, 100)
    assert cache.save()
    whole = file.read_bytes()
    for i in range(3):
        cache.put(f"new-{i}", (1, 900 + i, 1, 0o100644, i, i), "12" * 32)
    assert cache.save()
    full = file.read_bytes()
    assert len(full) > len(whole)

    for damaged in (full[:-5], full[:-1] + bytes([full[-1] ^ 1]), full + b"\0" * 4096):
        file.write_bytes(damaged)
        with caplog.at_level(logging.WARNING, logger="fsagent.scan"):
            caplog.clear()
            loaded = MetadataCache.load(file)
        if damaged.startswith(full):  # zeros after whole frames: the frames are kept
            assert len(loaded) == 103 and "damaged at its end" in caplog.text
        else:
            assert len(loaded) == 100 and "damaged at its end" in caplog.text
            assert loaded.key_of("new-0") is None
        # The next save writes the file whole: nothing is appended after damage.
        loaded.put("later", (1, 999, 1, 0o100644, 1, 1), "34" * 32)
        assert loaded.save()
        again = MetadataCache.load(file)
        assert len(again) == len(loaded) and again.get("later", (1, 999, 1, 0o100644, 1, 1))
        assert not file.read_bytes().endswith(b"\0")


def test_a_cache_file_of_the_first_format_is_read_and_then_rewritten(tmp_path: Path) -> None:
    file = tmp_path / "metacache"
    digest = hashlib.sha256(b"x").hexdigest()
    records = [
        scan_module._encode_record(f"p{i}", (1, i, 2, 0o100644, 3, 4), digest) for i in range(5)
    ]
    file.write_bytes(b"FSAMC1\n" + b"".join(records))
    cache = MetadataCache.load(file)
    assert len(cache) == 5 and cache.get("p3", (1, 3, 2, 0o100644, 3, 4)) == digest
    cache.put("p9", (1, 9, 2, 0o100644, 3, 4), digest)
    assert cache.save()
    assert file.read_bytes().startswith(b"FSAMC2\n")
    assert len(MetadataCache.load(file)) == 6
