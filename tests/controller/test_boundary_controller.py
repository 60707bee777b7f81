"""Controller boundaries: the embedded PostgreSQL after a crash, and REST writes
that meet serialization failures and deadlocks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest

from controller.db import retry
from controller.pgembed import EmbeddedPostgres
from tests.support.bridge import start_run
from tests.support.constants import REPO
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    free_port,
    world_searchable_tmpdir,
)

OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def embedded_template() -> Iterator[Path]:
    """The ``pg`` directory of a data dir whose embedded cluster one clean
    `controller serve` initialized and migrated, then stopped (no rows, no
    lock left). Each crash test's data dir starts as a copy of it: initdb and
    the migrations run once per module; what each test kills and recovers is
    its own cluster."""
    data = world_searchable_tmpdir("fsa-crash-tpl-")
    try:
        ControllerProcess(None, data).start().stop()
        pg = EmbeddedPostgres(data)
        pg.stop()  # a no-op after the clean stop above
        assert pg.initialized() and not (pg.pgdata / "postmaster.pid").exists()
        yield data / "pg"
    finally:
        EmbeddedPostgres(data).stop()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def embedded_dir(embedded_template: Path) -> Iterator[Path]:
    """A data dir for a controller with its own cluster (a copy of the
    module's cleanly stopped one); no process of it survives."""
    data = world_searchable_tmpdir("fsa-crash-")
    try:
        # -a keeps the postgres user's ownership and the 0700 modes.
        subprocess.run(["cp", "-a", str(embedded_template), str(data / "pg")], check=True)
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


def _cmdline(pid: str) -> bytes:
    """A process's command line; empty once it has exited (a backend whose
    client just disconnected may be gone between listing and reading)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def crash(ctl: ControllerProcess, *, freeze_one: bool = False) -> list[int]:
    """kill -9 the controller and its postmaster at once; the client backends' pids.

    ``freeze_one`` first stops (SIGSTOP) the first of them, so that it outlives any wait.
    """
    pg = EmbeddedPostgres(ctl.data_dir)
    postmaster = int((pg.pgdata / "postmaster.pid").read_text().split()[0])
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text()
    backends = [
        int(p) for p in children.split() if b"[local]" in _cmdline(p)
    ]  # not the checkpointer etc.
    if freeze_one:
        os.kill(backends[0], signal.SIGSTOP)
    assert ctl.proc is not None
    os.kill(ctl.proc.pid, signal.SIGKILL)
    os.kill(postmaster, signal.SIGKILL)
    ctl.proc.wait()
    with_timeout(lambda: not pg.running(), 10)  # dead, at most a zombie not yet reaped
    return backends


def put(t: Tenant, path: str, data: bytes) -> None:
    r = put_answer(t, path, data)
    assert r.status_code == 201, r.text


def put_answer(t: Tenant, path: str, data: bytes) -> httpx.Response:
    with t.client() as c:
        return c.put(t.my_folder + "/content", params={"path": path}, content=data, headers=OCTET)


def read(t: Tenant, path: str) -> bytes:
    with t.client() as c:
        r = c.get(t.my_folder + "/content", params={"path": path})
        assert r.status_code == 200, r.text
        return r.content


def write_and_crash(data: Path, *, freeze_one: bool = False) -> tuple[Tenant, list[int]]:
    """Serve with an embedded cluster, save ``kept.txt``, then :func:`crash`."""
    ctl = ControllerProcess(None, data).start()
    try:
        t = bootstrap_tenant(ctl)
        put(t, "kept.txt", b"kept across kill -9")
        return t, crash(ctl, freeze_one=freeze_one)
    finally:
        ctl.stop()


@contextlib.contextmanager
def serving_again(data: Path, t: Tenant) -> Iterator[Tenant]:
    """Serve the data dir again; ``t``'s company and owner, on the new controller."""
    again = ControllerProcess(None, data).start(timeout=90)
    try:
        t2 = Tenant(again, t.company_id, t.user_id, t.token)
        assert read(t2, "kept.txt") == b"kept across kill -9"
        yield t2
    finally:
        again.stop()


def test_serve_recovers_embedded_postgres_killed_with_it(embedded_dir: Path) -> None:
    # One orphaned backend lingers for 2 s (busy, or slow to be scheduled):
    # it holds the old cluster's shared memory all that time.
    t, backends = write_and_crash(embedded_dir, freeze_one=True)
    lingering = threading.Timer(2.0, os.kill, (backends[0], signal.SIGCONT))
    lingering.start()
    try:
        with serving_again(embedded_dir, t) as t2:
            put(t2, "after-crash.txt", b"new")
            assert read(t2, "after-crash.txt") == b"new"
    finally:
        lingering.join()
    assert not EmbeddedPostgres(embedded_dir).running()


def test_serve_gives_up_on_a_lingering_old_cluster_with_exit_3(embedded_dir: Path) -> None:
    # A stopped backend outlives any wait: the start must give up, not hang or crash.
    t, backends = write_and_crash(embedded_dir, freeze_one=True)
    try:
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "controller.cli", "serve"),
                *("--data-dir", str(embedded_dir), "--listen", f"127.0.0.1:{free_port()}"),
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
    with serving_again(embedded_dir, t):
        pass


@pytest.mark.parametrize("owner", ["unrelated process", "another cluster's postmaster"])
def test_stale_postmaster_pid_reused_by_a_live_process(
    embedded_dir: Path, pg_cluster: PgCluster, owner: str
) -> None:
    """The old postmaster's PID now belongs to another process, even a postgres."""
    t, _ = write_and_crash(embedded_dir)
    pg = EmbeddedPostgres(embedded_dir)
    with_timeout(lambda: not pg.leftover_processes(), 20)
    other = subprocess.Popen(["sleep", "60"]) if owner == "unrelated process" else None
    try:
        pid = (
            other.pid
            if other
            else int(pg_cluster.pg.pgdata.joinpath("postmaster.pid").read_text().split()[0])
        )
        lock = pg.pgdata / "postmaster.pid"
        lines = lock.read_text().split("\n")
        lock.write_text("\n".join([str(pid), *lines[1:]]))
        assert not pg.running()
        with serving_again(embedded_dir, t):
            pass
    finally:
        if other:
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


# --- REST and checkpoint writes that PostgreSQL rolls back -------------------

FORCED_CONFLICTS = """
CREATE TABLE forced_conflicts (sqlstate text NOT NULL, times integer NOT NULL);
CREATE SEQUENCE forced_conflict_tries;
-- Counts each transaction that writes a file row once; the first `times` of
-- them fail with `sqlstate`, as PostgreSQL itself would fail them.
CREATE FUNCTION forced_conflict() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    plan forced_conflicts%ROWTYPE;
BEGIN
    SELECT * INTO plan FROM forced_conflicts LIMIT 1;
    IF FOUND AND current_setting('forced.counted', true) IS DISTINCT FROM 'yes' THEN
        PERFORM set_config('forced.counted', 'yes', true);
        IF nextval('forced_conflict_tries') <= plan.times THEN
            RAISE EXCEPTION 'forced %', plan.sqlstate USING ERRCODE = plan.sqlstate;
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER forced_conflict BEFORE INSERT OR UPDATE ON files
    FOR EACH ROW EXECUTE FUNCTION forced_conflict();
"""


@pytest.fixture(scope="module")
def conflicted(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    """A controller whose database runs every transaction SERIALIZABLE (so
    concurrent writers really conflict) and can be told to fail file writes."""
    url = pg_cluster.create_database()
    name = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    with psycopg.connect(pg_cluster.admin_url(), autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = 'serializable'")
    ctl = ControllerProcess(url, world_searchable_tmpdir("fsa-conflict-")).start()
    try:
        with ctl.db() as conn:
            conn.execute(FORCED_CONFLICTS)
        yield ctl
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


@contextlib.contextmanager
def forced(ctl: ControllerProcess, sqlstate: str, times: int) -> Iterator[list[int]]:
    """The first ``times`` transactions that write a file row fail with
    ``sqlstate``; on exit the yielded list holds how many such transactions ran."""
    with ctl.db() as conn:
        conn.execute("ALTER SEQUENCE forced_conflict_tries RESTART")
        conn.execute("INSERT INTO forced_conflicts VALUES (%s, %s)", (sqlstate, times))
    tried: list[int] = []
    try:
        yield tried
    finally:
        with ctl.db() as conn:
            conn.execute("DELETE FROM forced_conflicts")
            row = conn.execute("SELECT last_value, is_called FROM forced_conflict_tries").fetchone()
        assert row is not None
        tried.append(int(row[0]) if row[1] else 0)


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])  # serialization failure, deadlock
def test_rest_upload_is_retried_after_a_conflict(
    conflicted: ControllerProcess, sqlstate: str
) -> None:
    t = bootstrap_tenant(conflicted)
    with forced(conflicted, sqlstate, times=2) as tried:
        r = put_answer(t, "a.txt", b"A")
    assert r.status_code == 201, r.text
    assert tried == [3] and t.file_rows("a.txt") == 1
    assert read(t, "a.txt") == b"A"


def test_rest_operation_is_retried_after_a_deadlock(conflicted: ControllerProcess) -> None:
    t = bootstrap_tenant(conflicted)
    with forced(conflicted, "40P01", times=1) as tried, t.client() as c:
        r = c.post(t.my_folder + "/operations", json={"action": "mkdir", "path": "d"})
    assert r.status_code == 200, r.text
    assert tried == [2] and t.file_rows("d") == 1


def test_checkpoint_is_retried_by_the_same_helper(conflicted: ControllerProcess) -> None:
    t = bootstrap_tenant(conflicted)
    run = start_run(t)
    digest = run.upload("task", b"saved").json()["digest"]
    entry = {"op": "put", "path": "s.txt", "digest": digest, "executable": False}
    with forced(conflicted, "40001", times=3) as tried:
        r = run.commit("task", [entry])
    assert r.status_code == 200, r.text
    assert tried == [4] and t.file_rows("s.txt") == 1


@pytest.mark.parametrize(
    ("sqlstate", "expected_tries"),
    [
        ("55P03", 1),  # lock_not_available: not a conflict, one try
        ("40001", retry.ATTEMPTS),  # conflicts every time: bounded
    ],
)
def test_failed_writes_answer_503_and_write_nothing(
    conflicted: ControllerProcess, sqlstate: str, expected_tries: int
) -> None:
    t = bootstrap_tenant(conflicted)
    with forced(conflicted, sqlstate, times=100) as tried:
        r = put_answer(t, "l.txt", b"L")
    assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
    assert tried == [expected_tries] and t.file_rows("l.txt") == 0


def test_concurrent_serializable_writers_all_succeed(conflicted: ControllerProcess) -> None:
    """Real conflicts: writers to one folder update its row under SERIALIZABLE."""
    t = bootstrap_tenant(conflicted)
    paths = [f"w{i}.txt" for i in range(8)]
    start = threading.Barrier(len(paths))

    def write(path: str) -> tuple[int, str]:
        start.wait()
        r = put_answer(t, path, path.encode())
        return r.status_code, r.text

    with ThreadPoolExecutor(len(paths)) as pool:
        answers = list(pool.map(write, paths))
    assert [code for code, _ in answers] == [201] * len(paths), conflicted.log()[-3000:]
    for path in paths:
        assert t.file_rows(path) == 1 and read(t, path) == path.encode()
