"""Log output for both commands: ``--log-format json|text`` and the request context.

``json`` writes one object per line (``ts``, ``level``, ``logger``, ``msg``, and
``requestId``, ``runId``, ``route``, ``method``, ``status`` when the line was
logged while serving a request, fsagent's ``runId`` and ``scope`` once known,
plus ``exc`` for a traceback). ``text`` is the
classic one-line format. The default is text on a terminal and json otherwise
(a service manager or container runtime collecting stderr).
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

FORMATS = ("json", "text")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
"""An ``X-Request-Id`` the controller takes as its own (else it makes one)."""
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class RequestContext:
    """What a log line logged while serving one request may say about it."""

    request_id: str
    method: str = ""
    route: str | None = None
    run_id: str | None = None
    status: int | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requestId": self.request_id}
        for key, value in (
            ("method", self.method),
            ("route", self.route),
            ("runId", self.run_id),
            ("status", self.status),
        ):
            if value:
                out[key] = value
        return out


current_request: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "current_request", default=None
)


process_fields: dict[str, Any] = {}
"""Fields on every JSON line of this process (fsagent: ``runId``, ``scope``)."""


def note_run(run_id: str) -> None:
    """Record the run a request acts for, for every later line about it."""
    ctx = current_request.get()
    if ctx is not None:
        ctx.run_id = run_id


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(process_fields)
        ctx = current_request.get()
        if ctx is not None:
            out.update(ctx.fields())
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None,
        help="json: one object per line; text: one plain line (default: text on a "
        "terminal, json otherwise)",
    )


def resolve(choice: str | None, stream: TextIO | None = None) -> str:
    if choice is not None:
        return choice
    stream = stream or sys.stderr
    return "text" if stream.isatty() else "json"


def configure(choice: str | None, level: int) -> str:
    """Send log records to stderr in the chosen format; returns the format used.

    Like ``logging.basicConfig``, this leaves a root logger that already has
    handlers alone (a host program, or pytest running the CLI in-process).
    """
    fmt = resolve(choice)
    root = logging.getLogger()
    if root.handlers:
        return fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    return fmt
