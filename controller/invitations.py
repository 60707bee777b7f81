"""Invitations: how an existing person joins a company through its admin API.

A company's owners and admins reach no one outside the company. They may
invite an existing user (by id) with a role; that person becomes a member
only by accepting the invitation with their own API token or Files page
session, or may decline it. Until then the company learns nothing about them
(no email, no other membership) and can change nothing of theirs. The host's
operator (``controller admin add-member``) still adds anyone directly.

One pending invitation per company and person: inviting again changes its
role. Only an owner invites to the owner role. Accepting, declining and
withdrawing delete the invitation; removing the company or the user does too.

An invitation lapses :data:`INVITATION_TTL` after it was made or last
renewed (inviting again renews it): the role it offers was the inviter's
decision then, and an old one should not wait forever for someone to take
it. A lapsed invitation is listed nowhere; accepting it is 410
``invitation_expired`` (only its invitee learns that it existed), declining
it removes it, and the company may invite the person again.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any, Final

from psycopg import AsyncConnection

from common.errors import AlreadyMember, InvitationExpired, InvitationNotFound, OwnerRequired
from controller.auth import CompanyActor
from controller.foldercore import Row
from controller.orgs import Membership, check_role, check_uuid, require_user

INVITATION_TTL: Final = timedelta(days=14)
"""How long an invitation waits for its answer (migration 0021 gave the ones
pending at that upgrade as long)."""

_COLUMNS = "i.id, i.company_id, i.user_id, i.role, i.invited_by, i.created_at, i.expires_at"
_PENDING = "i.expires_at > clock_timestamp()"


async def invite(conn: AsyncConnection[Any], user: str, role: str, *, actor: CompanyActor) -> Row:
    """Invite ``user`` to the actor's company with ``role`` (or change the
    role of their pending invitation, which renews it, lapsed or not). 404
    ``user_not_found`` for no such user, 409 ``already_member`` for a member
    (change their role instead)."""
    user = check_uuid(user, "userId")
    check_role(role)
    if role == "owner" and not actor.is_owner:
        raise OwnerRequired("Only an owner may invite to the owner role")
    await require_user(conn, user)
    cur = await conn.execute(
        "SELECT 1 FROM memberships WHERE company_id = %s AND user_id = %s",
        (actor.company_id, user),
    )
    if await cur.fetchone() is not None:
        raise AlreadyMember(f"user {user} is already a member of company {actor.company_id}")
    cur = await conn.execute(
        "INSERT INTO invitations AS i (id, company_id, user_id, role, invited_by, expires_at)"
        " VALUES (%s, %s, %s, %s, %s, clock_timestamp() + %s)"
        " ON CONFLICT (company_id, user_id)"
        " DO UPDATE SET role = EXCLUDED.role, expires_at = EXCLUDED.expires_at"
        f" RETURNING {_COLUMNS}",
        (str(uuid.uuid4()), actor.company_id, user, role, actor.user_id, INVITATION_TTL),
    )
    row: Row | None = await cur.fetchone()
    assert row is not None
    return row


async def company_invitations(conn: AsyncConnection[Any], company: str) -> list[Row]:
    """The company's pending invitations, oldest first (no emails: the
    invitees are not members); lapsed ones are not pending."""
    cur = await conn.execute(
        f"SELECT {_COLUMNS} FROM invitations i WHERE i.company_id = %s AND {_PENDING}"
        " ORDER BY i.created_at, i.id",
        (company,),
    )
    return list(await cur.fetchall())


async def withdraw(conn: AsyncConnection[Any], invitation: str, *, actor: CompanyActor) -> None:
    """The company takes back its pending invitation."""
    invitation = check_uuid(invitation, "invitationId")
    cur = await conn.execute(
        "DELETE FROM invitations WHERE id = %s AND company_id = %s RETURNING id",
        (invitation, actor.company_id),
    )
    if await cur.fetchone() is None:
        raise InvitationNotFound(f"no such invitation: {invitation}")


async def my_invitations(conn: AsyncConnection[Any], user: str) -> list[Row]:
    """A person's pending invitations, with each inviting company's name."""
    cur = await conn.execute(
        f"SELECT {_COLUMNS}, c.name AS company_name FROM invitations i"
        f" JOIN companies c ON c.id = i.company_id WHERE i.user_id = %s AND {_PENDING}"
        " ORDER BY i.created_at, i.id",
        (user,),
    )
    return list(await cur.fetchall())


async def _take(
    conn: AsyncConnection[Any], invitation: str, user: str, *, lapsed: bool = False
) -> Row:
    """Delete ``user``'s own invitation and return it; anyone else's (or none)
    is 404 ``invitation_not_found``, as if it did not exist, and their own
    lapsed one 410 ``invitation_expired`` unless ``lapsed`` takes it too (the
    refusal rolls the delete back; the company sees nothing either way)."""
    invitation = check_uuid(invitation, "invitationId")
    cur = await conn.execute(
        "DELETE FROM invitations i WHERE i.id = %s AND i.user_id = %s"
        f" RETURNING i.id, i.company_id, i.user_id, i.role, {_PENDING} AS pending",
        (invitation, user),
    )
    row: Row | None = await cur.fetchone()
    if row is None:
        raise InvitationNotFound(f"no such invitation: {invitation}")
    if not (row["pending"] or lapsed):
        raise InvitationExpired(
            f"invitation {invitation} has expired; the company may invite you again"
        )
    return row


async def accept(conn: AsyncConnection[Any], invitation: str, user: str) -> Membership:
    """``user`` accepts their invitation: they become a member with its role
    (a member already, say added meanwhile by the host's operator, keeps the
    role they have)."""
    row = await _take(conn, invitation, user)
    company = str(row["company_id"])
    cur = await conn.execute(
        "INSERT INTO memberships AS m (company_id, user_id, role) VALUES (%s, %s, %s)"
        " ON CONFLICT (company_id, user_id) DO UPDATE SET role = m.role RETURNING m.role",
        (company, user, row["role"]),
    )
    member = await cur.fetchone()
    assert member is not None
    return Membership(company, user, str(member["role"]))


async def decline(conn: AsyncConnection[Any], invitation: str, user: str) -> None:
    """``user`` declines their invitation (lapsed or not); the company may
    invite them again."""
    await _take(conn, invitation, user, lapsed=True)
