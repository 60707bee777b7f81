"""The daemon's side of its control socket (protocol: :mod:`fsagent.control.protocol`).

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

from fsagent.control.protocol import (
    MAX_REQUEST,
    READ_TIMEOUT,
    BadRequest,
    error_reply,
    limit_reply,
    parse_request,
)
from fsagent.errors import FsagentError, SaveFailed

log = logging.getLogger("fsagent.controlserver")

FlushHandler = Callable[[bool], Awaitable[dict[str, Any]]]
"""``handler(final)`` -> the reply of a valid flush request."""

StatsHandler = Callable[[], dict[str, Any]]
"""``handler()`` -> the reply of a stats request."""


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
        reply = error_reply("bad_request", str(exc))
    except SaveFailed as exc:
        # A storage limit's refusal is a warning of the run, as at stop
        # (never a failed save): the controller recorded it; the agent cleans
        # up and the next save takes its changes.
        if exc.over_limit:
            reply = limit_reply(str(exc), exc.details, final=final)
        else:
            reply = error_reply("save_failed", str(exc))
    except FsagentError as exc:
        reply = error_reply("save_failed", str(exc))
    except Exception as exc:
        log.exception("control request failed")
        reply = error_reply("internal_error", f"{type(exc).__name__}: {exc}")
    await conn.send_all(json.dumps(reply).encode() + b"\n")


def open_control_socket(sock_path: Path) -> socket.socket:
    """Bind and listen on ``sock_path`` before the mount is announced.

    The socket is made under a temporary name and renamed into place once it
    listens, so a client sees either no socket or one that answers: never a
    bound file that refuses connections (the window between bind and listen).
    """
    tmp = sock_path.with_name(f".{sock_path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(tmp))
        os.chmod(tmp, 0o600)
        listener.listen(16)
        os.replace(tmp, sock_path)  # replaces a stale socket left by a crash
    except BaseException:
        listener.close()
        tmp.unlink(missing_ok=True)
        raise
    return listener


async def serve_control(
    listening: socket.socket,
    sock_path: Path,
    flush: FlushHandler,
    stats: StatsHandler | None = None,
) -> None:
    """Answer control requests on a socket from :func:`open_control_socket`
    until cancelled; then remove ``sock_path``."""
    listener = trio.socket.from_stdlib_socket(listening)

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
            # One local metadata call at shutdown: not worth a worker thread.
            sock_path.unlink(missing_ok=True)  # noqa: ASYNC240
