"""Sign-in sessions of the Files page: opening, describing and closing them."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection

from controller.auth import SESSION_PREFIX, new_token, token_hash
from controller.foldercore import Row


@dataclass(frozen=True)
class Session:
    user_id: str
    email: str | None
    csrf_token: str
    companies: list[Row]
    """The user's memberships: company id, name and role, by name."""


async def describe(
    conn: AsyncConnection[Any], user_id: str, csrf_token: str, started: datetime | None = None
) -> Session:
    """The user and their companies; for a session signed in at ``started``,
    not the companies that ended the member's sessions since."""
    cur = await conn.execute("SELECT email FROM users WHERE id = %s", (user_id,))
    user = await cur.fetchone()
    cur = await conn.execute(
        "SELECT c.id, c.name, m.role FROM memberships m JOIN companies c ON c.id = m.company_id"
        " WHERE m.user_id = %s AND (%s::timestamptz IS NULL OR m.sessions_ended_at IS NULL"
        " OR m.sessions_ended_at < %s::timestamptz) ORDER BY c.name, c.id",
        (user_id, started, started),
    )
    companies = list(await cur.fetchall())
    return Session(user_id, user["email"] if user else None, csrf_token, companies)


async def open_session(conn: AsyncConnection[Any], user_id: str, days: int) -> tuple[str, Session]:
    """A new session for ``user_id`` valid for ``days``: its secret (the cookie
    value; only its hash is stored) and its description."""
    secret = new_token(SESSION_PREFIX)
    csrf = secrets.token_urlsafe(24)
    await conn.execute(
        "INSERT INTO web_sessions (session_hash, user_id, csrf_token, expires_at)"
        " VALUES (%s, %s, %s, now() + make_interval(days => %s))",
        (token_hash(secret), user_id, csrf, days),
    )
    return secret, await describe(conn, user_id, csrf)


async def close_session(conn: AsyncConnection[Any], secret: str) -> None:
    await conn.execute("DELETE FROM web_sessions WHERE session_hash = %s", (token_hash(secret),))
