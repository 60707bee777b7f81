"""`controller` command line: admin, migrate, and the embedded PostgreSQL lifecycle."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import httpx
import psycopg
import pytest

from controller.db import migrations
from controller.pgembed import EmbeddedPostgres
from tests.support.controller import (
    REPO,
    ControllerProcess,
    PgCluster,
    free_port,
    world_searchable_tmpdir,
)


def test_admin_commands_and_errors(controller: ControllerProcess) -> None:
    boot = controller.admin("bootstrap", "--email", "boss@example.com", "--company-name", "Acme")
    assert set(boot) == {"company_id", "user_id", "token", "token_id"}
    with controller.db() as conn:
        row = conn.execute(
            "SELECT role FROM memberships WHERE company_id = %s AND user_id = %s",
            (boot["company_id"], boot["user_id"]),
        ).fetchone()
        assert row == ("owner",)
        # Only a hash of the token is stored.
        tokens = [bytes(r[0]) for r in conn.execute("SELECT token_hash FROM api_tokens")]
        assert all(boot["token"].encode() not in t for t in tokens)
        assert all(len(t) == 32 for t in tokens)
    user = controller.admin("create-user", "second@example.com")
    assert (
        controller.admin("add-member", boot["company_id"], user["user_id"], "--role", "viewer")[
            "role"
        ]
        == "viewer"
    )
    project = controller.admin("create-project", boot["company_id"], "Proj")["id"]
    task = controller.admin("create-task", boot["company_id"], project, "Do it")["id"]
    agent = controller.admin("create-agent", boot["company_id"], "Bot")["id"]
    assert len({project, task, agent}) == 3

    def fails(*args: str) -> str:
        code, _, err = controller.cli("admin", *args)
        assert code == 1, (args, err)
        assert err.startswith("controller: ") and err.count("\n") == 1
        return err

    assert "already exists" in fails("create-user", "second@example.com")
    assert "not an email" in fails("create-user", "nope")
    assert "must be a UUID" in fails("create-agent", "xyz", "n")
    assert "no such compan" in fails("create-agent", "00000000-0000-0000-0000-000000000000", "n")
    assert "not a member" in fails("remove-member", boot["company_id"], agent)
    assert "no such project" in fails("create-task", boot["company_id"], agent, "t")
    with pytest.raises(SystemExit) as info:  # argparse refuses the role
        controller.cli("admin", "add-member", boot["company_id"], user["user_id"], "--role", "god")
    assert info.value.code == 2


def test_start_run_fences_older_lease(controller: ControllerProcess) -> None:
    boot = controller.admin("bootstrap", "--email", "runner@example.com")
    agent = controller.admin("create-agent", boot["company_id"], "a")["id"]
    first = controller.admin(
        "start-run",
        boot["company_id"],
        "--agent",
        agent,
        "--sandbox",
        "box-1",
        "--user",
        boot["user_id"],
    )
    second = controller.admin(
        "start-run", boot["company_id"], "--agent", agent, "--sandbox", "box-1"
    )
    assert second["lease_epoch"] == first["lease_epoch"] + 1
    assert first["env"]["PAPERCLIP_USER_DIR"].endswith("/user")
    assert "PAPERCLIP_TASK_DIR" not in first["env"] and "AGENT_HOME" in first["env"]
    with controller.db() as conn:
        active = dict(
            conn.execute(
                "SELECT id::text, active FROM runs WHERE id = ANY(%s::uuid[])",
                ([first["run_id"], second["run_id"]],),
            ).fetchall()
        )
    assert active == {first["run_id"]: False, second["run_id"]: True}
    ended = controller.admin("end-run", second["run_id"])
    assert ended["active"] is False


def test_migrate_is_idempotent(pg_cluster: PgCluster) -> None:
    url = pg_cluster.create_database()
    ctl = ControllerProcess(url, world_searchable_tmpdir("fsa-mig-"))
    code, out, _ = ctl.cli("migrate", "--json")
    names = [name for _, name, _ in migrations()]
    assert names[0] == "0001_init.sql" and names == sorted(names)
    assert code == 0 and json.loads(out)["applied"] == names
    code, out, _ = ctl.cli("migrate", "--json")
    assert code == 0 and json.loads(out)["applied"] == []
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone() == (len(names),)


def test_invitations_pending_at_the_upgrade_get_their_full_time(pg_cluster: PgCluster) -> None:
    """Migration 0021 gives each pending invitation the 14 days from the upgrade."""
    url = pg_cluster.create_database()
    before = [(v, n, sql) for v, n, sql in migrations() if v < 21]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, name, sql in before:
            conn.execute(sql.encode())
            conn.execute("INSERT INTO schema_migrations VALUES (%s, %s)", (version, name))
        company, user = uuid.uuid4(), uuid.uuid4()
        conn.execute("INSERT INTO companies (id, name) VALUES (%s, 'Acme')", (company,))
        conn.execute("INSERT INTO users (id, email) VALUES (%s, 'p@example.com')", (user,))
        conn.execute(
            "INSERT INTO invitations (id, company_id, user_id, role, created_at)"
            " VALUES (%s, %s, %s, 'member', now() - interval '30 days')",
            (uuid.uuid4(), company, user),
        )
    ctl = ControllerProcess(url, world_searchable_tmpdir("fsa-mig-"))
    code, out, _ = ctl.cli("migrate", "--json")
    assert code == 0 and json.loads(out)["applied"][0] == "0021_invitation_expiry.sql", out
    with psycopg.connect(url) as conn:
        left = conn.execute("SELECT expires_at - now() FROM invitations").fetchone()
    assert left is not None and timedelta(days=13, hours=23) < left[0] <= timedelta(days=14)


def test_serve_with_embedded_postgres_starts_and_stops_cleanly() -> None:
    data = world_searchable_tmpdir("fsa-embedded-")
    port = free_port()
    boot = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "admin",
            "bootstrap",
            "--data-dir",
            str(data),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    token = json.loads(boot.stdout)["token"]
    pg = EmbeddedPostgres(data)
    assert pg.initialized() and not pg.running()  # admin stopped the cluster it started
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "serve",
            "--data-dir",
            str(data),
            "--listen",
            f"127.0.0.1:{port}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                r = httpx.get(
                    f"http://127.0.0.1:{port}/api/companies/"
                    f"{json.loads(boot.stdout)['company_id']}/work-folders/user/"
                    f"{json.loads(boot.stdout)['user_id']}/",
                    headers={"Authorization": f"Bearer {token}"},
                )
                assert r.status_code == 200, r.text
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert pg.running()
        # The socket lives in a private directory: no TCP listener.
        assert (data / "pg" / "run").stat().st_mode & 0o777 == 0o700
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not pg.running()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        pg.stop()


def test_openapi_document(controller: ControllerProcess) -> None:
    doc = httpx.get(controller.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    base = "/api/companies/{companyId}/work-folders/{scope}/{ownerId}"
    for suffix, method in [
        ("", "get"),
        ("/content", "get"),
        ("/content", "put"),
        ("/operations", "post"),
        ("/sync", "get"),
        ("/refresh", "post"),
    ]:
        assert method in doc["paths"][base + suffix]


def test_unknown_route_and_method_are_json(controller: ControllerProcess) -> None:
    r = httpx.get(controller.url + "/nope")
    assert r.status_code == 404 and r.json()["code"] == "route_not_found"
    r = httpx.delete(controller.url + "/openapi.json")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


def test_migrate_on_a_fresh_data_dir_reports_what_it_applied() -> None:
    # A space in the path: the cluster's socket directory goes through pg_ctl's
    # shell and into a connection URL.
    base = world_searchable_tmpdir("fsa-mig-embedded-")
    data = base / "data dir"
    names = [name for _, name, _ in migrations()]

    def migrate() -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "controller.cli", "migrate", "--data-dir", str(data), "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        applied: list[str] = json.loads(proc.stdout)["applied"]
        return applied

    try:
        assert migrate() == names
        assert migrate() == []
        pg = EmbeddedPostgres(data)
        assert not pg.running()
        pg.start()
        try:
            with psycopg.connect(pg.url) as conn:
                assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone() == (
                    len(names),
                )
        finally:
            pg.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_bootstrap_with_a_taken_email_adds_no_company(controller: ControllerProcess) -> None:
    controller.admin("bootstrap", "--email", "taken@example.com", "--company-name", "First")
    with controller.db() as conn:
        before = conn.execute("SELECT count(*) FROM companies").fetchone()
        code, out, err = controller.cli(
            "admin", "bootstrap", "--email", "taken@example.com", "--company-name", "Orphan"
        )
        assert code == 1 and out == "" and "already exists" in err and err.count("\n") == 1
        assert conn.execute("SELECT count(*) FROM companies").fetchone() == before
        assert conn.execute("SELECT 1 FROM companies WHERE name = 'Orphan'").fetchone() is None


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "--listen", "127.0.0.1:0"],
        ["migrate"],
        ["gc", "--now"],
        ["admin", "bootstrap"],
        ["admin", "create-user", "x@example.com"],
        ["admin", "end-run", "00000000-0000-0000-0000-000000000000"],
    ],
)
def test_unreachable_database_is_one_line_and_exit_3(command: list[str]) -> None:
    data = world_searchable_tmpdir("fsa-nodb-")
    # Nothing listens on this port: the connection is refused at once.
    url = f"postgresql://controller@127.0.0.1:{free_port()}/controller?connect_timeout=5"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "controller.cli",
                *command,
                "--data-dir",
                str(data),
                "--database-url",
                url,
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("controller: database unavailable: "), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_list_and_revoke_tokens_and_end_sessions(controller: ControllerProcess) -> None:
    boot = controller.admin("bootstrap", "--email", f"rev-{uuid.uuid4().hex[:8]}@example.com")
    other = controller.admin("create-user", f"other-{uuid.uuid4().hex[:8]}@example.com")
    controller.admin("add-member", boot["company_id"], other["user_id"], "--role", "member")
    lonely = controller.admin("create-user", f"lonely-{uuid.uuid4().hex[:8]}@example.com")
    listed = controller.admin("list-tokens", "--company", boot["company_id"])["tokens"]
    assert {t["token_id"] for t in listed} == {boot["token_id"], other["token_id"]}
    assert all(t["revoked_at"] is None and "token" not in t for t in listed)
    mine = controller.admin("list-tokens", "--user", lonely["user_id"])["tokens"]
    assert [(t["token_id"], t["user_id"]) for t in mine] == [
        (lonely["token_id"], lonely["user_id"])
    ]

    base = controller.url
    listing = f"{base}/api/companies/{boot['company_id']}/directory"
    bearer = {"Authorization": f"Bearer {other['token']}"}
    assert httpx.get(listing, headers=bearer).status_code == 200
    signed_in = httpx.post(f"{base}/files/api/session", json={"token": other["token"]})
    assert signed_in.status_code == 200, signed_in.text
    cookies = {"fsa_session": signed_in.cookies["fsa_session"]}
    assert httpx.get(listing, cookies=cookies).status_code == 200

    out = controller.admin("revoke-token", other["token_id"])
    assert out["revoked"] is True and out["user_id"] == other["user_id"]
    r = httpx.get(listing, headers=bearer)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.post(f"{base}/files/api/session", json={"token": other["token"]})
    assert r.status_code == 401
    # Revoking again changes nothing; the owner's token still works.
    assert controller.admin("revoke-token", other["token_id"])["revoked_at"] == out["revoked_at"]
    owner = {"Authorization": f"Bearer {boot['token']}"}
    assert httpx.get(listing, headers=owner).status_code == 200
    [row] = controller.admin("list-tokens", "--user", other["user_id"])["tokens"]
    assert row["revoked_at"] == out["revoked_at"]

    # The session signed in before the revocation lives until it is ended.
    assert controller.admin("end-sessions", other["user_id"]) == {
        "user_id": other["user_id"],
        "ended": 1,
    }
    r = httpx.get(listing, cookies=cookies)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    assert httpx.get(f"{base}/files/api/session", cookies=cookies).status_code == 401

    for args, message in (
        (("revoke-token", "00000000-0000-0000-0000-000000000000"), "no such token"),
        (("revoke-token", "nope"), "must be a UUID"),
        (("end-sessions", "00000000-0000-0000-0000-000000000000"), "no such user"),
        (("list-tokens", "--company", "x"), "must be a UUID"),
    ):
        code, _, err = controller.cli("admin", *args)
        assert code == 1 and message in err, (args, err)


def test_start_run_lease_lock_is_not_a_folder_lock(controller: ControllerProcess) -> None:
    """The lease lock once shared the one-key space of the folder locks (folder ids):
    a folder write holding lock k blocked start-run whenever its key hashed to k."""
    boot = controller.admin("bootstrap", "--email", f"lease-{uuid.uuid4().hex[:8]}@example.com")
    company = boot["company_id"]
    agent = controller.admin("create-agent", company, "a")["id"]
    box = "box-lock"
    with controller.db() as holder:
        holder.execute("BEGIN")
        for text in (f"lease:{company}:{box}", f"{company}:{box}"):
            holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (text,))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = pool.submit(controller.admin, "start-run", company, "--agent", agent,
                                  "--sandbox", box)  # fmt: skip
            try:
                run = started.result(timeout=15)
            finally:
                holder.execute("ROLLBACK")
    assert run["lease_epoch"] == 1 and run["token"]
