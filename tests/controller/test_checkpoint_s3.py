"""On the S3 provider a checkpoint commits without a request to S3 (its
digests are checked against upload pins in the database, not with a HEAD
per file) and an upload costs one PUT per file (every S3 request goes
through a counting proxy)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from hashlib import sha256

import pytest

from common.bridge import encode_batch
from tests.support.bridge import start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    bootstrap_tenant,
    world_searchable_tmpdir,
)
from tests.support.lossy_proxy import LossyProxy
from tests.support.s3server import FAKE_CREDENTIALS, running_s3_server
from tests.support.storage import s3_client


@pytest.fixture(scope="module")
def counted_s3_controller(pg_cluster: PgCluster) -> Iterator[tuple[ControllerProcess, LossyProxy]]:
    with running_s3_server() as server:
        bucket = f"cp-{uuid.uuid4().hex[:16]}"
        s3_client(server).create_bucket(Bucket=bucket)
        proxy = LossyProxy(server.endpoint_url).start()
        ctl = ControllerProcess(
            pg_cluster.create_database(),
            world_searchable_tmpdir("fsa-cp-s3-"),
            ["--storage", "s3", "--s3-endpoint", proxy.url, "--s3-bucket", bucket,
             "--s3-region", "us-east-1"],
            env=FAKE_CREDENTIALS,
            # A deployment's delay: with none, an upload's own journal entry
            # is due at once and the next write of its digest checks storage.
            gc_args=["--gc-delay", "3600", "--gc-interval", "0"],
        )  # fmt: skip
        try:
            ctl.start()
            yield ctl, proxy
        finally:
            ctl.stop()
            proxy.stop()


def test_checkpoint_commit_sends_no_request_to_s3(
    counted_s3_controller: tuple[ControllerProcess, LossyProxy],
) -> None:
    ctl, proxy = counted_s3_controller
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    digests = []
    for _ in range(20):
        r = run.upload("task", os.urandom(2000))
        assert r.status_code == 200, r.text
        digests.append(r.json()["digest"])
    entries = [
        {"op": "put", "path": f"d/f{i}", "digest": d, "executable": False}
        for i, d in enumerate(digests)
    ]
    before = len(proxy.seen)
    r = run.commit("task", entries)
    assert r.status_code == 200, r.text
    assert proxy.seen[before:] == [], "the commit sent requests to S3"
    # The objects are there and served.
    with run.client() as c:
        got = c.get(f"/folders/task/objects/{digests[0]}")
    assert got.status_code == 200 and len(got.content) == 2000


def test_an_upload_costs_one_s3_request_per_file(
    counted_s3_controller: tuple[ControllerProcess, LossyProxy],
) -> None:
    """Storing and registering a file is one conditional PUT, single or in a
    batch, new or already stored (412): no HEAD to re-check the bytes."""
    ctl, proxy = counted_s3_controller
    run = start_run(bootstrap_tenant(ctl))
    single = os.urandom(3000)
    for _ in range(2):
        before = len(proxy.seen)
        r = run.upload("task", single)
        assert r.status_code == 200, r.text
        assert [s.split()[0] for s in proxy.seen[before:]] == ["PUT"]
    members = [os.urandom(n) for n in (1, 500, 4096, 60_000)] + [single]
    before = len(proxy.seen)
    with run.client() as c:
        r = c.put("/folders/task/uploads/batch", content=encode_batch(members))
    assert r.status_code == 200, r.text
    assert [o["digest"] for o in r.json()["objects"]] == [sha256(m).hexdigest() for m in members]
    assert [s.split()[0] for s in proxy.seen[before:]] == ["PUT"] * len(members)
    entries = [
        {"op": "put", "path": f"b/f{i}", "digest": sha256(m).hexdigest(), "executable": False}
        for i, m in enumerate(members)
    ]
    assert run.commit("task", entries).status_code == 200
    with run.client() as c:
        for m in members:
            got = c.get(f"/folders/task/objects/{sha256(m).hexdigest()}")
            assert got.status_code == 200 and got.content == m


def test_a_rest_put_costs_one_s3_request(
    counted_s3_controller: tuple[ControllerProcess, LossyProxy],
) -> None:
    ctl, proxy = counted_s3_controller
    tenant = bootstrap_tenant(ctl)
    data = os.urandom(4096)
    with tenant.client() as c:
        for path in ("a.bin", "copy.bin"):  # new, then already stored (412)
            before = len(proxy.seen)
            r = c.put(
                f"{tenant.my_folder}/content",
                params={"path": path},
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
            assert r.status_code in (200, 201), r.text
            assert [s.split()[0] for s in proxy.seen[before:]] == ["PUT"]
        got = c.get(f"{tenant.my_folder}/content", params={"path": "copy.bin"})
    assert got.status_code == 200 and got.content == data
