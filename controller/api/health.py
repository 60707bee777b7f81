"""Liveness (``/healthz``) and readiness (``/readyz``) for load balancers and supervisors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controller.api.common import state
from controller.db import ping

READY_TIMEOUT = 5.0
"""Seconds each dependency gets to answer a readiness probe."""


async def healthz(request: Request) -> Response:
    """The process is up and serving; touches no dependency, so a database
    outage does not make a supervisor restart every replica."""
    return JSONResponse({"ok": True})


async def _database(request: Request) -> None:
    async with state(request).pool.connection() as conn:
        await ping(conn)


async def _storage(request: Request) -> None:
    await asyncio.to_thread(state(request).storage.check)


async def _probe(check: Callable[[], Awaitable[None]]) -> str | None:
    """None when the check passes, else a one-line reason."""
    try:
        await asyncio.wait_for(check(), READY_TIMEOUT)
    except TimeoutError:
        return f"no answer within {READY_TIMEOUT:g}s"
    except Exception as exc:  # any failure means not ready; the reason is reported
        return " ".join(str(exc).split()) or type(exc).__name__
    return None


async def readyz(request: Request) -> Response:
    """200 when the database and object storage both answer, else 503 naming what failed."""
    results = await asyncio.gather(
        _probe(lambda: _database(request)), _probe(lambda: _storage(request))
    )
    reasons = dict(zip(("database", "storage"), results, strict=True))
    checks = {name: reason or "ok" for name, reason in reasons.items()}
    failing = [name for name, reason in reasons.items() if reason is not None]
    if failing:
        return JSONResponse(
            {
                "ok": False,
                "code": "not_ready",
                "error": "Not ready: " + ", ".join(failing),
                "failing": failing,
                "checks": checks,
            },
            status_code=503,
        )
    return JSONResponse({"ok": True, "checks": checks})


routes = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
]
