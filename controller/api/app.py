"""The ASGI application: routes, error answers and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from common.errors import WorkFolderError
from controller import gc
from controller.api import (
    agents,
    apibridge,
    attachments,
    audit,
    health,
    invitations,
    openapi,
    orgs,
    repobridge,
    runs,
    taskrepos,
    web,
    workfolders,
)
from controller.api.common import AppState, error_response
from controller.api.limits import RequestLimits
from controller.config import Settings
from controller.db import make_pool
from controller.metrics import Metrics, Observe
from controller.storage.base import StorageProvider

log = logging.getLogger(__name__)


async def openapi_json(request: Request) -> Response:
    return JSONResponse(openapi.document())


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "route_not_found", 405: "method_not_allowed"}
    return JSONResponse(
        {"error": exc.detail, "code": codes.get(exc.status_code, "http_error")},
        status_code=exc.status_code,
    )


async def project_error(request: Request, exc: Exception) -> Response:
    """A project error raised outside a ``json_errors`` handler (e.g. a body timeout)."""
    assert isinstance(exc, WorkFolderError)
    return error_response(exc)


async def unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"error": "Internal error", "code": "internal_error"}, status_code=500)


def app_routes() -> list[BaseRoute]:
    from controller.api import bridge

    return [
        Route("/openapi.json", openapi_json, methods=["GET"]),
        *health.routes,
        *workfolders.routes,
        *bridge.routes,
        *repobridge.routes,
        *taskrepos.routes,
        *apibridge.routes,
        *audit.routes,
        *orgs.routes,
        *invitations.routes,
        *runs.routes,
        *agents.routes,
        *attachments.routes,
        *web.routes,
    ]


def bridge_policy(settings: Settings, routes: list[BaseRoute]) -> apibridge.BridgePolicy:
    """The API bridge's allowlist resolved against ``routes``; ValueError for an
    entry that names no API route (``controller serve`` checks it before starting)."""
    return apibridge.BridgePolicy.build(routes, settings.bridge, settings.max_file_bytes)


def create_app(settings: Settings, storage: StorageProvider, *, run_gc: bool = True) -> Starlette:
    routes = app_routes()
    policy = bridge_policy(settings, routes)
    database_url = settings.database_url
    assert database_url is not None
    q = settings.quotas
    pool = make_pool(
        database_url,
        max_size=q.pool_size,
        share_size=q.pool_share,
        statement_timeout=q.statement_timeout,
    )
    settings.spool_dir.mkdir(parents=True, exist_ok=True)
    # Spool files only live during one request; any found now were left by a
    # process that died mid-upload (one controller per data dir).
    for stale in settings.spool_dir.iterdir():
        stale.unlink(missing_ok=True)

    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool.open(wait=True, timeout=30)
        metrics.attach(pool)
        sweeper = None
        if run_gc and settings.gc_interval_seconds > 0:
            sweeper = asyncio.create_task(
                gc.run_sweeper(
                    pool,
                    storage,
                    settings.gc_interval_seconds,
                    metrics.sweep_done,
                    upload_grace=settings.gc_upload_grace,
                )
            )
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            await pool.close()

    app = Starlette(
        routes=routes,
        exception_handlers={
            HTTPException: http_error,
            WorkFolderError: project_error,
            Exception: unexpected_error,
        },
        middleware=[
            Middleware(Observe, metrics=metrics, routes=routes),
            Middleware(RequestLimits, limits=settings.limits),
        ],
        lifespan=lifespan,
    )
    app.state.workfolders = AppState(settings=settings, pool=pool, storage=storage)
    app.state.apibridge = policy
    app.state.metrics = metrics
    return app
