"""Prometheus metrics of one controller process, served on ``--metrics-listen``.

The metrics are not on the API listener: they count every tenant's traffic,
and the only machine credential, an operator token, belongs to one company.
So they get an address of their own that the operator keeps off the public
network. :class:`Observe` (an ASGI middleware) records every
request by route template, method and status, the checkpoint and upload
figures (folder and repository checkpoints, every upload route) from their
answers, and sets the request context the logs use.
Pool use and active runs are read when scraped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.bridge import BATCH_MAX_MEMBERS, PREFIX
from common.logs import REQUEST_ID, RequestContext, current_request
from controller.db import SharedPool

log = logging.getLogger(__name__)

CHECKPOINT_ROUTES = {
    PREFIX + "/folders/{scope}/checkpoints": "folder",
    PREFIX + "/repos/{workspaceId}/checkpoints": "repository",
}
"""Checkpoint commit routes and the ``kind`` label of their series."""
UPLOAD_ROUTES = {
    ("PUT", PREFIX + "/folders/{scope}/uploads"),
    ("PUT", PREFIX + "/folders/{scope}/uploads/batch"),
    ("PUT", PREFIX + "/repos/{workspaceId}/uploads"),
    ("PUT", PREFIX + "/repos/{workspaceId}/uploads/batch"),
    ("PUT", "/api/companies/{companyId}/work-folders/{scope}/{ownerId}/content"),
    ("POST", "/api/companies/{companyId}/tasks/{taskId}/attachments"),
}
CAPTURED_ROUTES = {("POST", route) for route in CHECKPOINT_ROUTES} | UPLOAD_ROUTES
"""Routes whose JSON answer :meth:`Metrics.record_answer` reads."""
ANSWER_CAPTURE_BYTES = 64 * 1024
"""Longest answer body read back for its ``code`` (errors) or checkpoint figures."""
BATCH_ANSWER_CAPTURE_BYTES = 1024 + BATCH_MAX_MEMBERS * 128
"""A batch upload's answer lists every member (``{"digest": …, "byteSize": …}``,
under 100 bytes each): all of it is read, or the batch would count nothing."""
SCRAPE_QUERY_TIMEOUT = 5.0


class Metrics:
    """The registry and every series of one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "controller_http_requests", "HTTP requests answered",
            ["route", "method", "status"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "controller_http_request_duration_seconds", "Time to answer an HTTP request",
            ["route", "method", "status"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )  # fmt: skip
        self.checkpoints = Counter(
            "controller_checkpoint_commits", "Checkpoints committed, of a folder or a "
            "repository (replayed: a retry answered from the first commit)",
            ["kind", "outcome"], registry=r,
        )  # fmt: skip
        self.checkpoint_entries = Counter(
            "controller_checkpoint_entries", "Entries of applied checkpoints", ["kind"],
            registry=r,
        )  # fmt: skip
        self.checkpoint_bytes = Counter(
            "controller_checkpoint_bytes", "Content bytes referenced by applied checkpoints",
            ["kind"], registry=r,
        )  # fmt: skip
        self.checkpoint_refusals = Counter(
            "controller_checkpoint_refusals", "Checkpoints refused, by error code",
            ["kind", "code"], registry=r,
        )  # fmt: skip
        self.upload_bytes = Counter(
            "controller_upload_bytes", "Content bytes of accepted uploads (before framing "
            "and compression)", ["route"], registry=r,
        )  # fmt: skip
        self.gc_sweeps = Counter(
            "controller_gc_sweeps", "GC sweeps run, by outcome (ok, failed)", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.gc_objects = Counter(
            "controller_gc_objects", "Objects GC examined, by outcome (deleted, kept, failed)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self._server: Any = None

    def sweep_done(self, report: dict[str, int] | None) -> None:
        """Record one sweep: its report, or None when it failed."""
        if report is None:
            self.gc_sweeps.labels("failed").inc()
            return
        self.gc_sweeps.labels("ok").inc()
        for outcome in ("deleted", "kept", "failed"):
            self.gc_objects.labels(outcome).inc(report.get(outcome, 0))

    def record_answer(self, method: str, route: str, status: int, body: bytes) -> None:
        """The checkpoint figures (or refusal code) or upload size from an answer."""
        try:
            answer = json.loads(body) if body else {}
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        if (method, route) in UPLOAD_ROUTES:
            if status < 300:
                self.upload_bytes.labels(route).inc(uploaded_bytes(answer))
            return
        kind = CHECKPOINT_ROUTES[route]
        if status >= 400:
            self.checkpoint_refusals.labels(kind, str(answer.get("code") or status)).inc()
            return
        if answer.get("replayed"):
            self.checkpoints.labels(kind, "replayed").inc()
            return
        self.checkpoints.labels(kind, "applied").inc()
        self.checkpoint_entries.labels(kind).inc(int(answer.get("entries") or 0))
        self.checkpoint_bytes.labels(kind).inc(int(answer.get("byteSize") or 0))

    def listen(self, address: str) -> None:
        """Start the scrape listener (a thread) on HOST:PORT; OSError if it cannot bind."""
        host, _, port = address.rpartition(":")
        self._server, _ = start_http_server(int(port), host.strip("[]"), registry=self.registry)
        log.info("metrics on http://%s/metrics", address)

    def attach(self, pool: SharedPool) -> None:
        """Report ``pool`` (and active runs through it) from the running event loop."""
        self.registry.register(_PoolCollector(pool, asyncio.get_running_loop()))

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _PoolCollector(Collector):
    """Database pool use and active runs, read at scrape time.

    Scrapes run on the listener's thread; the runs query is handed to the
    event loop so it uses the process's own pool.
    """

    def __init__(self, pool: SharedPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop

    def describe(self) -> Iterable[Metric]:
        return []

    async def _active_runs(self) -> int:
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT count(*) AS n FROM runs WHERE active")
            row = await cur.fetchone()
        return int(row["n"]) if row else 0

    def collect(self) -> Iterator[Metric]:
        stats = self.pool.get_stats()
        size, idle = stats.get("pool_size", 0), stats.get("pool_available", 0)
        conns = GaugeMetricFamily(
            "controller_db_pool_connections", "Database connections by state", labels=["state"]
        )
        conns.add_metric(["in_use"], size - idle)
        conns.add_metric(["idle"], idle)
        yield conns
        yield GaugeMetricFamily(
            "controller_db_pool_max",
            "Connections the pool may open",
            value=stats.get("pool_max", 0),
        )
        yield GaugeMetricFamily(
            "controller_db_pool_waiting",
            "Requests waiting for a connection",
            value=stats.get("requests_waiting", 0),
        )
        future = asyncio.run_coroutine_threadsafe(self._active_runs(), self.loop)
        try:
            yield GaugeMetricFamily(
                "controller_active_runs",
                "Runs not yet ended",
                value=future.result(SCRAPE_QUERY_TIMEOUT),
            )
        except Exception as exc:  # a scrape must still answer while the database is down
            future.cancel()  # not left waiting for a pool connection after the scrape
            log.warning("metrics: cannot count active runs: %s", exc or type(exc).__name__)


def uploaded_bytes(answer: dict[str, Any]) -> int:
    """Content bytes an upload's answer reports: one object (``byteSize``), a
    batch (``objects``), a work-folder file (``file``) or an attachment."""
    objects = answer.get("objects")
    if isinstance(objects, list):
        return sum(int(o.get("byteSize") or 0) for o in objects if isinstance(o, dict))
    for wrapper in ("file", "attachment"):
        inner = answer.get(wrapper)
        if isinstance(inner, dict):
            return int(inner.get("byteSize") or 0)
    return int(answer.get("byteSize") or 0)


def route_template(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The matched route's template (``/api/companies/{companyId}/…``), never the raw path."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        path = str(getattr(route, "path", "unmatched"))
        if match == Match.FULL:
            return path + "/…" if isinstance(route, Mount) else path
        if match == Match.PARTIAL and partial is None:
            partial = path  # the path matched, the method did not (405)
    return partial or "unmatched"


def request_id(scope: Scope) -> str:
    """The caller's ``X-Request-Id`` when it is a sane token, else a new one."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = bytes(value).decode("latin-1")
            if REQUEST_ID.fullmatch(text):
                return text
    return uuid.uuid4().hex[:16]


class Observe:
    """Counts, times and labels every HTTP request; answers carry ``X-Request-Id``."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope["method"]
        route = route_template(self.routes, scope)
        ctx = RequestContext(request_id(scope), method=method, route=route)
        token = current_request.set(ctx)
        status = 500
        captured = bytearray()
        capture = (method, route) in CAPTURED_ROUTES
        limit = BATCH_ANSWER_CAPTURE_BYTES if route.endswith("/batch") else ANSWER_CAPTURE_BYTES

        async def observing_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                ctx.status = status
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (b"x-request-id", ctx.request_id.encode()),
                ]
            elif capture and message["type"] == "http.response.body" and len(captured) < limit:
                captured.extend(message.get("body", b"")[: limit - len(captured)])
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        finally:
            m = self.metrics
            labels = (route, method, str(status))
            m.requests.labels(*labels).inc()
            m.latency.labels(*labels).observe(time.perf_counter() - started)
            if capture:
                m.record_answer(method, route, status, bytes(captured))
            current_request.reset(token)
