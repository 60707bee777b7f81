"""Limits kept per process, and the database connections of N replicas.

The "Sizing for N replicas" table (docs/operators/sizing.md) names every
limit a controller process keeps in its own memory
(``controller.config.PER_PROCESS_FLAGS``), each a real ``serve`` flag; the
settings table (docs/operators/configuration.md) documents every limit, quota
and bridge flag; and ``serve`` warns at start when ``--replicas`` pools of
``--pool-size`` would take (nearly) every connection PostgreSQL allows.
"""

from __future__ import annotations

import argparse
import re

import pytest

from controller.cli import build_parser
from controller.config import _BRIDGE_FLAGS, _LIMIT_FLAGS, _QUOTA_FLAGS, PER_PROCESS_FLAGS
from controller.db import headroom_warning
from tests.support.constants import REPO
from tests.support.controller import PgCluster, private_controller

WARNING = "database connections:"


def page(name: str) -> str:
    return (REPO / "docs" / "operators" / name).read_text()


def first_column_flags(table_text: str) -> set[str]:
    flags: set[str] = set()
    for line in table_text.splitlines():
        if line.startswith("| `"):
            flags |= set(re.findall(r"`(--[a-z0-9-]+)`", line.split("|")[1]))
    return flags


def serve_flags() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return {o for a in serve._actions for o in a.option_strings if o.startswith("--")}


def test_sizing_table_names_every_per_process_limit() -> None:
    section = page("sizing.md")
    assert first_column_flags(section) == set(PER_PROCESS_FLAGS)
    assert serve_flags() >= PER_PROCESS_FLAGS
    assert "--replicas" in section


def test_settings_table_documents_every_limit_flag() -> None:
    section = page("configuration.md")
    documented = first_column_flags(section)
    declared = {flag for flag, *_ in [*_LIMIT_FLAGS, *_QUOTA_FLAGS, *_BRIDGE_FLAGS]}
    assert declared - documented == set()
    assert "--replicas" in declared


@pytest.mark.parametrize(
    ("max_connections", "reserved", "pool", "replicas", "verdict"),
    [
        (100, 3, 20, 1, None),
        (100, 3, 20, 3, None),  # 60 of 97
        (100, 3, 20, 4, "close to"),  # 80 of 97: over 80%
        (100, 3, 20, 5, "more than"),  # 100 of 97: 5 replicas run out
        (250, 3, 20, 8, None),  # the documented remedy: 160 of 247
        (100, 3, 10, 7, None),  # the other remedy: 70 of 97
    ],
)
def test_headroom_warning(
    max_connections: int, reserved: int, pool: int, replicas: int, verdict: str | None
) -> None:
    warning = headroom_warning(max_connections, reserved, pool, replicas)
    if verdict is None:
        assert warning is None
    else:
        assert warning is not None
        assert warning.startswith(f"{WARNING} {replicas} replica(s) x --pool-size {pool}")
        assert f"{verdict} the {max_connections - reserved} PostgreSQL accepts" in warning


def test_serve_warns_when_replicas_would_exhaust_connections(pg_cluster: PgCluster) -> None:
    """The test cluster allows 200 connections: 12 replicas of 20 do not fit;
    one does, without a word."""
    with private_controller(pg_cluster, "fsa-sizing-", "--replicas", "12") as ctl:
        log = ctl.log()
        assert f"{WARNING} 12 replica(s) x --pool-size 20 = 240, more than" in log, log
        assert "max_connections 200" in log
    with private_controller(pg_cluster, "fsa-sizing-") as ctl:
        assert WARNING not in ctl.log()
