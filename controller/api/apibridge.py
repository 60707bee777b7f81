"""The API bridge: sandbox code calls the controller's API through
``/bridge/v1/api/{path}``, authenticated with the run token.

Every control here is a boundary control (the API as sandbox code
reaches it through the bridge), so it runs on the host and trusts nothing the sandbox sends:

* only a run token opens the bridge, and the forwarded request carries no
  credential at all: it runs with the run's own authority (``controller.auth``,
  read again for each request), never the responsible user's;
* only allowlisted ``(method, route template)`` pairs are forwarded; anything
  else is 403 ``bridge_route_denied``, a method outside :data:`KNOWN_METHODS` is 405;
* only allowlisted request headers are forwarded; ``Set-Cookie`` never comes back;
* the run identity (run id, agent id, lease epoch) is attached to the request
  and every call is written to the audit trail (``controller.bridgeaudit``).

The request is dispatched in-process to the matched route. The resource
limits (body and response size, time, concurrent calls per run) protect the
host's resources; they are not boundary controls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match, Route

from common.bridge import PREFIX
from common.errors import (
    BridgeResponseTooLarge,
    BridgeRouteDenied,
    BridgeTimeout,
    PayloadTooLarge,
    TooManyRequests,
    Unauthenticated,
    WorkFolderError,
)
from common.limits import MAX_FILE_BYTES
from controller import bridgeaudit
from controller.api.common import (
    BRIDGE_IDENTITY,
    BridgeIdentity,
    authenticate,
    connection,
)
from controller.api.limits import RETRY_AFTER_SECONDS, credential_key
from controller.api.params import declared_length
from controller.auth import principal_for_bridge
from controller.config import BridgeLimits

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

API_PREFIX = PREFIX + "/api"
"""``/bridge/v1/api/...`` forwards to ``/api/...``."""

WORK_FOLDER = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}"
CONTENT = WORK_FOLDER + "/content"

DEFAULT_ALLOW: tuple[tuple[str, str], ...] = (
    ("GET", WORK_FOLDER),
    ("GET", WORK_FOLDER + "/"),
    ("GET", CONTENT),
    ("HEAD", CONTENT),
    ("PUT", CONTENT),
    ("POST", WORK_FOLDER + "/operations"),
    ("GET", WORK_FOLDER + "/changes"),
    ("GET", WORK_FOLDER + "/sync"),
    ("POST", WORK_FOLDER + "/refresh"),
    ("GET", "/api/companies/{companyId}/directory"),
)
"""The work-folder routes and the company directory (read-only for a run)."""

UPLOADS = frozenset({("PUT", CONTENT)})
"""Routes whose body is file content: they keep the file limit (1 GiB)."""
DOWNLOADS = frozenset({("GET", CONTENT), ("HEAD", CONTENT)})
"""Routes whose answer is file content: they keep the file limit (1 GiB)."""

KNOWN_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
"""Any other method is refused with 405 ``method_not_allowed`` before anything
else is looked at (the token included)."""

FORWARDED_HEADERS = frozenset(
    {
        b"content-type",
        b"content-length",
        b"accept",
        b"range",
        b"if-match",
        b"if-none-match",
        b"idempotency-key",
        b"x-file-content-type",
        b"x-file-executable",
    }
)
"""The only request headers the API sees; Cookie, Authorization, X-Forwarded-*,
Forwarded, hop-by-hop and CSRF headers (and everything else) are dropped."""

IDENTITY_HEADERS = (b"x-paperclip-run-id", b"x-paperclip-agent-id", b"x-paperclip-lease-epoch")
"""Attached by the controller to every forwarded request (never taken from the sandbox)."""


class _ResponseOverrun(Exception):
    """An answer without Content-Length (a streamed one, such as a
    repository's tar when an operator allowlists it) grew past the limit after
    it started: the rest is not sent and the connection is cut, so the client
    never takes the part it got for the whole answer."""


@dataclass
class BridgePolicy:
    """The resolved allowlist and limits of one application."""

    limits: BridgeLimits
    max_file_bytes: int
    routes: list[Route]
    allow: frozenset[tuple[str, str]]
    in_flight: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls, routes: Iterable[BaseRoute], limits: BridgeLimits, max_file_bytes: int = MAX_FILE_BYTES
    ) -> BridgePolicy:
        """Resolve the configured allowlist against the API routes; ValueError
        for an entry that names no API route or a method it does not answer."""
        api = [r for r in routes if isinstance(r, Route) and r.path.startswith("/api/")]
        wanted: list[tuple[str, str]] = []
        for method, template in DEFAULT_ALLOW if limits.allow is None else limits.allow:
            wanted.extend(DEFAULT_ALLOW if method == "default" else [(method, template)])
        for method, template in wanted:
            if not any(r.path == template and method in (r.methods or ()) for r in api):
                raise ValueError(f"bridge allowlist: no API route {method} {template}")
        return cls(limits, max_file_bytes, api, frozenset(wanted))

    def match(self, path: str, method: str) -> tuple[str | None, Route | None]:
        """The route template ``path`` matches (None for none) and the route that
        answers ``method`` there, when that pair is allowlisted."""
        probe = {"type": "http", "path": path, "root_path": "", "method": method}
        template = None
        for route in self.routes:
            found, _ = route.matches(probe)
            if found is Match.NONE:
                continue
            template = template or route.path
            if found is Match.FULL and (method, route.path) in self.allow:
                return route.path, route
        return template, None

    def body_limit(self, method: str, template: str) -> int:
        if (method, template) in UPLOADS:
            return self.max_file_bytes
        return self.limits.max_body_bytes

    def response_limit(self, method: str, template: str) -> int:
        if (method, template) in DOWNLOADS:
            return self.max_file_bytes
        return self.limits.max_response_bytes


def _plain_path(path: str) -> bool:
    """No empty (but a trailing slash), ``.`` or ``..`` segment: the path means
    what it says."""
    segments = path.split("/")[1:]
    if segments and segments[-1] == "":
        segments.pop()
    return all(seg not in ("", ".", "..") for seg in segments)


@dataclass
class _Meter:
    """What one bridged call did, for its audit row."""

    route: str | None = None
    status: int = 0
    started: bool = False
    request_bytes: int = 0
    response_bytes: int = 0
    response_limit: int = 0
    response_length: int | None = None
    """The answer's Content-Length, when it has one."""
    clock: asyncio.Timeout | None = None


class _Audit:
    """Writes the call's audit row once: before the last byte of the answer is
    sent (so a client that has its answer finds the row), or at the end of a
    call whose answer never completed."""

    def __init__(self, request: Request, ident: BridgeIdentity, meter: _Meter) -> None:
        self.request, self.ident, self.meter = request, ident, meter
        self.started = time.monotonic()
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        ident, meter = self.ident, self.meter
        rec = bridgeaudit.AuditRecord(
            run_id=ident.run_id,
            company_id=ident.company_id,
            agent_id=ident.agent_id,
            lease_epoch=ident.lease_epoch,
            method=str(self.request.scope["method"])[:16],
            route=meter.route,
            status=meter.status or 500,
            request_bytes=meter.request_bytes,
            response_bytes=meter.response_bytes,
            duration_ms=int((time.monotonic() - self.started) * 1000),
        )
        try:
            async with connection(self.request) as conn:
                await bridgeaudit.record(conn, rec)
        except WorkFolderError as exc:
            log.warning("bridge audit row for run %s not written: %s", ident.run_id, exc)


def _error(exc: WorkFolderError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if isinstance(exc, TooManyRequests) else {}
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


class ApiBridge:
    """The ASGI endpoint of ``/bridge/v1/api/{path:path}``."""

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        policy: BridgePolicy = scope["app"].state.apibridge
        try:
            ident = await self._identify(request)
        except WorkFolderError as exc:
            # No run is known: nothing to audit.
            await _error(exc)(scope, receive, send)
            return
        meter = _Meter(response_limit=policy.limits.max_response_bytes)
        audit = _Audit(request, ident, meter)
        out = _metered_send(send, meter, audit)
        try:
            await self._forward(request, policy, ident, meter, receive, out)
        except WorkFolderError as exc:
            if meter.started:
                raise
            await _error(exc)(scope, receive, out)
        except _ResponseOverrun:
            # Returning with the answer unfinished makes the server close the
            # connection: the client sees a broken answer, not a short one.
            log.warning(
                "answer to run %s's %s %s cut after %d bytes: over the %d-byte response limit",
                ident.run_id,
                scope["method"],
                meter.route,
                meter.response_bytes,
                meter.response_limit,
            )
        finally:
            await audit()

    async def _identify(self, request: Request) -> BridgeIdentity:
        if len(request.headers.getlist("authorization")) > 1:
            raise Unauthenticated("The API bridge takes exactly one Authorization header")
        async with connection(request) as conn:
            principal = await authenticate(request, conn)
            if principal.kind != "run" or principal.run is None:
                raise Unauthenticated("The API bridge needs a run token")
            run = principal.run
            # Refuses a superseded lease too, not only an ended run.
            await principal_for_bridge(conn, run.run_id, run.lease_epoch)
        return BridgeIdentity(
            run.run_id,
            run.agent_id,
            run.company_id,
            run.lease_epoch,
            share=credential_key(request.scope),
        )

    async def _forward(
        self,
        request: Request,
        policy: BridgePolicy,
        ident: BridgeIdentity,
        meter: _Meter,
        receive: Any,
        send: Any,
    ) -> None:
        scope = request.scope
        method = str(scope["method"])
        path = "/api/" + str(scope["path_params"]["path"])
        if not _plain_path(path):
            raise BridgeRouteDenied()
        template, route = policy.match(path, method)
        meter.route = template
        if route is None or template is None:
            raise BridgeRouteDenied()
        body_limit = policy.body_limit(method, template)
        declared = declared_length(request)
        if declared is not None and declared > body_limit:
            raise PayloadTooLarge(f"The API bridge forwards bodies of at most {body_limit} bytes")
        lim = policy.limits
        if policy.in_flight.get(ident.run_id, 0) >= lim.max_concurrent:
            raise TooManyRequests(
                f"More than {lim.max_concurrent} API bridge requests in flight for this run"
            )
        meter.response_limit = policy.response_limit(method, template)
        policy.in_flight[ident.run_id] = policy.in_flight.get(ident.run_id, 0) + 1
        try:
            child = _child_scope(scope, path, ident)
            _, matched = route.matches(child)
            child.update(matched)
            receive = _metered_receive(receive, meter, body_limit)
            await self._dispatch(route, child, receive, send, lim.request_timeout, meter)
        finally:
            left = policy.in_flight[ident.run_id] - 1
            if left:
                policy.in_flight[ident.run_id] = left
            else:
                del policy.in_flight[ident.run_id]

    async def _dispatch(
        self, route: Route, child: Scope, receive: Any, send: Any, seconds: float, meter: _Meter
    ) -> None:
        try:
            # Until the answer starts (the send wrapper stops the clock then):
            # a download streams at the pace of its reader.
            async with asyncio.timeout(seconds) as meter.clock:
                await route.handle(child, receive, send)
        except TimeoutError:
            raise BridgeTimeout(
                f"The bridged request took longer than {seconds:g} s; nothing more was done"
            ) from None
        finally:
            meter.clock = None


def _child_scope(scope: Scope, path: str, ident: BridgeIdentity) -> Scope:
    """The forwarded request: the API path, only the allowlisted headers plus
    the run identity, and the identity the API authenticates from."""
    headers = [(k, v) for k, v in scope["headers"] if k in FORWARDED_HEADERS]
    values = (ident.run_id, ident.agent_id, str(ident.lease_epoch))
    headers += [(k, v.encode()) for k, v in zip(IDENTITY_HEADERS, values, strict=True)]
    child = {
        k: v for k, v in scope.items() if k not in ("path_params", "endpoint", "route", "raw_path")
    }
    child.update(path=path, raw_path=path.encode(), headers=headers)
    child[BRIDGE_IDENTITY] = ident
    return child


def _metered_receive(receive: Any, meter: _Meter, limit: int) -> Any:
    async def metered() -> Message:
        message: Message = await receive()
        if message["type"] == "http.request":
            meter.request_bytes += len(message.get("body", b""))
            if meter.request_bytes > limit:
                raise PayloadTooLarge(f"The API bridge forwards bodies of at most {limit} bytes")
        return message

    return metered


def _metered_send(send: Any, meter: _Meter, audit: _Audit) -> Any:
    """Every answer of a bridged call: no Set-Cookie, at most the response
    limit, counted, and audited before its last byte."""
    replaced = False

    async def metered(message: Message) -> None:
        nonlocal replaced
        if replaced:
            return
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"set-cookie"]
            length = next((v for k, v in headers if k.lower() == b"content-length"), None)
            if length is not None and length.isdigit() and int(length) > meter.response_limit:
                replaced = True
                await _too_large(send, meter, audit)
                return
            meter.status, meter.started = int(message["status"]), True
            if length is not None and length.isdigit():
                meter.response_length = int(length)
            if meter.clock is not None and not meter.clock.expired():
                meter.clock.reschedule(None)
            message = {**message, "headers": headers}
            if _ends_with_head(str(audit.request.scope["method"]), meter.status, length):
                # The client has the whole answer with the head: audit first.
                await audit()
        elif message["type"] == "http.response.body":
            meter.response_bytes += len(message.get("body", b""))
            if meter.response_bytes > meter.response_limit:
                raise _ResponseOverrun()
            # A client reading Content-Length bytes has its answer with the
            # last of them, before the message that ends the body.
            last = (
                meter.response_length is not None and meter.response_bytes >= meter.response_length
            )
            if last or not message.get("more_body", False):
                await audit()
        await send(message)

    return metered


async def _too_large(send: Any, meter: _Meter, audit: _Audit) -> None:
    exc = BridgeResponseTooLarge(
        f"The answer is larger than the {meter.response_limit} bytes the API bridge forwards"
    )
    body = _error(exc)
    meter.status, meter.started = exc.status, True
    meter.response_bytes += len(body.body)
    # Before the head: the answer to a HEAD request ends there.
    await audit()
    await send({"type": "http.response.start", "status": exc.status, "headers": body.raw_headers})
    await send({"type": "http.response.body", "body": body.body})


def _ends_with_head(method: str, status: int, length: bytes | None) -> bool:
    """Whether an answer is complete once its head is sent (no body follows)."""
    return method == "HEAD" or status in (204, 304) or length == b"0"


routes = [Route(API_PREFIX + "/{path:path}", ApiBridge(), methods=list(KNOWN_METHODS))]
