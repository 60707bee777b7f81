"""A company's directory: its agents, projects, tasks and members, and for
people whether each agent, project and task folder has files and an active run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from controller.foldercore import Row
from controller.grants import configurable_agents


@dataclass(frozen=True)
class Directory:
    agents: list[Row]
    projects: list[Row]
    tasks: list[Row]
    members: list[Row]
    activity: bool
    """Whether the agent, project and task rows carry ``has_files`` and ``active_run``."""


# Each owner table, its folder scope and its column in runs.
_OWNERS = {"agents": ("agent", "agent_id"), "projects": ("project", "project_id"),
           "tasks": ("task", "task_id")}  # fmt: skip


async def directory(
    conn: AsyncConnection[Any],
    company_id: str,
    *,
    activity: bool = False,
    viewer: str | None = None,
) -> Directory:
    """The directory; ``activity`` adds to each agent, project and task whether
    its folder has live entries (the folder row's counter: one index lookup
    each) and whether a run bound to it is active (one query for the company's
    active runs), so a home page needs no request per folder. For ``viewer``
    (a person), an agent whose folder that person may not open (no configure
    permission: ``controller.grants``) says nothing about its files
    (``has_files`` None)."""

    async def rows(sql: str) -> list[Row]:
        cur = await conn.execute(sql, (company_id,))
        return list(await cur.fetchall())

    async def owners(table: str, columns: str, order: str) -> list[Row]:
        if not activity:
            return await rows(f"SELECT {columns} FROM {table} o WHERE o.company_id = %s {order}")
        scope, _ = _OWNERS[table]
        return await rows(
            f"SELECT {columns}, coalesce(f.live_entries, 0) > 0 AS has_files FROM {table} o"
            " LEFT JOIN folders f ON f.company_id = o.company_id"
            f" AND f.scope = '{scope}' AND f.owner_id = o.id::text"
            f" WHERE o.company_id = %s {order}"
        )

    found = Directory(
        agents=await owners("agents", "o.id, o.name", "ORDER BY o.name, o.id"),
        projects=await owners("projects", "o.id, o.name", "ORDER BY o.name, o.id"),
        tasks=await owners("tasks", "o.id, o.title, o.project_id", "ORDER BY o.title, o.id"),
        members=await rows(
            "SELECT u.id, u.email, m.role FROM memberships m JOIN users u ON u.id = m.user_id"
            " WHERE m.company_id = %s ORDER BY u.email"
        ),
        activity=activity,
    )
    if activity:
        active = await rows(
            "SELECT agent_id, project_id, task_id FROM runs WHERE company_id = %s AND active"
        )
        for table, (_, column) in _OWNERS.items():
            busy = {r[column] for r in active if r[column] is not None}
            for row in getattr(found, table):
                row["active_run"] = row["id"] in busy
        if viewer is not None:
            open_agents = await configurable_agents(conn, company_id, viewer)
            for row in found.agents:
                if open_agents is not None and str(row["id"]) not in open_agents:
                    row["has_files"] = None
    return found
