"""The Files page: sign-in sessions, the company directory and static assets."""

from __future__ import annotations

import secrets
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from common.errors import NotFound, Unauthenticated, ValidationError
from common.paths import validate_uuid
from controller.api.common import (
    SESSION_COOKIE,
    authenticate,
    connection,
    json_errors,
    read_json,
)
from controller.auth import (
    SESSION_PREFIX,
    Principal,
    membership_role,
    new_token,
    principal_from_bearer,
    token_hash,
)

SESSION_DAYS = 7
WEB_ROOT = Path(str(resources.files("controller").joinpath("web")))


async def session_body(conn: Any, user_id: str, csrf: str) -> dict[str, Any]:
    cur = await conn.execute("SELECT email FROM users WHERE id = %s", (user_id,))
    user = await cur.fetchone()
    cur = await conn.execute(
        "SELECT c.id, c.name, m.role FROM memberships m JOIN companies c ON c.id = m.company_id"
        " WHERE m.user_id = %s ORDER BY c.name, c.id",
        (user_id,),
    )
    companies = [
        {"id": str(r["id"]), "name": r["name"], "role": r["role"]} for r in await cur.fetchall()
    ]
    return {
        "userId": user_id,
        "email": user["email"] if user else None,
        "csrfToken": csrf,
        "companies": companies,
    }


@json_errors
async def create_session(request: Request) -> Response:
    body = await read_json(request, before_auth=True)  # the credential is the body
    token = body.get("token")
    if not isinstance(token, str) or not token or set(body) != {"token"}:
        raise ValidationError.single("token", "required", 'body must be {"token": <api token>}')
    async with connection(request) as conn:
        principal = await principal_from_bearer(conn, token)
        if principal.kind != "user" or principal.user_id is None:
            raise Unauthenticated("Sign in with a personal API token")
        secret = new_token(SESSION_PREFIX)
        csrf = secrets.token_urlsafe(24)
        await conn.execute(
            "INSERT INTO web_sessions (session_hash, user_id, csrf_token, expires_at)"
            " VALUES (%s, %s, %s, now() + make_interval(days => %s))",
            (token_hash(secret), principal.user_id, csrf, SESSION_DAYS),
        )
        body_out = await session_body(conn, principal.user_id, csrf)
    resp = JSONResponse(body_out)
    resp.set_cookie(
        SESSION_COOKIE,
        secret,
        max_age=SESSION_DAYS * 86400,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return resp


@json_errors
async def get_session(request: Request) -> Response:
    async with connection(request) as conn:
        principal = await authenticate(request, conn)
        if principal.kind != "user" or principal.user_id is None:
            raise Unauthenticated()
        return JSONResponse(await session_body(conn, principal.user_id, principal.csrf_token or ""))


@json_errors
async def delete_session(request: Request) -> Response:
    async with connection(request) as conn:
        principal = await authenticate(request, conn)
        secret = request.cookies.get(SESSION_COOKIE)
        if principal.via_session and secret:
            await conn.execute(
                "DELETE FROM web_sessions WHERE session_hash = %s", (token_hash(secret),)
            )
    resp = Response(status_code=204)
    resp.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return resp


def directory_member(principal: Principal, row: dict[str, Any]) -> dict[str, Any]:
    """A run sees who the members are, never their emails or roles."""
    if principal.kind == "run":
        return {"userId": str(row["id"])}
    return {"userId": str(row["id"]), "email": row["email"], "role": row["role"]}


@json_errors
async def company_directory(request: Request) -> Response:
    company_id = validate_uuid(request.path_params["companyId"], "companyId")
    async with connection(request) as conn:
        principal = await authenticate(request, conn)
        if principal.kind == "run":
            assert principal.run is not None
            if principal.run.company_id != company_id:
                raise NotFound("Company not found")
        else:
            assert principal.user_id is not None
            if await membership_role(conn, company_id, principal.user_id) is None:
                raise NotFound("Company not found")

        async def rows(sql: str) -> list[dict[str, Any]]:
            cur = await conn.execute(sql, (company_id,))
            return list(await cur.fetchall())

        agents = await rows("SELECT id, name FROM agents WHERE company_id = %s ORDER BY name, id")
        projects = await rows(
            "SELECT id, name FROM projects WHERE company_id = %s ORDER BY name, id"
        )
        tasks = await rows(
            "SELECT id, title, project_id FROM tasks WHERE company_id = %s ORDER BY title, id"
        )
        members = await rows(
            "SELECT u.id, u.email, m.role FROM memberships m JOIN users u ON u.id = m.user_id"
            " WHERE m.company_id = %s ORDER BY u.email"
        )
    return JSONResponse(
        {
            "agents": [{"id": str(r["id"]), "name": r["name"]} for r in agents],
            "projects": [{"id": str(r["id"]), "name": r["name"]} for r in projects],
            "tasks": [
                {"id": str(r["id"]), "title": r["title"], "projectId": str(r["project_id"])}
                for r in tasks
            ],
            "members": [directory_member(principal, r) for r in members],
        }
    )


_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    # Everything the page needs comes from this origin; blob: for previews.
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' blob: data:; frame-src blob:; object-src blob:;"
        " style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'"
    ),
}


async def static_asset(request: Request) -> Response:
    name = request.path_params["name"]
    # Resolving and stat-ing the package's own small asset files is not worth
    # a thread hop.
    root = WEB_ROOT.resolve()  # noqa: ASYNC240
    target = (root / name).resolve()
    if root not in target.parents or not target.is_file():
        return JSONResponse({"error": "Not found", "code": "not_found"}, status_code=404)
    return FileResponse(target, headers=_PAGE_HEADERS)


async def page(request: Request) -> Response:
    index = WEB_ROOT / "index.html"
    if not index.is_file():
        return JSONResponse({"error": "Files page is not installed", "code": "not_found"}, 404)
    return FileResponse(index, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


routes = [
    Route("/files/api/session", create_session, methods=["POST"]),
    Route("/files/api/session", get_session, methods=["GET"]),
    Route("/files/api/session", delete_session, methods=["DELETE"]),
    Route("/api/companies/{companyId}/directory", company_directory, methods=["GET"]),
    Route("/files/static/{name:path}", static_asset, methods=["GET", "HEAD"]),
    Route("/files", page, methods=["GET", "HEAD"]),
    Route("/files/{rest:path}", page, methods=["GET", "HEAD"]),
]
