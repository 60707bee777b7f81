"""GC and repository checkpoints: the current checkpoint's objects and manifest
stay while the task's binding exists (also once its workspace is removed);
superseded ones are deleted after the delay. Real controller (GC delay of a
few seconds, sweeps on demand), PostgreSQL and local-disk storage."""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.repomanifest import MAX_CHAIN
from controller.storage.base import object_key
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    bootstrap_tenant,
    private_controller,
)
from tests.support.repos import (
    RepoRun,
    decode_batch,
    file_member,
    members_of,
    repo_run,
    restart,
    sha,
    small_repo,
)

DELAY = 3.0


@pytest.fixture(scope="module")
def gc_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    with private_controller(pg_cluster, "fsa-repogc-", "--gc-delay", str(DELAY)) as ctl:
        yield ctl


def stored(run: RepoRun, digest: str) -> bool:
    ctl = run.tenant.controller
    path: Path = ctl.data_dir / "objects" / object_key(run.tenant.company_id, digest)
    return path.is_file()


def manifests(run: RepoRun) -> dict[str, str]:
    """Checkpoint id -> manifest digest, for the run's task."""
    with run.tenant.controller.db() as db:
        rows = db.execute(
            "SELECT id::text, manifest_digest FROM repo_checkpoints WHERE task_id = %s",
            (run.task,),
        ).fetchall()
    return dict(rows)


def test_superseded_objects_go_after_the_delay_and_the_current_ones_stay(
    gc_controller: ControllerProcess,
) -> None:
    tenant = bootstrap_tenant(gc_controller)
    run = repo_run(tenant)
    ws = run.ws()
    v1, v2, shared = b"version one\n" * 50, b"version two\n" * 50, b"kept in both\n"
    first = run.save(ws, {**small_repo(), "x.txt": v1, "y.txt": shared})
    run.upload_all(ws, [v2])
    r = run.commit(ws, [file_member("x.txt", v2)], base=first["checkpointId"])
    assert r.status_code == 200, r.text
    second = r.json()
    by_id = manifests(run)
    old_manifest, new_manifest = by_id[first["checkpointId"]], by_id[second["checkpointId"]]
    # The run's committed uploads pin their objects while it runs: end it.
    gc_controller.admin("end-run", run.run_id)

    report = gc_controller.gc_now()
    assert report["deleted"] == 0
    assert stored(run, sha(v1)) and stored(run, old_manifest)  # not due yet
    time.sleep(DELAY + 0.5)
    gc_controller.gc_now()
    with gc_controller.db() as db:
        outcomes = dict(
            db.execute(
                "SELECT digest, string_agg(DISTINCT outcome, ',') FROM deletion_journal"
                " WHERE company_id = %s GROUP BY digest",
                (tenant.company_id,),
            ).fetchall()
        )
    deleted = {d for d, outcome in outcomes.items() if outcome == "deleted"}
    assert deleted == {sha(v1)}, outcomes
    assert set(outcomes.values()) == {"deleted", "referenced"}
    assert not stored(run, sha(v1))
    current = [sha(c) for c in {**small_repo(), "y.txt": shared}.values() if isinstance(c, bytes)]
    # The delta's manifest is stored on the first one's: both stay while current.
    for digest in [*current, sha(v2), new_manifest, old_manifest]:
        assert stored(run, digest), digest

    # A new sandbox restores the current checkpoint whole.
    later = restart(run)
    body = later.manifest(ws).json()
    assert body["checkpointId"] == second["checkpointId"]
    digests = sorted({m["digest"] for m in body["members"] if m["kind"] == "file"})
    fetched = later.fetch(ws, digests)
    assert fetched.status_code == 200
    assert [d.hex() for d, _ in decode_batch(fetched.content)] == digests


def test_a_removed_workspaces_checkpoint_stays_protected(gc_controller: ControllerProcess) -> None:
    tenant = bootstrap_tenant(gc_controller)
    run = repo_run(tenant)
    ws = run.ws()
    tree = {**small_repo(), "only-here.bin": b"\x00only here\x01" * 100}
    saved = run.save(ws, tree)
    manifest = manifests(run)[saved["checkpointId"]]
    gc_controller.admin("end-run", run.run_id)
    gc_controller.admin("remove-workspace", ws)
    digests = [sha(c) for c in tree.values() if isinstance(c, bytes)] + [manifest]
    # Queue every one of them for deletion, due now: the sweeper must keep them.
    with gc_controller.db() as db:
        db.execute(
            "INSERT INTO deletion_journal (company_id, digest, reason, not_before)"
            " SELECT %s, d, 'test', now() - interval '1 second' FROM unnest(%s::text[]) AS d",
            (tenant.company_id, digests),
        )
    time.sleep(DELAY + 0.5)  # and the uploads' own journal entries come due
    gc_controller.gc_now()
    with gc_controller.db() as db:
        outcomes = db.execute(
            "SELECT DISTINCT outcome FROM deletion_journal WHERE company_id = %s"
            " AND digest = ANY(%s)",
            (tenant.company_id, digests),
        ).fetchall()
    assert outcomes == [("referenced",)]
    for digest in digests:
        assert stored(run, digest), digest
    with tenant.client() as c:
        r = c.get(f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos/{ws}/archive")
        assert r.status_code == 200 and len(r.content) > 1200


def referenced(run: RepoRun, ws: str) -> set[str]:
    with run.tenant.controller.db() as db:
        rows = db.execute(
            "SELECT digest FROM repo_refs WHERE task_id = %s AND workspace_id = %s",
            (run.task, ws),
        ).fetchall()
    return {str(r[0]) for r in rows}


def test_a_chain_of_delta_manifests_is_read_cold_and_goes_once_stored_whole(
    gc_controller: ControllerProcess,
) -> None:
    """Delta commits store their manifests as deltas, each on the last: the
    checkpoint references the whole chain, a restarted controller (nothing
    cached) reads it back for the manifest route, the archive and the next
    delta, and the commit after MAX_CHAIN objects stores a full manifest,
    after which GC deletes the old chain."""
    tenant = bootstrap_tenant(gc_controller)
    run = repo_run(tenant)
    ws = run.ws()
    tree: dict[str, bytes | str | None] = dict(small_repo())
    saved = run.save(ws, tree)
    chain = [manifests(run)[saved["checkpointId"]]]
    base = saved["checkpointId"]
    for i in range(1, MAX_CHAIN + 1):
        content = f"file {i}\n".encode()
        run.upload_all(ws, [content])
        removed = ["README.md"] if i == 3 else []
        r = run.commit(
            ws, [file_member(f"notes/f{i:02d}.txt", content)], base=base, removed=removed
        )
        assert r.status_code == 200, r.text
        base = r.json()["checkpointId"]
        tree[f"notes/f{i:02d}.txt"] = content
        if removed:
            del tree["README.md"]
        chain.append(manifests(run)[base])
        files = {sha(c) for c in tree.values() if isinstance(c, bytes)}
        if i < MAX_CHAIN:
            assert referenced(run, ws) == files | set(chain), i  # the chain so far
        else:
            assert referenced(run, ws) == files | {chain[-1]}  # stored whole again
        if i == 5:
            gc_controller.stop()  # a cold start: no manifest is cached
            gc_controller.start()
        if i in (5, MAX_CHAIN):
            body = run.manifest(ws).json()
            assert body["checkpointId"] == base
            assert body["members"] == sorted(members_of(tree), key=lambda m: m["path"])
            with tenant.client() as c:
                r = c.get(f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos/{ws}/archive")
            assert r.status_code == 200
            with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
                names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
            assert names >= {p for p, c in tree.items() if c is not None}
            assert "README.md" not in names
    gc_controller.admin("end-run", run.run_id)
    time.sleep(DELAY + 0.5)
    gc_controller.gc_now()
    for digest in chain[:-1]:
        assert not stored(run, digest), digest
    for digest in {sha(c) for c in tree.values() if isinstance(c, bytes)} | {chain[-1]}:
        assert stored(run, digest), digest
    assert restart(run).manifest(ws).json()["members"] == sorted(
        members_of(tree), key=lambda m: m["path"]
    )
