"""A test that outlives its time must end, and say why.

pytest-timeout ends a test that runs too long by exiting its worker. Two
kinds of hang defeat that. A thread waiting in the kernel on a FUSE mount
whose daemon has read the request but never answers cannot be interrupted,
and the worker cannot exit around it. A Playwright call without a timeout
of its own (``evaluate``, ``keyboard``) waits on the browser forever, and
under xdist the ended worker's test is then run again and the run waits
with no worker (the Makefile passes ``--max-worker-restart=0`` against
that). Either way the report is lost: while a test runs, the worker's fd 2
is pytest's capture file. Sixty seconds before the test's timeout (the
marker's, else ``--timeout``, else the ini file's; 0 means none), this
watchdog:

1. writes to the worker's real stderr which test it is, every thread's
   stack (``faulthandler``, which needs no lock the stuck thread may hold),
   the stack of each suspended greenlet (Playwright parks the test in one),
   and every process below the worker with its state and kernel wait channel;
2. aborts the FUSE connections of the mounts below the session's temp root
   (``/sys/fs/fuse/connections/N/abort``): a wait on such a mount returns
   ``ECONNABORTED`` or ``ENOTCONN``, by kernel version;
3. ends the browser processes below the worker: a pending Playwright call
   fails.

The test then fails and its teardown runs; pytest-timeout still ends the
worker if it does not. The watchdog runs in a thread of its own, which
waits on nothing the test can hold.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Generator
from pathlib import Path

import pytest

from tests.support.tmp import mount_entries

MARGIN = 60.0
"""Seconds before the test's pytest-timeout that the watchdog acts."""

_lock = threading.Lock()
_current: tuple[str, float, float] | None = None
"""(node id, start time, seconds it may run) of the test running now."""


def _limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        seconds = float(marker.args[0])
    else:  # --timeout (0: none), else the ini file's
        given = item.config.getoption("timeout", None)
        seconds = float(item.config.getini("timeout") or 0) if given is None else float(given)
    return max(seconds - MARGIN, seconds / 2) if seconds > 0 else 0.0


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    global _current
    with _lock:
        _current = (item.nodeid, time.monotonic(), _limit(item))
    try:
        return (yield)
    finally:
        with _lock:
            _current = None


def pytest_configure(config: pytest.Config) -> None:
    threading.Thread(target=_watch, args=(config,), name="test-watchdog", daemon=True).start()


def _watch(config: pytest.Config) -> None:
    handled: str | None = None
    while True:
        time.sleep(2.0)
        with _lock:
            current = _current
        if current is None:
            continue
        nodeid, started, limit = current
        key = f"{nodeid}@{started}"
        if not limit or key == handled or time.monotonic() - started < limit:
            continue
        handled = key
        _act(config, nodeid, time.monotonic() - started)


def _terminal_fd(config: pytest.Config) -> int:
    """The worker's real stderr: while a test runs, pytest's capture has fd 2
    pointing at a temp file that nobody reads if the worker is ended."""
    capman = config.pluginmanager.getplugin("capturemanager")
    err = getattr(getattr(capman, "_global_capturing", None), "err", None)
    saved = getattr(err, "targetfd_save", None)
    return saved if isinstance(saved, int) else 2


def _act(config: pytest.Config, nodeid: str, seconds: float) -> None:
    fd = _terminal_fd(config)

    def say(line: str) -> None:
        os.write(fd, f"watchdog: {line}\n".encode(errors="replace"))

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    say(f"{nodeid} has run {seconds:.0f}s ({worker}, pid {os.getpid()}); its stacks:")
    faulthandler.dump_traceback(file=fd, all_threads=True)
    for stack in greenlet_stacks():
        say("a suspended greenlet (a Playwright call waits in it):")
        os.write(fd, stack.encode(errors="replace"))
    below = processes_below(os.getpid())
    for pid, state, wchan, cmd in below:
        say(f"  {pid} {state} {wchan} {cmd[:200]}")
    from tests.support.session import session_temp_root

    control = Path("/sys/fs/fuse/connections")
    if control.is_dir() and not os.path.ismount(control):  # the FUSE control fs
        subprocess.run(["mount", "-t", "fusectl", "none", str(control)], capture_output=True)
    for point, fstype, conn in mount_entries(session_temp_root(config)):
        if not fstype.startswith("fuse"):
            continue
        say(f"aborting the FUSE connection of {point}")
        try:
            Path(f"/sys/fs/fuse/connections/{conn}/abort").write_text("1")
        except OSError as exc:
            say(f"  could not: {exc}")
    # A Playwright call without a timeout of its own (evaluate, keyboard)
    # waits on the browser forever: ended, the browser fails the call.
    for pid, _, _, cmd in below:
        if "chrom" in cmd.split(" ", 1)[0]:
            say(f"ending the browser process {pid}")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def greenlet_stacks() -> list[str]:
    """The stacks of suspended greenlets: Playwright's sync API runs the test
    in one, parked while its event loop waits for the browser, so the thread
    stacks show only the loop."""
    try:
        import greenlet
    except ImportError:
        return []
    stacks = []
    for obj in gc.get_objects():
        if isinstance(obj, greenlet.greenlet) and obj.gr_frame is not None:
            stacks.append("".join(traceback.format_stack(obj.gr_frame)))
    return stacks


def processes_below(root: int) -> list[tuple[int, str, str, str]]:
    """Every process below ``root``: pid, state, kernel wait channel, command line."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    below, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        below += kids
        frontier += kids
    lines = []
    for pid in below:
        proc = Path(f"/proc/{pid}")
        try:
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            wchan = (proc / "wchan").read_text() or "-"
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        lines.append((pid, state, wchan, cmd))
    return lines
