"""ASGI middleware: request-body deadlines, the auth-first gate, per-token request caps.

The sandbox is untrusted, and before this layer a client could make the
controller hold memory and request slots without limit: bodies were read
before the token was checked, and a stalled body was waited for forever.

* **Body deadlines.** Each wait for the next piece of a body is bounded by
  ``body_idle_timeout``; over the time spent waiting, the body must average
  ``body_min_rate`` bytes/s after a grace of ``body_idle_timeout`` (against a
  slowloris that sends one byte just before each idle timeout); the whole body
  must arrive within ``body_deadline``. A breach raises
  :class:`~common.errors.RequestTimeout` from ``receive()``, which the handler
  answers 408 (its spool file is removed, nothing is published).
* **Auth first.** :func:`mark_authenticated` is called by
  ``controller.api.common.authenticate``. Before that, a handler can read at
  most :data:`PREAUTH_BODY_BYTES` of a body (sign-in, whose token *is* the
  body); a handler that forgot to authenticate first gets 413, not the body.
* **Connection close.** An answer sent before the body was read completely
  carries ``Connection: close``, so uvicorn stops reading (and buffering) the
  rest of the body instead of draining it for keep-alive.
* **Per-token cap.** At most ``max_requests_per_token`` requests in flight per
  presented bearer token or session cookie (keyed by its hash, before the
  database is asked: a forged token only limits itself); one more is 429 with
  ``Retry-After``.
* **Buffered body bytes.** A body read into memory whole (a JSON body,
  ``controller.api.common.read_json``) first takes its bytes from one
  :class:`BodyBudget` of ``max_buffered_body_bytes`` per process, and holds
  them until its request is answered (the parsed body lives that long too).
  The per-token cap and the parse slots bound requests, not bytes: 16
  checkpoint bodies of 60 MiB from 4 run tokens took a controller from 57 to
  910 MiB. A body that does not fit waits, unread (the client's send stalls
  on TCP flow control), as long as it may wait for its next piece
  (``body_idle_timeout``), for others to finish; then it is answered 503
  ``server_busy`` with ``Retry-After``, which fsagent's client honours and
  retries. Uploads stream to a spool file and take nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request

from common.errors import PayloadTooLarge, RequestTimeout, ServerBusy, TooManyRequests
from common.limits import KiB
from controller.config import ServerLimits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PREAUTH_BODY_BYTES = 64 * KiB
"""Body bytes a handler may read before the request is authenticated."""

RETRY_AFTER_SECONDS = 1
_GUARD_KEY = "controller.body_guard"
_HOLD_KEY = "controller.body_hold"

_SESSION_COOKIE = b"fsa_session="  # common.SESSION_COOKIE (common imports this module)


def mark_authenticated(request: Request) -> None:
    """The request's credentials were checked: its body may now be read in full."""
    guard = request.scope.get(_GUARD_KEY)
    if isinstance(guard, BodyGuard):
        guard.authenticated = True


def is_authenticated(request: Request) -> bool:
    guard = request.scope.get(_GUARD_KEY)
    return isinstance(guard, BodyGuard) and guard.authenticated


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value)
    return None


def credential_key(scope: Scope) -> str | None:
    """A stable key for the credential a request presents (never the secret itself)."""
    auth = _header(scope, b"authorization")
    if auth is not None:
        return "b:" + hashlib.sha256(auth.strip()).hexdigest()
    cookie = _header(scope, b"cookie")
    if cookie is not None:
        for part in cookie.split(b";"):
            part = part.strip()
            if part.startswith(_SESSION_COOKIE):
                return "s:" + hashlib.sha256(part[len(_SESSION_COOKIE) :]).hexdigest()
    return None


def declares_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    if length is not None:
        return length.strip() not in (b"", b"0")
    return _header(scope, b"transfer-encoding") is not None


class BodyGuard:
    """The ``receive`` of one request, with the body rules of this module."""

    def __init__(self, receive: Receive, limits: ServerLimits, has_body: bool) -> None:
        self._receive = receive
        self._limits = limits
        self.complete = not has_body
        self.authenticated = False
        self.responding = False
        self._received = 0
        self._waited = 0.0
        self._started: float | None = None

    def _wait_budget(self, now: float) -> tuple[float, str]:
        lim = self._limits
        assert self._started is not None
        budgets = [
            (lim.body_idle_timeout, f"no body data for {lim.body_idle_timeout:g} s"),
            (
                self._started + lim.body_deadline - now,
                f"body not received in {lim.body_deadline:g} s",
            ),
            (
                lim.body_idle_timeout + self._received / lim.body_min_rate - self._waited,
                f"body arrived slower than {lim.body_min_rate} bytes/s",
            ),
        ]
        return min(budgets)

    async def receive(self) -> Message:
        if self.complete or self.responding:
            # Nothing more to guard: the body is in, or the answer is on its
            # way and the connection closes after it.
            return await self._receive()
        now = time.monotonic()
        if self._started is None:
            self._started = now
        budget, reason = self._wait_budget(now)
        try:
            async with asyncio.timeout(max(budget, 0.0)):
                message = await self._receive()
        except TimeoutError:
            raise RequestTimeout(f"Request body timed out: {reason}") from None
        finally:
            self._waited += time.monotonic() - now
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = True
            if not self.authenticated and self._received > PREAUTH_BODY_BYTES:
                raise PayloadTooLarge(
                    f"A body over {PREAUTH_BODY_BYTES} bytes is read only after authentication"
                )
        return message

    def wrap_send(self, send: Send) -> Send:
        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.responding = True
                if not self.complete:
                    headers = list(message.get("headers", []))
                    headers.append((b"connection", b"close"))
                    message = {**message, "headers": headers}
            await send(message)

        return guarded_send


class BodyBudget:
    """Bytes of request bodies buffered in memory at once, across every
    request of the process (``--max-buffered-body-bytes``).

    A request that finds nothing held always gets its bytes, so one body up
    to its route's own limit can be read even under a budget smaller than
    that. Waiters are woken on every release and take their bytes as soon as
    they fit (a small body need not wait behind a large one)."""

    def __init__(self, total: int, wait: float) -> None:
        self.total = total
        self.wait = wait
        self.used = 0
        self._waiters: set[asyncio.Future[None]] = set()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.total

    async def take(self, n: int) -> None:
        """Take ``n`` bytes, waiting up to :attr:`wait` seconds for them;
        :class:`ServerBusy` if they never fit."""
        if n <= 0:
            return
        deadline = time.monotonic() + self.wait
        while not self._fits(n):
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerBusy(
                    f"{self.used} bytes of request bodies are buffered (at most {self.total});"
                    f" retry in {RETRY_AFTER_SECONDS} s"
                )
            freed = asyncio.get_running_loop().create_future()
            self._waiters.add(freed)
            try:
                async with asyncio.timeout(left):
                    await freed
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(freed)
        self.used += n

    def give(self, n: int) -> None:
        """Return ``n`` bytes; synchronous, so a cancelled request frees them too."""
        if n <= 0:
            return
        self.used -= n
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class BodyHold:
    """What one request took from the :class:`BodyBudget`, given back whole
    when its request is answered."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    async def take(self, n: int) -> None:
        await self.budget.take(n)
        self.bytes += n

    def release(self) -> None:
        taken, self.bytes = self.bytes, 0
        self.budget.give(taken)


def body_hold(request: Request) -> BodyHold | None:
    """The request's hold on the process's body budget (None outside
    :class:`RequestLimits`, e.g. an app built without it in a unit test)."""
    hold = request.scope.get(_HOLD_KEY)
    return hold if isinstance(hold, BodyHold) else None


class RequestLimits:
    """The middleware; one instance per application."""

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits
        self.in_flight: dict[str, int] = {}
        self.bodies = BodyBudget(limits.max_buffered_body_bytes, limits.body_idle_timeout)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        guard = BodyGuard(receive, self.limits, declares_body(scope))
        key = credential_key(scope)
        if key is not None and self.in_flight.get(key, 0) >= self.limits.max_requests_per_token:
            await self._too_many(guard.wrap_send(send))
            return
        if key is not None:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
        scope[_GUARD_KEY] = guard
        hold = scope[_HOLD_KEY] = BodyHold(self.bodies)
        try:
            await self.app(scope, guard.receive, guard.wrap_send(send))
        finally:
            hold.release()
            if key is not None:
                left = self.in_flight[key] - 1
                if left:
                    self.in_flight[key] = left
                else:
                    del self.in_flight[key]

    async def _too_many(self, send: Send) -> None:
        exc = TooManyRequests()
        body = json.dumps(exc.to_json()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": exc.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
