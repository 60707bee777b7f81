"""Tokens, principals and the folder access rules.

Every denial is reported as :class:`NotFound` ("Work folder not found") so a
caller cannot tell a folder it may not see from one that does not exist.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from psycopg import AsyncConnection

from common.errors import (
    CompanyNotFound,
    MembershipRevoked,
    NotFound,
    PurgeForbidden,
    StaleLease,
    Unauthenticated,
    WriteNotAllowed,
)
from controller.config import Quotas
from controller.foldercore import STORE_MARK_SQL, Authority, WritePolicy
from controller.grants import ALL_AGENTS_ROLES, CONFIGURE, confirm_configure, may_configure_agent

USER_TOKEN_PREFIX = "fsa_u_"
RUN_TOKEN_PREFIX = "fsa_r_"
OPERATOR_TOKEN_PREFIX = "fsa_o_"
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
class OperatorGrant:
    """An operator token: a machine's credential for one company's admin routes."""

    token_id: str
    company_id: str


@dataclass(frozen=True)
class Principal:
    kind: Literal["user", "run", "operator"]
    user_id: str | None = None
    run: RunBinding | None = None
    via_session: bool = False
    csrf_token: str | None = None
    operator: OperatorGrant | None = None
    token_id: str | None = None
    """The id of the API token a person's request presented."""
    session_hash: bytes | None = None
    """The Files page session a person's request presented (its stored hash)."""
    session_started: datetime | None = None
    """When that session was signed in: a company that ended the member's
    sessions since (``memberships.sessions_ended_at``) is closed to it."""


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
    if token.startswith(OPERATOR_TOKEN_PREFIX):
        cur = await conn.execute(
            "SELECT id, company_id FROM operator_tokens"
            " WHERE token_hash = %s AND revoked_at IS NULL",
            (digest,),
        )
        row = await cur.fetchone()
        if row is None:
            raise Unauthenticated()
        grant = OperatorGrant(str(row["id"]), str(row["company_id"]))
        return Principal(kind="operator", operator=grant)
    cur = await conn.execute(
        "SELECT id, user_id FROM api_tokens WHERE token_hash = %s AND revoked_at IS NULL",
        (digest,),
    )
    row = await cur.fetchone()
    if row is None:
        raise Unauthenticated()
    return Principal(kind="user", user_id=str(row["user_id"]), token_id=str(row["id"]))


_NEWEST_EPOCH = (
    "(SELECT max(lease_epoch) FROM runs o"
    " WHERE o.company_id = r.company_id AND o.sandbox_key = r.sandbox_key) AS newest"
)


async def principal_for_bridge(
    conn: AsyncConnection[Any], run_id: str, lease_epoch: int
) -> Principal:
    """The run behind a request the API bridge forwards: read again for every
    request, so a run ended or superseded (a newer lease epoch for its sandbox)
    since the bridge checked its token is refused here too."""
    cur = await conn.execute(f"SELECT r.*, {_NEWEST_EPOCH} FROM runs r WHERE r.id = %s", (run_id,))
    row = await cur.fetchone()
    if row is None or not row["active"]:
        raise Unauthenticated("The run has ended")
    if int(row["lease_epoch"]) != lease_epoch or row["newest"] != row["lease_epoch"]:
        raise Unauthenticated("The run was superseded by a newer lease")
    return Principal(kind="run", run=_run_from_row(row))


async def principal_from_session(conn: AsyncConnection[Any], secret: str) -> Principal:
    digest = token_hash(secret)
    cur = await conn.execute(
        "SELECT user_id, csrf_token, created_at FROM web_sessions"
        " WHERE session_hash = %s AND expires_at > now()",
        (digest,),
    )
    row = await cur.fetchone()
    if row is None:
        raise Unauthenticated()
    return Principal(
        kind="user",
        user_id=str(row["user_id"]),
        via_session=True,
        csrf_token=row["csrf_token"],
        session_hash=digest,
        session_started=row["created_at"],
    )


async def session_ended_in(
    conn: AsyncConnection[Any], principal: Principal, company_id: str, *, lock: bool = False
) -> bool:
    """Whether ``company_id`` ended the member's Files page sessions since the
    principal's session was signed in: it no longer reaches that company
    (and still reaches the others). ``lock`` takes the membership row
    ``FOR SHARE``, so ending the sessions waits for the write."""
    if principal.session_started is None:
        return False
    cur = await conn.execute(
        "SELECT 1 FROM memberships WHERE company_id = %s AND user_id = %s"
        " AND sessions_ended_at >= %s" + (" FOR SHARE" if lock else ""),
        (company_id, principal.user_id, principal.session_started),
    )
    return await cur.fetchone() is not None


async def confirm_credential(
    conn: AsyncConnection[Any], principal: Principal, company_id: str | None = None
) -> None:
    """The API token or Files page session a person's request presented is
    still valid (for a session, not ended by ``company_id`` either), its row
    locked ``FOR SHARE``: revoking the token (an update) or ending the
    session (a delete, or the company's update of the membership) waits for
    this transaction, so a write commits wholly before the revocation or not
    at all (401)."""
    if principal.token_id is not None:
        cur = await conn.execute(
            "SELECT 1 FROM api_tokens WHERE id = %s AND revoked_at IS NULL FOR SHARE",
            (principal.token_id,),
        )
        if await cur.fetchone() is None:
            raise Unauthenticated("The token was revoked; nothing was saved")
    if principal.session_hash is not None:
        cur = await conn.execute(
            "SELECT 1 FROM web_sessions WHERE session_hash = %s AND expires_at > now() FOR SHARE",
            (principal.session_hash,),
        )
        if await cur.fetchone() is None:
            raise Unauthenticated("The session has ended; nothing was saved")
        if company_id is not None and await session_ended_in(
            conn, principal, company_id, lock=True
        ):
            raise Unauthenticated("The session was ended for this company; nothing was saved")


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


async def run_may_write_user_folder(conn: AsyncConnection[Any], run: RunBinding) -> bool:
    """A run acts for its user: writing that user's folder also needs the
    user's own write right (a viewer's run may read it, not change it)."""
    if not run.active or run.user_id is None:
        return False
    role = await membership_role(conn, run.company_id, run.user_id)
    return role is not None and role != "viewer"


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
        user_id = principal.user_id
        role = await membership_role(conn, company_id, user_id)

        async def configures() -> bool:
            return await may_configure_agent(conn, company_id, user_id, owner_id, role)

        if not await _person_may(
            role, scope, owner_id, user_id, write=write, configures=configures
        ):
            raise NotFound()
        if scope == "user":
            return  # the membership just checked is the owner's own
    elif principal.kind == "run":
        run = principal.run
        assert run is not None
        # A run's authority, for reads as for writes, is exactly its binding:
        # its task and project, its own agent, and its user while that user is
        # an active member. Everything else of the company is invisible to it.
        if not run.active or run.company_id != company_id or owner_id != run.owner_for(scope):
            raise NotFound()
        if scope == "user" and not await run_may_use_user_folder(conn, run):
            raise NotFound()
        if scope == "user" and write and not await run_may_write_user_folder(conn, run):
            raise WriteNotAllowed("The run's user is a viewer; the run cannot write their folder")
    else:
        # An operator token administers a company; it reads and writes no files.
        raise NotFound()
    if not await _owner_exists(conn, company_id, scope, owner_id):
        raise NotFound()


_OWNER_EXISTS_SQL = {
    scope: f"EXISTS (SELECT 1 FROM {table} WHERE company_id = %(company)s AND id::text = %(owner)s)"
    for scope, table in _OWNER_TABLE.items()
}
_CONFIGURES_SQL = (
    "EXISTS (SELECT 1 FROM agent_grants WHERE company_id = %(company)s AND user_id = t.user_id"
    " AND agent_id::text = %(owner)s AND permission = %(permission)s)"
)


async def token_write_access(
    conn: AsyncConnection[Any], token: str, company_id: str, scope: str, owner_id: str
) -> dict[str, Any] | None:
    """What a write to a folder with a person's API token needs to know
    before its body is read, in one statement (one round trip, no
    transaction): the token (None when it is unknown or revoked), the
    member's role in the company, for an agent's folder whether a grant lets
    the member configure the agent, whether the folder's owner exists, the
    folder's id (None while it was never written) and a store mark
    (:func:`controller.foldercore.take_store_mark`), drawn for a known token only.

    The same reads as :func:`principal_from_bearer`, :func:`authorize_folder`
    and :func:`controller.foldercore.get_folder`, from one snapshot;
    :func:`check_token_write` applies the same rules to them."""
    sql = (
        "SELECT t.id, t.user_id,"
        " (SELECT role FROM memberships WHERE company_id = %(company)s AND user_id = t.user_id)"
        " AS role,"
        f" {_CONFIGURES_SQL if scope == 'agent' else 'false'} AS configures,"
        f" {_OWNER_EXISTS_SQL.get(scope, 'true')} AS owner_exists,"
        " (SELECT id FROM folders"
        "  WHERE company_id = %(company)s AND scope = %(scope)s AND owner_id = %(owner)s)"
        " AS folder_id,"
        f" {STORE_MARK_SQL} AS mark"
        " FROM api_tokens t WHERE t.token_hash = %(hash)s AND t.revoked_at IS NULL"
    )
    params = {
        "hash": token_hash(token),
        "company": company_id,
        "scope": scope,
        "owner": owner_id,
        "permission": CONFIGURE,
    }
    cur = await conn.execute(sql, params)
    row: dict[str, Any] | None = await cur.fetchone()
    return row


def token_principal(access: dict[str, Any]) -> Principal:
    """The person behind a known token of :func:`token_write_access`."""
    return Principal(kind="user", user_id=str(access["user_id"]), token_id=str(access["id"]))


async def _person_may(
    role: str | None,
    scope: str,
    owner_id: str,
    user_id: str,
    *,
    write: bool,
    configures: Callable[[], Awaitable[bool]],
) -> bool:
    """A person's rules for a folder (its owner's existence aside), the one
    place both :func:`authorize_folder` and :func:`check_token_write` take
    them from: a member, and for a write not a viewer; only their own user
    folder (generic company access never grants another person's); an
    agent's folder only with the configure permission (``configures``,
    asked only then)."""
    if role is None or (write and role == "viewer"):
        return False
    if scope == "user":
        return owner_id == user_id
    return scope != "agent" or await configures()


async def check_token_write(
    access: dict[str, Any], principal: Principal, scope: str, owner_id: str
) -> None:
    """:func:`authorize_folder`'s rules for a person's write, on what
    :func:`token_write_access` read: NotFound unless ``principal`` may write."""
    role = access["role"]
    assert principal.user_id is not None

    async def configures() -> bool:
        return role in ALL_AGENTS_ROLES or bool(access["configures"])

    if not await _person_may(role, scope, owner_id, principal.user_id, write=True,
                             configures=configures):  # fmt: skip
        raise NotFound()
    if scope != "user" and not access["owner_exists"]:
        raise NotFound()


def authorize_purge(principal: Principal) -> None:
    """Purging makes deletions unrecoverable: a person's decision, never a sandbox's."""
    if principal.kind == "run":
        raise PurgeForbidden()


async def _locked_role(conn: AsyncConnection[Any], company_id: str, user_id: str) -> str | None:
    # FOR SHARE: a concurrent remove-member or role change waits for this
    # commit, so it is ordered entirely before or after the write.
    cur = await conn.execute(
        "SELECT role FROM memberships WHERE company_id = %s AND user_id = %s FOR SHARE",
        (company_id, user_id),
    )
    row = await cur.fetchone()
    return None if row is None else str(row["role"])


async def confirm_member_writes(conn: AsyncConnection[Any], company_id: str, user_id: str) -> str:
    """The member's role, locked; refused when gone or a viewer."""
    return _writer_role(await _locked_role(conn, company_id, user_id))


async def confirm_token_member_writes(
    conn: AsyncConnection[Any], token_id: str, company_id: str, user_id: str
) -> str:
    """:func:`confirm_credential` and :func:`confirm_member_writes` for a
    person's API token in one statement: the token row, then the membership
    row, each locked ``FOR SHARE`` as there, and the same refusals (the
    token's first)."""
    cur = await conn.execute(
        "SELECT (SELECT true FROM api_tokens WHERE id = %s AND revoked_at IS NULL FOR SHARE)"
        " AS valid,"
        " (SELECT role FROM memberships WHERE company_id = %s AND user_id = %s FOR SHARE) AS role",
        (token_id, company_id, user_id),
    )
    row = await cur.fetchone()
    assert row is not None
    if row["valid"] is None:
        raise Unauthenticated("The token was revoked; nothing was saved")
    return _writer_role(None if row["role"] is None else str(row["role"]))


def _writer_role(role: str | None) -> str:
    if role is None:
        raise MembershipRevoked("The membership was removed; nothing was saved")
    if role == "viewer":
        raise WriteNotAllowed("The member is now a viewer; nothing was saved")
    return role


async def confirm_run_agent_writes(conn: AsyncConnection[Any], run: RunBinding) -> None:
    """A run saving its agent's folder acts for its responsible user, if any,
    who must hold the agent's configure permission now (locked, like the
    membership): a 404, like every denial of a folder."""
    if run.user_id is None:
        return
    role = await _locked_role(conn, run.company_id, run.user_id)
    await confirm_configure(conn, run.company_id, run.user_id, run.agent_id, role)


async def run_may_write_agent_folder(conn: AsyncConnection[Any], run: RunBinding) -> bool:
    """:func:`confirm_run_agent_writes` without locks, before a body is read."""
    if run.user_id is None:
        return True
    role = await membership_role(conn, run.company_id, run.user_id)
    return await may_configure_agent(conn, run.company_id, run.user_id, run.agent_id, role)


_LEASE_SQL = f"SELECT r.lease_epoch, r.active, {_NEWEST_EPOCH} FROM runs r WHERE r.id = %s "
_ROW_LOCKS = {"share": "FOR SHARE", "update": "FOR NO KEY UPDATE"}


async def locked_lease(
    conn: AsyncConnection[Any], run_id: str, lock: Literal["share", "update"]
) -> dict[str, Any] | None:
    """The run's lease epoch, active flag and its sandbox's newest epoch, with
    the run row locked: ending or superseding the run waits for this
    transaction, so a write commits wholly before revocation or not at all."""
    cur = await conn.execute(_LEASE_SQL + _ROW_LOCKS[lock], (run_id,))
    row: dict[str, Any] | None = await cur.fetchone()
    return row


async def confirm_run_lease(conn: AsyncConnection[Any], run: RunBinding) -> None:
    """The run is still active and holds its sandbox's newest lease."""
    row = await locked_lease(conn, run.run_id, "share")
    if row is None or not row["active"]:
        raise Unauthenticated("The run has ended; nothing was saved")
    if row["lease_epoch"] != run.lease_epoch or row["newest"] != row["lease_epoch"]:
        raise StaleLease(details=[{"leaseEpoch": run.lease_epoch}])


async def confirm_write(
    conn: AsyncConnection[Any], principal: Principal, company_id: str, scope: str, owner_id: str
) -> None:
    """Authority again, inside the transaction that commits a write (after the
    folder lock): a person's API token or session still valid, the token's run
    still active on the newest lease, the responsible membership still present
    and still allowed to write, and for an agent's folder the configure
    permission still held."""
    if principal.kind == "user":
        assert principal.user_id is not None
        if principal.token_id is not None and principal.session_hash is None:
            role = await confirm_token_member_writes(
                conn, principal.token_id, company_id, principal.user_id
            )
        else:
            await confirm_credential(conn, principal, company_id)
            role = await confirm_member_writes(conn, company_id, principal.user_id)
        if scope == "agent":
            await confirm_configure(conn, company_id, principal.user_id, owner_id, role)
        return
    if principal.kind != "run":
        raise NotFound()
    assert principal.run is not None and principal.run.company_id == company_id
    await confirm_run_writes(conn, principal.run, scope)


async def confirm_run_writes(conn: AsyncConnection[Any], run: RunBinding, scope: str) -> None:
    """A run's part of :func:`confirm_write`: active, newest lease, for the
    user folder its user still a member with write rights, for its agent's
    folder its user (if any) still allowed to configure the agent."""
    await confirm_run_lease(conn, run)
    if scope == "user":
        assert run.user_id is not None
        await confirm_member_writes(conn, run.company_id, run.user_id)
    if scope == "agent":
        await confirm_run_agent_writes(conn, run)


def write_policy(
    principal: Principal, company_id: str, scope: str, owner_id: str, quotas: Quotas
) -> WritePolicy:
    """What a person's (or a run's REST) write re-checks when it commits."""

    async def confirm(conn: AsyncConnection[Any]) -> None:
        await confirm_write(conn, principal, company_id, scope, owner_id)

    authority: Authority = confirm
    agent = quotas.agent if scope == "agent" else None
    return WritePolicy(authority, quotas.max_folder_entries, agent)


# --- the company admin API ------------------------------------------------------


@dataclass(frozen=True)
class CompanyActor:
    """Who acts on a company through its admin routes: an owner or admin
    (``user_id`` set), or one of the company's operator tokens."""

    company_id: str
    role: Literal["owner", "admin", "operator"]
    user_id: str | None = None
    token_id: str | None = None

    @property
    def is_owner(self) -> bool:
        return self.role == "owner"


async def authorize_company(
    conn: AsyncConnection[Any], principal: Principal, company_id: str, *, write: bool
) -> CompanyActor:
    """The caller's authority over ``company_id``'s admin routes.

    Owners and admins of the company, and operator tokens made for it, have
    it. Everyone else (a member, a viewer, a stranger, another company's
    operator token, a run) gets :class:`CompanyNotFound`, exactly what a
    company that does not exist answers. For a write the membership or the
    token row is locked ``FOR SHARE`` (and a person's API token or session,
    :func:`confirm_credential`): removing the member, revoking the token or
    ending the session waits for the write, which lands entirely before it.
    """
    lock = " FOR SHARE" if write else ""
    if principal.kind == "operator":
        grant = principal.operator
        assert grant is not None
        if grant.company_id == company_id:
            cur = await conn.execute(
                "SELECT 1 FROM operator_tokens WHERE id = %s AND revoked_at IS NULL" + lock,
                (grant.token_id,),
            )
            if await cur.fetchone() is not None:
                return CompanyActor(company_id, "operator", token_id=grant.token_id)
    elif principal.kind == "user" and principal.user_id is not None:
        if write:
            await confirm_credential(conn, principal, company_id)
        cur = await conn.execute(
            "SELECT role FROM memberships WHERE company_id = %s AND user_id = %s" + lock,
            (company_id, principal.user_id),
        )
        row = await cur.fetchone()
        role = None if row is None else row["role"]
        if role == "owner" or role == "admin":
            return CompanyActor(company_id, role, user_id=principal.user_id)
    raise CompanyNotFound()
