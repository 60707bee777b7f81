"""A bridged call's audit row is written before its client can have the whole
answer: before the last byte a Content-Length promises, which a streamed
answer sends before the empty message that ends its body
(controller.api.apibridge._metered_send)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.api import apibridge


class Audit:
    def __init__(self, events: list[str], method: str = "GET") -> None:
        self.events = events
        self.request = type("Request", (), {"scope": {"method": method}})()

    async def __call__(self) -> None:
        if "audit" not in self.events:
            self.events.append("audit")


def run(messages: list[dict[str, Any]], method: str = "GET") -> list[str]:
    events: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        body = message.get("body")
        events.append(message["type"] if body is None else f"body {body!r}")

    async def main() -> None:
        meter = apibridge._Meter(response_limit=1 << 20)
        metered = apibridge._metered_send(send, meter, Audit(events, method))  # type: ignore[arg-type]
        for message in messages:
            await metered(message)

    asyncio.run(main())
    return events


def start(length: int | None) -> dict[str, Any]:
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    return {"type": "http.response.start", "status": 200, "headers": headers}


def body(data: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_streamed_answer_is_audited_before_its_last_promised_byte() -> None:
    events = run([start(5), body(b"abc", True), body(b"de", True), body(b"", False)])
    assert events == [
        "http.response.start",
        "body b'abc'",
        "audit",
        "body b'de'",
        "body b''",
    ]


@pytest.mark.parametrize("length", [None, 5])
def test_an_answer_in_one_message_is_audited_before_it(length: int | None) -> None:
    events = run([start(length), body(b"abcde", False)])
    assert events == ["http.response.start", "audit", "body b'abcde'"]


def test_an_answer_without_a_length_is_audited_before_its_end() -> None:
    events = run([start(None), body(b"abc", True), body(b"de", True), body(b"", False)])
    assert events == ["http.response.start", "body b'abc'", "body b'de'", "audit", "body b''"]


def test_a_head_is_audited_with_its_head() -> None:
    events = run([start(5), body(b"", False)], method="HEAD")
    assert events == ["audit", "http.response.start", "body b''"]
