"""The polling window after a request adapts to how far apart requests are."""

from __future__ import annotations

import pytest

from fsagent.fuse import glue as fuseglue
from fsagent.fuse.glue import Spinner

US = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(fuseglue.time, "perf_counter_ns", c)
    return c


def requests(spinner: Spinner, clock: Clock, gap_us: int, n: int) -> list[int]:
    windows = []
    for _ in range(n):
        clock.now += gap_us * US
        spinner.poke()
        windows.append(spinner.window_ns // US)
    return windows


def test_the_window_grows_until_it_catches_the_next_request(clock: Clock) -> None:
    s = Spinner(100 * US)
    assert requests(s, clock, 1_000_000, 1) == [50]  # after a long idle: halved
    assert requests(s, clock, 30, 3) == [50, 50, 50]  # caught: stays
    assert requests(s, clock, 70, 3) == [100, 100, 100]  # missed by a little: grows
    assert requests(s, clock, 150, 1) == [50]  # beyond the longest window: shrinks


def test_sparse_requests_stop_polling_and_a_burst_brings_it_back(clock: Clock) -> None:
    s = Spinner(100 * US)
    assert requests(s, clock, 400, 4) == [50, 25, 0, 0]  # polling would only burn CPU
    # A burst: each request comes after the (shorter) window ended, but soon
    # enough that a longer window would have caught it.
    assert requests(s, clock, 40, 4) == [25, 50, 50, 50]


def test_zero_disables(clock: Clock) -> None:
    s = Spinner(0)
    assert requests(s, clock, 10, 3) == [0, 0, 0]
