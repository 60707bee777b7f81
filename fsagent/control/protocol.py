"""The daemon's control socket (``control.sock`` in the state dir): its protocol
and its client. The daemon's side is :mod:`fsagent.control.server`.

Protocol: one JSON object on one line in, one JSON object on one line out.

Request: ``{"cmd": "flush", "final": false}`` (``cmd`` defaults to
``flush``, ``final`` to false). ``final: true`` ships the final checkpoint and
unmounts. ``{"cmd": "ping"}`` answers ``{"ok": true}``. ``{"cmd": "stats"}``
answers ``{"ok": true, "fuse": {...}, "queueDepth": N, "lastCheckpoint": {...}}``
(the live part of ``fsagent status --json``).

A final flush answers ``{"ok", "saved", "error", "warning", "final": true}``
(fsagent.checkpoint.ship.FinalSave.flush_reply): ``ok`` is also true when the agent
folder's final save was refused over a storage limit, which ``warning`` says.
A flush that is not final and is refused over that limit answers the same
way (:func:`limit_reply`): ``{"ok": true, "saved": false, "code":
"AGENT_FILES_LIMIT_EXCEEDED", "warning", "details", "final": false}``, a
warning of the run, not a failed save.

Reply: ``{"ok": true, ...}`` or ``{"ok": false, "code": CODE, "error": TEXT}``
with CODE ``bad_request`` (not JSON, not an object, unknown command or field,
a line over :data:`MAX_REQUEST` bytes), ``save_failed`` or ``internal_error``.

The other way a daemon speaks to who started it: its ready record, one JSON
line on an inherited descriptor (``--ready-fd``, :func:`inherited_fd`;
written by fsagent.control.server.announce_ready).

This module imports neither trio nor the HTTP client: ``fsagent flush`` and
``fsagent status`` load only it, so they start in a fraction of the time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any

MAX_REQUEST = 4096
"""Longest request line in bytes; a longer one is refused unread."""

READ_TIMEOUT = 10.0
"""Seconds a client has to send its request line."""

COMMANDS = ("flush", "ping", "stats")

LIMIT_CODE = "AGENT_FILES_LIMIT_EXCEEDED"
"""The code of a save refused over an agent folder's storage limit: its
receipt's (controller.receipts.LIMIT_REFUSED) and the run's warning's."""


def limit_reply(error: str, details: list[dict[str, Any]], *, final: bool) -> dict[str, Any]:
    """The answer to a flush the controller refused over the agent folder's
    storage limit: nothing saved, and not a failure (``ok``); ``details``
    name the limit (``limit``, ``max``, ``value``, ``path`` of an oversized
    file)."""
    return {
        "ok": True,
        "saved": False,
        "code": LIMIT_CODE,
        "warning": f"agent folder not saved, over its storage limit: {error}",
        "details": details,
        "final": final,
    }


class BadRequest(ValueError):
    """A control request that does not follow the protocol."""


def error_reply(code: str, message: str) -> dict[str, Any]:
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


def inherited_fd(text: str) -> int:
    """``--ready-fd``'s value: a descriptor this process inherited open, made
    close-on-exec here, so that no process it starts keeps the pipe open."""
    try:
        fd = int(text)
        os.fstat(fd)
    except (ValueError, OSError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an open file descriptor") from None
    os.set_inheritable(fd, False)
    return fd
