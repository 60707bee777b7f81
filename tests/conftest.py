"""Session-wide real services: one PostgreSQL cluster and one controller."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.controller_helper import (
    ControllerProcess,
    PgCluster,
    Tenant,
    world_searchable_tmpdir,
)
from tests.fuse_helper import mounts  # noqa: F401 - the FUSE mount fixture, for every module


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    cluster = PgCluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A real `controller serve` (local_disk storage, GC sweeps on demand)."""
    ctl = ControllerProcess(pg_cluster.create_database(), world_searchable_tmpdir("fsa-ctl-"))
    ctl.start()
    try:
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture
def tenant(controller: ControllerProcess) -> Tenant:
    """A fresh company and owner for one test, so tests never see each other's rows."""
    out = controller.admin(
        "bootstrap",
        "--company-name",
        f"co-{uuid.uuid4().hex[:8]}",
        "--email",
        f"owner-{uuid.uuid4().hex[:10]}@example.com",
    )
    return Tenant(controller, out["company_id"], out["user_id"], out["token"])
