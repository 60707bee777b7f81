"""The embedded PostgreSQL's start while the server resets after one of its
processes was killed with -9: the postmaster lives (so it is not started
again), and until its crash recovery ends it closes or refuses connections.
``start`` used to fail on the first of them (``server closed the connection
unexpectedly``, seen by the lifecycle explorer after a ``pg_kill``), or took a
postmaster killed a moment ago for a live one and never started it; it now
asks again, and starts the server once it is gone, until the recovery's time
is up."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import psycopg

from controller.pgembed import DB_NAME, DB_USER, EmbeddedPostgres, EmbeddedPostgresError
from tests.support.controller import world_searchable_tmpdir


def children(pid: int) -> dict[int, str]:
    """Child pids of ``pid`` and their command lines."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            out[int(entry.name)] = cmdline
    return out


def wait_reaped(pid: int) -> None:
    """Wait until ``pid`` is gone from ``/proc`` (reaped by its parent, not a zombie)."""
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"pid {pid} was never reaped"
        time.sleep(0.01)


def test_start_waits_out_a_reset_after_a_child_was_killed() -> None:
    data = world_searchable_tmpdir("fsa-pgreset-")
    pg = EmbeddedPostgres(data)
    try:
        pg.start()
        postmaster = pg._postmaster_pid()
        assert postmaster is not None
        [checkpointer] = [p for p, cmd in children(postmaster).items() if "checkpointer" in cmd]
        for attempt in range(3):
            os.kill(checkpointer, signal.SIGKILL)  # the postmaster resets every process
            # Until the postmaster reaps the child it does not know of the
            # crash and still lets connections in: a start then would find a
            # database that answers, and the reset would only begin after it.
            wait_reaped(checkpointer)
            pg.start()  # running: no new server, and the database must answer
            url = f"postgresql://{DB_USER}@/{DB_NAME}?host={pg.sockdir}"
            with psycopg.connect(url, connect_timeout=30) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
            assert pg._postmaster_pid() == postmaster, attempt
            found = [p for p, cmd in children(postmaster).items() if "checkpointer" in cmd]
            assert found and found[0] != checkpointer
            checkpointer = found[0]
    finally:
        pg.stop()
        shutil.rmtree(data, ignore_errors=True)


def test_a_server_that_cannot_start_is_explained_by_its_log() -> None:
    """pg_ctl only says "could not start server, examine the log output": the
    error quotes the end of that log, which names the cause."""
    data = world_searchable_tmpdir("fsa-pgfail-")
    pg = EmbeddedPostgres(data)
    try:
        pg.init()
        with open(pg.pgdata / "postgresql.conf", "a") as conf:
            conf.write("\nshared_buffers = 'a lot'\n")
        try:
            pg.start()
        except EmbeddedPostgresError as exc:
            message = str(exc)
        else:
            raise AssertionError("a server with a broken configuration started")
        assert "could not start server" in message
        assert str(pg.logfile) in message
        assert 'invalid value for parameter "shared_buffers"' in message
        assert not pg.running()
    finally:
        pg.stop()
        shutil.rmtree(data, ignore_errors=True)
