"""The boundary of every FUSE handler: errno mapping and the request spinner."""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final, ParamSpec, TypeVar

import pyfuse3
import trio

from common.errors import InvalidPath

log = logging.getLogger("fsagent.fs")

_P = ParamSpec("_P")
_R = TypeVar("_R")

# OSError numbers that mean something to the caller and pass through as-is;
# anything else from the local disk is an internal failure (EIO).
_PASS_THROUGH: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class Spinner:
    """Keep the trio loop polling for a short window after each request.

    A round trip to the daemon costs two wake-ups: the daemon's when the
    request arrives and the caller's when the reply does.  On virtual machines
    an idle vCPU halts, and waking it costs tens of microseconds, more than
    most handlers.  Agents often issue requests back to back (a ``git status``
    stats every file), so after a request the loop keeps polling /dev/fuse
    for a while before it sleeps: the next request is picked up at once.

    The window adapts, like the kernel's guest halt-polling: when a request
    arrives after the window ended but within ``max_ns`` of the previous one,
    a longer window would have caught it, so it doubles (up to ``max_ns``);
    when requests are further apart than ``max_ns``, polling is wasted CPU,
    so it halves, down to nothing.  ``max_ns=0`` disables polling.
    """

    GROW_START_NS: Final = 25_000

    def __init__(self, max_ns: int) -> None:
        self.max_ns = max_ns
        self.window_ns = max_ns
        self._last = 0
        self._wake = trio.Event()

    def poke(self) -> None:
        now = time.perf_counter_ns()
        idle = now - self._last
        if idle > self.window_ns:  # the loop had gone to sleep
            if idle <= self.max_ns:
                self.window_ns = min(self.max_ns, max(2 * self.window_ns, self.GROW_START_NS))
            else:
                self.window_ns //= 2
                if self.window_ns < self.GROW_START_NS:
                    self.window_ns = 0
        self._last = now
        if not self._wake.is_set():
            self._wake.set()

    async def run(self) -> None:
        if self.max_ns <= 0:
            return
        clock = time.perf_counter_ns
        checkpoint = trio.lowlevel.checkpoint
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while clock() - self._last < self.window_ns:
                await checkpoint()


def fuse_boundary(
    fn: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """Let only FUSEError out of a handler: log anything else once, answer EIO."""

    @functools.wraps(fn)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        args[0].spinner.poke()  # type: ignore[attr-defined]
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            if exc.errno in _PASS_THROUGH:
                raise pyfuse3.FUSEError(exc.errno) from None
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def fuse_err(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)


def name_errno(exc: InvalidPath) -> int:
    if exc.reason == "reserved_segment":
        return errno.EPERM
    if exc.reason == "segment_too_long":
        return errno.ENAMETOOLONG
    return errno.EINVAL
