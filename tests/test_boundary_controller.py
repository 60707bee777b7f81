"""Controller boundaries: the embedded PostgreSQL after a crash, and REST writes
that meet serialization failures and deadlocks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from controller.pgembed import EmbeddedPostgres
from tests.support.constants import REPO
from tests.support.controller import (
    ControllerProcess,
    Tenant,
    bootstrap_tenant,
    free_port,
    world_searchable_tmpdir,
)

OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture
def embedded_dir() -> Iterator[Path]:
    """A data dir for a controller with its own cluster; no process of it survives."""
    data = world_searchable_tmpdir("fsa-crash-")
    try:
        yield data
    finally:
        pg = EmbeddedPostgres(data)
        pg.stop()
        for pid in pg.leftover_processes():
            os.kill(pid, signal.SIGKILL)
        with_timeout(lambda: not pg.leftover_processes(), 20)
        shutil.rmtree(data, ignore_errors=True)


def with_timeout(ready: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)


def crash(ctl: ControllerProcess, *, freeze_one: bool = False) -> list[int]:
    """kill -9 the controller and its postmaster at once; the client backends' pids.

    ``freeze_one`` first stops (SIGSTOP) the first of them, so that it outlives any wait.
    """
    pg = EmbeddedPostgres(ctl.data_dir)
    postmaster = int((pg.pgdata / "postmaster.pid").read_text().split()[0])
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text()
    backends = [
        int(p)
        for p in children.split()
        if b"[local]" in Path(f"/proc/{p}/cmdline").read_bytes()  # not the checkpointer etc.
    ]
    if freeze_one:
        os.kill(backends[0], signal.SIGSTOP)
    assert ctl.proc is not None
    os.kill(ctl.proc.pid, signal.SIGKILL)
    os.kill(postmaster, signal.SIGKILL)
    ctl.proc.wait()
    with_timeout(lambda: not pg.running(), 10)  # dead, at most a zombie not yet reaped
    return backends


def put(t: Tenant, path: str, data: bytes) -> None:
    with t.client() as c:
        r = c.put(t.my_folder + "/content", params={"path": path}, content=data, headers=OCTET)
        assert r.status_code == 201, r.text


def read(t: Tenant, path: str) -> bytes:
    with t.client() as c:
        r = c.get(t.my_folder + "/content", params={"path": path})
        assert r.status_code == 200, r.text
        return r.content


def test_serve_recovers_embedded_postgres_killed_with_it(embedded_dir: Path) -> None:
    ctl = ControllerProcess(None, embedded_dir).start()
    try:
        t = bootstrap_tenant(ctl)
        put(t, "before-crash.txt", b"kept across kill -9")
        # One orphaned backend lingers for 2 s (busy, or slow to be scheduled):
        # it holds the old cluster's shared memory all that time.
        backends = crash(ctl, freeze_one=True)
    finally:
        ctl.stop()
    lingering = threading.Timer(2.0, os.kill, (backends[0], signal.SIGCONT))
    lingering.start()
    try:
        again = ControllerProcess(None, embedded_dir).start(timeout=90)
    finally:
        lingering.join()
    try:
        t2 = Tenant(again, t.company_id, t.user_id, t.token)
        assert read(t2, "before-crash.txt") == b"kept across kill -9"
        put(t2, "after-crash.txt", b"new")
        assert read(t2, "after-crash.txt") == b"new"
    finally:
        again.stop()
    assert not EmbeddedPostgres(embedded_dir).running()


def test_serve_gives_up_on_a_lingering_old_cluster_with_exit_3(embedded_dir: Path) -> None:
    ctl = ControllerProcess(None, embedded_dir).start()
    try:
        t = bootstrap_tenant(ctl)
        put(t, "kept.txt", b"kept")
        # A stopped backend outlives any wait: the start must give up, not hang or crash.
        backends = crash(ctl, freeze_one=True)
    finally:
        ctl.stop()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "controller.cli",
                "serve",
                "--data-dir",
                str(embedded_dir),
                "--listen",
                f"127.0.0.1:{free_port()}",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "CONTROLLER_PG_RECOVERY_WAIT": "1"},
            timeout=60,
            check=False,
        )
    finally:
        os.kill(backends[0], signal.SIGCONT)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "still running" in lines[0] and str(backends[0]) in lines[0]
    assert "Traceback" not in proc.stderr
    # Once it is gone, the next start recovers.
    again = ControllerProcess(None, embedded_dir).start(timeout=90)
    try:
        assert read(Tenant(again, t.company_id, t.user_id, t.token), "kept.txt") == b"kept"
    finally:
        again.stop()


def test_stale_postmaster_pid_of_a_live_other_process(embedded_dir: Path) -> None:
    """The old postmaster's PID now belongs to an unrelated process."""
    ctl = ControllerProcess(None, embedded_dir).start()
    try:
        t = bootstrap_tenant(ctl)
        put(t, "kept.txt", b"kept")
        crash(ctl)
    finally:
        ctl.stop()
    pg = EmbeddedPostgres(embedded_dir)
    with_timeout(lambda: not pg.leftover_processes(), 20)
    other = subprocess.Popen(["sleep", "60"])
    try:
        lock = pg.pgdata / "postmaster.pid"
        lines = lock.read_text().split("\n")
        lock.write_text("\n".join([str(other.pid), *lines[1:]]))
        assert not pg.running()
        again = ControllerProcess(None, embedded_dir).start(timeout=90)
        try:
            assert read(Tenant(again, t.company_id, t.user_id, t.token), "kept.txt") == b"kept"
        finally:
            again.stop()
    finally:
        other.kill()
        other.wait()


def test_admin_command_recovers_embedded_postgres_killed_with_it(
    embedded_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`controller admin` right after a crash recovers the same way, and says so."""
    ctl = ControllerProcess(None, embedded_dir).start()
    try:
        boot = ctl.admin("bootstrap", "--email", "crash-admin@example.com")
        crash(ctl)
    finally:
        ctl.stop()
    code, _, err = ctl.cli("admin", "create-user", "after-crash@example.com")
    assert code == 0, err
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "embedded PostgreSQL was not shut down cleanly; it recovers now"
    ]
    pg = EmbeddedPostgres(embedded_dir)
    assert not pg.running()  # the admin command stopped the cluster it started
    pg.start()
    try:
        with psycopg.connect(pg.url) as conn:
            emails = {r[0] for r in conn.execute("SELECT email FROM users")}
        assert emails == {"crash-admin@example.com", "after-crash@example.com"}
        assert boot["user_id"]
    finally:
        pg.stop()
