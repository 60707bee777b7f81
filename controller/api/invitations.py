"""Invitations (:mod:`controller.invitations`): a company's owners and admins
invite an existing person under ``/api/companies/{companyId}/invitations``
(people only, like membership changes), and the person sees, accepts or
declines their own under ``/api/invitations`` with their API token or Files
page session. Nobody else's invitation is visible: another person's, or one
that does not exist, is 404 ``invitation_not_found``."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.errors import Unauthenticated
from common.paths import validate_uuid
from controller import invitations
from controller.api.common import (
    authenticate,
    company_read,
    company_write,
    connection,
    json_errors,
    path_company,
    read_json,
    write_transaction,
)
from controller.api.params import string_fields
from controller.auth import CompanyActor, Principal, confirm_credential
from controller.foldercore import Row
from controller.rowjson import iso

Conn = AsyncConnection[Any]


def invitation_json(row: Row) -> dict[str, Any]:
    """An invitation; a person's own listing adds the inviting company's name."""
    found = {
        "invitationId": str(row["id"]),
        "companyId": str(row["company_id"]),
        "userId": str(row["user_id"]),
        "role": row["role"],
        "invitedBy": None if row["invited_by"] is None else str(row["invited_by"]),
        "createdAt": iso(row["created_at"]),
        "expiresAt": iso(row["expires_at"]),
    }
    if "company_name" in row:
        found["companyName"] = row["company_name"]
    return found


# --- the company's side (owners and admins) -----------------------------------------


@json_errors
async def create_invitation(request: Request) -> Response:
    """Invite an existing user (by id) with a role; they join only by accepting."""
    path_company(request)
    fields = string_fields(await read_json(request), required=("userId", "role"))
    user = validate_uuid(str(fields["userId"]), "userId")
    role = str(fields["role"])

    async def work(conn: Conn, actor: CompanyActor) -> dict[str, Any]:
        return invitation_json(await invitations.invite(conn, user, role, actor=actor))

    return JSONResponse(await company_write(request, work), status_code=201)


@json_errors
async def list_invitations(request: Request) -> Response:
    async def work(conn: Conn, actor: CompanyActor) -> list[dict[str, Any]]:
        rows = await invitations.company_invitations(conn, actor.company_id)
        return [invitation_json(r) for r in rows]

    return JSONResponse({"invitations": await company_read(request, work)})


@json_errors
async def withdraw_invitation(request: Request) -> Response:
    invitation = validate_uuid(request.path_params["invitationId"], "invitationId")

    async def work(conn: Conn, actor: CompanyActor) -> None:
        await invitations.withdraw(conn, invitation, actor=actor)

    await company_write(request, work)
    return JSONResponse({"invitationId": invitation, "withdrawn": True})


# --- the invited person's side ------------------------------------------------------


async def _person(request: Request, conn: Conn) -> tuple[Principal, str]:
    principal = await authenticate(request, conn)
    if principal.kind != "user" or principal.user_id is None:
        raise Unauthenticated("Invitations are answered by the invited person")
    return principal, principal.user_id


@json_errors
async def my_invitations(request: Request) -> Response:
    async with connection(request) as conn:
        _, user = await _person(request, conn)
        rows = await invitations.my_invitations(conn, user)
    return JSONResponse({"invitations": [invitation_json(r) for r in rows]})


@json_errors
async def accept_invitation(request: Request) -> Response:
    """The person's consent: they become a member with the invitation's role."""
    invitation = validate_uuid(request.path_params["invitationId"], "invitationId")

    async def work(conn: Conn) -> dict[str, Any]:
        principal, user = await _person(request, conn)
        await confirm_credential(conn, principal)
        joined = await invitations.accept(conn, invitation, user)
        return {"companyId": joined.company_id, "userId": joined.user_id, "role": joined.role}

    return JSONResponse(await write_transaction(request, work))


@json_errors
async def decline_invitation(request: Request) -> Response:
    invitation = validate_uuid(request.path_params["invitationId"], "invitationId")

    async def work(conn: Conn) -> None:
        principal, user = await _person(request, conn)
        await confirm_credential(conn, principal)
        await invitations.decline(conn, invitation, user)

    await write_transaction(request, work)
    return JSONResponse({"invitationId": invitation, "declined": True})


COMPANY = "/api/companies/{companyId}"

routes = [
    Route(COMPANY + "/invitations", list_invitations, methods=["GET"]),
    Route(COMPANY + "/invitations", create_invitation, methods=["POST"]),
    Route(COMPANY + "/invitations/{invitationId}", withdraw_invitation, methods=["DELETE"]),
    Route("/api/invitations", my_invitations, methods=["GET"]),
    Route("/api/invitations/{invitationId}/accept", accept_invitation, methods=["POST"]),
    Route("/api/invitations/{invitationId}", decline_invitation, methods=["DELETE"]),
]
