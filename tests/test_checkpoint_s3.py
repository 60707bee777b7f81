"""A checkpoint on the S3 provider commits without a request to S3: its
digests are checked against upload pins in the database, not with a HEAD
per file (every S3 request goes through a counting proxy)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

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
