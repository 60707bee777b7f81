"""Repository checkpoints over the bridge, against a real controller and
PostgreSQL: commits whole and delta, replay and conflicts, fencing, what a
checkpoint may reference, and reading a checkpoint back for a restore."""

from __future__ import annotations

import hashlib

from tests.support.controller import Tenant
from tests.support.repos import decode_batch, repo_run, sha, small_repo


def test_smoke(tenant: Tenant) -> None:
    run = repo_run(tenant)
    ws = run.ws()
    listing = run.listing()
    assert listing["repos"][0]["name"] == "app"
    tree = small_repo()
    receipt = run.save(ws, tree)
    assert receipt["entries"] == len(tree)
    r = run.manifest(ws)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["checkpointId"] == receipt["checkpointId"]
    assert [m["path"] for m in body["members"]] == sorted(tree)
    digests = [sha(c) for c in tree.values() if isinstance(c, bytes)]
    r = run.fetch(ws, digests)
    assert r.status_code == 200, r.text
    got = decode_batch(r.content)
    assert [hashlib.sha256(b).digest() for _, b in got] == [d for d, _ in got]
    assert [d.hex() for d, _ in got] == digests
