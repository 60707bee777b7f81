"""A round-robin HTTP load balancer in front of several controller replicas.

Each request goes to the next replica in turn (per request, not per
connection, so one client's uploads and commit land on different replicas).
A replica that refuses the connection is skipped and the request goes to the
next one: nothing reached the refusing replica, so that is safe for any
method. A replica that dies while it holds a request makes the balancer
answer 502, as a real load balancer would; the client retries.

:meth:`RoundRobinBalancer.kill_during` arms a fault: the next matching
request is forwarded and, while the replica holds it, ``action(index)`` is
called (e.g. ``kill -9`` of that replica).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.procs import free_port
from tests.support.threaded import ThreadedServer

_HOP_HEADERS = {b"host", b"connection", b"content-length", b"transfer-encoding", b"keep-alive"}


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    action: Callable[[int], None]
    delay: float


@dataclass
class RoundRobinBalancer:
    backends: list[str]
    port: int = field(default_factory=free_port)
    served: list[int] = field(init=False)
    """Requests each backend answered."""
    faults_fired: list[tuple[str, str, int]] = field(default_factory=list)
    """(method, path, backend) of each request during which a fault fired."""
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _faults: list[_Fault] = field(default_factory=list)
    _clients: dict[int, httpx.AsyncClient] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _server: ThreadedServer | None = None

    def __post_init__(self) -> None:
        self.served = [0] * len(self.backends)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill_during(
        self, method: str, path_regex: str, action: Callable[[int], None], delay: float = 0.01
    ) -> None:
        """Once: forward the next ``method`` request whose path matches, then
        ``delay`` seconds later (while that replica holds the request) call
        ``action`` with the replica's index."""
        with self._lock:
            self._faults.append(_Fault(method, re.compile(path_regex), action, delay))

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.method == method and fault.path.search(path):
                    self._faults.remove(fault)
                    return fault
        return None

    def _order(self) -> list[int]:
        with self._lock:
            start = self._next
            self._next = (self._next + 1) % len(self.backends)
        return [(start + i) % len(self.backends) for i in range(len(self.backends))]

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        query = scope.get("query_string", b"").decode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_HEADERS]
        # Bodies are small here; reading one whole lets a refused connection
        # be retried on the next replica.
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if msg["type"] == "http.disconnect" or not msg.get("more_body"):
                break
        fault = self._take_fault(method, path)
        status, out_headers, content = 502, [], b'{"error": "no replica answered", "code": "lb"}'
        for index in self._order():
            fired = None
            if fault is not None:
                fired = asyncio.get_running_loop().call_later(
                    fault.delay, self._fire, fault, method, path, index
                )
                fault = None
            target = self.backends[index] + path + (f"?{query}" if query else "")
            try:
                # A connection per request: a replica's death never leaves a
                # stale pooled connection behind.
                async with httpx.AsyncClient(timeout=120) as client:
                    resp = await client.request(
                        method, target, headers=headers, content=bytes(body)
                    )
            except httpx.ConnectError:
                if fired is not None:
                    fired.cancel()
                continue  # nothing reached that replica: the next one may take it
            except httpx.TransportError:
                break  # the replica died holding the request: 502, the client retries
            with self._lock:
                self.served[index] += 1
            status, content = resp.status_code, resp.content
            out_headers = [
                (k.encode(), v.encode())
                for k, v in resp.headers.items()
                if k.lower() not in ("transfer-encoding", "connection", "content-encoding")
                and k.lower() != "content-length"
            ]
            break
        out_headers.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        await send({"type": "http.response.body", "body": content})

    def _client(self, index: int) -> httpx.AsyncClient:
        self._loop = asyncio.get_running_loop()
        client = self._clients.get(index)
        if client is None:
            # Kept-alive connections to a replica that died are noticed closed
            # and replaced, never reused.
            client = self._clients[index] = httpx.AsyncClient(timeout=120)
        return client

    def _fire(self, fault: _Fault, method: str, path: str, index: int) -> None:
        self.faults_fired.append((method, path, index))
        fault.action(index)

    def start(self) -> RoundRobinBalancer:
        self._server = ThreadedServer(self.app, self.port).start()
        return self

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            for client in self._clients.values():
                asyncio.run_coroutine_threadsafe(client.aclose(), self._loop).result(timeout=10)
        if self._server is not None:
            self._server.stop()
