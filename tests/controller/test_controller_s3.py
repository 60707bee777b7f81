"""The controller end to end on the S3 provider (an S3-protocol server the test starts)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator

import pytest

from tests.support.controller import ControllerProcess, PgCluster, Tenant, world_searchable_tmpdir
from tests.support.s3server import FAKE_CREDENTIALS, S3Server, running_s3_server
from tests.support.storage import s3_client

OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def s3_controller(pg_cluster: PgCluster) -> Iterator[tuple[ControllerProcess, S3Server, str]]:
    with running_s3_server() as server:
        bucket = f"ctl-{uuid.uuid4().hex[:16]}"
        s3_client(server).create_bucket(Bucket=bucket)
        ctl = ControllerProcess(
            pg_cluster.create_database(),
            world_searchable_tmpdir("fsa-ctl-s3-"),
            [
                "--storage",
                "s3",
                "--s3-endpoint",
                server.endpoint_url,
                "--s3-bucket",
                bucket,
                "--s3-region",
                "us-east-1",
            ],
            env=FAKE_CREDENTIALS,
        )
        ctl.start()
        try:
            yield ctl, server, bucket
        finally:
            ctl.stop()


def bucket_keys(server: S3Server, bucket: str) -> set[str]:
    client = s3_client(server)
    return {o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_upload_download_purge_gc_on_s3(
    s3_controller: tuple[ControllerProcess, S3Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, server, bucket = s3_controller
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    boot = ctl.admin("bootstrap", "--email", f"{uuid.uuid4().hex}@s3.example")
    tenant = Tenant(ctl, boot["company_id"], boot["user_id"], boot["token"])
    data = os.urandom(3 << 20)
    digest = hashlib.sha256(data).hexdigest()
    key = f"objects/{tenant.company_id}/{digest[:2]}/{digest}"
    with tenant.client() as c:
        r = c.put(
            f"{tenant.my_folder}/content", params={"path": "big.bin"}, content=data, headers=OCTET
        )
        assert r.status_code == 201, r.text
        assert key in bucket_keys(server, bucket)
        # Nothing of the object landed on the controller's local disk.
        assert not (ctl.data_dir / "objects").exists() or not any(
            (ctl.data_dir / "objects").rglob("*")
        )
        g = c.get(f"{tenant.my_folder}/content", params={"path": "big.bin"})
        assert g.content == data
        g = c.get(
            f"{tenant.my_folder}/content",
            params={"path": "big.bin"},
            headers={"Range": "bytes=100-199"},
        )
        assert g.status_code == 206 and g.content == data[100:200]
        trashed = c.post(
            f"{tenant.my_folder}/operations", json={"action": "delete", "path": "big.bin"}
        )
        c.post(
            f"{tenant.my_folder}/operations",
            json={"action": "purge", "fileId": trashed.json()["files"][0]["id"]},
        )
    code, out, err = ctl.cli(
        "gc",
        "--now",
        "--json",
        "--storage",
        "s3",
        "--s3-endpoint",
        server.endpoint_url,
        "--s3-bucket",
        bucket,
        "--s3-region",
        "us-east-1",
    )
    assert code == 0, err
    assert json.loads(out)["deleted"] >= 1
    assert key not in bucket_keys(server, bucket)
