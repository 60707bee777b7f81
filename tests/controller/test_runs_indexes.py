"""Run lookups stay index lookups as runs pile up (migration 0012): on a few
thousand runs, the company directory's active runs come from the partial
``runs_active`` index and /sync's runs of one folder owner from that owner's
index, without a scan of the runs table. The real domain functions run against
real PostgreSQL; the statistics of their own transaction say what was read."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import psycopg
from psycopg.rows import dict_row

from controller import companies, runs
from controller.db import migrate
from tests.support.controller import PgCluster

COMPANIES, RUNS_EACH, ACTIVE_EACH = 3, 1000, 5


def seed(url: str) -> dict[str, str]:
    """Companies with agents, projects, tasks, members and their runs (the newest
    few running); one company's ids to look up."""
    with psycopg.connect(url, autocommit=True) as db:
        # One commit for the whole seed, not one (and its WAL flush) per row.
        with db.transaction():
            for n in range(COMPANIES):
                company = uuid.uuid4()
                db.execute("INSERT INTO companies (id, name) VALUES (%s, 'c')", (company,))
                agents = [uuid.uuid4() for _ in range(20)]
                project = uuid.uuid4()
                tasks = [uuid.uuid4() for _ in range(100)]
                user = uuid.uuid4()
                db.execute("INSERT INTO projects (id, company_id, name) VALUES (%s, %s, 'p')",
                           (project, company))  # fmt: skip
                for a in agents:
                    db.execute("INSERT INTO agents (id, company_id, name) VALUES (%s, %s, 'a')",
                               (a, company))  # fmt: skip
                for t in tasks:
                    db.execute("INSERT INTO tasks (id, company_id, project_id, title)"
                               " VALUES (%s, %s, %s, 't')", (t, company, project))  # fmt: skip
                db.execute("INSERT INTO users (id, email) VALUES (%s, %s)", (user, f"{user}@x"))
                with db.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO runs (id, company_id, agent_id, task_id, project_id, user_id,"
                        " sandbox_key, lease_epoch, token_hash, active, started_at)"
                        " VALUES (%s, %s, %s, %s, %s, %s, %s, 1, %s, %s,"
                        " now() - make_interval(mins => %s))",
                        [
                            (uuid.uuid4(), company, agents[i % 20], tasks[i % 100], project, user,
                             f"box-{i}", os.urandom(32), i >= RUNS_EACH - ACTIVE_EACH, RUNS_EACH - i)
                            for i in range(RUNS_EACH)
                        ],
                    )  # fmt: skip
                if n == 0:
                    mine = {"company": str(company), "agent": str(agents[0]), "task": str(tasks[0])}
        db.execute("VACUUM ANALYZE runs")
    return mine


async def lookups(url: str, ids: dict[str, str]) -> tuple[dict[str, Any], Any, list[Any]]:
    conn = await psycopg.AsyncConnection.connect(url, row_factory=dict_row)
    async with conn, conn.transaction():
        found = await companies.directory(conn, ids["company"], activity=True)
        by_task = await runs.bound_runs(conn, ids["company"], "task", ids["task"])
        by_agent = await runs.bound_runs(conn, ids["company"], "agent", ids["agent"])
        cur = await conn.execute(
            "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = 'runs'"
        )
        table = await cur.fetchone()
        cur = await conn.execute(
            "SELECT c.relname, pg_stat_get_xact_numscans(c.oid) AS scans FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'runs'::regclass"
        )
        indexes = {r["relname"]: r["scans"] for r in await cur.fetchall()}
    busy = [r for r in found.agents + found.tasks if r["active_run"]]
    return indexes, table, [by_task, by_agent, busy]


def test_active_and_bound_run_lookups_use_their_indexes(pg_cluster: PgCluster) -> None:
    url = pg_cluster.create_database()
    migrate(url)
    ids = seed(url)
    indexes, table, (by_task, by_agent, busy) = asyncio.run(lookups(url, ids))
    assert table is not None and table["seq_scan"] == 0, (table, indexes)
    assert indexes["runs_active"] >= 1, indexes
    assert indexes["runs_task_started"] >= 1 and indexes["runs_agent_started"] >= 1, indexes
    # And they found what they were asked for.
    assert len(by_task) == RUNS_EACH // 100 and len(by_agent) == RUNS_EACH // 20
    assert [r["started_at"] for r in by_agent] == sorted(
        (r["started_at"] for r in by_agent), reverse=True
    )
    assert {str(r["company_id"]) for r in by_task + by_agent} == {ids["company"]}
    assert len(busy) == 2 * ACTIVE_EACH  # the running runs' agents and tasks, all distinct
