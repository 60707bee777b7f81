"""Per-agent permissions of people: who may configure an agent (its folder).

An agent's folder holds its instructions and personal files, so company
membership alone does not open it. Owners and admins
hold the ``configure`` permission for every agent of their company; a member
(or a viewer, then read-only) holds it only through a grant on that agent.
A run may always read its own agent's folder; its saves there need its
responsible user, if any, to hold the permission at save time
(:func:`confirm_configure`, inside the committing transaction).

A grant belongs to a membership: removing the member removes its grants.
Every check here answers "no" the same way for a missing agent, another
company's agent and a missing grant: callers turn it into a 404.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from common.errors import AgentNotFound, MemberNotFound, NotFound
from common.paths import validate_uuid
from controller.foldercore import Row

CONFIGURE = "configure"
ALL_AGENTS_ROLES = ("owner", "admin")
"""Roles that hold every permission on every agent of their company."""


async def may_configure_agent(
    conn: AsyncConnection[Any], company_id: str, user_id: str, agent_id: str, role: str | None
) -> bool:
    """Whether the member (of ``role``, already read) may configure the agent."""
    if role is None:
        return False
    if role in ALL_AGENTS_ROLES:
        return True
    cur = await conn.execute(
        "SELECT 1 FROM agent_grants WHERE company_id = %s AND user_id = %s"
        " AND agent_id::text = %s AND permission = %s",
        (company_id, user_id, agent_id, CONFIGURE),
    )
    return await cur.fetchone() is not None


async def configurable_agents(
    conn: AsyncConnection[Any], company_id: str, user_id: str
) -> set[str] | None:
    """The ids of the agents the member may configure; None for all of them
    (an owner or admin)."""
    cur = await conn.execute(
        "SELECT role FROM memberships WHERE company_id = %s AND user_id = %s",
        (company_id, user_id),
    )
    row = await cur.fetchone()
    if row is not None and row["role"] in ALL_AGENTS_ROLES:
        return None
    cur = await conn.execute(
        "SELECT agent_id FROM agent_grants WHERE company_id = %s AND user_id = %s"
        " AND permission = %s",
        (company_id, user_id, CONFIGURE),
    )
    return {str(r["agent_id"]) for r in await cur.fetchall()}


async def confirm_configure(
    conn: AsyncConnection[Any], company_id: str, user_id: str, agent_id: str, role: str | None
) -> None:
    """NotFound unless the member still holds the permission, with the grant
    row locked ``FOR SHARE``: a revoke waits for the write in flight, which
    lands wholly before it. ``role`` was read with the membership row locked."""
    if role is None:
        raise NotFound()
    if role in ALL_AGENTS_ROLES:
        return
    cur = await conn.execute(
        "SELECT 1 FROM agent_grants WHERE company_id = %s AND user_id = %s"
        " AND agent_id::text = %s AND permission = %s FOR SHARE",
        (company_id, user_id, agent_id, CONFIGURE),
    )
    if await cur.fetchone() is None:
        raise NotFound()


async def _check_parties(
    conn: AsyncConnection[Any], company_id: str, user_id: str, agent_id: str
) -> tuple[str, str, str]:
    company_id = validate_uuid(company_id, "company")
    user_id = validate_uuid(user_id, "user")
    agent_id = validate_uuid(agent_id, "agent")
    cur = await conn.execute(
        "SELECT 1 FROM agents WHERE id = %s AND company_id = %s", (agent_id, company_id)
    )
    if await cur.fetchone() is None:
        raise AgentNotFound(f"no agent {agent_id} in company {company_id}")
    cur = await conn.execute(
        "SELECT 1 FROM memberships WHERE company_id = %s AND user_id = %s", (company_id, user_id)
    )
    if await cur.fetchone() is None:
        raise MemberNotFound(f"user {user_id} is not a member of company {company_id}")
    return company_id, user_id, agent_id


async def list_grants(conn: AsyncConnection[Any], company_id: str, agent_id: str) -> list[Row]:
    """The members granted a permission on the agent, oldest grant first
    (owners and admins hold every permission without a grant and are not
    listed unless granted too)."""
    cur = await conn.execute(
        "SELECT 1 FROM agents WHERE id = %s AND company_id = %s", (agent_id, company_id)
    )
    if await cur.fetchone() is None:
        raise AgentNotFound(f"no agent {agent_id} in company {company_id}")
    cur = await conn.execute(
        "SELECT g.user_id, g.permission, g.granted_at, m.role FROM agent_grants g"
        " JOIN memberships m ON m.company_id = g.company_id AND m.user_id = g.user_id"
        " WHERE g.company_id = %s AND g.agent_id = %s ORDER BY g.granted_at, g.user_id",
        (company_id, agent_id),
    )
    return list(await cur.fetchall())


async def grant_configure(
    conn: AsyncConnection[Any], company_id: str, user_id: str, agent_id: str
) -> dict[str, Any]:
    """Let a member configure one agent; in effect from the next request."""
    company_id, user_id, agent_id = await _check_parties(conn, company_id, user_id, agent_id)
    await conn.execute(
        "INSERT INTO agent_grants (company_id, agent_id, user_id, permission)"
        " VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
        (company_id, agent_id, user_id, CONFIGURE),
    )
    return {
        "company_id": company_id,
        "user_id": user_id,
        "agent_id": agent_id,
        "permission": CONFIGURE,
        "granted": True,
    }


async def revoke_configure(
    conn: AsyncConnection[Any], company_id: str, user_id: str, agent_id: str
) -> dict[str, Any]:
    """Take the grant back: the next request, and any write not yet committed
    (it waits for this), no longer sees the agent's folder. Revoking a grant
    that does not exist changes nothing (``revoked`` false)."""
    company_id, user_id, agent_id = await _check_parties(conn, company_id, user_id, agent_id)
    cur = await conn.execute(
        "DELETE FROM agent_grants WHERE company_id = %s AND user_id = %s AND agent_id = %s"
        " AND permission = %s",
        (company_id, user_id, agent_id, CONFIGURE),
    )
    return {
        "company_id": company_id,
        "user_id": user_id,
        "agent_id": agent_id,
        "permission": CONFIGURE,
        "revoked": cur.rowcount > 0,
    }
