"""`/healthz` answers while the process serves; `/readyz` checks the database and storage."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support.controller import ControllerProcess, PgCluster, world_searchable_tmpdir
from tests.support.s3server import FAKE_CREDENTIALS, S3Server
from tests.support.storage import s3_client


@pytest.fixture
def own_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller on its own database, which a test may cut off."""
    ctl = ControllerProcess(pg_cluster.create_database(), world_searchable_tmpdir("fsa-ctl-"))
    try:
        yield ctl.start()
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


def test_ready_when_database_and_storage_answer(controller: ControllerProcess) -> None:
    assert httpx.get(controller.url + "/healthz").json() == {"ok": True}
    r = httpx.get(controller.url + "/readyz")
    assert r.status_code == 200
    assert r.json() == {"ok": True, "checks": {"database": "ok", "storage": "ok"}}


@pytest.mark.allow_warning_logs
def test_database_outage_fails_readiness_not_liveness(
    own_controller: ControllerProcess, pg_cluster: PgCluster
) -> None:
    name = conninfo_to_dict(own_controller.db_url)["dbname"]
    with psycopg.connect(pg_cluster.admin_url(), autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
    try:
        r = httpx.get(own_controller.url + "/readyz", timeout=30)
        assert r.status_code == 503
        body = r.json()
        assert body["code"] == "not_ready"
        assert body["failing"] == ["database"]
        assert body["checks"]["storage"] == "ok"
        assert body["checks"]["database"] != "ok"
        assert httpx.get(own_controller.url + "/healthz").status_code == 200
    finally:
        with psycopg.connect(pg_cluster.admin_url(), autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
    r = httpx.get(own_controller.url + "/readyz", timeout=30)
    assert r.status_code == 200, r.text


def test_storage_failure_fails_readiness(own_controller: ControllerProcess) -> None:
    objects = own_controller.data_dir / "objects"
    moved = own_controller.data_dir / "objects-away"
    objects.rename(moved)
    objects.write_bytes(b"not a directory")
    try:
        r = httpx.get(own_controller.url + "/readyz", timeout=30)
        assert r.status_code == 503
        assert r.json()["failing"] == ["storage"]
        assert r.json()["checks"]["database"] == "ok"
    finally:
        objects.unlink()
        moved.rename(objects)
    assert httpx.get(own_controller.url + "/readyz").status_code == 200


def test_s3_outage_fails_readiness_not_liveness(pg_cluster: PgCluster) -> None:
    """On S3: ready while the bucket answers; with the S3 server stopped, and
    then back but without the bucket, 503 ``not_ready`` naming storage (the
    database still ok) while ``/healthz`` answers; ready again once the bucket
    is back."""
    server = S3Server().start()
    bucket = f"ready-{uuid.uuid4().hex[:16]}"
    ctl = ControllerProcess(
        pg_cluster.create_database(),
        world_searchable_tmpdir("fsa-ctl-s3ready-"),
        ["--storage", "s3", "--s3-endpoint", server.endpoint_url, "--s3-bucket", bucket,
         "--s3-region", "us-east-1"],
        env=FAKE_CREDENTIALS,
    )  # fmt: skip
    try:
        s3_client(server).create_bucket(Bucket=bucket)
        ctl.start()
        r = httpx.get(ctl.url + "/readyz", timeout=30)
        assert (r.status_code, r.json()) == (
            200,
            {"ok": True, "checks": {"database": "ok", "storage": "ok"}},
        )

        def not_ready() -> dict[str, Any]:
            r = httpx.get(ctl.url + "/readyz", timeout=30)
            assert r.status_code == 503, r.text
            body: dict[str, Any] = r.json()
            assert body["code"] == "not_ready" and body["failing"] == ["storage"], body
            assert body["checks"]["database"] == "ok"
            assert httpx.get(ctl.url + "/healthz").status_code == 200
            return body

        server.stop()
        assert "unreachable" in not_ready()["checks"]["storage"]
        server = S3Server(server.port).start()  # an empty server: the bucket is gone
        assert "is not usable" in not_ready()["checks"]["storage"]
        s3_client(server).create_bucket(Bucket=bucket)
        r = httpx.get(ctl.url + "/readyz", timeout=30)
        assert r.status_code == 200, r.text
    finally:
        ctl.stop()
        server.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)
