"""pytest fixtures for the real parts: one PostgreSQL cluster and one controller
per session, a fresh tenant per test, FUSE mounts torn down after each test
(or module), and the storage providers (one moto S3 server per session, a
fresh bucket or local-disk root per test)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.storage import LocalDiskProvider, S3Provider, StorageProvider
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    world_searchable_tmpdir,
)
from tests.support.mount import FsagentMount, MountFactory, mount_factory
from tests.support.pyfuse3_patch import handles_env, patched_pyfuse3_env
from tests.support.s3server import S3Server, running_s3_server
from tests.support.storage import make_s3_provider, remove_bucket


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


@pytest.fixture(params=["no-open", "handles"])
def mounts_in_both_modes(request: pytest.FixtureRequest) -> Iterator[MountFactory]:
    """Mounts in each of fsagent's FUSE modes in turn (fsagent.fuse.fs): the kernel's
    "no open" mode, with the patched pyfuse3 whatever the venv holds, and
    OPEN/RELEASE handles, the mode of a stock pyfuse3."""
    with mount_factory() as factory:
        factory.env = patched_pyfuse3_env() if request.param == "no-open" else handles_env()
        yield factory


@pytest.fixture(scope="module")
def module_mounts() -> Iterator[MountFactory]:
    with mount_factory() as factory:
        yield factory


MODES = ("fuse", "dir")
"""The two ways fsagent serves a collection; tests of the shared contract run in both."""


@pytest.fixture(params=MODES)
def mode_mounts(request: pytest.FixtureRequest) -> Iterator[MountFactory]:
    """A mount factory per mode: a test using it runs once with FUSE mounts and
    once with plain directories (a module makes it its ``mounts``)."""
    with mount_factory(mode=request.param) as factory:
        yield factory


@pytest.fixture
def mnt(mounts: MountFactory) -> FsagentMount:
    """A mounted, bound, empty agent collection."""
    return mounts.mount()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    bucket = f"test-{uuid.uuid4().hex[:24]}"
    yield bucket
    remove_bucket(s3_server, bucket)


@pytest.fixture
def s3_provider(s3_server: S3Server, s3_bucket: str) -> S3Provider:
    provider = make_s3_provider(s3_server, s3_bucket)
    provider.check()
    return provider


@pytest.fixture
def local_provider(tmp_path: Path) -> LocalDiskProvider:
    return LocalDiskProvider(tmp_path / "store")


@pytest.fixture(params=["local_disk", "s3"])
def provider(request: pytest.FixtureRequest) -> StorageProvider:
    """Each storage provider in turn: a test using it runs once per provider."""
    # Resolved lazily so a run of only the local tests never starts a server.
    fixture = "local_provider" if request.param == "local_disk" else "s3_provider"
    result: StorageProvider = request.getfixturevalue(fixture)
    return result
