"""Quotas under concurrency: uploads checked at the same moment on three
controller replicas (one PostgreSQL database) never accept more than the
quota together, and a reservation never outlives its upload.

Each upload is held, after its quota step and its bytes are stored, at the
registering transaction's object lock, which the test takes first: every
upload that passed its quota step is then in flight at once, the widest race
there can be. Without an atomic reservation every one of them passes (each
sees the others' bytes not yet registered); with it only those that fit do,
and the others are refused with their documented code before storing
anything.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import psycopg
import pytest

from common.bridge import PREFIX
from controller.foldercore import OBJECT_LOCK_CLASS
from controller.quotas import QUOTA_LOCK_CLASS
from tests.support.bridge import framed, start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    world_searchable_tmpdir,
)

OCTET = {"Content-Type": "application/octet-stream"}
KiB, MiB = 1024, 1024 * 1024
PENDING_BYTES = 1 * MiB
COMPANY_BYTES = 3 * MiB
REPLICAS = 3


@pytest.fixture(scope="module")
def replicas(pg_cluster: PgCluster) -> Iterator[list[ControllerProcess]]:
    url = pg_cluster.create_database()
    dirs = [world_searchable_tmpdir("fsa-quota-replica-") for _ in range(REPLICAS)]
    flags = [
        "--max-pending-upload-bytes",
        str(PENDING_BYTES),
        "--company-storage-bytes",
        str(COMPANY_BYTES),
    ]
    with ExitStack() as stack:
        started = []
        for d in dirs:
            stack.callback(shutil.rmtree, d, ignore_errors=True)
            ctl = ControllerProcess(url, d, list(flags)).start()
            stack.callback(ctl.stop)
            started.append(ctl)
        yield started


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reservations(db: psycopg.Connection) -> int:
    row = db.execute("SELECT count(*) FROM quota_reservations").fetchone()
    assert row is not None
    return int(row[0])


def lock_waiters(db: psycopg.Connection) -> list[int]:
    """Backends of this database waiting on an advisory lock other than a quota
    lock: uploads that passed their quota step and wait to register."""
    rows = db.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND NOT (objsubid = 2 AND classid = %s)",
        (QUOTA_LOCK_CLASS,),
    ).fetchall()
    return [int(r[0]) for r in rows]


@contextmanager
def objects_locked(db: psycopg.Connection, company: str, contents: list[bytes]) -> Iterator[None]:
    """Hold the object locks every registration of ``contents`` takes."""
    keys = [f"{company}:{sha(c)}" for c in contents]
    for key in keys:
        db.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (OBJECT_LOCK_CLASS, key))
    try:
        yield
    finally:
        for key in keys:
            db.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", (OBJECT_LOCK_CLASS, key))


def race(
    db: psycopg.Connection,
    company: str,
    contents: list[bytes],
    send: Callable[[int, bytes], httpx.Response],
) -> list[httpx.Response]:
    """Send upload i of ``contents`` through replica i, all at once, with the
    registrations held until every upload has either answered or passed its
    quota step; then let them register."""
    with (
        concurrent.futures.ThreadPoolExecutor(len(contents)) as pool,
        objects_locked(db, company, contents),
    ):
        futures = [pool.submit(send, i, c) for i, c in enumerate(contents)]
        deadline = time.monotonic() + 120
        while True:
            done = sum(f.done() for f in futures)
            if done + len(lock_waiters(db)) >= len(contents):
                break
            assert time.monotonic() < deadline, (done, lock_waiters(db))
            time.sleep(0.05)
    return [f.result(timeout=120) for f in futures]


def bridge_upload(ctl: ControllerProcess, token: str, data: bytes) -> httpx.Response:
    with httpx.Client(
        base_url=ctl.url + PREFIX, headers={"Authorization": f"Bearer {token}"}, timeout=120
    ) as c:
        return c.put(
            "/folders/task/uploads",
            content=framed(data),
            headers={"X-Content-SHA256": sha(data)},
        )


def test_run_allowance_holds_across_replicas(replicas: list[ControllerProcess]) -> None:
    """One run, three 700 KiB uploads through three replicas at once, an
    allowance of 1 MiB: one is accepted, two are 429 upload_quota_exceeded."""
    t = bootstrap_tenant(replicas[0])
    run = start_run(t)
    contents = [os.urandom(700 * KiB) for _ in range(REPLICAS)]
    with replicas[0].db() as db:
        answers = race(
            db, t.company_id, contents, lambda i, c: bridge_upload(replicas[i], run.token, c)
        )
        accepted = [a for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code != 200]
        assert len(accepted) == 1, [(a.status_code, a.text) for a in answers]
        for r in refused:
            assert r.status_code == 429 and r.json()["code"] == "upload_quota_exceeded", r.text
        row = db.execute(
            "SELECT coalesce(sum(byte_size), 0) FROM run_uploads WHERE run_id = %s", (run.run_id,)
        ).fetchone()
        assert row is not None and 0 < row[0] <= PENDING_BYTES
        assert reservations(db) == 0


def test_company_quota_holds_across_replicas(replicas: list[ControllerProcess]) -> None:
    """Three people's 1.2 MiB uploads through three replicas at once, 3 MiB of
    company storage: two are stored, one is 413 storage_quota_exceeded."""
    t = bootstrap_tenant(replicas[0])
    contents = [os.urandom(1200 * KiB) for _ in range(REPLICAS)]

    def put(i: int, data: bytes) -> httpx.Response:
        client = Tenant(replicas[i], t.company_id, t.user_id, t.token).client()
        with client as c:
            return c.put(f"{t.my_folder}/content?path=f{i}", content=data, headers=OCTET)

    with replicas[0].db() as db:
        answers = race(db, t.company_id, contents, put)
        codes = sorted(a.status_code for a in answers)
        assert codes == [201, 201, 413], [(a.status_code, a.text) for a in answers]
        refused = next(a for a in answers if a.status_code == 413)
        assert refused.json()["code"] == "storage_quota_exceeded"
        row = db.execute(
            "SELECT coalesce(sum(byte_size), 0) FROM objects WHERE company_id = %s",
            (t.company_id,),
        ).fetchone()
        assert row is not None and row[0] <= COMPANY_BYTES
        assert reservations(db) == 0


def test_a_failed_upload_releases_its_reservation(replicas: list[ControllerProcess]) -> None:
    """An upload that reserved its bytes and then fails (its registering
    transaction cancelled) gives them back at once: the run's next upload of
    its whole allowance is accepted."""
    t = bootstrap_tenant(replicas[0])
    run = start_run(t)
    doomed = os.urandom(PENDING_BYTES)
    with (
        replicas[0].db() as db,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        objects_locked(db, t.company_id, [doomed]),
    ):
        answer = pool.submit(bridge_upload, replicas[1], run.token, doomed)
        deadline = time.monotonic() + 120
        while not (waiting := lock_waiters(db)):
            assert not answer.done(), answer.result().text
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert reservations(db) == 1
        db.execute("SELECT pg_cancel_backend(%s)", (waiting[0],))
        r = answer.result(timeout=120)
        assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
        assert reservations(db) == 0
    again = bridge_upload(replicas[2], run.token, os.urandom(PENDING_BYTES))
    assert again.status_code == 200, again.text
    with replicas[0].db() as db:
        assert reservations(db) == 0
