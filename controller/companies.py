"""A company's directory: its agents, projects, tasks and members."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from controller.apply import Row


@dataclass(frozen=True)
class Directory:
    agents: list[Row]
    projects: list[Row]
    tasks: list[Row]
    members: list[Row]


async def directory(conn: AsyncConnection[Any], company_id: str) -> Directory:
    async def rows(sql: str) -> list[Row]:
        cur = await conn.execute(sql, (company_id,))
        return list(await cur.fetchall())

    return Directory(
        agents=await rows("SELECT id, name FROM agents WHERE company_id = %s ORDER BY name, id"),
        projects=await rows(
            "SELECT id, name FROM projects WHERE company_id = %s ORDER BY name, id"
        ),
        tasks=await rows(
            "SELECT id, title, project_id FROM tasks WHERE company_id = %s ORDER BY title, id"
        ),
        members=await rows(
            "SELECT u.id, u.email, m.role FROM memberships m JOIN users u ON u.id = m.user_id"
            " WHERE m.company_id = %s ORDER BY u.email"
        ),
    )
