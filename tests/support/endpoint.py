"""``fsagent bridge`` for tests: the endpoint as a subprocess, and a stand-in
controller that records what reaches it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.constants import REPO
from tests.support.procs import free_port
from tests.support.threaded import ThreadedServer
from tests.support.tmp import private_tmpdir

TOKEN = "run-token-" + "s3cr3t" * 6
MiB = 1 << 20

RUN = {
    "runId": "r1", "companyId": "c1", "agentId": "a1", "leaseEpoch": 1, "active": True,
    "refreshRequested": False,
    "bindings": {"task": "t1", "agent": "a1", "user": None, "project": "p1"},
}  # fmt: skip
"""What the stand-in answers for ``GET /bridge/v1/run``."""

REPOS = {
    "reposDir": "repos",
    "repos": [
        {"workspaceId": "w1", "name": "app", "repoUrl": "https://git.example/app.git",
         "ref": None, "primary": True, "branch": None, "setupCommand": None, "current": None},
    ],
}  # fmt: skip
"""What the stand-in answers for ``GET /bridge/v1/repos``."""


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
    trickled: list[int] = field(default_factory=list)
    _server: ThreadedServer | None = None

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
        if path in ("/bridge/v1/run", "/bridge/v1/repos"):
            answer = RUN if path == "/bridge/v1/run" else REPOS
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
            return
        if path.endswith("/slow"):
            await self.trickle(receive, send)
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

    async def trickle(self, receive: Any, send: Any) -> None:
        """1 MiB every 10 ms, up to 1000, until the reader hangs up; the count in ``trickled``."""
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        sent = 0
        while sent < 1000 and not gone.is_set():
            await send({"type": "http.response.body", "body": b"x" * MiB, "more_body": True})
            sent += 1
            await asyncio.sleep(0.01)
        self.trickled.append(sent)
        if not gone.is_set():
            await send({"type": "http.response.body", "body": b""})
        watcher.cancel()

    def start(self) -> Upstream:
        self._server = ThreadedServer(self.app, self.port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


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


def start_endpoint(controller: str, token: str = TOKEN, *extra: str) -> LocalEndpoint:
    d = private_tmpdir("fsa-lb-")  # short: unix socket paths are limited to 107 bytes
    token_file = d / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    return LocalEndpoint(controller, d, token_file, list(extra)).start()
