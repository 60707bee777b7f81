"""uvicorn's httptools protocol with the limits it lacks: header timeout, head size, connections.

uvicorn (httptools) arms no timer until a first response is sent, so a client
that connects and sends nothing, or trickles its headers, holds a connection
forever; it also has no bound on the request line and headers (h11's
``h11_max_incomplete_event_size`` exists only for the h11 protocol). Its
``limit_concurrency`` accepts and keeps an over-the-limit connection until
its headers arrive and then answers 503; here such a connection is answered
and closed on accept, before it can hold anything.

Everything about request bodies lives in the ASGI layer (``limits.py``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.errors import (
    RequestHeadTooLarge,
    RequestTimeout,
    TooManyConnections,
    WorkFolderError,
)
from controller.config import ServerLimits


class _HeadTooLarge(Exception):
    """Raised inside a parser callback to stop parsing an oversized head."""


def raw_error_response(exc: WorkFolderError, *, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 error answer that closes the connection."""
    body = json.dumps(exc.to_json()).encode()
    head = [
        f"HTTP/1.1 {exc.status} {type(exc).__name__}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """One connection; ``limits`` is set on the subclass made by :func:`protocol_class`."""

    limits: ServerLimits = ServerLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_refused = False

    # --- connection --------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # ``connections`` already holds this one.
        if len(self.connections) > self.limits.max_connections:
            self._refuse(TooManyConnections(), retry_after=1)
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    # --- head: timer and size ---------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        # The first request's timer runs from connect, so trickling the first
        # bytes cannot extend it; a keep-alive request's timer starts here.
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_head_bytes:
            self._head_refused = True
            # httptools turns this into HttpParserError, which uvicorn answers
            # through send_400_response (overridden below).
            raise _HeadTooLarge()

    def send_400_response(self, msg: str) -> None:
        if self._head_refused:
            self._refuse(
                RequestHeadTooLarge(
                    f"Request line and headers exceed {self.limits.max_head_bytes} bytes"
                )
            )
            return
        super().send_400_response(msg)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head stalled while an earlier answer is still being
            # written: an error answer now would corrupt that one.
            self.transport.close()
            return
        self._refuse(RequestTimeout("Request headers did not arrive in time"))

    def _refuse(self, exc: WorkFolderError, *, retry_after: int | None = None) -> None:
        if not self.transport.is_closing():
            self.transport.write(raw_error_response(exc, retry_after=retry_after))
            self.transport.close()


def protocol_class(limits: ServerLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to hand to ``uvicorn.Config(http=...)`` for ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
