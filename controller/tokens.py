"""Credentials an operator manages: people's API tokens (listed and revoked by
id, never shown again), operator tokens for machines, Files page sessions.

An **operator token** belongs to one company and opens only that company's
orchestrator routes (``/api/companies/{companyId}/…``: reading members;
agents, projects, tasks, runs and their audit trails): never a membership
change, a token, a work folder, the API bridge, the Files page or another
company. Like an API token it is shown once; only its SHA-256 is
stored, with a public id to list and revoke it by.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from common.errors import TokenNotFound
from controller.apply import Row
from controller.auth import OPERATOR_TOKEN_PREFIX, new_token, token_hash
from controller.orgs import check_name, check_uuid, require_company, require_user


@dataclass(frozen=True)
class NewOperatorToken:
    token_id: str
    company_id: str
    name: str
    token: str
    """Shown once; only its hash is stored."""
    created_at: Any


async def create_operator_token(
    conn: AsyncConnection[Any], company: str, name: str
) -> NewOperatorToken:
    company = check_uuid(company, "company")
    check_name(name)
    await require_company(conn, company)
    token = new_token(OPERATOR_TOKEN_PREFIX)
    cur = await conn.execute(
        "INSERT INTO operator_tokens (id, company_id, name, token_hash)"
        " VALUES (%s, %s, %s, %s) RETURNING id, created_at",
        (str(uuid.uuid4()), company, name, token_hash(token)),
    )
    row = await cur.fetchone()
    assert row is not None
    return NewOperatorToken(str(row["id"]), company, name, token, row["created_at"])


_TOKENS = (
    "SELECT * FROM ("
    " SELECT t.id, 'user' AS kind, t.user_id, u.email, NULL::uuid AS company_id,"
    "  NULL::text AS name, t.created_at, t.revoked_at"
    " FROM api_tokens t JOIN users u ON u.id = t.user_id"
    " UNION ALL"
    " SELECT o.id, 'operator', NULL, NULL, o.company_id, o.name, o.created_at, o.revoked_at"
    " FROM operator_tokens o) AS t"
)


async def list_tokens(
    conn: AsyncConnection[Any], *, company: str | None = None, user: str | None = None
) -> list[Row]:
    """Tokens (never the tokens themselves), oldest first: with ``company``,
    its members' API tokens and its operator tokens; with ``user``, that
    user's API tokens; with both, that user's if they are a member."""
    where: list[str] = []
    params: list[Any] = []
    if company is not None:
        where.append(
            "(t.user_id IN (SELECT user_id FROM memberships WHERE company_id = %s)"
            " OR t.company_id = %s)"
        )
        company = check_uuid(company, "company")
        params += [company, company]
    if user is not None:
        where.append("t.user_id = %s")
        params.append(check_uuid(user, "user"))
    sql = _TOKENS + (" WHERE " + " AND ".join(where) if where else "")
    cur = await conn.execute(sql + " ORDER BY t.created_at, t.id", params)
    return list(await cur.fetchall())


async def list_operator_tokens(conn: AsyncConnection[Any], company: str) -> list[Row]:
    cur = await conn.execute(
        _TOKENS + " WHERE t.kind = 'operator' AND t.company_id = %s ORDER BY t.created_at, t.id",
        (company,),
    )
    return list(await cur.fetchall())


async def revoke_token(
    conn: AsyncConnection[Any], token_id: str, *, operator_of: str | None = None
) -> Row:
    """Revoke an API or operator token by id; requests presenting it answer
    401 from now on. Revoking it again changes nothing (the first time is kept).

    ``operator_of`` limits this to the operator tokens of that company (the
    admin API: a company's admins never revoke a person's API token, which
    serves the person in every company they belong to)."""
    token_id = check_uuid(token_id, "token")
    row: Row | None = None
    if operator_of is None:
        cur = await conn.execute(
            "UPDATE api_tokens SET revoked_at = coalesce(revoked_at, now())"
            " WHERE id = %s RETURNING id",
            (token_id,),
        )
        row = await cur.fetchone()
    if row is None:
        cur = await conn.execute(
            "UPDATE operator_tokens SET revoked_at = coalesce(revoked_at, now())"
            " WHERE id = %s AND (%s::uuid IS NULL OR company_id = %s::uuid) RETURNING id",
            (token_id, operator_of, operator_of),
        )
        row = await cur.fetchone()
    if row is None:
        raise TokenNotFound(f"no such token: {token_id}")
    cur = await conn.execute(_TOKENS + " WHERE t.id = %s", (token_id,))
    found: Row | None = await cur.fetchone()
    assert found is not None
    return found


async def end_sessions(conn: AsyncConnection[Any], user: str) -> int:
    """End every Files page session of ``user``; their next request is 401."""
    user = check_uuid(user, "user")
    await require_user(conn, user)
    cur = await conn.execute("DELETE FROM web_sessions WHERE user_id = %s", (user,))
    return cur.rowcount
