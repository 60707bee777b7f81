"""``fsagent bridge``, the sandbox's local API endpoint, as a real process.

First against a recording stand-in for the controller (what is forwarded,
what comes back, streaming in bounded memory, early errors, an unreachable
controller), then against a real controller through ``/bridge/v1/api``.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.support.constants import REPO
from tests.support.procs import free_port
from tests.support.tmp import private_tmpdir

TOKEN = "run-token-" + "s3cr3t" * 6
MiB = 1 << 20


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body_len: int
    body_sha: str


@dataclass
class Upstream:
    """A stand-in controller that records every request and streams big answers."""

    port: int = field(default_factory=free_port)
    seen: list[Seen] = field(default_factory=list)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        digest, length = hashlib.sha256(), 0
        while True:
            msg = await receive()
            chunk = msg.get("body", b"")
            digest.update(chunk)
            length += len(chunk)
            if not msg.get("more_body"):
                break
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            name = k.decode().lower()
            headers[name] = headers[name] + ", " + v.decode() if name in headers else v.decode()
        self.seen.append(
            Seen(scope["method"], scope["raw_path"].decode(), scope["query_string"].decode(),
                 headers, length, digest.hexdigest())
        )  # fmt: skip
        path = scope["path"]
        if path.endswith("/big"):
            size = int(scope["query_string"].decode().split("=")[1])
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(size).encode())]})  # fmt: skip
            block = bytes(range(256)) * (MiB // 256)
            for _ in range(size // MiB):
                await send({"type": "http.response.body", "body": block, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        status = 403 if path.endswith("/denied") else 200
        body = json.dumps(
            {"code": "bridge_route_denied"} if status == 403 else {"n": len(self.seen)}
        )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"set-cookie", b"session=stolen"),
                    (b"x-upstream", b"yes"),
                    (b"etag", b'"v1"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})

    def start(self) -> Upstream:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", loop="asyncio", interface="asgi3")  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "stand-in controller did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


@dataclass
class LocalEndpoint:
    """``fsagent bridge`` in a subprocess, started and stopped like a daemon."""

    controller: str
    dir: Path
    token_file: Path
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.info["PAPERCLIP_API_URL"])

    @property
    def socket(self) -> str:
        return str(self.info["PAPERCLIP_API_SOCKET"])

    def start(self) -> LocalEndpoint:
        ready = self.dir / "ready.json"
        with open(self.dir / "stderr", "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fsagent.cli", "bridge", "--controller", self.controller,
                 "--token-file", str(self.token_file), "--socket", str(self.dir / "api.sock"),
                 "--ready-file", str(ready), *self.extra],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "bridge did not start"
            time.sleep(0.02)
        self.info = json.loads(ready.read_text())
        return self

    def stderr(self) -> str:
        return (self.dir / "stderr").read_text(errors="replace")

    def tcp(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def unix(self) -> httpx.Client:
        return httpx.Client(base_url="http://bridge", transport=httpx.HTTPTransport(uds=self.socket),
                            timeout=60)  # fmt: skip

    def peak_rss(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


def start_endpoint(controller: str, token: str = TOKEN, *extra: str) -> LocalEndpoint:
    d = private_tmpdir("fsa-lb-")  # short: unix socket paths are limited to 107 bytes
    token_file = d / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    return LocalEndpoint(controller, d, token_file, list(extra)).start()


@pytest.fixture
def endpoint(upstream: Upstream) -> Iterator[LocalEndpoint]:
    ep = start_endpoint(upstream.url)
    yield ep
    assert ep.stop() == 0, ep.stderr()
    assert not Path(ep.socket).exists()  # the socket goes with the endpoint


def test_forwards_over_tcp_and_socket_adding_the_run_token(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    for client in (endpoint.tcp(), endpoint.unix()):
        with client:
            res = client.put(
                "/api/companies/c1/work-folders/task/t1/content?path=a%20b%2Fc.txt&x=1",
                content=b"hello",
                headers={
                    "Authorization": "Bearer user-token-smuggled",
                    "Cookie": "fsa_session=abc",
                    "X-Forwarded-For": "10.0.0.1",
                    "Forwarded": "for=10.0.0.1",
                    "X-CSRF-Token": "csrf",
                    "Idempotency-Key": "k1",
                    "If-Match": '"v0"',
                    "X-File-Executable": "true",
                    "Content-Type": "text/plain",
                },
            )
        assert res.status_code == 200, res.text
        assert "set-cookie" not in res.headers
        assert res.headers["x-upstream"] == "yes" and res.headers["etag"] == '"v1"'
        assert TOKEN not in res.text and TOKEN not in str(res.headers)
        seen = upstream.seen[-1]
        assert (seen.method, seen.path, seen.query) == (
            "PUT", "/bridge/v1/api/companies/c1/work-folders/task/t1/content", "path=a%20b%2Fc.txt&x=1",
        )  # fmt: skip
        assert seen.headers["authorization"] == f"Bearer {TOKEN}"
        assert seen.headers["accept-encoding"] == "identity"  # raw bytes pass through
        assert seen.body_len == 5 and seen.body_sha == hashlib.sha256(b"hello").hexdigest()
        forwarded = set(seen.headers) - {"host", "accept-encoding", "connection", "user-agent"}
        assert forwarded == {"authorization", "content-length", "content-type", "accept",
                             "idempotency-key", "if-match", "x-file-executable"}, seen.headers  # fmt: skip
    assert len(upstream.seen) == 2


def test_early_errors_never_reach_the_controller(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    with endpoint.tcp() as client:
        assert client.get("/healthz").json() == {"ok": True}
        for path in ("/bridge/v1/run", "/run", "/api/../bridge/v1/run", "/api/%2e%2e/run",
                     "/api/x/%2E/y", "/files/"):  # fmt: skip
            res = client.get(path)
            assert res.status_code == 404 and res.json()["code"] == "route_not_found", path
        res = client.request("TRACE", "/api/companies")
        assert res.status_code == 405 and res.json()["code"] == "method_not_allowed"
    assert upstream.seen == []


def test_controller_refusal_comes_back_unchanged(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    with endpoint.unix() as client:
        res = client.post("/api/companies/c1/denied", json={"a": 1})
    assert res.status_code == 403 and res.json() == {"code": "bridge_route_denied"}


def test_chunked_upload_is_streamed_on(upstream: Upstream, endpoint: LocalEndpoint) -> None:
    with endpoint.unix() as client:
        res = client.post("/api/companies/c1/x", content=iter([b"ab", b"", b"cd"]))
    assert res.status_code == 200
    seen = upstream.seen[-1]
    assert seen.body_len == 4 and seen.headers.get("transfer-encoding") == "chunked"


def test_token_file_is_read_again_when_it_changes(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    with endpoint.tcp() as client:
        client.get("/api/companies")
        endpoint.token_file.write_text("next-run-token")
        client.get("/api/companies")
        endpoint.token_file.unlink()
        res = client.get("/api/companies")
    assert [s.headers["authorization"] for s in upstream.seen] == [
        f"Bearer {TOKEN}",
        "Bearer next-run-token",
    ]
    assert res.status_code == 503 and res.json()["code"] == "run_token_unavailable"


@pytest.mark.allow_warning_logs
def test_unreachable_controller_is_502(tmp_path: Path) -> None:
    ep = start_endpoint(f"http://127.0.0.1:{free_port()}")
    try:
        with ep.tcp() as client:
            res = client.get("/api/companies")
        assert res.status_code == 502 and res.json()["code"] == "bridge_unreachable"
    finally:
        assert ep.stop() == 0
    assert "controller unreachable for GET /api/companies" in ep.stderr()


def test_bodies_stream_both_ways_in_bounded_memory(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    size = 256 * MiB
    block = bytes(range(256)) * (MiB // 256)
    expected = hashlib.sha256()
    for _ in range(size // MiB):
        expected.update(block)

    def upload() -> Iterator[bytes]:
        for _ in range(size // MiB):
            yield block

    with endpoint.tcp() as client:
        started = time.monotonic()
        res = client.put("/api/companies/c1/work-folders/task/t1/content?path=big", content=upload(),
                         headers={"Content-Length": str(size)})  # fmt: skip
        up_s = time.monotonic() - started
        assert res.status_code == 200
        assert upstream.seen[-1].body_len == size
        assert upstream.seen[-1].body_sha == expected.hexdigest()
        started = time.monotonic()
        got = hashlib.sha256()
        with client.stream("GET", f"/api/big?n={size}") as stream:
            assert stream.headers["content-length"] == str(size)
            for chunk in stream.iter_raw():
                got.update(chunk)
        down_s = time.monotonic() - started
    assert got.hexdigest() == expected.hexdigest()
    peak = endpoint.peak_rss()
    print(f"256 MiB through the endpoint: up {size / MiB / up_s:.0f} MiB/s, "
          f"down {size / MiB / down_s:.0f} MiB/s, peak RSS {peak / MiB:.0f} MiB")  # fmt: skip
    assert peak < 100 * MiB, f"endpoint peak RSS {peak / MiB:.0f} MiB: a body was buffered"
