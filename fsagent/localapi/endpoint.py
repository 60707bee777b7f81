"""``fsagent bridge``: the sandbox's local endpoint for the controller's API.

Sandbox code calls ``$PAPERCLIP_API_URL/api/<path>`` (``127.0.0.1:<port>``)
or the same path over the unix socket ``$PAPERCLIP_API_SOCKET``; each request
is forwarded to ``<controller>/bridge/v1/api/<path>`` with the run token added
here, so the sandbox's code never needs to hold it.

This is not a control. The controller decides what a run may do (route and
method allowlist, header allowlist, the run agent's authority, limits); the
checks here only turn requests that can never succeed into early, local
errors:

* a path outside ``/api/`` or with a ``.`` / ``..`` segment: 404 ``route_not_found``;
* a raw byte outside ASCII in the URL (the HTTP parser refuses these already): 400;
* a method no API route has: 405 ``method_not_allowed``.

The caller's ``Authorization`` and ``Cookie`` and hop-by-hop headers are
never sent on (the controller keeps only its own header allowlist of the
rest), and ``Set-Cookie`` and hop-by-hop headers never come back. Bodies stream both
ways in chunks (an upload of 1 GiB is never held in memory). When the
controller cannot be reached the answer is 502 ``controller_unreachable``; when it
stops answering, 504 ``controller_timeout``; when the token file cannot be read,
503 ``run_token_unavailable``. ``GET /healthz`` is answered here
(``{"ok": true}``) so ``fsagent doctor`` can tell the endpoint is up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx

from common import logs
from common.bridge import PREFIX
from fsagent.bridge import tls
from fsagent.bridge.client import read_token
from fsagent.bridge.requestlog import event_hooks, request_fields
from fsagent.control.protocol import inherited_fd
from fsagent.control.server import ROOM_RETRY_SECONDS, announce_ready
from fsagent.errors import FULL_DISK, FsagentError
from fsagent.state.statedir import default_socket

log = logging.getLogger("fsagent.localbridge")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

API_PREFIX = "/api/"
"""Local paths under this prefix go to ``<controller>/bridge/v1/api/``."""

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers of one connection, never passed on in either direction."""

DROP_REQUEST_HEADERS = HOP_BY_HOP | {"host", "expect", "authorization", "cookie"}
"""Request headers not sent on: the connection's own, and the caller's
credentials (the run token replaces them). Which of the rest the API sees is
the controller's allowlist, enforced there and only there."""

DROP_RESPONSE_HEADERS = HOP_BY_HOP | {"set-cookie", "server", "date"}
"""Response headers not passed back: hop-by-hop ones, cookies, and the two the
local server writes itself."""

API_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "PATCH"})
"""Methods some API route has; any other is refused here already."""

SOCKET_PATH_MAX = 107
"""Longest unix socket path the kernel accepts (``sun_path`` less its NUL)."""

UPSTREAM_TIMEOUT = httpx.Timeout(600.0, connect=10.0, pool=None)
"""Connecting may take 10 s; the controller may then go quiet for 600 s between
two pieces of a body (its own per-request limit answers sooner)."""


class TokenSource:
    """The run token, read from its file again whenever the file changes
    (a new run writes a new token without restarting the endpoint)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._token: str | None = None

    def get(self) -> str:
        st = os.stat(self.path)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key or self._token is None:
            token = read_token(self.path)
            assert token is not None
            self._token, self._key = token, key
        return self._token


def _error_body(status: int, code: str, message: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": message, "code": code}).encode()


class ClientGone(Exception):
    """The caller hung up while its request body was still arriving."""


class LocalBridge:
    """The ASGI application: one forwarded request per local request."""

    def __init__(
        self, controller: str, tokens: TokenSource, verify: ssl.SSLContext | bool = True
    ) -> None:
        self.upstream = controller.rstrip("/") + PREFIX
        self.tokens = tokens
        self.verify = verify
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # No cookie jar: a Set-Cookie from the controller must never be
            # stored here and sent along with the next caller's request.
            no_cookies = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
            self._client = httpx.AsyncClient(
                cookies=no_cookies,
                verify=self.verify,
                headers={"Accept-Encoding": "identity"},
                timeout=UPSTREAM_TIMEOUT,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=16),
                event_hooks=event_hooks(),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        early = self.refuse_early(scope)
        if early is not None:
            await _answer(send, *early)
            return
        try:
            token = self.tokens.get()
        except (OSError, FsagentError) as exc:
            log.warning("run token file %s unreadable: %s", self.tokens.path, exc)
            await _answer(send, *_error_body(503, "run_token_unavailable", "run token unavailable"))
            return
        await self.forward(scope, receive, send, token)

    def refuse_early(self, scope: Scope) -> tuple[int, bytes] | None:
        """A local answer for a request the controller would certainly refuse, else None."""
        path: str = scope["path"]
        if scope["method"] == "GET" and path == "/healthz":
            return 200, b'{"ok": true}'
        raw = scope.get("raw_path") or path.encode()
        if not (raw.isascii() and scope.get("query_string", b"").isascii()):
            return _error_body(400, "validation_error", "percent-encode the URL")
        segments = unquote(raw.decode("latin-1")).split("/")
        if not path.startswith(API_PREFIX) or any(s in (".", "..") for s in segments):
            return _error_body(404, "route_not_found", "no such bridge route")
        if scope["method"] not in API_METHODS:
            return _error_body(405, "method_not_allowed", "method not allowed")
        return None

    async def forward(self, scope: Scope, receive: Receive, send: Send, token: str) -> None:
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        # The target as the caller sent it (the HTTP parser admits only ASCII
        # there): escapes are passed on, never decoded and encoded again.
        target = raw_path.decode("ascii") + ("?" + query.decode("ascii") if query else "")
        url = self.upstream + target
        # Headers a Connection header names are this connection's too.
        named = {
            t.strip().lower()
            for k, v in scope["headers"]
            if k == b"connection"
            for t in v.decode("latin-1").split(",")
        }
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in DROP_REQUEST_HEADERS | named
        ]
        headers.append(("Authorization", f"Bearer {token}"))
        has_body = any(k.lower() == "content-length" for k, _ in headers) or any(
            k == b"transfer-encoding" for k, _ in scope["headers"]
        )
        client = self.client()
        request = client.build_request(
            scope["method"], url, headers=headers, content=_body(receive) if has_body else None
        )
        try:
            response = await client.send(request, stream=True)
        except ClientGone:
            return
        except httpx.TimeoutException as exc:
            log.warning("controller did not answer %s %s: %r", scope["method"], scope["path"], exc,
                        extra=request_fields())  # fmt: skip
            await _answer(
                send, *_error_body(504, "controller_timeout", "controller did not answer")
            )
            return
        except httpx.HTTPError as exc:
            log.warning("controller unreachable for %s %s: %r", scope["method"], scope["path"], exc,
                        extra=request_fields())  # fmt: skip
            await _answer(
                send, *_error_body(502, "controller_unreachable", "controller unreachable")
            )
            return
        # The server drops what is sent to a caller that hung up without a
        # word: watch for the hang-up, so a 1 GiB download nobody reads is not
        # fetched to its end (closing the response closes the controller's
        # connection).
        gone = asyncio.Event()
        watcher = asyncio.create_task(_wait_disconnect(receive, gone))
        try:
            out = [
                (k, v)
                for k, v in response.headers.raw
                if k.decode("latin-1").lower() not in DROP_RESPONSE_HEADERS
            ]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": out}
            )
            async for chunk in response.aiter_raw():
                if gone.is_set():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except httpx.HTTPError as exc:
            # Too late for an error answer: the caller sees the answer cut short.
            log.warning("controller's answer to %s %s broke off: %r", scope["method"],
                        scope["path"], exc, extra=request_fields())  # fmt: skip
        finally:
            watcher.cancel()
            await response.aclose()


async def _wait_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set ``gone`` when the caller disconnects (body parts left unread are dropped)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body"):
            return


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --- sockets and the command ------------------------------------------------------


def bind_tcp(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise FsagentError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


def bind_unix(path: Path) -> socket.socket:
    """Listen on ``path``; a stale socket file is replaced, a live one refused."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise FsagentError(f"socket path {path} is longer than {SOCKET_PATH_MAX} bytes")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise FsagentError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listens: left by an endpoint that died
        else:
            raise FsagentError(f"another endpoint already serves {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(128)
    return sock


def bind_unix_or_wait(path: Path) -> socket.socket | None:
    """:func:`bind_unix`, or None when the disk is full (no inode for the
    socket file): the endpoint then serves TCP alone until
    :func:`unix_when_there_is_room` binds it. A sandbox started again on a
    disk its agent filled still gets its endpoint, and the agent that can
    free the disk gets to run."""
    try:
        return bind_unix(path)
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise
        log.warning(
            "cannot make the socket %s: %s; serving on TCP alone until the disk has room "
            "(tried again every %gs)", path, exc.strerror, ROOM_RETRY_SECONDS,
        )  # fmt: skip
        return None


async def unix_when_there_is_room(path: Path, port: int) -> None:
    """Bind ``path`` once the disk has room, then pass each connection made
    to it on to the endpoint's TCP port (runs until cancelled)."""
    while True:
        await asyncio.sleep(ROOM_RETRY_SECONDS)
        try:
            sock = bind_unix(path)
            break
        except OSError as exc:
            if exc.errno not in FULL_DISK:
                log.error("cannot make the socket %s: %s; serving on TCP alone", path, exc)
                return
    log.warning("the socket %s serves again", path)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            to_reader, to_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, to_writer), _pipe(to_reader, writer))

    server = await asyncio.start_unix_server(connection, sock=sock)
    async with server:
        await server.serve_forever()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until its end, which is passed on."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


def cmd_bridge(args: argparse.Namespace) -> int:
    """Serve the local endpoint until SIGTERM/SIGINT."""
    import uvicorn

    from fsagent.commands.envfile import update_env_file
    from fsagent.commands.up import env_for, fetch_repos_env, fetch_run

    if not args.controller.startswith(("http://", "https://")):
        raise FsagentError("fsagent bridge needs an http(s) --controller URL")
    if not args.token_file:
        raise FsagentError("--token-file is required")
    transport = tls.options_from(args)
    tls.check_url(args.controller, transport)
    verify = tls.ssl_context(transport) if args.controller.startswith("https://") else True
    tokens = TokenSource(args.token_file)
    tokens.get()  # an unreadable token file is a startup error, not a 503 per request
    sock_path = Path(args.socket) if args.socket else default_socket()
    unix_sock = bind_unix_or_wait(sock_path)
    tcp_sock = bind_tcp(args.port)
    port = tcp_sock.getsockname()[1]
    endpoint = {
        "PAPERCLIP_API_URL": f"http://127.0.0.1:{port}",
        "PAPERCLIP_API_SOCKET": str(sock_path),
    }
    app = LocalBridge(args.controller, tokens, verify)
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        loop="asyncio",
        http="httptools",
        interface="asgi3",
        proxy_headers=False,
        timeout_keep_alive=5,
        server_header=False,
        date_header=True,
    )
    server = uvicorn.Server(config)
    if args.env_file:
        collections: dict[str, str] = {}
        if args.home:
            home = Path(args.home).absolute()
            collections = {**env_for(home, fetch_run(args)), **fetch_repos_env(args, home)}
        update_env_file(Path(args.env_file), {**collections, **endpoint})
    announce_ready(
        {**endpoint, "pid": os.getpid()},
        Path(args.ready_file) if args.ready_file else None,
        args.ready_fd,
    )
    print(
        f"fsagent bridge: {endpoint['PAPERCLIP_API_URL']} and {sock_path} -> {app.upstream}/api/",
        flush=True,
    )

    async def serve() -> None:
        later = None
        if unix_sock is None:
            later = asyncio.create_task(unix_when_there_is_room(sock_path, port))
        try:
            await server.serve(sockets=[tcp_sock] if unix_sock is None else [tcp_sock, unix_sock])
        finally:
            if later is not None:
                later.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await later
            await app.aclose()

    # uvicorn stops gracefully on SIGTERM/SIGINT and then raises the signal
    # again for the handler it found: let that one do nothing, so the socket
    # file and ready file are removed and the exit status is 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    try:
        asyncio.run(serve())
    finally:
        tcp_sock.close()
        if unix_sock is not None:
            unix_sock.close()
        sock_path.unlink(missing_ok=True)
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
    return 0


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "bridge", help="serve the controller's API to sandbox code (adds the run token)"
    )
    b.add_argument("--controller", required=True, help="controller base URL")
    b.add_argument("--token-file", help="file holding the run token (re-read when it changes)")
    b.add_argument(
        "--socket", help="unix socket path (default ~/.local/state/fsagent/run/api.sock)"
    )
    b.add_argument(
        "--port", type=int, default=0, help="TCP port on 127.0.0.1 (default: any free one)"
    )
    b.add_argument(
        "--env-file", help="write PAPERCLIP_API_URL and PAPERCLIP_API_SOCKET into this env file"
    )
    b.add_argument(
        "--home",
        help="with --env-file, also write AGENT_HOME and PAPERCLIP_*_DIR for the run's "
        "collections mounted under this home (what fsagent up writes)",
    )
    b.add_argument("--ready-file", help="write the endpoint as JSON here once listening")
    b.add_argument(
        "--ready-fd",
        type=inherited_fd,
        help="instead of --ready-file, write it as one JSON line to this inherited file "
        "descriptor and close it (how fsagent up hears of it: no disk space needed)",
    )
    b.add_argument("--retry-deadline", type=float, default=60.0, help=argparse.SUPPRESS)
    tls.add_arguments(b)
    logs.add_argument(b)
    b.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO"
    )
    b.set_defaults(func=cmd_bridge)
