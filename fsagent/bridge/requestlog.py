"""Request ids on fsagent's controller requests, and one log line per answer.

Every request fsagent sends the controller (the bridge client's, and the local
API endpoint's forwarded calls) carries an ``X-Request-Id``: the caller's own
when the local endpoint's caller sent a sane one (``common.logs.REQUEST_ID``),
else a new ``fsa-`` id. The
controller takes a sane id as its own (``controller/metrics.py``), answers
with it and puts it on every line it logs while serving the request, so an
fsagent line and the controller's lines about the same request share their
``requestId``.

With ``-v`` each answer is one INFO line on the ``fsagent.http`` logger:
``requestId``, ``method``, ``path`` (the URL path, no query) and ``status``
as fields, plus ``ms`` from sending to the answer's head. A retry line names
the id of the attempt that failed (``last_request_id``).
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from typing import Any

import httpx

from common.logs import REQUEST_ID

HEADER = "X-Request-Id"

log = logging.getLogger("fsagent.http")

last_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "last_request_id", default=None
)
"""The id of the request this task sent last (trio and asyncio tasks each
have their own), for a line about its failure."""


def new_request_id() -> str:
    return "fsa-" + uuid.uuid4().hex[:16]


def request_fields() -> dict[str, Any]:
    """``extra=`` for a line about the request this task sent last."""
    rid = last_request_id.get()
    return {} if rid is None else {"fields": {"requestId": rid}}


async def _on_request(request: httpx.Request) -> None:
    rid = request.headers.get(HEADER)
    if rid is None or not REQUEST_ID.fullmatch(rid):
        rid = new_request_id()
        request.headers[HEADER] = rid
    request.extensions["fsagent_sent"] = time.monotonic()
    last_request_id.set(rid)


async def _on_response(response: httpx.Response) -> None:
    request = response.request
    rid = request.headers.get(HEADER, "")
    sent = request.extensions.get("fsagent_sent")
    ms = None if sent is None else round((time.monotonic() - sent) * 1000, 1)
    path = request.url.path
    log.info(
        "%s %s answered %d (request %s)",
        request.method,
        path,
        response.status_code,
        rid,
        extra={
            "fields": {
                "requestId": rid,
                "method": request.method,
                "path": path,
                "status": response.status_code,
                "ms": ms,
            }
        },
    )


def event_hooks() -> dict[str, list[Any]]:
    """``event_hooks=`` for an ``httpx.AsyncClient`` that talks to the controller."""
    return {"request": [_on_request], "response": [_on_response]}
