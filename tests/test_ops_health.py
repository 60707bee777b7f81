"""`/healthz` answers while the process serves; `/readyz` checks the database and storage."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support.controller import ControllerProcess, PgCluster, world_searchable_tmpdir


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
