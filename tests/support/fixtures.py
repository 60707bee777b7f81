"""pytest fixtures for the real parts: one PostgreSQL cluster and one controller
per session, a fresh tenant per test, and FUSE mounts torn down after each test
(or module)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    world_searchable_tmpdir,
)
from tests.support.mount import FsagentMount, MountFactory, mount_factory


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
    try:
        ctl.start()
        yield ctl
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


@pytest.fixture
def tenant(controller: ControllerProcess) -> Tenant:
    """A fresh company and owner for one test, so tests never see each other's rows."""
    return bootstrap_tenant(controller)


@pytest.fixture
def mounts() -> Iterator[MountFactory]:
    with mount_factory() as factory:
        yield factory


@pytest.fixture(scope="module")
def module_mounts() -> Iterator[MountFactory]:
    with mount_factory() as factory:
        yield factory


@pytest.fixture
def mnt(mounts: MountFactory) -> FsagentMount:
    """A mounted, bound, empty agent collection."""
    return mounts.mount()
