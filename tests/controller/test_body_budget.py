"""The process-wide bound on request body bytes held in memory
(``--max-buffered-body-bytes``, ``controller/api/limits.py``: BodyBudget).

A JSON body takes its bytes from the budget before it is read and gives them
back when its request is answered. One that does not fit waits, as long as a
body may wait for its next piece, for room; then it is answered 503
``server_busy`` with ``Retry-After`` (which fsagent's client honours). A body
alone always fits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from common.bridge import PREFIX
from common.errors import ServerBusy
from controller.api.limits import BodyBudget
from tests.support.bridge import Run, start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    bootstrap_tenant,
    private_controller,
)

KiB = 1024
BUDGET = 1024 * KiB
IDLE = 3.0


def test_budget_waits_for_room_then_refuses() -> None:
    async def scenario() -> None:
        budget = BodyBudget(100, wait=0.3)
        await budget.take(80)
        # Too much while 80 are held: waits, then ServerBusy.
        started = time.monotonic()
        with pytest.raises(ServerBusy):
            await budget.take(30)
        assert time.monotonic() - started >= 0.29
        assert budget.used == 80
        # A waiter gets its bytes as soon as they are given back.
        waiter = asyncio.create_task(budget.take(30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        budget.give(80)
        await asyncio.wait_for(waiter, 1)
        assert budget.used == 30
        budget.give(30)
        # A body larger than the whole budget fits when nothing is held.
        await budget.take(500)
        assert budget.used == 500
        budget.give(500)
        assert budget.used == 0

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def ctl(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    with private_controller(
        pg_cluster,
        "fsa-bodybudget-",
        "--max-buffered-body-bytes",
        str(BUDGET),
        "--body-idle-timeout",
        str(IDLE),
    ) as c:
        yield c


def padded_checkpoint(run: Run, size: int) -> bytes:
    """A checkpoint body of exactly ``size`` bytes that validation refuses
    (an unknown field) once it has been read and parsed."""
    head = {"operationId": str(uuid.uuid4()), "leaseEpoch": run.lease_epoch, "entries": []}
    base = len(json.dumps({**head, "pad": ""}).encode())
    return json.dumps({**head, "pad": "x" * (size - base)}).encode()


def post(run: Run, body: bytes | Iterator[bytes], length: int) -> httpx.Response:
    with httpx.Client(base_url=run.tenant.controller.url + PREFIX, timeout=120) as c:
        return c.post(
            "/folders/task/checkpoints",
            content=body,
            headers={
                "Authorization": f"Bearer {run.token}",
                "Content-Type": "application/json",
                "Content-Length": str(length),
            },
        )


class Trickle:
    """A body sent in 16 KiB pieces every 0.2 s (fast enough for the body
    rate rules) until :meth:`finish`, then the rest at once."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.done = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        while sent < len(self.body) - 16 * KiB and not self.done.is_set():
            yield self.body[sent : sent + 16 * KiB]
            sent += 16 * KiB
            self.done.wait(0.2)
        yield self.body[sent:]

    def finish(self) -> None:
        self.done.set()


def test_a_body_over_the_budget_waits_then_is_refused(ctl: ControllerProcess) -> None:
    tenant = bootstrap_tenant(ctl)
    holder, other = start_run(tenant), start_run(tenant)
    big = padded_checkpoint(holder, 900 * KiB)
    small = padded_checkpoint(other, 300 * KiB)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trickle = Trickle(big)
        held = pool.submit(post, holder, iter(trickle), len(big))
        # Until the trickling body holds its bytes, ``small`` is read at once
        # (and refused by validation); from then on it cannot fit.
        deadline = time.monotonic() + 60
        while True:
            assert not held.done(), held.result().text
            started = time.monotonic()
            r = post(other, small, len(small))
            if r.status_code == 503:
                break
            assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
            assert time.monotonic() < deadline
        assert r.json()["code"] == "server_busy"
        assert r.headers["retry-after"] == "1"
        assert time.monotonic() - started >= IDLE - 0.5  # it waited for room first

        # A body that waits while the holder's body completes gets its answer.
        waiting = pool.submit(post, other, small, len(small))
        # Unanswered for a second, well within its wait of IDLE seconds: it
        # is waiting for room (a body that fits is answered in milliseconds).
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=1.0)
        trickle.finish()
        first = held.result(timeout=60)
        assert first.status_code == 400 and first.json()["code"] == "validation_error"
        second = waiting.result(timeout=60)
        assert second.status_code == 400, second.text
        assert second.json()["code"] == "validation_error"

    # A body larger than the whole budget is read when it is alone.
    alone = padded_checkpoint(holder, BUDGET + 100 * KiB)
    r = post(holder, alone, len(alone))
    assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
