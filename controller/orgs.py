"""Companies, users, memberships, agents, projects and tasks: what an operator
(``controller admin``) and a company's owners, admins and operator tokens
(the admin REST API) create and change.

The CLI and the REST API call these same functions (the CLI through
``controller/admin.py``), so the two cannot drift. ``actor`` is who acts
through the API; ``None`` is the host's operator at the command line, who is
bound by no company role. Refusals are :mod:`common.errors` classes, worded
so the command line can print them as they are.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from common.errors import (
    AgentNotFound,
    CompanyNotFound,
    EmailTaken,
    LastOwner,
    MemberNotFound,
    OwnerRequired,
    ProjectNotFound,
    TaskNotFound,
    UserNotFound,
    ValidationError,
)
from common.limits import DEFAULT_AGENT_ENTRY
from common.text import MAX_NAME_CHARS, check_text
from controller.auth import USER_TOKEN_PREFIX, CompanyActor, new_token, token_hash
from controller.foldercore import Row

ROLES = ("owner", "admin", "member", "viewer")

MAX_EMAIL_CHARS = 320


def check_uuid(value: str, field: str) -> str:
    """The canonical form of a UUID argument; the message names the CLI's field."""
    try:
        parsed = uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        parsed = None
    if parsed is None or len(value) != 36:
        raise ValidationError.single(
            field, "invalid_uuid", f"{field} must be a UUID, got {value!r}"
        )
    return str(parsed)


def check_name(value: str, field: str = "name") -> str:
    """A display name or title: the text rule (:mod:`common.text`), one line
    of at most :data:`MAX_NAME_CHARS`, not blank (400 ``invalid_text``):
    PostgreSQL text cannot hold NUL, escapes garble listings, and a
    bidirectional override shows one agent's name as another's."""
    return check_text(value, field, MAX_NAME_CHARS)


def check_email(email: str) -> str:
    check_text(email, "email", MAX_EMAIL_CHARS)
    if "@" not in email or any(c.isspace() for c in email):
        raise ValidationError.single("email", "invalid_email", f"not an email address: {email!r}")
    return email


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValidationError.single(
            "role", "invalid_role", f"role must be one of {', '.join(ROLES)}, got {role!r}"
        )
    return role


async def _exists(conn: AsyncConnection[Any], sql: str, *params: Any) -> bool:
    cur = await conn.execute(sql, params)
    return await cur.fetchone() is not None


async def require_company(conn: AsyncConnection[Any], company: str) -> None:
    if not await _exists(conn, "SELECT 1 FROM companies WHERE id = %s", company):
        raise CompanyNotFound(f"no such company: {company}")


async def require_user(conn: AsyncConnection[Any], user: str) -> None:
    if not await _exists(conn, "SELECT 1 FROM users WHERE id = %s", user):
        raise UserNotFound(f"no such user: {user}")


async def require_agent(conn: AsyncConnection[Any], company: str, agent: str) -> None:
    sql = "SELECT 1 FROM agents WHERE id = %s AND company_id = %s"
    if not await _exists(conn, sql, agent, company):
        raise AgentNotFound(f"no such agent: {agent}")


async def require_project(conn: AsyncConnection[Any], company: str, project: str) -> None:
    sql = "SELECT 1 FROM projects WHERE id = %s AND company_id = %s"
    if not await _exists(conn, sql, project, company):
        raise ProjectNotFound(f"no such project: {project}")


async def task_project(conn: AsyncConnection[Any], company: str, task: str) -> str:
    """The project of a task of ``company``; TaskNotFound otherwise."""
    cur = await conn.execute(
        "SELECT project_id FROM tasks WHERE id = %s AND company_id = %s", (task, company)
    )
    row = await cur.fetchone()
    if row is None:
        raise TaskNotFound(f"no such task: {task}")
    return str(row["project_id"])


# --- users ---------------------------------------------------------------------


@dataclass(frozen=True)
class NewUser:
    user_id: str
    email: str
    token: str
    """The user's first API token, shown once (only its hash is stored)."""
    token_id: str


async def create_user(conn: AsyncConnection[Any], email: str) -> NewUser:
    check_email(email)
    if await _exists(conn, "SELECT 1 FROM users WHERE email = %s", email):
        raise EmailTaken(f"a user with email {email} already exists")
    user_id = str(uuid.uuid4())
    token = new_token(USER_TOKEN_PREFIX)
    # ON CONFLICT: a concurrent create of the same email loses cleanly here
    # instead of failing on the unique index.
    cur = await conn.execute(
        "INSERT INTO users (id, email) VALUES (%s, %s) ON CONFLICT (email) DO NOTHING RETURNING id",
        (user_id, email),
    )
    if await cur.fetchone() is None:
        raise EmailTaken(f"a user with email {email} already exists")
    cur = await conn.execute(
        "INSERT INTO api_tokens (token_hash, user_id) VALUES (%s, %s) RETURNING id",
        (token_hash(token), user_id),
    )
    row = await cur.fetchone()
    assert row is not None
    return NewUser(user_id, email, token, str(row["id"]))


async def bootstrap(
    conn: AsyncConnection[Any], company_name: str, email: str
) -> tuple[str, NewUser]:
    """A company, its owner and the membership (the caller's one transaction)."""
    check_name(company_name, "company name")
    company_id = str(uuid.uuid4())
    await conn.execute(
        "INSERT INTO companies (id, name) VALUES (%s, %s)", (company_id, company_name)
    )
    user = await create_user(conn, email)
    await set_member_role(conn, company_id, user.user_id, "owner")
    return company_id, user


# --- memberships -----------------------------------------------------------------


async def _locked_owners(conn: AsyncConnection[Any], company: str) -> set[str]:
    """The company's owners, their rows locked (in user id order)."""
    cur = await conn.execute(
        "SELECT user_id FROM memberships WHERE company_id = %s AND role = 'owner'"
        " ORDER BY user_id FOR UPDATE",
        (company,),
    )
    return {str(r["user_id"]) for r in await cur.fetchall()}


async def _locked_role(
    conn: AsyncConnection[Any],
    company: str,
    user: str,
    new: str | None,
    actor: CompanyActor | None,
) -> str | None:
    """The user's current role, its row locked, after the owner rules: through
    the API only an owner touches the owner role, and a company keeps at least
    one owner. (The host's operator is bound by neither.)

    Through the API the owners' rows are locked first, always in one order, so
    two requests demoting or removing owners at once are ordered and cannot
    both take away the last one."""
    owners = None if actor is None else await _locked_owners(conn, company)
    cur = await conn.execute(
        "SELECT role FROM memberships WHERE company_id = %s AND user_id = %s FOR UPDATE",
        (company, user),
    )
    row = await cur.fetchone()
    current = None if row is None else str(row["role"])
    if actor is not None and current != new:
        if "owner" in (current, new) and not actor.is_owner:
            raise OwnerRequired()
        if current == "owner" and owners == {user}:
            raise LastOwner()
    return current


@dataclass(frozen=True)
class Membership:
    company_id: str
    user_id: str
    role: str


async def set_member_role(
    conn: AsyncConnection[Any],
    company: str,
    user: str,
    role: str,
    *,
    actor: CompanyActor | None = None,
    joining: bool = False,
) -> Membership:
    """Add ``user`` to ``company`` with ``role``, or change their role.

    Through the API (``actor``) only a member's role changes: an existing
    person joins a company by accepting its invitation
    (:mod:`controller.invitations`) or through the host's operator
    (``add-member``, no actor). Anyone else is :class:`MemberNotFound`,
    whether or not such a user exists: a company reads and changes nothing of
    people outside it. ``joining`` is :func:`add_new_member`'s user, made in
    the same transaction."""
    company, user = check_uuid(company, "company"), check_uuid(user, "user")
    check_role(role)
    await require_company(conn, company)
    if actor is None or joining:
        await require_user(conn, user)
    current = await _locked_role(conn, company, user, role, actor)
    if current is None and actor is not None and not joining:
        raise MemberNotFound(
            f"user {user} is not a member of company {company} (invite them to join)"
        )
    await conn.execute(
        "INSERT INTO memberships (company_id, user_id, role) VALUES (%s, %s, %s)"
        " ON CONFLICT (company_id, user_id) DO UPDATE SET role = EXCLUDED.role",
        (company, user, role),
    )
    return Membership(company, user, role)


async def add_new_member(
    conn: AsyncConnection[Any], company: str, email: str, role: str, *, actor: CompanyActor
) -> tuple[NewUser, Membership]:
    """A new user with ``email`` and a first API token, made a member at once
    (``create-user`` then ``add-member``, in one transaction)."""
    check_role(role)
    if role == "owner" and not actor.is_owner:
        raise OwnerRequired()
    user = await create_user(conn, email)
    member = await set_member_role(conn, company, user.user_id, role, actor=actor, joining=True)
    return user, member


async def remove_member(
    conn: AsyncConnection[Any], company: str, user: str, *, actor: CompanyActor | None = None
) -> None:
    """End the membership: the user's tokens, sessions and runs lose the
    company at their next request (and at the commit of a write in flight,
    which locks the membership row)."""
    company, user = check_uuid(company, "company"), check_uuid(user, "user")
    if await _locked_role(conn, company, user, None, actor) is None:
        raise MemberNotFound(f"user {user} is not a member of company {company}")
    await conn.execute(
        "DELETE FROM memberships WHERE company_id = %s AND user_id = %s", (company, user)
    )


async def list_members(conn: AsyncConnection[Any], company: str) -> list[Row]:
    cur = await conn.execute(
        "SELECT u.id, u.email, m.role, m.created_at FROM memberships m"
        " JOIN users u ON u.id = m.user_id WHERE m.company_id = %s ORDER BY u.email, u.id",
        (company,),
    )
    return list(await cur.fetchall())


async def get_member(conn: AsyncConnection[Any], company: str, user: str) -> Row:
    cur = await conn.execute(
        "SELECT u.id, u.email, m.role, m.created_at FROM memberships m"
        " JOIN users u ON u.id = m.user_id WHERE m.company_id = %s AND m.user_id = %s",
        (company, user),
    )
    row: Row | None = await cur.fetchone()
    if row is None:
        raise MemberNotFound(f"user {user} is not a member of company {company}")
    return row


# --- agents, projects, tasks -------------------------------------------------------


async def create_agent(conn: AsyncConnection[Any], company: str, name: str) -> Row:
    """An agent; its folder starts with an empty instruction entry
    (``agentfiles.DEFAULT_AGENT_ENTRY``)."""
    from controller import agentfiles  # agentfiles reaches foldercore: keep orgs light to import

    row = await _create_named(conn, "agents", company, name)
    await agentfiles.ensure_entry(conn, str(company), str(row["id"]))
    return {**row, "entry_path": DEFAULT_AGENT_ENTRY}


async def create_project(conn: AsyncConnection[Any], company: str, name: str) -> Row:
    return await _create_named(conn, "projects", company, name)


async def _create_named(conn: AsyncConnection[Any], table: str, company: str, name: str) -> Row:
    company = check_uuid(company, "company")
    check_name(name)
    await require_company(conn, company)
    cur = await conn.execute(
        f"INSERT INTO {table} (id, company_id, name) VALUES (%s, %s, %s)"
        " RETURNING id, name, created_at",
        (str(uuid.uuid4()), company, name),
    )
    row: Row | None = await cur.fetchone()
    assert row is not None
    return row


async def create_task(conn: AsyncConnection[Any], company: str, project: str, title: str) -> Row:
    company, project = check_uuid(company, "company"), check_uuid(project, "project")
    check_name(title, "title")
    await require_company(conn, company)
    await require_project(conn, company, project)
    cur = await conn.execute(
        "INSERT INTO tasks (id, company_id, project_id, title) VALUES (%s, %s, %s, %s)"
        " RETURNING id, title, project_id, created_at",
        (str(uuid.uuid4()), company, project, title),
    )
    row: Row | None = await cur.fetchone()
    assert row is not None
    return row


async def list_agents(conn: AsyncConnection[Any], company: str) -> list[Row]:
    cur = await conn.execute(
        "SELECT id, name, created_at FROM agents WHERE company_id = %s ORDER BY name, id",
        (company,),
    )
    return list(await cur.fetchall())


async def list_projects(conn: AsyncConnection[Any], company: str) -> list[Row]:
    cur = await conn.execute(
        "SELECT id, name, created_at FROM projects WHERE company_id = %s ORDER BY name, id",
        (company,),
    )
    return list(await cur.fetchall())


async def list_tasks(
    conn: AsyncConnection[Any], company: str, project: str | None = None
) -> list[Row]:
    cur = await conn.execute(
        "SELECT id, title, project_id, created_at FROM tasks WHERE company_id = %s"
        " AND (%s::uuid IS NULL OR project_id = %s::uuid) ORDER BY title, id",
        (company, project, project),
    )
    return list(await cur.fetchall())
