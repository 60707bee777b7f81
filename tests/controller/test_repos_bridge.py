"""Repository checkpoints over the bridge, against a real controller and
PostgreSQL: commits whole and delta, replay and conflicts, lease fencing,
what a checkpoint may reference, and reading a checkpoint back for a restore
(manifest and batched objects, SHA-256 checked)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time
import uuid
from typing import Any

import pytest

from tests.support.controller import PgCluster, Tenant, bootstrap_tenant, private_controller
from tests.support.repos import (
    RepoRun,
    decode_batch,
    file_member,
    link_member,
    members_of,
    repo_run,
    restart,
    sha,
    small_repo,
)


def current_id(run: RepoRun, ws: str) -> str | None:
    (listed,) = [r for r in run.listing()["repos"] if r["workspaceId"] == ws]
    current = listed["current"]
    return None if current is None else str(current["checkpointId"])


def checkpoints(run: RepoRun) -> int:
    with run.tenant.controller.db() as db:
        row = db.execute(
            "SELECT count(*) FROM repo_checkpoints WHERE task_id = %s", (run.task,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_full_then_delta_checkpoints_and_the_manifest_they_make(tenant: Tenant) -> None:
    run = repo_run(tenant)
    ws = run.ws()
    assert current_id(run, ws) is None
    assert run.manifest(ws).status_code == 404
    tree = small_repo()
    first = run.save(ws, tree)
    assert set(first) == {"operationId", "checkpointId", "entries", "byteSize", "savedAt"}
    assert first["entries"] == len(tree)
    assert first["byteSize"] == sum(len(c) for c in tree.values() if isinstance(c, bytes))
    assert current_id(run, ws) == first["checkpointId"]

    changed = b"print('changed')\n"
    added = os.urandom(3000)
    run.upload_all(ws, [changed, added])
    r = run.commit(
        ws,
        [
            file_member("src/main.py", changed),
            file_member("data/blob.bin", added, executable=True),
            link_member("latest", "data/blob.bin"),
        ],
        base=first["checkpointId"],
        removed=["docs/link.md", "bin/run.sh"],
    )
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["checkpointId"] != first["checkpointId"]
    assert second["entries"] == len(tree) + 2 - 2  # two added, one changed, two removed
    body = run.manifest(ws).json()
    assert body["checkpointId"] == second["checkpointId"]
    by_path = {m["path"]: m for m in body["members"]}
    assert [m["path"] for m in body["members"]] == sorted(by_path)
    assert "docs/link.md" not in by_path and "bin/run.sh" not in by_path
    assert by_path["src/main.py"] == file_member("src/main.py", changed)
    assert by_path["data/blob.bin"]["executable"] is True
    assert by_path["latest"] == link_member("latest", "data/blob.bin")
    assert by_path[".git"] == {"path": ".git", "kind": "dir"}
    assert run.manifest(ws, second["checkpointId"]).status_code == 200
    # Only the current checkpoint is served.
    assert run.manifest(ws, first["checkpointId"]).status_code == 404
    assert run.manifest(ws, str(uuid.uuid4())).status_code == 404

    # A delta on the old base is refused; the pointer stays.
    r = run.commit(ws, [file_member("src/main.py", changed)], base=first["checkpointId"])
    assert r.status_code == 409 and r.json()["code"] == "base_mismatch"
    assert current_id(run, ws) == second["checkpointId"]
    # A whole checkpoint replaces whatever is current.
    third = run.save(ws, tree)
    assert current_id(run, ws) == third["checkpointId"]
    assert sorted(m["path"] for m in run.manifest(ws).json()["members"]) == sorted(tree)


def test_replay_returns_the_receipt_and_another_body_is_a_conflict(tenant: Tenant) -> None:
    run = repo_run(tenant)
    ws = run.ws()
    tree = small_repo()
    run.upload_all(ws, [c for c in tree.values() if isinstance(c, bytes)])
    op = str(uuid.uuid4())
    first = run.commit(ws, members_of(tree), operation_id=op)
    assert first.status_code == 200
    again = run.commit(ws, members_of(tree), operation_id=op)
    assert again.status_code == 200
    assert again.json() == {**first.json(), "replayed": True}
    assert checkpoints(run) == 1
    other = run.commit(ws, members_of(tree)[:-1], operation_id=op)
    assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"
    assert current_id(run, ws) == first.json()["checkpointId"]
    # A replay after another commit still answers the original receipt.
    run.save(ws, tree)
    late = run.commit(ws, members_of(tree), operation_id=op)
    assert late.json() == {**first.json(), "replayed": True}


def test_an_old_lease_epoch_or_a_superseded_run_cannot_advance_the_pointer(
    tenant: Tenant,
) -> None:
    old = repo_run(tenant, sandbox="box-1")
    ws = old.ws()
    tree = small_repo()
    saved = old.save(ws, tree)
    r = old.commit(ws, members_of(tree), lease_epoch=old.lease_epoch + 1)
    assert r.status_code == 409 and r.json()["code"] == "stale_lease"
    new = restart(old, sandbox="box-1")
    assert new.lease_epoch == old.lease_epoch + 1
    # The superseded run's token is refused outright.
    r = old.commit(ws, members_of(tree))
    assert r.status_code == 401
    assert current_id(new, ws) == saved["checkpointId"]
    # ...also its replay of a committed operation.
    assert old.commit(ws, members_of(tree), operation_id=saved["operationId"]).status_code == 401


def test_a_run_superseded_while_its_commit_waits_is_refused_inside_the_transaction(
    tenant: Tenant,
) -> None:
    """The commit authenticated before the new lease; the lease is re-checked
    under the locks of the transaction that would advance the pointer."""
    old = repo_run(tenant, sandbox="box-2")
    ws = old.ws()
    tree = small_repo()
    saved = old.save(ws, tree)
    changed = b"changed by the old run\n"
    old.upload_all(ws, [changed])
    ctl = tenant.controller
    with ctl.db() as blocker:
        blocker.autocommit = False
        # Hold the task's repository lock: the commit waits inside its transaction.
        blocker.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (0x726570, old.task))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                old.commit, ws, [file_member("README.md", changed)], base=saved["checkpointId"]
            )
            deadline = time.monotonic() + 30
            while not _waiting_on_repo_lock(ctl, old.task):
                assert time.monotonic() < deadline, "the commit never reached the lock"
                time.sleep(0.05)
            new = restart(old, sandbox="box-2")
            blocker.rollback()
            r = pending.result(timeout=60)
    assert r.status_code == 409 and r.json()["code"] == "stale_lease", r.text
    assert current_id(new, ws) == saved["checkpointId"]
    assert checkpoints(new) == 1


def _waiting_on_repo_lock(ctl: Any, task: str) -> bool:
    with ctl.db() as db:
        row = db.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND NOT l.granted AND l.classid = %s",
            (0x726570,),
        ).fetchone()
    assert row is not None
    return int(row[0]) > 0


def test_missing_names_what_the_task_cannot_reference_yet(tenant: Tenant) -> None:
    run = repo_run(tenant, {"app": "https://h/app.git", "lib": "https://h/lib.git"})
    app, lib = run.ws("app"), run.ws("lib")
    blobs = [os.urandom(100) for _ in range(3)]
    digests = [sha(b) for b in blobs]
    assert run.missing(app, digests).json() == {"missing": digests}
    run.upload_all(app, blobs[:1])
    assert run.missing(app, digests).json() == {"missing": digests[1:]}
    tree = {**small_repo(), "one.bin": blobs[0]}
    run.save(app, tree)
    # Another sandbox of the same task, and another workspace of the task, can
    # reference what the task's current checkpoints reference.
    other = restart(run)
    assert other.missing(lib, digests).json() == {"missing": digests[1:]}
    r = other.commit(lib, [*members_of(small_repo()), file_member("one.bin", blobs[0])])
    assert r.status_code == 200, r.text
    # Another task of the company cannot, even with the same hash in hand.
    stranger = repo_run(tenant, {"app": "https://h/app.git"})
    assert stranger.missing(stranger.ws(), digests).json() == {"missing": digests}
    r = stranger.commit(
        stranger.ws(), [*members_of(small_repo()), file_member("one.bin", blobs[0])]
    )
    assert r.status_code == 422 and r.json()["code"] == "unknown_content"
    for bad in ({"digests": ["XYZ"]}, {"digests": "x"}, {"other": []}):
        with run.client() as c:
            assert c.post(f"/repos/{app}/missing", json=bad).status_code == 400


def test_objects_are_fetched_in_batches_and_verify(tenant: Tenant) -> None:
    run = repo_run(tenant)
    ws = run.ws()
    big = os.urandom(9 << 20)  # three frames, incompressible
    text = b"line of text\n" * 200_000  # compressible
    empty = b""
    tree = {**small_repo(), "big.bin": big, "text.txt": text, "empty": empty}
    first = run.save(ws, tree)
    wanted = [sha(big), sha(empty), sha(text), sha(big)]
    r = run.fetch(ws, wanted)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    got = decode_batch(r.content)
    assert [d.hex() for d, _ in got] == wanted
    assert [hashlib.sha256(data).hexdigest() for _, data in got] == wanted
    assert got[0][1] == big and got[2][1] == text and got[1][1] == b""
    assert len(r.content) < len(big) * 2 + len(text) // 4  # the text went compressed

    # A superseded object is no longer served; nor an object of another binding.
    run.upload_all(ws, [b"v2"])
    r = run.commit(ws, [file_member("big.bin", b"v2")], base=first["checkpointId"])
    assert r.status_code == 200, r.text
    r = run.fetch(ws, [sha(text), sha(big)])
    assert r.status_code == 404 and r.json()["details"] == [{"digest": sha(big)}]
    lib = repo_run(tenant, {"lib": "https://h/lib.git"}, project=run.project, task=run.task)
    r = lib.fetch(lib.ws("lib"), [sha(text)])
    assert r.status_code == 404
    for bad in ({"digests": [sha(text)] * 1025}, {"digests": ["nothex"]}):
        assert run.fetch(ws, bad["digests"]).status_code == 400


def test_another_tasks_workspace_is_not_found_on_every_route(tenant: Tenant) -> None:
    mine = repo_run(tenant)
    theirs = repo_run(tenant)
    ws = theirs.ws()
    theirs.save(ws, small_repo())
    routes: list[tuple[str, str, Any]] = [
        ("POST", f"/repos/{ws}/missing", {"json": {"digests": []}}),
        ("PUT", f"/repos/{ws}/uploads", {"content": b""}),
        ("PUT", f"/repos/{ws}/uploads/batch", {"content": b""}),
        (
            "POST",
            f"/repos/{ws}/checkpoints",
            {"json": {"operationId": "x", "leaseEpoch": 1, "members": []}},
        ),
        ("GET", f"/repos/{ws}/checkpoints/current/manifest", {}),
        ("POST", f"/repos/{ws}/objects/batch", {"json": {"digests": []}}),
        ("POST", f"/repos/{ws}/report", {"json": {"state": "saving"}}),
        ("GET", f"/repos/{uuid.uuid4()}/checkpoints/current/manifest", {}),
        ("GET", "/repos/not-a-uuid/checkpoints/current/manifest", {}),
    ]
    with mine.client() as c:
        for method, path, kwargs in routes:
            r = c.request(method, path, **kwargs)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
    assert [r["workspaceId"] for r in mine.listing()["repos"]] == [mine.ws()]


def test_report_makes_the_save_state_visible(tenant: Tenant) -> None:
    run = repo_run(tenant)
    ws = run.ws()
    url = f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos"

    def shown() -> dict[str, Any]:
        with tenant.client() as c:
            (repo,) = c.get(url).json()["repos"]
        return dict(repo)

    assert shown()["state"] == "unsaved"
    with run.client() as c:
        assert c.post(f"/repos/{ws}/report", json={"state": "saving"}).json() == {"state": "saving"}
        assert shown()["state"] == "saving"
        r = c.post(f"/repos/{ws}/report", json={"state": "failed", "error": "index.lock held"})
        assert r.status_code == 200
        assert (shown()["state"], shown()["error"]) == ("failed", "index.lock held")
        for bad in (
            {"state": "saved"},
            {"state": "failed", "error": 3},
            {"state": "saving", "x": 1},
        ):
            assert c.post(f"/repos/{ws}/report", json=bad).status_code == 400
    run.save(ws, small_repo())
    assert (shown()["state"], shown()["error"]) == ("saved", None)


def test_config_keeps_only_portable_keys(tenant: Tenant) -> None:
    run = repo_run(tenant)
    ws = run.ws()
    config = [
        ["core.repositoryformatversion", "0"],
        ["core.fsmonitor", "touch /tmp/pwned"],
        ["include.path", "/etc/x"],
        ["includeIf.gitdir:/x/.path", "/etc/x"],
        ["remote.origin.url", "https://attacker.example/x.git"],
        ["branch.main.remote", "origin"],
        ["branch.main.merge", "refs/heads/main"],
    ]
    saved = run.save(ws, small_repo(), config=config)
    assert run.manifest(ws).json()["config"] == [
        ["branch.main.merge", "refs/heads/main"],
        ["branch.main.remote", "origin"],
        ["core.repositoryformatversion", "0"],
    ]
    # A delta replaces the config whole.
    r = run.commit(ws, [], base=saved["checkpointId"], config=[["extensions.objectFormat", "sha1"]])
    assert r.status_code == 200
    assert run.manifest(ws).json()["config"] == [["extensions.objectformat", "sha1"]]


def test_a_save_that_outlives_its_upload_pins_is_refused_visibly(pg_cluster: PgCluster) -> None:
    """A repository upload pins its object for --repo-upload-ttl (an hour by
    default); a commit after that is unknown_content and the binding says so."""
    with private_controller(pg_cluster, "fsa-repottl-", "--repo-upload-ttl", "3") as ctl:
        tenant = bootstrap_tenant(ctl)
        run = repo_run(tenant)
        ws = run.ws()
        tree = small_repo()
        run.upload_all(ws, [c for c in tree.values() if isinstance(c, bytes)])
        time.sleep(3.5)
        digests = [sha(c) for c in tree.values() if isinstance(c, bytes)]
        assert sorted(run.missing(ws, digests).json()["missing"]) == sorted(set(digests))
        r = run.commit(ws, members_of(tree))
        assert r.status_code == 422 and r.json()["code"] == "unknown_content"
        with tenant.client() as c:
            (repo,) = c.get(f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos").json()[
                "repos"
            ]
        assert repo["state"] == "failed" and repo["error"].startswith("unknown_content")
        assert repo["checkpointId"] is None
        # Uploading again (and committing within the TTL) makes the same commit succeed.
        run.save(ws, tree)


@pytest.mark.parametrize("changes", [10])
def test_a_small_delta_on_a_large_checkpoint_costs_what_changed(
    tenant: Tenant, changes: int
) -> None:
    """20,000 members, then a delta of 10 changed files: the commit writes rows
    for the changes only, stores its manifest as a delta, and is fast (the
    figure is printed)."""
    run = repo_run(tenant)
    ws = run.ws()
    blobs = [f"file {i}\n".encode() * 3 for i in range(20_000 - len(small_repo()))]
    run.upload_all(ws, [*blobs, *(c for c in small_repo().values() if isinstance(c, bytes))])
    members = members_of(small_repo()) + [
        file_member(f"src/m{i // 500:03d}/f{i:05d}.py", b) for i, b in enumerate(blobs)
    ]
    assert len(members) == 20_000
    started = time.perf_counter()
    r = run.commit(ws, members)
    full_seconds = time.perf_counter() - started
    assert r.status_code == 200, r.text
    base = r.json()["checkpointId"]
    with tenant.controller.db() as db:
        refs_before = db.execute(
            "SELECT count(*) FROM repo_refs WHERE task_id = %s", (run.task,)
        ).fetchone()
    assert refs_before is not None and refs_before[0] == 20_000 - 2 + 1  # dirs and link carry none
    new = [f"changed {i}\n".encode() for i in range(changes)]
    run.upload_all(ws, new)
    delta = [file_member(members[100 + i]["path"], b) for i, b in enumerate(new)]
    timings = []
    for attempt in range(2):
        started = time.perf_counter()
        r = run.commit(ws, delta, base=base)
        timings.append(time.perf_counter() - started)
        assert r.status_code == 200, r.text
        base = r.json()["checkpointId"]
        # Then the files' first contents again.
        delta = [members[100 + i] for i in range(changes)]
        with tenant.controller.db() as db:
            rows = db.execute(
                "SELECT count(*) FROM repo_refs WHERE task_id = %s", (run.task,)
            ).fetchone()
        # The same number of files; one manifest object more: the delta's,
        # on the full one (which its chain keeps referenced).
        assert rows is not None and rows[0] == refs_before[0] + 1 + attempt
    with tenant.controller.db() as db:
        sizes = [
            int(row[0])
            for row in db.execute(
                "SELECT o.byte_size FROM repo_checkpoints c JOIN objects o"
                " ON o.company_id = c.company_id AND o.digest = c.manifest_digest"
                " WHERE c.task_id = %s ORDER BY c.created_at",
                (run.task,),
            ).fetchall()
        ]
    assert len(sizes) == 3 and max(sizes[1:]) * 50 < sizes[0], sizes  # deltas are stored as such
    print(
        f"\nrepository commit, 20,000 members: full {full_seconds:.3f} s;"
        f" {changes}-change delta {timings[0]:.3f} s, {timings[1]:.3f} s"
    )
    # Generous for a loaded shared machine; a commit that rewrote the
    # checkpoint's rows (as the full one does) takes several times longer.
    assert min(timings) < 3.0
