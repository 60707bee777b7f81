"""`controller admin backup` / `restore`: back up a live controller, destroy it, restore,
and read every file's bytes back through the API."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support.bridge import start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    bootstrap_tenant,
    world_searchable_tmpdir,
)

pytestmark = pytest.mark.skipif(
    shutil.which("pg_dump") is None or shutil.which("pg_restore") is None,
    reason="needs the PostgreSQL client tools pg_dump and pg_restore",
)
OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture
def own_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    ctl = ControllerProcess(pg_cluster.create_database(), world_searchable_tmpdir("fsa-ctl-bk-"))
    try:
        yield ctl.start()
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


@pytest.fixture
def backup_dir() -> Iterator[Path]:
    d = world_searchable_tmpdir("fsa-backup-")
    try:
        yield d / "b1"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_backup_destroy_restore_keeps_every_byte(
    own_controller: ControllerProcess, pg_cluster: PgCluster, backup_dir: Path
) -> None:
    ctl = own_controller
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    folder = tenant.my_folder
    files = {f"docs/f{i}.bin": os.urandom(1000 + 977 * i) for i in range(8)}
    files["empty.txt"] = b""
    files["same-as-f0.bin"] = files["docs/f0.bin"]
    with tenant.client() as c:
        for path, data in files.items():
            r = c.put(folder + "/content", params={"path": path}, content=data, headers=OCTET)
            assert r.status_code == 201, r.text
    saved = run.save("task", {"from-agent.txt": b"agent bytes"})
    assert saved.status_code == 200, saved.text

    code, out, err = ctl.cli("admin", "backup", "--to", str(backup_dir), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["objects"]["files"] >= len(files)  # one object per distinct content
    assert (backup_dir / "db.dump").stat().st_size > 0

    # Written after the backup: must not come back.
    with tenant.client() as c:
        late = c.put(folder + "/content", params={"path": "late.txt"}, content=b"x", headers=OCTET)
        assert late.status_code == 201

    # Destroy: the database and the object directory.
    ctl.stop()
    name = conninfo_to_dict(ctl.db_url)["dbname"]
    with psycopg.connect(pg_cluster.admin_url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name}")
        conn.execute(f"CREATE DATABASE {name}")
    shutil.rmtree(ctl.data_dir / "objects")

    code, out, err = ctl.cli("admin", "restore", "--from", str(backup_dir), "--json")
    assert code == 0, err
    assert json.loads(out)["objects"] == report["objects"]["files"]

    ctl.start()
    with tenant.client() as c:
        for path, data in files.items():
            r = c.get(folder + "/content", params={"path": path})
            assert r.status_code == 200, (path, r.text)
            assert r.content == data, path
        agent = c.get(
            tenant.folder("task", str(run.task)) + "/content", params={"path": "from-agent.txt"}
        )
        assert agent.content == b"agent bytes"
        assert c.get(folder + "/content", params={"path": "late.txt"}).status_code == 404
        listing = c.get(folder + "/", params={"limit": 1000}).json()["entries"]
    assert {e["path"] for e in listing if e["kind"] == "file"} == set(files)


def test_backup_refuses_a_used_directory_and_restore_an_unfinished_one(
    controller: ControllerProcess, backup_dir: Path
) -> None:
    backup_dir.mkdir(parents=True)
    (backup_dir / "something").write_text("x")
    code, _, err = controller.cli("admin", "backup", "--to", str(backup_dir))
    assert code == 1
    assert "is not empty" in err and err.count("\n") == 1
    code, _, err = controller.cli("admin", "restore", "--from", str(backup_dir))
    assert code == 1
    assert "not a finished backup" in err


def tampered(backup: Path, name: str) -> Path:
    """A copy of ``backup`` (links copied as links) to tamper with."""
    copy = backup.parent / name
    shutil.copytree(backup, copy, symlinks=True)
    return copy


def test_restore_follows_no_link_and_refuses_what_it_did_not_write(
    own_controller: ControllerProcess, backup_dir: Path
) -> None:
    """A backup directory is data: a symbolic link in it (to a host file, or
    to a directory) is refused, not followed, and so is anything the backup
    did not write; nothing is restored from a refused directory."""
    ctl = own_controller
    tenant = bootstrap_tenant(ctl)
    folder = tenant.my_folder
    with tenant.client() as c:
        r = c.put(folder + "/content", params={"path": "a.txt"}, content=b"a", headers=OCTET)
        assert r.status_code == 201, r.text
    code, out, err = ctl.cli("admin", "backup", "--to", str(backup_dir), "--json")
    assert code == 0, err
    assert json.loads(out)["objects"]["files"] >= 1
    with tenant.client() as c:  # after the backup: a restore would remove it
        r = c.put(folder + "/content", params={"path": "late.txt"}, content=b"l", headers=OCTET)
        assert r.status_code == 201, r.text

    host = backup_dir.parent / "host-secret"
    host.write_bytes(b"host secret bytes")
    (obj,) = [p for p in (backup_dir / "objects").rglob("*") if p.is_file()]
    rel = obj.relative_to(backup_dir)
    fake = obj.parent.name + "ab" * 31  # a valid object key's name in that directory
    cases: list[tuple[str, str]] = []

    def case(name: str, said: str) -> Path:
        cases.append((name, said))
        return tampered(backup_dir, name)

    d = case("object-is-a-symlink", "is a symbolic link")
    (d / rel).unlink()
    (d / rel).symlink_to(host)
    d = case("extra-symlinked-object", "is a symbolic link")
    (d / rel).with_name(fake).symlink_to(host)
    d = case("objects-dir-is-a-symlink", "objects is not a directory")
    shutil.rmtree(d / "objects")
    (d / "objects").symlink_to(backup_dir / "objects")
    d = case("company-dir-is-a-symlink", "is a symbolic link")
    company_dir = d / rel.parent.parent
    shutil.rmtree(company_dir)
    company_dir.symlink_to(backup_dir / rel.parent.parent)
    d = case("manifest-is-a-symlink", "not a finished backup")
    (d / "backup.json").unlink()
    (d / "backup.json").symlink_to(backup_dir / "backup.json")
    d = case("dump-is-a-symlink", "db.dump is missing or not a regular file")
    (d / "db.dump").unlink()
    (d / "db.dump").symlink_to(backup_dir / "db.dump")
    d = case("stray-file", "not an object")
    (d / "objects" / "objects" / "notes.txt").write_bytes(b"x")
    d = case("extra-object", "objects/ holds 2 files")
    (d / rel).with_name(fake).write_bytes(b"host secret bytes")
    d = case("other-dump", "is not the dump backup.json describes")
    with (d / "db.dump").open("r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 1]))

    for name, said in cases:
        code, _, err = ctl.cli("admin", "restore", "--from", str(backup_dir.parent / name))
        assert code == 1 and said in err and err.count("\n") == 1, (name, err)
    stored = [p.read_bytes() for p in (ctl.data_dir / "objects").rglob("*") if p.is_file()]
    assert b"host secret bytes" not in stored
    with tenant.client() as c:  # the database was never touched
        assert c.get(folder + "/content", params={"path": "late.txt"}).content == b"l"
