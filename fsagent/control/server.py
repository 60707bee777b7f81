"""The daemon's side of its control socket (protocol: :mod:`fsagent.control.protocol`).

A bad request, a client that hangs up, or a failing handler never ends the
daemon: the mount keeps serving and its final save still runs at stop.

Nor does a full disk: when the state dir's filesystem has no room for the
socket (or the daemon's record, ``daemon.json``) at start, the daemon serves
its collection without it and makes it as soon as there is room
(:class:`WhenThereIsRoom`); only ``fsagent flush`` and ``fsagent status``
wait for it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import trio

from fsagent.control.protocol import (
    MAX_REQUEST,
    READ_TIMEOUT,
    BadRequest,
    error_reply,
    limit_reply,
    parse_request,
)
from fsagent.errors import FULL_DISK, FsagentError, SaveFailed

log = logging.getLogger("fsagent.controlserver")

FlushHandler = Callable[[bool], Awaitable[dict[str, Any]]]
"""``handler(final)`` -> the reply of a valid flush request."""

StatsHandler = Callable[[], dict[str, Any]]
"""``handler()`` -> the reply of a stats request."""

ROOM_RETRY_SECONDS = 5.0
"""How often a daemon tries again to make what a full disk refused it."""

T = TypeVar("T")


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


def write_record(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` whole or not at all: a temporary name
    renamed into place, removed when the write fails (a full disk's half
    written file takes no room). The daemon's ``daemon.json`` in both modes,
    and the ready file of a detached mount (:func:`announce_ready`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def announce_ready(data: dict[str, Any], ready_file: Path | None, ready_fd: int | None) -> None:
    """Say a process serves: ``data`` as one JSON line on ``ready_fd`` (closed
    after it), or as the record ``ready_file`` (:func:`write_record`).

    ``fsagent up`` hands its children the write end of a pipe (``--ready-fd``):
    a ready file needs a block of the disk, and a sandbox restarted on a full
    disk could not start. A reader gone meanwhile (EPIPE) is not an error:
    whoever started this process stopped waiting for it."""
    if ready_fd is not None:
        line = (json.dumps(data) + "\n").encode()
        try:
            while line:
                line = line[os.write(ready_fd, line) :]
        except BrokenPipeError:
            pass
        finally:
            os.close(ready_fd)
    elif ready_file is not None:
        write_record(ready_file, data)


class WhenThereIsRoom(Generic[T]):
    """What ``make()`` makes in the state dir for ``fsagent flush`` and
    ``fsagent status`` to reach the daemon by (its control socket, its record
    ``daemon.json``): made now, or, when the disk is full (:data:`FULL_DISK`),
    as soon as it has room again. Until then the daemon serves its collection
    without it and :meth:`made`, a task of the daemon's nursery, tries again
    every ``retry`` seconds; one warning says so, one more when it is made.
    Any other error of the first try is the daemon's failure to start."""

    def __init__(self, what: str, make: Callable[[], T], retry: float = ROOM_RETRY_SECONDS) -> None:
        self.what, self.make, self.retry = what, make, retry
        self.done = False
        self.value: T | None = None
        self.failed: int | None = None
        """The errno of the first try, when it found no room."""
        try:
            self.value, self.done = make(), True
        except OSError as exc:
            if exc.errno not in FULL_DISK:
                raise
            self.failed = exc.errno
            log.warning(
                "cannot make %s: %s; `fsagent flush` and `fsagent status` cannot reach this"
                " daemon until its disk has room (it serves its collection meanwhile, and"
                " tries again every %gs)",
                what,
                exc.strerror,
                retry,
            )

    async def made(self) -> T:
        """What ``make()`` made, once it has: tried again every ``retry``
        seconds until then (a cancellation ends the wait)."""
        failed = self.failed
        while not self.done:
            await trio.sleep(self.retry)
            try:
                self.value, self.done = self.make(), True
            except OSError as exc:
                if exc.errno != failed:  # a line for a new reason, none for each try
                    failed = exc.errno
                    log.warning("cannot make %s yet: %s", self.what, exc)
                continue
            log.warning("made %s now that its disk has room", self.what)
        return cast(T, self.value)


class ControlSocket:
    """The daemon's control socket at ``path`` (:func:`open_control_socket`),
    listening before the collection is served or, on a full disk, once there
    is room (:class:`WhenThereIsRoom`); both modes serve it (fsagent.fuse.mount,
    fsagent.dirmode.serve)."""

    def __init__(self, path: Path, retry: float = ROOM_RETRY_SECONDS) -> None:
        self.path = path
        self.listening = WhenThereIsRoom(
            f"the control socket {path}", partial(open_control_socket, path), retry
        )
        if not self.listening.done:
            # A socket left by a crashed run answers nobody: a client finds
            # none rather than one that refuses it (and an inode is freed).
            path.unlink(missing_ok=True)

    async def serve(self, flush: FlushHandler, stats: StatsHandler | None = None) -> None:
        """Answer control requests once the socket is made, until cancelled;
        then remove it (:func:`serve_control`)."""
        await serve_control(await self.listening.made(), self.path, flush, stats)

    def close(self) -> None:
        """Close the socket (already closed if it served) and remove its file."""
        if self.listening.value is not None:
            self.listening.value.close()
        self.path.unlink(missing_ok=True)
