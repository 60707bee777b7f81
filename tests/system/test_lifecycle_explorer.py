"""The lifecycle explorer (tests/support/explorer.py) on a fixed set of seeds
and one random seed, printed so that a failure can be run again:
``python -m tests.support.explorer --seed N --schedules 1 --mode M``.

Each seed is a schedule of a run's life against the real ``fsagent up`` and a
real controller, checked against the model of what must be saved. Seeds that
once failed stay here as regression tests; ``make explore`` runs many more.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    private_controller,
)
from tests.support.explorer import CONTROLLER_ARGS, EVENTS, EVENTS_V1, run_schedule

# A schedule that kills PostgreSQL restarts it, which warns of its crash recovery.
pytestmark = [pytest.mark.fuse, pytest.mark.slow, pytest.mark.allow_warning_logs]

Schedule = tuple[int, str, int, tuple[str, ...], list[str] | None]
"""Seed, mode, events drawn, the catalogue drawn from, or events given in order."""

REGRESSIONS: list[Schedule] = [
    # A newer run for the sandbox fenced the agent folder's final save, and
    # the stop discarded the agent folder's local copy: the fenced run's
    # acknowledged writes were lost instead of saved by the newer run.
    (1, "fuse", 8, EVENTS_V1, None),
]
FIXED: list[Schedule] = [
    (7, "dir", 8, EVENTS_V1, None),
    # The host's and the sandbox's faults, in order, every time.
    (6, "fuse", 0, EVENTS, ["agent_limit", "disk_full", "pg_kill", "kill9_child", "rename"]),
    # Dir mode's children restarted: each start says it serves on a pipe of its own.
    (10, "dir", 0, EVENTS, ["write", "kill9_child", "disk_full", "kill9_child", "sigterm"]),
    # Empty directories made and removed across kill -9 and a stop mid-save.
    (
        9,
        "fuse",
        0,
        EVENTS,
        ["mkdir", "mkdir", "kill9_up", "mkdir", "sigterm_during_save", "mkdir", "replace_sandbox"],
    ),
]


@pytest.fixture(scope="module")
def xp_cluster() -> Iterator[PgCluster]:
    """A PostgreSQL cluster of the module's own: schedules kill it."""
    cluster = PgCluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def xp_controller(xp_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller of the module's own: schedules kill and restart it."""
    with private_controller(xp_cluster, "fsa-xpc-", *CONTROLLER_ARGS) as ctl:
        yield ctl


@pytest.fixture
def xp_tenant(xp_controller: ControllerProcess) -> Tenant:
    if xp_controller.proc is None or xp_controller.proc.poll() is not None:
        xp_controller.start()  # a failed schedule may have left it down
    return bootstrap_tenant(xp_controller)


@pytest.mark.parametrize(("seed", "mode", "events", "catalog", "script"), REGRESSIONS + FIXED)
def test_a_fixed_schedule_keeps_every_acknowledged_write(
    xp_cluster: PgCluster,
    xp_controller: ControllerProcess,
    xp_tenant: Tenant,
    seed: int,
    mode: str,
    events: int,
    catalog: tuple[str, ...],
    script: list[str] | None,
) -> None:
    run_schedule(xp_controller, xp_tenant, seed, mode, events, xp_cluster, catalog, script)


def test_a_random_schedule_keeps_every_acknowledged_write(
    xp_cluster: PgCluster, xp_controller: ControllerProcess, xp_tenant: Tenant
) -> None:
    seed = int(os.environ.get("EXPLORE_SEED", random.randrange(1 << 30)))
    mode = random.Random(seed).choice(["fuse", "dir"])
    print(f"explorer: seed {seed}, mode {mode}")
    run_schedule(xp_controller, xp_tenant, seed, mode, 8, xp_cluster)
