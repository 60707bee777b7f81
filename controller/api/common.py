"""Request plumbing shared by the API modules: state, errors, auth, JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.bridge import PREFIX as BRIDGE_PREFIX
from common.errors import (
    CsrfFailed,
    DatabaseUnavailable,
    PayloadTooLarge,
    ServerBusy,
    Unauthenticated,
    ValidationError,
    WorkFolderError,
)
from common.logs import note_run
from common.paths import validate_uuid
from controller.api.limits import (
    RETRY_AFTER_SECONDS,
    BodyBudget,
    BodyHold,
    body_hold,
    credential_key,
    is_authenticated,
    mark_authenticated,
)
from controller.api.params import declared_length
from controller.auth import (
    OPERATOR_TOKEN_PREFIX,
    RUN_TOKEN_PREFIX,
    CompanyActor,
    Principal,
    RunBinding,
    authorize_company,
    principal_for_bridge,
    principal_from_bearer,
    principal_from_session,
    same_secret,
    session_ended_in,
)
from controller.config import Settings
from controller.db import SharedPool, end_autocommit
from controller.db.retry import retrying
from controller.runs import Transact
from controller.storage.base import StorageProvider

log = logging.getLogger("controller.api")
T = TypeVar("T")

SESSION_COOKIE = "fsa_session"

JSON_INLINE_BYTES = 256 * 1024
"""Bodies up to this size are parsed on the event loop; larger ones in a thread."""

# Parsing a large body costs CPU and several times its size in memory; a few
# at a time bound both (the per-token cap alone would allow dozens per run).
_large_bodies = asyncio.Semaphore(2)


@dataclass
class AppState:
    settings: Settings
    pool: SharedPool
    storage: StorageProvider


BRIDGE_IDENTITY = "controller.bridge_identity"
"""Scope key of a request the API bridge forwards (``controller/api/apibridge.py``).
Only the controller sets it: an ASGI scope is not something a client can send."""


@dataclass(frozen=True)
class BridgeIdentity:
    """The run a forwarded request acts for, attached by the API bridge."""

    run_id: str
    agent_id: str
    company_id: str
    lease_epoch: int
    share: str | None = None
    """The pool share of the bridge request's own credential (its run token)."""


def bridge_identity(scope: MutableMapping[str, Any]) -> BridgeIdentity | None:
    ident = scope.get(BRIDGE_IDENTITY)
    return ident if isinstance(ident, BridgeIdentity) else None


def share_key(scope: MutableMapping[str, Any]) -> str | None:
    """Whose pool share a request draws on: its credential's, also when the API
    bridge forwarded it without the credential headers (one share per run token,
    whether fsagent or sandbox code presents it)."""
    ident = bridge_identity(scope)
    return ident.share if ident is not None else credential_key(scope)


def state(request: Request) -> AppState:
    st: AppState = request.app.state.workfolders
    return st


@asynccontextmanager
async def connection(request: Request) -> AsyncIterator[AsyncConnection[Any]]:
    """A pooled connection; the block runs in one transaction."""
    try:
        pool = state(request).pool
        share = share_key(request.scope)
        async with pool.connection(share=share) as conn, conn.transaction():
            yield conn
    except psycopg.OperationalError as exc:
        # Serialization failures and deadlocks are OperationalErrors in psycopg
        # too: outside write_transaction (which runs them again) they are a 503.
        raise DatabaseUnavailable() from exc


@asynccontextmanager
async def single_statements(request: Request) -> AsyncIterator[AsyncConnection[Any]]:
    """A pooled connection in autocommit mode: each statement is a
    transaction of its own, without the round trips of ``BEGIN`` and
    ``COMMIT``. For a block of one statement (which sees one snapshot, as
    in a transaction of its own)."""
    try:
        pool = state(request).pool
        async with pool.connection(share=share_key(request.scope)) as conn:
            await conn.set_autocommit(True)
            try:
                yield conn
            finally:
                await end_autocommit(conn)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable() from exc


async def write_transaction(
    request: Request,
    work: Callable[[AsyncConnection[Any]], Awaitable[T]],
    *,
    pipeline: bool = False,
) -> T:
    """``work(conn)`` in one transaction from the caller's pool share, run again
    (bounded, with jitter) when PostgreSQL rolls it back for a serialization
    failure or a deadlock (:func:`controller.db.retry.retrying`; ``pipeline``:
    see there)."""
    return await retrying(
        state(request).pool, work, share=share_key(request.scope), pipeline=pipeline
    )


def transact(request: Request) -> Transact:
    """:func:`write_transaction` for the caller, as a ``Transact`` for domain
    code that runs transactions of its own."""

    async def run(work: Callable[[AsyncConnection[Any]], Awaitable[T]]) -> T:
        return await write_transaction(request, work)

    return run


def error_response(exc: WorkFolderError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if isinstance(exc, ServerBusy) else None
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


Endpoint = Callable[[Request], Awaitable[Response]]


def json_errors(endpoint: Endpoint) -> Endpoint:
    """Turn project errors into their documented JSON answers."""

    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        except WorkFolderError as exc:
            if exc.status >= 500:
                # The cause carries what the answer leaves out (a key, a path on this host).
                cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
                log.error("%s %s failed: %s%s", request.method, request.url.path, exc, cause)
            return error_response(exc)

    wrapper.__name__ = endpoint.__name__
    wrapper.__doc__ = endpoint.__doc__
    return wrapper


OPERATOR_ROUTE = "controller.operator_route"
"""Scope key set by :func:`company_route`: this route takes operator tokens."""


def company_route(endpoint: Endpoint) -> Endpoint:
    """A company admin route (``/api/companies/{companyId}/…`` members, agents,
    projects, tasks, runs): JSON errors, and operator tokens accepted (the
    handler's :func:`company_read` / :func:`company_write` checks whose)."""
    inner = json_errors(endpoint)

    async def wrapper(request: Request) -> Response:
        request.scope[OPERATOR_ROUTE] = True
        return await inner(request)

    wrapper.__name__ = endpoint.__name__
    wrapper.__doc__ = endpoint.__doc__
    return wrapper


def path_company(request: Request) -> str:
    return validate_uuid(request.path_params["companyId"], "companyId")


async def company_read(
    request: Request, work: Callable[[AsyncConnection[Any], CompanyActor], Awaitable[T]]
) -> T:
    """``work(conn, actor)`` in one transaction, for an owner or admin of the
    path's company or one of its operator tokens (anyone else: 404
    ``company_not_found``, like a company that does not exist)."""
    company_id = path_company(request)
    async with connection(request) as conn:
        principal = await authenticate(request, conn)
        actor = await authorize_company(conn, principal, company_id, write=False)
        return await work(conn, actor)


async def company_write(
    request: Request, work: Callable[[AsyncConnection[Any], CompanyActor], Awaitable[T]]
) -> T:
    """:func:`company_read` for a change: the caller's membership or token is
    checked (and locked) in the transaction that makes the change, which runs
    again after a serialization failure or deadlock."""
    company_id = path_company(request)

    async def work_as_actor(conn: AsyncConnection[Any]) -> T:
        principal = await authenticate(request, conn)
        actor = await authorize_company(conn, principal, company_id, write=True)
        return await work(conn, actor)

    return await write_transaction(request, work_as_actor)


def is_write(request: Request) -> bool:
    return request.method not in ("GET", "HEAD")


def on_bridge(request: Request) -> bool:
    path: str = request.scope.get("path", "")
    return path.startswith(BRIDGE_PREFIX + "/")


async def authenticate(request: Request, conn: AsyncConnection[Any]) -> Principal:
    principal = await _authenticate(request, conn)
    # Least privilege: an operator token opens a company's admin routes and
    # nothing else (no folder, no directory, no sign-in), refused here once
    # rather than in every handler that reads a principal.
    if principal.kind == "operator" and not request.scope.get(OPERATOR_ROUTE):
        raise Unauthenticated("Operator tokens are not accepted on this route")
    company = request.path_params.get("companyId")
    if principal.session_started is not None and isinstance(company, str):
        # A company that ended the member's sessions is closed to this one;
        # the other companies it reaches stay open.
        try:
            company = validate_uuid(company, "companyId")
        except ValidationError:
            company = None  # the handler answers the 400
        if company is not None and await session_ended_in(conn, principal, company):
            raise Unauthenticated("The session was ended for this company; sign in again")
    mark_authenticated(request)
    if principal.run is not None:
        note_run(principal.run.run_id)
    return principal


async def bound_run(request: Request, conn: AsyncConnection[Any]) -> RunBinding:
    """The run whose token authenticates a bridge request (401 for any other
    credential)."""
    principal = await authenticate(request, conn)
    if principal.kind != "run" or principal.run is None:
        raise Unauthenticated("The bridge needs a run token")
    return principal.run


async def authenticate_first(request: Request) -> None:
    """Check the credentials in a short transaction of their own, before any body
    byte is read: an unauthenticated client gets its 401 at once and never
    makes the controller buffer its body. Handlers authorize again inside their
    own transaction (a token can be revoked in between)."""
    if not is_authenticated(request):
        async with connection(request) as conn:
            await authenticate(request, conn)


def api_token(request: Request) -> str | None:
    """The person's API token the request presents, when that is all that
    decides who it is (what :func:`authenticate` would look up in
    ``api_tokens``): not forwarded by the API bridge, a well-formed
    ``Authorization: Bearer`` header, neither a run's nor an operator's
    token. None for every other request (and every malformed one):
    :func:`authenticate` answers those."""
    if bridge_identity(request.scope) is not None:
        return None
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if token.startswith((RUN_TOKEN_PREFIX, OPERATOR_TOKEN_PREFIX)):
        return None
    return token


async def _authenticate(request: Request, conn: AsyncConnection[Any]) -> Principal:
    ident = bridge_identity(request.scope)
    if ident is not None:
        # Forwarded by the API bridge, which consumed the run token: the run's
        # own authority, never a person's.
        return await principal_for_bridge(conn, ident.run_id, ident.lease_epoch)
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("Authorization must be 'Bearer <token>'")
        # Bridge authentication is limited to bridge access: the API itself
        # only sees a run through the API bridge's allowlist.
        if token.startswith(RUN_TOKEN_PREFIX) and not on_bridge(request):
            raise Unauthenticated(f"Run tokens are accepted only under {BRIDGE_PREFIX}/")
        return await principal_from_bearer(conn, token)
    secret = request.cookies.get(SESSION_COOKIE)
    # The bridge is the sandbox's surface: a person's session cookie that
    # reached it (smuggled by sandbox code) is no credential there.
    if secret and not on_bridge(request):
        principal = await principal_from_session(conn, secret)
        # SameSite=Strict keeps the cookie off cross-site requests; the header
        # (which a cross-site form cannot set) is the second lock.
        if is_write(request):
            sent = request.headers.get("x-csrf-token", "")
            if not principal.csrf_token or not same_secret(sent, principal.csrf_token):
                raise CsrfFailed()
        return principal
    raise Unauthenticated()


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in a JSON body."""

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_BRACKETS_OR_QUOTES = bytes(b for b in range(256) if b not in b'[]{}"')
# A run of openers or of closers.
_RUN = re.compile(rb"[\[{]+|[\]}]+")
_LEAF = re.compile(rb"\[\]|\{\}")
_LEAF_PASSES = 2


def json_too_deep(raw: bytes | bytearray, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """True when ``raw`` nests arrays or objects deeper than ``max_depth``.

    Checked before parsing, so a deep body costs neither recursion nor the
    memory of a parsed tree. Outside strings only the brackets matter. With
    the escaped backslashes and then the escaped quotes taken out, every
    quote left opens or closes a string (in valid JSON; anything else the
    parser refuses), so a bracket is inside a string exactly when an odd
    number of quotes precede it. Keeping only quotes and brackets, and then
    dropping adjacent pairs of quotes (which changes no bracket's parity),
    leaves quotes only around strings that hold brackets; the pieces between
    those quotes alternate outside and inside. Each pass deleting the empty
    ``[]`` and ``{}`` lowers the deepest nesting by exactly one and clears the
    many small leaves of a typical body; what is left is walked a run of
    openers or closers at a time. All but that walk are bytes methods: a
    3,000-entry checkpoint body is checked in a fraction of its parse time
    (a regular expression over its strings took longer than the parse).
    """
    unescaped = bytes(raw).replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = unescaped.translate(None, _NOT_BRACKETS_OR_QUOTES).replace(b'""', b"")
    brackets = b"".join(marks.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    limit = max_depth
    for _ in range(_LEAF_PASSES):
        brackets = _LEAF.sub(b"", brackets)
        limit -= 1
    depth = 0
    for run in _RUN.finditer(brackets):
        n = run.end() - run.start()
        if brackets[run.start()] in b"[{":
            depth += n
            if depth > limit:
                return True
        else:
            depth -= n
    return False


def parse_json_object(raw: bytes | bytearray) -> dict[str, Any]:
    """A JSON object from ``raw``; ValidationError for anything else.

    Refused too: nesting deeper than :data:`MAX_JSON_DEPTH`, and ``\\uD800``-style
    escapes of lone surrogates, which no UTF-8 text (or database) can hold.
    """
    if json_too_deep(raw):
        raise ValidationError.single(
            "body", "too_deep", f"JSON nests deeper than {MAX_JSON_DEPTH} levels"
        )
    try:
        body = json.loads(raw)
        if b"\\u" in raw:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError.single(
            "body", "invalid_json", "body contains a lone surrogate escape"
        ) from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValidationError.single("body", "invalid_json", "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ValidationError.single("body", "invalid_json", "body must be a JSON object")
    return body


async def read_json(
    request: Request, max_bytes: int = 64 * 1024, *, before_auth: bool = False
) -> dict[str, Any]:
    """The JSON object body, read only after :func:`authenticate_first`.

    ``before_auth`` is for sign-in alone, whose credential is the body itself.
    """
    if not before_auth:
        await authenticate_first(request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ValidationError.single(
            "Content-Type", "invalid_content_type", "body must be application/json"
        )
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise PayloadTooLarge(f"JSON body is larger than {max_bytes} bytes")
    hold = body_hold(request)
    own = hold is None
    if hold is None:  # no RequestLimits in front: a budget of this body alone
        hold = BodyHold(BodyBudget(max_bytes, 0.0))
    try:
        raw = await _read_body(request, max_bytes, hold, declared)
        if len(raw) <= JSON_INLINE_BYTES:
            return parse_json_object(raw)
        # Only the parse holds a slot: a slow sender must not keep others waiting.
        async with _large_bodies:
            return await asyncio.to_thread(parse_json_object, raw)
    finally:
        if own:
            hold.release()


async def _read_body(
    request: Request, max_bytes: int, hold: BodyHold, declared: int | None
) -> bytearray:
    """The body, its bytes taken from the process's body budget before they
    are read (all at once when the length is declared, so two bodies never
    each hold half of what both need; else as they arrive), and held until
    the request is answered (:class:`controller.api.limits.BodyBudget`)."""
    if declared is not None:
        await hold.take(declared)
    raw = bytearray()
    async for chunk in request.stream():
        if len(raw) + len(chunk) > max_bytes:
            raise PayloadTooLarge(f"JSON body is larger than {max_bytes} bytes")
        if len(raw) + len(chunk) > hold.bytes:
            await hold.take(len(raw) + len(chunk) - hold.bytes)
        raw += chunk
    return raw
