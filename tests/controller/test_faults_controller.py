"""Controller-side faults: lost database connections, kill -9 and restarts."""

from __future__ import annotations

import hashlib
import os
import socket
import time

import httpx
import psycopg
import pytest

from tests.support.bridge import start_run
from tests.support.controller import ControllerProcess, PgCluster, Tenant, world_searchable_tmpdir

OCTET = {"Content-Type": "application/octet-stream"}


def wait_healthy(ctl: ControllerProcess) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(ctl.url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("controller did not recover")


def test_database_connection_loss_is_survived(pg_cluster: PgCluster) -> None:
    ctl = ControllerProcess(
        pg_cluster.create_database(), world_searchable_tmpdir("fsa-pgloss-")
    ).start()
    try:
        boot = ctl.admin("bootstrap", "--email", "pgloss@example.com")
        t = Tenant(ctl, boot["company_id"], boot["user_id"], boot["token"])
        with t.client() as c:
            assert (
                c.put(
                    t.my_folder + "/content", params={"path": "before"}, content=b"1", headers=OCTET
                ).status_code
                == 201
            )
            dbname = psycopg.conninfo.conninfo_to_dict(ctl.database_url)["dbname"]
            with psycopg.connect(pg_cluster.admin_url(), autocommit=True) as admin:
                killed = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s",
                    (dbname,),
                ).fetchone()
            assert killed is not None and killed[0] >= 1
            # The pool notices dead connections and replaces them; at worst one
            # request answers 503 and the client's retry succeeds.
            codes = []
            for _ in range(3):
                r = c.put(
                    t.my_folder + "/content",
                    params={"path": "after"},
                    content=b"2",
                    headers={**OCTET, "Idempotency-Key": "after-1"},
                )
                codes.append(r.status_code)
                if r.status_code in (200, 201):
                    break
                assert r.status_code == 503 and r.json()["code"] == "database_unavailable"
            assert codes[-1] == 201, codes
            paths = [e["path"] for e in c.get(t.my_folder + "/").json()["entries"]]
            assert paths == ["after", "before"]
    finally:
        ctl.stop()


def test_pooled_connections_the_server_ended_are_never_handed_out(
    pg_cluster: PgCluster,
) -> None:
    """The pool checks a connection without a round trip (its socket reads as
    closed, or holds the server's last error): once the server has ended
    every session, the next requests all succeed on new connections."""
    ctl = ControllerProcess(
        pg_cluster.create_database(), world_searchable_tmpdir("fsa-pgend-")
    ).start()
    try:
        boot = ctl.admin("bootstrap", "--email", "pgend@example.com")
        t = Tenant(ctl, boot["company_id"], boot["user_id"], boot["token"])
        with t.client() as c:
            for i in range(8):  # several connections in the pool, all idle afterwards
                r = c.put(t.my_folder + "/content", params={"path": f"before-{i}"},
                          content=b"1", headers=OCTET)  # fmt: skip
                assert r.status_code == 201, r.text
            dbname = psycopg.conninfo.conninfo_to_dict(ctl.database_url)["dbname"]
            with psycopg.connect(pg_cluster.admin_url(), autocommit=True) as admin:
                ended = [
                    row[0]
                    for row in admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = %s", (dbname,)
                    ).fetchall()
                ]
                assert ended
                for pid in ended:
                    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                deadline = time.monotonic() + 60
                while admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (ended,)
                ).fetchone():
                    assert time.monotonic() < deadline, "the sessions never ended"
                    time.sleep(0.05)
            for i in range(8):
                r = c.put(t.my_folder + "/content", params={"path": f"after-{i}"},
                          content=b"2", headers=OCTET)  # fmt: skip
                assert r.status_code == 201, r.text
            paths = {e["path"] for e in c.get(t.my_folder + "/").json()["entries"]}
            assert paths == {f"{w}-{i}" for w in ("before", "after") for i in range(8)}
    finally:
        ctl.stop()


def test_kill_during_upload_publishes_nothing_and_restart_cleans_spool(
    pg_cluster: PgCluster,
) -> None:
    ctl = ControllerProcess(
        pg_cluster.create_database(), world_searchable_tmpdir("fsa-kill-")
    ).start()
    try:
        boot = ctl.admin("bootstrap", "--email", "kill@example.com")
        t = Tenant(ctl, boot["company_id"], boot["user_id"], boot["token"])
        with socket.create_connection(("127.0.0.1", ctl.port)) as s:
            s.sendall(
                f"PUT {t.my_folder}/content?path=torn.bin HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {t.token}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {64 << 20}\r\n\r\n".encode()
            )
            s.sendall(os.urandom(8 << 20))
            deadline = time.monotonic() + 10
            while not any((ctl.data_dir / "spool").iterdir()) and time.monotonic() < deadline:
                time.sleep(0.05)
            ctl.kill()
        assert any((ctl.data_dir / "spool").iterdir())  # the dead process left its spool file
        ctl.start()
        assert list((ctl.data_dir / "spool").iterdir()) == []
        with t.client() as c:
            assert c.get(t.my_folder + "/").json()["entries"] == []
    finally:
        ctl.stop()


def test_checkpoint_retry_after_restart_is_not_applied_twice(pg_cluster: PgCluster) -> None:
    ctl = ControllerProcess(
        pg_cluster.create_database(), world_searchable_tmpdir("fsa-restart-")
    ).start()
    try:
        boot = ctl.admin("bootstrap", "--email", "restart@example.com")
        t = Tenant(ctl, boot["company_id"], boot["user_id"], boot["token"])
        run = start_run(t)
        data = os.urandom(2 << 20)
        digest = run.upload("task", data).json()["digest"]
        body = {
            "operationId": "cp-restart",
            "leaseEpoch": run.lease_epoch,
            "final": False,
            "entries": [{"op": "put", "path": "work.bin", "digest": digest, "executable": False}],
        }
        with run.client() as c:
            first = c.post("/folders/task/checkpoints", json=body)
        assert first.status_code == 200
        # The response is "lost": the controller dies, comes back, the sandbox retries.
        ctl.kill()
        ctl.start()
        wait_healthy(ctl)
        # Meanwhile a person writes a newer version; the retry must not undo it.
        with t.client() as c:
            c.put(
                t.folder("task", run.task or "") + "/content",
                params={"path": "work.bin"},
                content=b"newer by a person",
                headers=OCTET,
            )
        with run.client() as c:
            again = c.post("/folders/task/checkpoints", json=body)
        assert again.status_code == 200 and again.json() == {**first.json(), "replayed": True}
        with t.client() as c:
            got = c.get(t.folder("task", run.task or "") + "/content", params={"path": "work.bin"})
            assert got.content == b"newer by a person"
        with ctl.db() as conn:
            receipts = conn.execute(
                "SELECT count(*) FROM receipts WHERE operation_id = 'cp-restart'"
            ).fetchone()
        assert receipts == (1,)
        assert hashlib.sha256(data).hexdigest() == digest
    finally:
        ctl.stop()


@pytest.mark.allow_warning_logs
def test_database_down_answers_503_at_once_and_recovers_when_it_returns() -> None:
    """With PostgreSQL gone (not one connection lost: the server), a request
    answers 503 database_unavailable in seconds rather than holding its
    client for the pool's whole 30 s wait, and once the server is back the
    next requests succeed without waiting out a reconnection backoff."""
    cluster = PgCluster()
    ctl = ControllerProcess(cluster.create_database(), world_searchable_tmpdir("fsa-pgdown-"))
    try:
        ctl.start()
        boot = ctl.admin("bootstrap", "--email", "pgdown@example.com")
        t = Tenant(ctl, boot["company_id"], boot["user_id"], boot["token"])
        with t.client() as c:
            put = c.put(t.my_folder + "/content", params={"path": "before"}, content=b"1",
                        headers=OCTET)  # fmt: skip
            assert put.status_code == 201, put.text
            cluster.kill()
            waits = []
            for i in range(4):
                started = time.monotonic()
                r = c.put(t.my_folder + "/content", params={"path": f"down-{i}"}, content=b"2",
                          headers=OCTET, timeout=120)  # fmt: skip
                waits.append(time.monotonic() - started)
                assert r.status_code == 503, r.text
                assert r.json()["code"] == "database_unavailable"
            # The pool waits 30 s for a connection; with the server refusing
            # them, a request gives up after DOWN_WAIT_SECONDS (2 s).
            assert max(waits) < 15, waits
            cluster.pg.start()
            back = time.monotonic()
            codes = []
            while True:
                r = c.put(t.my_folder + "/content", params={"path": "after"}, content=b"3",
                          headers={**OCTET, "Idempotency-Key": "after-1"}, timeout=120)  # fmt: skip
                codes.append(r.status_code)
                if r.status_code == 201:
                    break
                assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
                assert time.monotonic() - back < 120, codes
                time.sleep(0.2)
            recovered = time.monotonic() - back
            assert recovered < 30, (recovered, codes)
            paths = [e["path"] for e in c.get(t.my_folder + "/").json()["entries"]]
            assert paths == ["after", "before"]
            print(f"waits while down {[round(w, 2) for w in waits]}, recovered in {recovered:.1f}s")
    finally:
        ctl.stop()
        cluster.stop()
