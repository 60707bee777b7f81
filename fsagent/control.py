"""The daemon's control socket (``control.sock`` in the state dir).

Protocol: one JSON object on one line in, one JSON object on one line out.

Request: ``{"cmd": "flush", "final": false}`` (``cmd`` defaults to
``flush``, ``final`` to false). ``final: true`` ships the final checkpoint and
unmounts. ``{"cmd": "ping"}`` answers ``{"ok": true}``. ``{"cmd": "stats"}``
answers ``{"ok": true, "fuse": {...}, "queueDepth": N, "lastCheckpoint": {...}}``
(the live part of ``fsagent status --json``).

Reply: ``{"ok": true, ...}`` or ``{"ok": false, "code": CODE, "error": TEXT}``
with CODE ``bad_request`` (not JSON, not an object, unknown command or field,
a line over :data:`MAX_REQUEST` bytes), ``save_failed`` or ``internal_error``.

A bad request, a client that hangs up, or a failing handler never ends the
daemon: the mount keeps serving and its final save still runs at stop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from fsagent.errors import FsagentError

log = logging.getLogger(__name__)

MAX_REQUEST = 4096
"""Longest request line in bytes; a longer one is refused unread."""

READ_TIMEOUT = 10.0
"""Seconds a client has to send its request line."""

FlushHandler = Callable[[bool], Awaitable[dict[str, Any]]]
"""``handler(final)`` -> the reply of a valid flush request."""

StatsHandler = Callable[[], dict[str, Any]]
"""``handler()`` -> the reply of a stats request."""

COMMANDS = ("flush", "ping", "stats")


class BadRequest(ValueError):
    """A control request that does not follow the protocol."""


def _error(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "code": code, "error": message}


def parse_request(raw: bytes) -> tuple[str, bool]:
    """(command, final) of one request line; BadRequest otherwise."""
    if len(raw) > MAX_REQUEST:
        raise BadRequest(f"request line over {MAX_REQUEST} bytes")
    try:
        request = json.loads(raw.strip() or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequest("request must be a JSON object")
    unknown = set(request) - {"cmd", "final"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    cmd = request.get("cmd", "flush")
    if cmd not in COMMANDS:
        raise BadRequest(f"unknown command {cmd!r} ({', '.join(COMMANDS)})")
    final = request.get("final", False)
    if not isinstance(final, bool):
        raise BadRequest('"final" must be true or false')
    return cmd, final


async def _read_line(conn: trio.SocketStream) -> bytes:
    """The request line; past MAX_REQUEST the rest of the line is read and
    dropped, so the reply is not lost to a reset by unread data."""
    raw = b""
    while not raw.endswith(b"\n"):
        chunk = await conn.receive_some(65536)
        if not chunk:
            break
        raw = raw + chunk if len(raw) <= MAX_REQUEST else raw[: MAX_REQUEST + 1] + chunk[-1:]
    return raw


async def _answer(conn: trio.SocketStream, flush: FlushHandler, stats: StatsHandler | None) -> None:
    reply: dict[str, Any]
    raw = b""
    with trio.move_on_after(READ_TIMEOUT):
        raw = await _read_line(conn)
    try:
        cmd, final = parse_request(raw)
        if cmd == "ping":
            reply = {"ok": True}
        elif cmd == "stats":
            reply = {"ok": True, **(stats() if stats is not None else {})}
        else:
            reply = await flush(final)
    except BadRequest as exc:
        reply = _error("bad_request", str(exc))
    except FsagentError as exc:
        reply = _error("save_failed", str(exc))
    except Exception as exc:
        log.exception("control request failed")
        reply = _error("internal_error", f"{type(exc).__name__}: {exc}")
    await conn.send_all(json.dumps(reply).encode() + b"\n")


async def serve_control(
    sock_path: Path, flush: FlushHandler, stats: StatsHandler | None = None
) -> None:
    """Answer control requests on ``sock_path`` until cancelled."""
    # Removing a stale socket file is one local metadata call, done before
    # the mount serves anything: not worth a worker thread.
    sock_path.unlink(missing_ok=True)  # noqa: ASYNC240
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(str(sock_path))
    os.chmod(sock_path, 0o600)
    listener.listen(4)

    async def handle(conn: trio.SocketStream) -> None:
        try:
            async with conn:
                await _answer(conn, flush, stats)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("control client went away: %s", exc)

    async with trio.open_nursery() as nursery:
        try:
            while True:
                client_sock, _ = await listener.accept()
                nursery.start_soon(handle, trio.SocketStream(client_sock))
        finally:
            listener.close()
            sock_path.unlink(missing_ok=True)  # noqa: ASYNC240 - as above, at shutdown


def exchange(sock_path: Path, line: bytes, timeout: float, *, read: bool = True) -> bytes:
    """Send raw bytes to a control socket; the reply line (b"" with ``read=False``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(sock_path))
        sock.sendall(line)
        raw = b""
        while read and not raw.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    return raw


def request(sock_path: Path, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request to a daemon's control socket and return its reply."""
    raw = exchange(sock_path, json.dumps(body).encode() + b"\n", timeout)
    reply: dict[str, Any] = json.loads(raw or b"{}")
    return reply
