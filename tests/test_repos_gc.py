"""GC and repository checkpoints: the current checkpoint's objects and manifest
stay while the task's binding exists (also once its workspace is removed);
superseded ones are deleted after the delay. Real controller (GC delay of a
few seconds, sweeps on demand), PostgreSQL and local-disk storage."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    assert deleted == {sha(v1), old_manifest}, outcomes
    assert set(outcomes.values()) == {"deleted", "referenced"}
    assert not stored(run, sha(v1)) and not stored(run, old_manifest)
    current = [sha(c) for c in {**small_repo(), "y.txt": shared}.values() if isinstance(c, bytes)]
    for digest in [*current, sha(v2), new_manifest]:
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
