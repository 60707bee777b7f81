"""Tokens, principals and the folder access rules.

Every denial is reported as :class:`NotFound` ("Work folder not found") so a
caller cannot tell a folder it may not see from one that does not exist.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from psycopg import AsyncConnection

from common.errors import NotFound, Unauthenticated

USER_TOKEN_PREFIX = "fsa_u_"
RUN_TOKEN_PREFIX = "fsa_r_"
SESSION_PREFIX = "fsa_s_"


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> bytes:
    # Tokens carry 256 random bits, so a plain SHA-256 is enough: there is
    # nothing to brute-force that a slow hash would protect.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def same_secret(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True)
class RunBinding:
    run_id: str
    company_id: str
    agent_id: str
    task_id: str | None
    project_id: str | None
    user_id: str | None
    lease_epoch: int
    active: bool

    def owner_for(self, scope: str) -> str | None:
        return {
            "task": self.task_id,
            "agent": self.agent_id,
            "project": self.project_id,
            "user": self.user_id,
        }[scope]


@dataclass(frozen=True)
class Principal:
    kind: Literal["user", "run"]
    user_id: str | None = None
    run: RunBinding | None = None
    via_session: bool = False
    csrf_token: str | None = None


def _run_from_row(row: dict[str, Any]) -> RunBinding:
    def s(v: Any) -> str | None:
        return None if v is None else str(v)

    return RunBinding(
        run_id=str(row["id"]),
        company_id=str(row["company_id"]),
        agent_id=str(row["agent_id"]),
        task_id=s(row["task_id"]),
        project_id=s(row["project_id"]),
        user_id=s(row["user_id"]),
        lease_epoch=int(row["lease_epoch"]),
        active=bool(row["active"]),
    )


async def principal_from_bearer(conn: AsyncConnection[Any], token: str) -> Principal:
    digest = token_hash(token)
    if token.startswith(RUN_TOKEN_PREFIX):
        cur = await conn.execute("SELECT * FROM runs WHERE token_hash = %s", (digest,))
        row = await cur.fetchone()
        # An ended run's token stops working at once.
        if row is None or not row["active"]:
            raise Unauthenticated()
        return Principal(kind="run", run=_run_from_row(row))
    cur = await conn.execute(
        "SELECT user_id FROM api_tokens WHERE token_hash = %s AND revoked_at IS NULL", (digest,)
    )
    row = await cur.fetchone()
    if row is None:
        raise Unauthenticated()
    return Principal(kind="user", user_id=str(row["user_id"]))


async def principal_from_session(conn: AsyncConnection[Any], secret: str) -> Principal:
    cur = await conn.execute(
        "SELECT user_id, csrf_token FROM web_sessions"
        " WHERE session_hash = %s AND expires_at > now()",
        (token_hash(secret),),
    )
    row = await cur.fetchone()
    if row is None:
        raise Unauthenticated()
    return Principal(
        kind="user", user_id=str(row["user_id"]), via_session=True, csrf_token=row["csrf_token"]
    )


async def membership_role(conn: AsyncConnection[Any], company_id: str, user_id: str) -> str | None:
    cur = await conn.execute(
        "SELECT role FROM memberships WHERE company_id = %s AND user_id = %s",
        (company_id, user_id),
    )
    row = await cur.fetchone()
    return None if row is None else str(row["role"])


_OWNER_TABLE = {"task": "tasks", "agent": "agents", "project": "projects"}


async def _owner_exists(
    conn: AsyncConnection[Any], company_id: str, scope: str, owner: str
) -> bool:
    if scope == "user":
        cur = await conn.execute(
            "SELECT 1 FROM memberships WHERE company_id = %s AND user_id::text = %s",
            (company_id, owner),
        )
    else:
        cur = await conn.execute(
            f"SELECT 1 FROM {_OWNER_TABLE[scope]} WHERE company_id = %s AND id::text = %s",
            (company_id, owner),
        )
    return await cur.fetchone() is not None


async def run_may_use_user_folder(conn: AsyncConnection[Any], run: RunBinding) -> bool:
    """A run reaches its responsible user's folder only while it runs and the
    user is still an active member of the run's company."""
    if not run.active or run.user_id is None:
        return False
    return await membership_role(conn, run.company_id, run.user_id) is not None


async def authorize_folder(
    conn: AsyncConnection[Any],
    principal: Principal,
    company_id: str,
    scope: str,
    owner_id: str,
    *,
    write: bool,
) -> None:
    """Raise NotFound unless ``principal`` may read (or write) the folder."""
    if principal.kind == "user":
        assert principal.user_id is not None
        role = await membership_role(conn, company_id, principal.user_id)
        if role is None or (write and role == "viewer"):
            raise NotFound()
        # Generic company access never grants another person's user folder.
        if scope == "user":
            if owner_id != principal.user_id:
                raise NotFound()
            return  # the membership just checked is the owner's own
    else:
        run = principal.run
        assert run is not None
        if not run.active or run.company_id != company_id:
            raise NotFound()
        if scope == "user":
            if owner_id != run.user_id or not await run_may_use_user_folder(conn, run):
                raise NotFound()
        elif scope == "agent" and write and owner_id != run.agent_id:
            # An agent may write only its own agent folder.
            raise NotFound()
        elif scope in ("task", "project") and write and owner_id != run.owner_for(scope):
            raise NotFound()
    if not await _owner_exists(conn, company_id, scope, owner_id):
        raise NotFound()
