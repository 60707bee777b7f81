"""An HTTP proxy in front of the controller that can lose responses.

A request matching a drop rule is forwarded and fully processed upstream, and
then its answer is replaced by 504: the client sees a lost response (as behind
a load balancer that timed out) although the server applied the request. A
request matching a fail rule is never forwarded: it is answered 503 at once,
as a controller that cannot reach its database would. A request matching a
hold rule waits, before it is forwarded, until the test releases it: a
controller slow to answer.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.procs import free_port
from tests.support.threaded import ThreadedServer


@dataclass
class DropRule:
    method: str
    path: re.Pattern[str]
    remaining: int
    passing: int = 0
    """Matching requests let through untouched before the rule applies."""


@dataclass
class Hold:
    """A held request: ``reached`` when one arrived, forwarded after ``release``."""

    method: str
    path: re.Pattern[str]
    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    used: bool = False

    def release(self) -> None:
        self.released.set()


@dataclass
class LossyProxy:
    upstream: str
    port: int = field(default_factory=free_port)
    rules: list[DropRule] = field(default_factory=list)
    fail_rules: list[DropRule] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    queries: list[tuple[str, str, str]] = field(default_factory=list)
    """(method, path, query string) of every request, in arrival order."""
    broken: list[tuple[str, str, str]] = field(default_factory=list)
    """The requests of :attr:`queries` whose exchange with the upstream broke
    (a transport error: the connection reset, say), which a client retries."""
    record_rules: list[tuple[str, re.Pattern[str]]] = field(default_factory=list)
    bodies: list[tuple[str, bytes]] = field(default_factory=list)
    """``("METHOD path", request body)`` of each request a record rule matched."""
    _server: ThreadedServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop_next(self, method: str, path_regex: str, count: int = 1) -> None:
        with self._lock:
            self.rules.append(DropRule(method, re.compile(path_regex), count))

    def fail_next(self, method: str, path_regex: str, count: int = 1, after: int = 0) -> None:
        """The next ``count`` matching requests get 503 without reaching the
        controller, once ``after`` of them have passed."""
        with self._lock:
            self.fail_rules.append(DropRule(method, re.compile(path_regex), count, after))

    def record_bodies(self, method: str, path_regex: str) -> None:
        """Keep the body of every later matching request in :attr:`bodies`."""
        with self._lock:
            self.record_rules.append((method, re.compile(path_regex)))

    def _should_record(self, method: str, path: str) -> bool:
        with self._lock:
            return any(m == method and rx.search(path) for m, rx in self.record_rules)

    def clear_rules(self) -> None:
        """Forward every later request untouched."""
        with self._lock:
            self.rules.clear()
            self.fail_rules.clear()

    def hold_next(self, method: str, path_regex: str) -> Hold:
        """The next matching request waits until ``release()`` (released at stop too)."""
        hold = Hold(method, re.compile(path_regex))
        with self._lock:
            self.holds.append(hold)
        return hold

    def _hold_for(self, method: str, path: str) -> Hold | None:
        with self._lock:
            for hold in self.holds:
                if not hold.used and hold.method == method and hold.path.search(path):
                    hold.used = True
                    return hold
        return None

    def _should_fail(self, method: str, path: str) -> bool:
        with self._lock:
            for rule in self.fail_rules:
                if rule.remaining > 0 and rule.method == method and rule.path.search(path):
                    if rule.passing > 0:
                        rule.passing -= 1
                        continue
                    rule.remaining -= 1
                    self.failed.append(f"{method} {path}")
                    return True
        return False

    def _should_drop(self, method: str, path: str) -> bool:
        with self._lock:
            self.seen.append(f"{method} {path}")
            for rule in self.rules:
                if rule.remaining > 0 and rule.method == method and rule.path.search(path):
                    rule.remaining -= 1
                    self.dropped.append(f"{method} {path}")
                    return True
        return False

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        query = scope.get("query_string", b"").decode()
        with self._lock:
            self.queries.append((method, path, query))
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"connection")]

        kept: bytearray | None = bytearray() if self._should_record(method, path) else None

        async def body() -> AsyncIterator[bytes]:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunk = msg.get("body", b"")
                if kept is not None:
                    kept.extend(chunk)
                yield chunk
                if not msg.get("more_body"):
                    if kept is not None:
                        with self._lock:
                            self.bodies.append((f"{method} {path}", bytes(kept)))
                    return

        hold = self._hold_for(method, path)
        if hold is not None:
            hold.reached.set()
            await asyncio.to_thread(hold.released.wait)  # set from the test's thread
        if self._should_fail(method, path):
            async for _ in body():  # read the request, as a server would
                pass
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": b'{"error": "injected failure", "code": "database_unavailable"}',
                }
            )
            return
        try:
            await self._forward(method, path, query, headers, body(), send)
        except httpx.TransportError:
            with self._lock:
                self.broken.append((method, path, query))
            raise

    async def _forward(
        self,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[bytes, bytes]],
        content: AsyncIterator[bytes],
        send: Any,
    ) -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            req = client.build_request(
                method,
                self.upstream + path + (f"?{query}" if query else ""),
                headers=headers,
                content=content,
            )
            resp = await client.send(req, stream=True)
            drop = self._should_drop(method, path)
            if drop:
                await resp.aread()
                await resp.aclose()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 504,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send(
                    {
                        "type": "http.response.body",
                        "body": b'{"error": "gateway timeout", "code": "lost"}',
                    }
                )
                return
            out_headers = [
                (k.encode(), v.encode())
                for k, v in resp.headers.items()
                if k.lower() not in ("transfer-encoding", "connection", "content-encoding")
            ]
            await send(
                {"type": "http.response.start", "status": resp.status_code, "headers": out_headers}
            )
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await resp.aclose()
            await send({"type": "http.response.body", "body": b""})

    def start(self) -> LossyProxy:
        self._server = ThreadedServer(self.app, self.port).start()
        return self

    def stop(self) -> None:
        for hold in self.holds:
            hold.release()
        if self._server is not None:
            self._server.stop()
