"""Subprocess helpers: ports, polling with a deadline, stopping, JSON CLIs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.support.constants import REPO


class ProcessError(RuntimeError):
    """A helper's subprocess died, did not answer in time, or a CLI call failed."""


def free_port() -> int:
    """A port nothing listens on right now (another process may still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop_process(proc: subprocess.Popen[bytes] | None, grace: float = 15.0) -> int | None:
    """Terminate (if still running), wait ``grace`` seconds, then kill; the exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def wait_until_healthy(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout: float,
    describe: Callable[[], str],
    interval: float = 0.05,
) -> None:
    """Poll ``url`` until it answers 200; fail at once, with ``describe()``, if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ProcessError(f"process exited {proc.returncode}:\n{describe()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise ProcessError(f"{url} did not answer 200 within {timeout:.0f}s:\n{describe()}")


def run_module_json(module: str, *args: str, timeout: float = 900.0) -> Any:
    """``python -m module args...`` from the checkout; its JSON stdout, or ProcessError."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        check=False,
        cwd=REPO,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise ProcessError(
            f"{module} {' '.join(args)} exited {out.returncode}: {out.stderr.decode()}"
        )
    return json.loads(out.stdout)
