"""Credentials an operator manages: people's API tokens (listed and revoked by
id, never shown again), operator tokens for machines, Files page sessions.

The host's operator (``controller admin``) may act on any of them. A
company's owners and admins (the admin API, ``actor``) act only on their
company's: its operator tokens, and its members' API tokens and sessions,
under the owner rule (only an owner acts on an owner's credentials). A
person's API token and sessions serve them in every company they belong to:
a company revokes such a token only while the person belongs to no other
company (:class:`~common.errors.TokenShared`). A company ends a member's
Files page sessions for itself alone: they stop reaching that company and
still reach the others (``memberships.sessions_ended_at``); the host's
operator ends them everywhere.

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

from common.errors import MemberNotFound, OwnerRequired, TokenNotFound, TokenShared
from controller.auth import OPERATOR_TOKEN_PREFIX, CompanyActor, new_token, token_hash
from controller.foldercore import Row
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


async def _member_role(conn: AsyncConnection[Any], company: str, user: str) -> str | None:
    cur = await conn.execute(
        "SELECT role FROM memberships WHERE company_id = %s AND user_id = %s FOR SHARE",
        (company, user),
    )
    row = await cur.fetchone()
    return None if row is None else str(row["role"])


async def _check_company_may_revoke(
    conn: AsyncConnection[Any], token: Row, actor: CompanyActor
) -> None:
    """Whether ``actor``'s company may revoke ``token`` (TokenNotFound for a
    token that is none of the company's, as if it did not exist)."""
    if token["kind"] == "operator":
        if str(token["company_id"]) != actor.company_id:
            raise TokenNotFound(f"no such token in the company: {token['id']}")
        return
    user = str(token["user_id"])
    # Locked first: a membership of the user added meanwhile (its foreign key
    # takes a key-share lock on this row) waits until the revocation commits.
    await conn.execute("SELECT 1 FROM users WHERE id = %s FOR UPDATE", (user,))
    role = await _member_role(conn, actor.company_id, user)
    if role is None:
        raise TokenNotFound(f"no such token in the company: {token['id']}")
    if role == "owner" and not actor.is_owner:
        raise OwnerRequired("Only an owner may revoke an owner's API token")
    cur = await conn.execute(
        "SELECT 1 FROM memberships WHERE user_id = %s AND company_id <> %s LIMIT 1",
        (user, actor.company_id),
    )
    if await cur.fetchone() is not None:
        raise TokenShared()


async def revoke_token(
    conn: AsyncConnection[Any],
    token_id: str,
    *,
    actor: CompanyActor | None = None,
    operator_only: bool = False,
) -> Row:
    """Revoke an API or operator token by id; requests presenting it answer
    401 from now on. Revoking it again changes nothing (the first time is kept).

    With ``actor`` (the admin API) only a token of the actor's company, under
    the rules in the module docstring; ``operator_only`` limits it to
    operator tokens (a person's token is then not found)."""
    token_id = check_uuid(token_id, "token")
    cur = await conn.execute(_TOKENS + " WHERE t.id = %s", (token_id,))
    token: Row | None = await cur.fetchone()
    if token is None or (operator_only and token["kind"] != "operator"):
        raise TokenNotFound(f"no such token: {token_id}")
    if actor is not None:
        await _check_company_may_revoke(conn, token, actor)
    table = "operator_tokens" if token["kind"] == "operator" else "api_tokens"
    await conn.execute(
        f"UPDATE {table} SET revoked_at = coalesce(revoked_at, now()) WHERE id = %s",
        (token_id,),
    )
    cur = await conn.execute(_TOKENS + " WHERE t.id = %s", (token_id,))
    found: Row | None = await cur.fetchone()
    assert found is not None
    return found


async def end_sessions(
    conn: AsyncConnection[Any], user: str, *, actor: CompanyActor | None = None
) -> int:
    """End every Files page session of ``user``; their next request is 401.
    With ``actor`` (the admin API) only for a member of the actor's company,
    an owner's only by an owner, and only there: the sessions signed in so
    far stop reaching the actor's company (401 there from the next request,
    and for a write not yet committed), not the user's other companies. The
    count is of the sessions this ended."""
    user = check_uuid(user, "user")
    if actor is None:
        await require_user(conn, user)
        cur = await conn.execute("DELETE FROM web_sessions WHERE user_id = %s", (user,))
        return cur.rowcount
    # Not a member and no such user answer alike: a company learns nothing
    # of people outside it. The row is locked for the update below (a write
    # of the member in flight holds it FOR SHARE: this waits for it).
    cur = await conn.execute(
        "SELECT role, sessions_ended_at FROM memberships WHERE company_id = %s AND user_id = %s"
        " FOR NO KEY UPDATE",
        (actor.company_id, user),
    )
    member = await cur.fetchone()
    if member is None:
        raise MemberNotFound(f"user {user} is not a member of company {actor.company_id}")
    if member["role"] == "owner" and not actor.is_owner:
        raise OwnerRequired("Only an owner may end an owner's sessions")
    cur = await conn.execute(
        "SELECT count(*) AS n FROM web_sessions WHERE user_id = %s AND expires_at > now()"
        " AND created_at <= now() AND (%s::timestamptz IS NULL OR created_at > %s::timestamptz)",
        (user, member["sessions_ended_at"], member["sessions_ended_at"]),
    )
    counted = await cur.fetchone()
    assert counted is not None
    await conn.execute(
        "UPDATE memberships SET sessions_ended_at = now() WHERE company_id = %s AND user_id = %s",
        (actor.company_id, user),
    )
    return int(counted["n"])
