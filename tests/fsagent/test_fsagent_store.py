"""The store's journal semantics and the bridge client, without a mount.

These pin down the contract the checkpoint shipper builds on: which change
set a sequence of mutations produces, and when acknowledging a checkpoint
clears a path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import httpx
import lmdb
import pyfuse3
import pytest
import trio

from common.errors import ResyncRequired
from common.types import Digest, FileVersion
from fsagent.bridge.http import HttpBridgeClient
from fsagent.errors import (
    ControllerRefused,
    ControllerUnavailable,
    ObjectUnavailable,
    StateBindingMismatch,
    StateCorrupt,
    StateForeign,
)
from fsagent.fuse.fs import WorkFolderFS
from fsagent.state.hydrate import ContentFetcher
from fsagent.state.statedir import discard_state_dir
from fsagent.state.store import (
    MARKER,
    ROOT_INODE,
    STATE_FORMAT,
    Binding,
    Change,
    InodeNo,
    ManifestRow,
    Store,
)
from tests.support.memclient import MemoryBridgeClient
from tests.support.pagecache import dirty_pages


def sha(data: bytes) -> Digest:
    return Digest(hashlib.sha256(data).hexdigest())


def row(path: str, data: bytes | None, version: int, exe: bool = False) -> ManifestRow:
    if data is None:
        return ManifestRow(path, "directory", None, 0, False, FileVersion(version))
    return ManifestRow(path, "file", sha(data), len(data), exe, FileVersion(version))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(tmp_path / "state")
    s.tree.hydrate([row("docs", None, 1), row("docs/a", b"A", 2), row("docs/b", b"B", 3),
               row("x/y/z", b"Z", 4, exe=True)], high_water=4)  # fmt: skip
    return s


def ino(store: Store, path: str) -> InodeNo:
    cur = ROOT_INODE
    for name in path.split("/"):
        found = store.tree.lookup(cur, name)
        assert found is not None, path
        cur = found
    return cur


def by_path(changes: list[Change]) -> dict[str, Change]:
    return {c.path: c for c in changes}


def test_hydrate_builds_the_tree_and_the_baseline(store: Store) -> None:
    assert [n for n, _ in store.tree.children(ROOT_INODE)] == ["docs", "x"]
    z = store.get(ino(store, "x/y/z"))
    assert z.digest == sha(b"Z") and z.executable and not z.upper
    assert store.journal.baseline().high_water == 4 and store.journal.baseline().hydrated
    assert store.changes_since_baseline() == []


def test_changes_coalesce_to_the_net_effect(store: Store) -> None:
    docs = ino(store, "docs")
    # Created then deleted: nothing.
    tmp = store.tree.create(docs, "tmp", "file", 0o644)
    store.tree.unlink(docs, "tmp", keep=False)
    # Unchanged file renamed: delete + reference to its saved digest.
    store.tree.rename(docs, "a", ROOT_INODE, "a2", keep_replaced=lambda _: False)
    # Renamed away and back: nothing.
    store.tree.rename(docs, "b", ROOT_INODE, "b-tmp", keep_replaced=lambda _: False)
    store.tree.rename(ROOT_INODE, "b-tmp", docs, "b", keep_replaced=lambda _: False)
    # Exec bit flipped on a saved file: reference with the new bit, no upload.
    z = store.get(ino(store, "x/y/z"))
    z.mode = 0o644
    store.tree.persist(z, touch="chmod")
    # A new directory.
    store.tree.create(ROOT_INODE, "new", "directory", 0o755)
    changes = by_path(store.changes_since_baseline())
    assert set(changes) == {"docs/a", "a2", "x/y/z", "new"}, changes
    assert changes["docs/a"].action == "delete" and changes["docs/a"].base is not None
    assert changes["a2"].action == "reference" and changes["a2"].digest == sha(b"A")
    assert changes["x/y/z"].action == "reference" and not changes["x/y/z"].executable
    assert changes["new"].action == "mkdir"
    assert tmp.upper  # new files are upper-only from the start
    # Parents come before children in the listing.
    paths = [c.path for c in store.changes_since_baseline()]
    assert paths == sorted(paths)


def test_directory_rename_lists_every_moved_path(store: Store) -> None:
    store.tree.rename(ROOT_INODE, "docs", ROOT_INODE, "papers", keep_replaced=lambda _: False)
    changes = by_path(store.changes_since_baseline())
    assert {p: c.action for p, c in changes.items()} == {
        "docs": "delete", "docs/a": "delete", "docs/b": "delete",
        "papers": "mkdir", "papers/a": "reference", "papers/b": "reference",
    }  # fmt: skip


def test_directory_link_counts_follow_every_change_and_a_fresh_count(store: Store) -> None:
    def links(*inos: InodeNo) -> tuple[int, ...]:
        return tuple(store.tree.nlink(store.get(i)) for i in inos)

    docs, x, y = ino(store, "docs"), ino(store, "x"), ino(store, "x/y")
    # Counted from the hydrated records: the root has docs and x (an ancestor
    # the manifest did not list), x has y; a file has one link.
    assert links(ROOT_INODE, docs, x, y) == (4, 2, 3, 2)
    assert links(ino(store, "docs/a")) == (1,)
    store.tree.create(docs, "sub", "directory", 0o755)
    store.tree.rename(x, "y", docs, "y", keep_replaced=lambda _: False)
    assert links(docs, x) == (4, 2)
    store.tree.create(x, "file", "file", 0o644)
    store.tree.exchange(docs, "sub", x, "file")  # a directory and a file swap parents
    assert links(docs, x) == (3, 3)
    gone = store.tree.unlink(x, "file", keep=True)  # the directory, removed while in use
    assert store.tree.nlink(gone) == 0 and links(x) == (2,)
    counted = links(ROOT_INODE, docs, x)
    store.close()
    fresh = Store.open(store.root)  # counted again from the records
    assert (
        tuple(fresh.tree.nlink(fresh.get(i)) for i in (ROOT_INODE, docs, x)) == counted == (4, 3, 2)
    )
    fresh.close()


@pytest.mark.allow_warning_logs
def test_times_written_behind_survive_a_failed_commit_and_a_reopen(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = WorkFolderFS(store, ContentFetcher(store, MemoryBridgeClient(), "agent"))
    a = ino(store, "docs/a")
    attr = pyfuse3.EntryAttributes()
    attr.st_atime_ns, attr.st_mtime_ns = 4_000_000_007, 5_000_000_009
    times_only = SimpleNamespace(update_atime=True, update_mtime=True, update_ctime=False,
                                 update_mode=False, update_uid=False, update_gid=False,
                                 update_size=False)  # fmt: skip
    trio.run(fs.setattr, a, attr, times_only, None, None)
    assert (store.get(a).atime_ns, store.get(a).mtime_ns) == (4_000_000_007, 5_000_000_009)

    def disk_full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "state database: no space")

    monkeypatch.setattr(store.tree, "write_behind", disk_full)
    fs.flush_behind()  # logged; the times wait for the next flush
    monkeypatch.undo()
    fs.flush_behind()
    assert store.changes_since_baseline() == []  # times are not shipped
    store.close()
    reopened = Store.open(store.root)
    assert (reopened.get(a).atime_ns, reopened.get(a).mtime_ns) == (4_000_000_007, 5_000_000_009)
    reopened.close()


@pytest.mark.allow_warning_logs
def test_a_record_kept_behind_stays_cached_while_it_cannot_be_committed(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A WRITE to a durable file keeps its new size and generation in the
    cached record for the next batch. If the kernel forgets the inode while
    that batch cannot commit (the disk full), the record is not evicted:
    evicted, the next lookup would read the old size from LMDB and a save
    would ship the file cut short and take it as saved."""
    fs = WorkFolderFS(store, ContentFetcher(store, MemoryBridgeClient(), "agent"))
    a = ino(store, "docs/a")
    node = store.get(a)
    node.size, node.generation = node.size + 4096, node.generation + 1
    fs._record_behind(a)  # what Content.write does for a durable file

    def disk_full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "state database: no space")

    monkeypatch.setattr(store.tree, "write_behind", disk_full)
    fs._maybe_free(a)  # the kernel forgot it; the batch fails
    assert store.get(a) is node  # still the cached record, not LMDB's
    monkeypatch.undo()
    fs.flush_behind()
    fs._maybe_free(a)
    store.close()
    reopened = Store.open(store.root)
    assert (reopened.get(a).size, reopened.get(a).generation) == (node.size, node.generation)
    reopened.close()


def test_acknowledge_clears_only_what_did_not_change_meanwhile(store: Store) -> None:
    docs = ino(store, "docs")
    f = store.tree.create(docs, "new", "file", 0o644)
    f.size, f.generation = 3, 1
    store.tree.persist(f, touch="write")
    g = store.tree.create(docs, "busy", "file", 0o644)
    store.tree.unlink(docs, "a", keep=False)
    snapshot = by_path(store.changes_since_baseline())
    # While the checkpoint is in flight, "busy" is written again.
    g.generation += 1
    store.tree.persist(g, touch="write")
    shipped = [(snapshot["docs/new"], sha(b"new"), FileVersion(10)),
               (snapshot["docs/busy"], sha(b""), FileVersion(11)),
               (snapshot["docs/a"], None, FileVersion(12))]  # fmt: skip
    assert store.acknowledge(shipped, high_water=12) == 2
    after = by_path(store.changes_since_baseline())
    assert set(after) == {"docs/busy"}, after
    assert after["docs/busy"].base is not None and after["docs/busy"].base.version == 11
    assert store.journal.baseline().high_water == 12


def test_binding_is_recorded_once_and_enforced(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "s")
    b = Binding("c1", "agent", "a1", {"task": None, "agent": "a1", "user": None, "project": None})
    s.dir.bind(b)
    s.dir.bind(b)
    other = Binding("c1", "agent", "a1", {**b.owners, "task": "t9"})
    with pytest.raises(StateBindingMismatch, match="task=t9"):
        s.dir.bind(other)
    s.close()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x").write_text("x")
    with pytest.raises(StateForeign):
        Store.open(tmp_path / "foreign")


def test_recover_frees_orphans_and_trusts_upper_file_sizes(store: Store) -> None:
    docs = ino(store, "docs")
    f = store.tree.create(docs, "w", "file", 0o644)
    store.tree.drop_inline(f)  # a large file: its bytes live in upper/
    store.upper.path(f.ino).write_bytes(b"written before the crash")
    o = store.tree.create(docs, "o", "file", 0o644)
    store.tree.drop_inline(o)
    store.upper.path(o.ino).write_bytes(b"orphan")
    store.tree.unlink(docs, "o", keep=True)
    # A crash while a file moved out of line leaves both copies: inline wins.
    m = store.tree.create(docs, "moving", "file", 0o644)
    m.size = 5
    store.tree.persist(m, touch="write", inline=b"small")
    store.upper.path(m.ino).write_bytes(b"small and then some")
    # The upper file of a spilled file that never reached the disk.
    lost = store.tree.create(docs, "lost", "file", 0o644)
    lost.size = 9
    store.tree.drop_inline(lost)
    root = store.root
    store.close()
    again = Store.open(root)
    assert again.tree.recover() == (1, 2)
    assert again.get(f.ino).size == len(b"written before the crash")
    assert not again.upper.path(o.ino).exists()
    with pytest.raises(KeyError):
        again.get(o.ino)
    assert again.get(m.ino).size == 5 and again.inline_data(m.ino) == b"small"
    assert not again.upper.path(m.ino).exists()
    assert again.get(lost.ino).size == 0 and again.inline_data(lost.ino) == b""


def test_small_files_live_inline_and_leave_no_file_on_disk(store: Store) -> None:
    docs = ino(store, "docs")
    f = store.tree.create(docs, "note", "file", 0o644)
    assert store.inline_data(f.ino) == b""
    f.size = 4
    store.tree.persist(f, touch="write", inline=b"abcd")
    assert store.inline_data(f.ino) == b"abcd"
    assert os.listdir(store.upper.directory) == []
    store.tree.unlink(docs, "note", keep=False)
    assert store.inline_data(f.ino) is None
    with pytest.raises(KeyError):
        store.get(f.ino)


def test_format_1_state_dir_is_upgraded_and_a_newer_format_refused(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "s")
    s.close()
    marker = tmp_path / "s" / MARKER
    marker.write_text(json.dumps({"kind": "fsagent-state", "format": 1}) + "\n")
    env = lmdb.open(str(tmp_path / "s" / "db"), max_dbs=8)
    meta, inline = env.open_db(b"meta"), env.open_db(b"inline")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"1", db=meta)
        txn.drop(inline, delete=True)  # format 1 had no inline database
    env.close()
    # Read-only (fsagent status) leaves a format-1 dir as it is.
    ro = Store.open(tmp_path / "s", readonly=True)
    ro.close()
    assert json.loads(marker.read_text())["format"] == 1
    up = Store.open(tmp_path / "s")
    assert json.loads(marker.read_text())["format"] == STATE_FORMAT == 5
    up.close()
    marker.write_text(json.dumps({"kind": "fsagent-state", "format": 6}) + "\n")
    with pytest.raises(StateCorrupt, match="unsupported state format 6"):
        Store.open(tmp_path / "s")


# --- bridge client --------------------------------------------------------------


def run_client(handler: object, fn: str, *args: object, deadline: float = 2.0) -> object:
    transport = httpx.MockTransport(handler)  # type: ignore[arg-type]

    async def main() -> object:
        client = HttpBridgeClient("http://ctl", "tok", retry_deadline=deadline, transport=transport)
        try:
            return await getattr(client, fn)(*args)
        finally:
            await client.aclose()

    return trio.run(main)


RUN = {"runId": "r", "companyId": "c", "agentId": "a", "leaseEpoch": 2, "active": True,
       "bindings": {"task": None, "agent": "a", "user": None, "project": "p"}}  # fmt: skip


def test_client_retries_transient_failures_then_succeeds() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["authorization"])
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        if len(calls) == 2:
            return httpx.Response(503, json={"code": "database_unavailable"})
        return httpx.Response(200, json=RUN)

    run = run_client(handler, "get_run")
    assert run.bindings == RUN["bindings"] and len(calls) == 3
    assert calls[0] == "Bearer tok"


def test_client_does_not_retry_permanent_refusals() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(401, json={"code": "unauthenticated", "error": "bad token"})

    with pytest.raises(ControllerRefused, match="401 unauthenticated bad token"):
        run_client(handler, "get_run")
    assert calls == 1

    def gone(request: httpx.Request) -> httpx.Response:
        return httpx.Response(410, json={"code": "resync_required"})

    async def list_all() -> None:
        client = HttpBridgeClient("http://ctl", "t", transport=httpx.MockTransport(gone))
        async for _ in client.iter_manifest("agent", 5):
            pass

    with pytest.raises(ControllerRefused) as gone_info:
        trio.run(list_all)
    assert gone_info.value.status == 410 and gone_info.value.means(ResyncRequired)


def test_client_gives_up_at_the_deadline_naming_what_it_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "fsagent.client")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502)

    with pytest.raises(ControllerUnavailable, match=r"GET run: gave up after \d+ attempts"):
        run_client(handler, "get_run", deadline=0.5)
    # Each retry is logged (quiet at first, a warning once it keeps failing).
    assert any("GET run failed" in r.getMessage() for r in caplog.records)


def test_client_pages_manifests_and_streams_objects(tmp_path: Path) -> None:
    pages = {0: {"entries": [{"path": "a", "kind": "file", "digest": sha(b"a"), "byteSize": 1,
                              "executable": False, "version": 3, "deleted": False}],
                 "nextSince": 3, "highWater": 9},
             3: {"entries": [{"path": "b", "kind": "directory", "digest": None, "byteSize": 0,
                              "executable": False, "version": 7, "deleted": False}],
                 "nextSince": None, "highWater": 10}}  # fmt: skip

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/manifest"):
            return httpx.Response(200, json=pages[int(request.url.params["since"])])
        if request.url.path.endswith(sha(b"payload")):
            return httpx.Response(200, content=b"payload")
        return httpx.Response(404, json={"code": "not_found"})

    async def main() -> None:
        client = HttpBridgeClient("http://ctl", "t", transport=httpx.MockTransport(handler))
        got = [p async for p in client.iter_manifest("agent")]
        assert [e.path for p in got for e in p.entries] == ["a", "b"]
        assert {p.high_water for p in got} == {9}  # the first page's mark is the baseline
        digest, size = await client.fetch_object("agent", sha(b"payload"), tmp_path / "o")
        assert (digest, size) == (sha(b"payload"), 7)
        with pytest.raises(ObjectUnavailable):
            await client.fetch_object("agent", sha(b"other"), tmp_path / "p")
        await client.aclose()

    trio.run(main)


def test_a_discarded_state_dir_is_whole_or_empty(tmp_path: Path) -> None:
    """The agent folder's discard: the state dir leaves in one rename (one an
    interrupted discard left is removed first), an empty one stays, and a
    fresh store opens there."""
    root = tmp_path / "agent"
    store = Store.open(root)
    store.dir.bind(
        Binding("c1", "agent", "a1", {"task": None, "agent": "a1", "user": None, "project": None})
    )
    store.close()
    assert (root / MARKER).is_file() and (root / "db").is_dir()
    left_over = tmp_path / ".agent.discarded"
    (left_over / "db").mkdir(parents=True)
    discard_state_dir(root)
    assert root.is_dir() and list(root.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent"]
    fresh = Store.open(root)
    try:
        assert fresh.dir.binding() is None
    finally:
        fresh.close()


def test_start_writeback_sends_the_dirty_pages_of_the_state_to_disk(store: Store) -> None:
    """Commits are sync=False: their pages stay dirty until written back.
    start_writeback submits every one of them at once (the kernel itself
    waits up to 30 s); nothing is dirty right after it."""
    data = store.dir.root / "db" / "data.mdb"
    docs = ino(store, "docs")
    for i in range(64):
        node = store.tree.create(docs, f"new{i}", "file", 0o644)
        node.size = 30_000
        store.tree.persist(node, touch="write", inline=os.urandom(30_000))
    assert dirty_pages(data) > 0
    store.dir.env.start_writeback()
    assert dirty_pages(data) == 0  # every one is on its way to the disk
