"""Stop signals caught while ``fsagent up`` is still importing.

``python -m fsagent.cli up`` spends a few hundred milliseconds importing
before :class:`fsagent.commands.up.StopRequest` exists (366 ms at the median on a
busy 2-core machine), and a SIGTERM then would kill it by the default
action: exit -15 and no clean stop. ``fsagent.cli`` calls :func:`install`
before its other imports, so from there on a stop signal is only recorded,
and :class:`~fsagent.commands.up.StopRequest` takes it over (:func:`take`) once its
own handlers are in place. Only the interpreter's own start-up remains
before any handler can exist; nothing of ``up`` has started then.

This module imports nothing of fsagent's: it must load first, and fast.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_caught: int | None = None


def _record(signum: int, frame: FrameType | None) -> None:
    global _caught
    if _caught is None:
        _caught = signum


def handle(handler: Callable[[int, FrameType | None], None]) -> None:
    """``handler`` for every stop signal. SIGINT and SIGHUP inherited as
    ignored (``nohup``, a background job of a script) stay ignored."""
    for signum in SIGNALS:
        if signum != signal.SIGTERM and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        signal.signal(signum, handler)


def install(argv: list[str]) -> None:
    """Record stop signals from now on, if ``argv`` runs ``up``."""
    if argv[1:2] == ["up"]:
        handle(_record)


def take() -> int | None:
    """The first stop signal recorded before ``up``'s own handlers, if any."""
    return _caught
