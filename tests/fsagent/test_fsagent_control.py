"""fsagent's daemon boundaries: the control socket (made once there is room
when the disk is full at start), daemonizing from code, and ``Retry-After``
on the bridge client's retries."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from fsagent.bridge.http import RETRY_AFTER_MAX, HttpBridgeClient, parse_retry_after
from fsagent.control.protocol import MAX_REQUEST, BadRequest, exchange, parse_request, request
from fsagent.control.server import ControlSocket
from tests.support.constants import REPO
from tests.support.controller import Tenant
from tests.support.mount import MountFactory, is_mounted
from tests.system.test_checkpoints import flush, server_files, start_run, token_file

JUNK = [
    b"[]\n",
    b"not json\n",
    b"\xff\xfe\n",
    b'{"cmd": "explode"}\n',
    b'{"final": "yes"}\n',
    b'{"final": false, "extra": 1}\n',
    b"7\n",
    b"x" * (MAX_REQUEST * 25) + b"\n",
]


@pytest.mark.parametrize("raw", JUNK, ids=lambda r: repr(r[:20]))
def test_parse_request_refuses_junk(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_request(raw)


def test_parse_request_accepts_the_protocol() -> None:
    assert parse_request(b"") == ("flush", False)
    assert parse_request(b'{"final": true}\n') == ("flush", True)
    assert parse_request(b'{"cmd": "ping"}\n') == ("ping", False)


def ask(sock_path: Path, raw: bytes, *, read: bool = True) -> dict[str, Any] | None:
    reply = exchange(sock_path, raw, 30, read=read)
    return json.loads(reply) if read else None


@pytest.mark.fuse
def test_bad_control_requests_get_an_error_and_the_daemon_keeps_serving(
    mounts: MountFactory, tenant: Tenant
) -> None:
    run = start_run(tenant)
    m = mounts.mount(tenant.controller.url, scope="task", token_file=token_file(mounts, run))
    (m.mountpoint / "before.txt").write_bytes(b"written before the junk")
    sock_path = m.state_dir / "control.sock"
    for raw in JUNK:
        reply = ask(sock_path, raw)
        assert reply is not None and reply["ok"] is False, raw[:20]
        assert reply["code"] == "bad_request", reply
    ask(sock_path, b"[]\n", read=False)  # hangs up before the answer
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(sock_path))  # and one that says nothing at all
    assert ask(sock_path, b'{"cmd": "ping"}\n') == {"ok": True}
    assert is_mounted(m.mountpoint) and m.proc is not None and m.proc.poll() is None
    result = flush(m)
    assert result["ok"] is True
    assert server_files(tenant, "task", run["task"]) == {"before.txt": b"written before the junk"}
    assert m.fsagent("status")["collections"][0]["state"] == "mounted"
    (m.mountpoint / "after.txt").write_bytes(b"saved by the final save")
    assert m.signal(signal.SIGTERM) == 0
    files = server_files(tenant, "task", run["task"])
    assert files == {
        "before.txt": b"written before the junk",
        "after.txt": b"saved by the final save",
    }


@pytest.mark.fuse
def test_main_daemonizes_the_argv_it_was_given(mounts: MountFactory) -> None:
    """main(argv=[...]) called from code must start that command, not sys.argv's."""
    source = mounts.source({"agent": {"hello.txt": b"hi"}})
    mountpoint = mounts.base / "daemonized"
    mountpoint.mkdir()
    state_dir = mounts.base / "daemonized-state" / "agent"
    argv = ["mount", "agent", str(mountpoint), "--controller", f"dir:{source}",
            "--state-dir", str(state_dir)]  # fmt: skip
    code = (
        "import sys\n"
        "from fsagent.cli import main\n"
        "sys.argv = ['embedding-program', 'status', '--json']\n"
        f"sys.exit(main({argv!r}))\n"
    )
    pid = None
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr + done.stdout
        assert is_mounted(mountpoint)
        pid = int(json.loads((state_dir / "daemon.json").read_text())["pid"])
        assert (mountpoint / "hello.txt").read_bytes() == b"hi"
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                       capture_output=True)  # fmt: skip
        if pid is None and (state_dir / "daemon.json").exists():
            pid = int(json.loads((state_dir / "daemon.json").read_text())["pid"])
        if pid is not None:
            _wait_gone(pid)


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


# --- the control socket on a full disk ----------------------------------------


class RefusedBinds:
    """``socket.socket.bind`` refused with ``error`` while ``full`` (counting
    the refusals), the real bind once it is not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: int = errno.ENOSPC) -> None:
        self.error, self.full, self.refused = error, True, 0
        self.tried_again: trio.Event | None = None
        """Set at the fifth refusal, if made (in trio.run)."""
        real = socket.socket.bind

        def bind(sock: socket.socket, address: Any) -> None:
            if self.full:
                self.refused += 1
                if self.refused == 5 and self.tried_again is not None:
                    self.tried_again.set()
                raise OSError(self.error, os.strerror(self.error))
            real(sock, address)

        monkeypatch.setattr(socket.socket, "bind", bind)


async def no_flush(final: bool) -> dict[str, Any]:
    return {"ok": True, "result": {"operationId": None}, "final": final}


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{condition} still false after {timeout}s"
        time.sleep(0.01)


def control_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "fsagent.controlserver" and r.levelno >= logging.WARNING]  # fmt: skip


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT])
def test_a_control_socket_a_full_disk_refuses_is_made_once_there_is_room(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: int,
) -> None:
    """The daemon starts without its socket (a stale one of a crashed run
    removed), one warning says so, the bind is tried again quietly, and once
    there is room the socket answers; at stop it is removed."""
    path = tmp_path / "control.sock"
    path.write_bytes(b"")  # what a kill -9 left
    binds = RefusedBinds(monkeypatch, error)
    control = ControlSocket(path, retry=0.02)
    assert binds.refused == 1
    assert not path.exists()
    assert os.listdir(tmp_path) == []  # nor its temporary name
    assert len(control_warnings(caplog)) == 1
    assert "`fsagent flush` and `fsagent status` cannot reach" in control_warnings(caplog)[0]
    answers: list[dict[str, Any]] = []

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            binds.tried_again = trio.Event()
            nursery.start_soon(control.serve, no_flush, lambda: {"queueDepth": 7})
            with trio.fail_after(30):
                await binds.tried_again.wait()
            assert not path.exists()
            binds.full = False
            await trio.to_thread.run_sync(wait_for, path.exists)
            for body in ({"cmd": "ping"}, {"cmd": "stats"}, {"cmd": "flush"}):
                answers.append(await trio.to_thread.run_sync(request, path, body, 30.0))
            nursery.cancel_scope.cancel()

    try:
        trio.run(scenario)
    finally:
        control.close()
    assert answers == [
        {"ok": True},
        {"ok": True, "queueDepth": 7},
        {"ok": True, "result": {"operationId": None}, "final": False},
    ]
    assert not path.exists()
    assert os.listdir(tmp_path) == []
    warnings = control_warnings(caplog)
    assert len(warnings) == 2, warnings  # one when refused, one when made: none per try
    assert warnings[1].startswith(f"made the control socket {path}")


def test_a_stop_while_the_control_socket_waits_for_room_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Cancelled while still refused: the wait ends at once and leaves no file."""
    path = tmp_path / "control.sock"
    binds = RefusedBinds(monkeypatch)
    control = ControlSocket(path, retry=3600)

    async def scenario() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(control.serve, no_flush, None)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()

    trio.run(scenario)
    control.close()
    assert binds.refused == 1
    assert os.listdir(tmp_path) == []
    assert len(control_warnings(caplog)) == 1


@pytest.mark.parametrize("error", [errno.EACCES, errno.EADDRINUSE, errno.ENAMETOOLONG])
def test_a_control_socket_error_other_than_a_full_disk_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    RefusedBinds(monkeypatch, error)
    with pytest.raises(OSError) as refused:
        ControlSocket(tmp_path / "control.sock")
    assert refused.value.errno == error
    assert os.listdir(tmp_path) == []


# --- Retry-After -------------------------------------------------------------

RUN = {"runId": "r", "companyId": "c", "agentId": "a", "leaseEpoch": 1, "active": True,
       "bindings": {"task": None, "agent": "a", "user": None, "project": None}}  # fmt: skip


def retried_run_after(status: int, retry_after: str) -> tuple[float, int]:
    """Virtual seconds a get_run took when the first answer is ``status`` with that header."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return httpx.Response(status, headers={"Retry-After": retry_after})
        return httpx.Response(200, json=RUN)

    async def main() -> float:
        client = HttpBridgeClient(
            "http://ctl", "tok", retry_deadline=300, transport=httpx.MockTransport(handler)
        )
        try:
            start = trio.current_time()
            await client.get_run()
            return trio.current_time() - start
        finally:
            await client.aclose()

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return elapsed, calls


@pytest.mark.parametrize("status", [429, 503])
def test_retries_wait_as_long_as_retry_after_says(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    elapsed, calls = retried_run_after(status, "7")
    assert calls == 2 and 7 <= elapsed < 7.5


def test_retry_after_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    elapsed, calls = retried_run_after(503, "86400")
    assert calls == 2 and elapsed == pytest.approx(RETRY_AFTER_MAX, abs=0.5)


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("3") == 3
    now = 1_000_000_000.0  # 2001-09-09T01:46:40Z
    assert parse_retry_after("Sun, 09 Sep 2001 01:46:50 GMT", now=now) == 10
    assert parse_retry_after("Sun, 09 Sep 2001 01:40:00 GMT", now=now) == 0
