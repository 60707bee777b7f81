"""The Files page: sign-in sessions, the company directory and static assets."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from common.errors import NotFound, Unauthenticated, ValidationError
from common.paths import validate_uuid
from controller import companies, sessions
from controller.api.common import (
    SESSION_COOKIE,
    authenticate,
    connection,
    json_errors,
    read_json,
)
from controller.api.serialize import directory_json, session_json
from controller.auth import membership_role, principal_from_bearer

SESSION_DAYS = 7
WEB_ROOT = Path(str(resources.files("controller").joinpath("web")))


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
        secret, session = await sessions.open_session(conn, principal.user_id, SESSION_DAYS)
    resp = JSONResponse(session_json(session))
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
        session = await sessions.describe(
            conn, principal.user_id, principal.csrf_token or "", principal.session_started
        )
    return JSONResponse(session_json(session))


@json_errors
async def delete_session(request: Request) -> Response:
    async with connection(request) as conn:
        principal = await authenticate(request, conn)
        secret = request.cookies.get(SESSION_COOKIE)
        if principal.via_session and secret:
            await sessions.close_session(conn, secret)
    resp = Response(status_code=204)
    resp.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return resp


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
        # Which folders have files and an active run is for people (the Files
        # page's home); a run sees names and ids only.
        person = principal.kind != "run"
        found = await companies.directory(
            conn, company_id, activity=person, viewer=principal.user_id if person else None
        )
    return JSONResponse(directory_json(found, members_private=not person))


_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    # Everything the page needs comes from this origin; blob: for image
    # previews; the one frame is the PDF viewer below.
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' blob: data:; frame-src 'self'; object-src 'none';"
        " style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'"
    ),
}

PDF_VIEWER = "pdf-viewer.html"
"""The document the Files page shows a PDF in: pdf.js in a sandboxed frame."""

_VIEWER_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "SAMEORIGIN",
    "Referrer-Policy": "no-referrer",
    # A PDF is hostile input: the viewer's document has an opaque origin even
    # when opened on its own (`sandbox`), reaches no network (the page hands it
    # the bytes), and runs only this origin's scripts: its own module and
    # pdf.js, whose worker starts from a blob: URL made in the frame.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src blob: data:;"
        " font-src data:; worker-src blob:; connect-src 'none'; form-action 'none';"
        " base-uri 'none'; frame-ancestors 'self'; sandbox allow-scripts"
    ),
}

_CORS_ASSETS = ("pdf-viewer.js", "vendor/pdfjs/")
"""Scripts the viewer's opaque origin loads: a module script from another
origin needs CORS. Public code, so any origin may read it."""


def _asset_headers(name: str) -> dict[str, str]:
    if name == PDF_VIEWER:
        return _VIEWER_HEADERS
    if name.startswith(_CORS_ASSETS):
        return {**_PAGE_HEADERS, "Access-Control-Allow-Origin": "*"}
    return _PAGE_HEADERS


async def static_asset(request: Request) -> Response:
    name = request.path_params["name"]
    # Resolving and stat-ing the package's own small asset files is not worth
    # a thread hop.
    root = WEB_ROOT.resolve()  # noqa: ASYNC240
    target = (root / name).resolve()
    if root not in target.parents or not target.is_file():
        return JSONResponse({"error": "Not found", "code": "not_found"}, status_code=404)
    return FileResponse(target, headers=_asset_headers(target.relative_to(root).as_posix()))


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
