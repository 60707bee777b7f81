"""The bridge (fsagent ↔ controller): manifests, objects and checkpoints, including hostile input."""

from __future__ import annotations

import hashlib
import os
import uuid

import httpx
import zstandard

from common.bridge import END_FRAME, encode_frame, frame_header
from tests.support.bridge import Run, framed, start_run
from tests.support.controller import Tenant

OCTET = {"Content-Type": "application/octet-stream"}


def manifest(run: Run, scope: str, since: int = 0) -> tuple[list[dict[str, object]], int]:
    entries: list[dict[str, object]] = []
    high = 0
    with run.client() as c:
        while True:
            r = c.get(f"/folders/{scope}/manifest", params={"since": since, "limit": 2})
            assert r.status_code == 200, r.text
            body = r.json()
            entries += body["entries"]
            high = max(high, body["highWater"])
            if body["nextSince"] is None:
                return entries, high
            since = body["nextSince"]


def folder_files(tenant: Tenant, scope: str, owner: str) -> dict[str, bytes]:
    with tenant.client() as c:
        out = {}
        for e in c.get(tenant.folder(scope, owner) + "/", params={"limit": 1000}).json()["entries"]:
            if e["kind"] == "file":
                out[e["path"]] = c.get(
                    tenant.folder(scope, owner) + "/content", params={"path": e["path"]}
                ).content
        return out


def test_run_info_and_manifest_paging(tenant: Tenant) -> None:
    run = start_run(tenant)
    with run.client() as c:
        info = c.get("/run").json()
        assert info["bindings"] == {
            "task": run.task,
            "agent": run.agent,
            "user": tenant.user_id,
            "project": run.project,
        }
        assert info["leaseEpoch"] == run.lease_epoch
    with tenant.client() as c:
        for i in range(5):
            c.put(
                tenant.folder("task", run.task or "") + "/content",
                params={"path": f"f{i}"},
                content=str(i).encode(),
                headers=OCTET,
            )
    entries, high = manifest(run, "task")
    assert [e["path"] for e in entries] == [f"f{i}" for i in range(5)]
    assert all(e["deleted"] is False for e in entries)
    versions = [int(str(e["version"])) for e in entries]
    assert versions == sorted(versions) and high >= versions[-1]
    # Changes since: a delete shows up as a tombstone, an unchanged file does not.
    with tenant.client() as c:
        c.post(
            tenant.folder("task", run.task or "") + "/operations",
            json={"action": "delete", "path": "f1"},
        )
        c.put(
            tenant.folder("task", run.task or "") + "/content",
            params={"path": "f2"},
            content=b"new",
            headers=OCTET,
        )
    changes, _ = manifest(run, "task", since=high)
    assert [(e["path"], e["deleted"]) for e in changes] == [("f1", True), ("f2", False)]


def test_objects_only_through_the_folder(tenant: Tenant) -> None:
    run = start_run(tenant)
    data = os.urandom(5000)
    digest = hashlib.sha256(data).hexdigest()
    with tenant.client() as c:
        r = c.put(
            tenant.folder("task", run.task or "") + "/content",
            params={"path": "x"},
            content=data,
            headers=OCTET,
        )
        assert r.status_code == 201, r.text
        # Bytes stored in another folder of the run do not become reachable through this scope.
        # The PUT is checked: were it refused, the 404 below would prove nothing.
        secret = os.urandom(100)
        project_folder = tenant.folder("project", run.project or "")
        r = c.put(project_folder + "/content", params={"path": "s"}, content=secret, headers=OCTET)
        assert r.status_code == 201, r.text
        assert r.json()["file"]["digest"] == hashlib.sha256(secret).hexdigest()
        r = c.get(project_folder + "/content", params={"path": "s"})
        assert r.status_code == 200 and r.content == secret
    with run.client() as c:
        r = c.get(f"/folders/task/objects/{digest}")
        assert r.status_code == 200 and r.content == data
        r = c.get(f"/folders/task/objects/{digest}", headers={"Range": "bytes=10-19"})
        assert r.status_code == 206 and r.content == data[10:20]
        assert (
            c.get(f"/folders/task/objects/{hashlib.sha256(secret).hexdigest()}").status_code == 404
        )
        assert c.get(f"/folders/agent/objects/{digest}").status_code == 404
        assert c.get("/folders/task/objects/../../etc").status_code in (400, 404)
        assert c.get(f"/folders/task/objects/{digest.upper()}").status_code == 400


def test_unbound_scope_and_user_token_rejected(tenant: Tenant) -> None:
    run = start_run(tenant, user=False)
    with run.client() as c:
        assert c.get("/folders/user/manifest").status_code == 404
        assert c.get("/folders/bogus/manifest").status_code == 400
    r = httpx.get(
        tenant.controller.url + "/bridge/v1/run",
        headers={"Authorization": f"Bearer {tenant.token}"},
    )
    assert r.status_code == 401


def test_checkpoint_round_trip_and_idempotent_retry(tenant: Tenant) -> None:
    run = start_run(tenant)
    data = os.urandom(9 << 20)  # several frames
    up = run.upload("task", data)
    assert up.status_code == 200, up.text
    assert up.json() == {"digest": hashlib.sha256(data).hexdigest(), "byteSize": len(data)}
    body = {
        "operationId": "op-1",
        "leaseEpoch": run.lease_epoch,
        "final": False,
        "entries": [
            {"op": "mkdir", "path": "empty"},
            {"op": "put", "path": "src/big.bin", "digest": up.json()["digest"], "executable": True},
        ],
    }
    with run.client() as c:
        r1 = c.post("/folders/task/checkpoints", json=body)
        assert r1.status_code == 200, r1.text
        receipt = r1.json()
        assert receipt["applied"] is True and receipt["entries"] == 2
        r2 = c.post("/folders/task/checkpoints", json=body)
        assert r2.status_code == 200 and r2.json() == {**receipt, "replayed": True}
        other = {**body, "entries": body["entries"][:1]}
        r3 = c.post("/folders/task/checkpoints", json=other)
        assert r3.status_code == 409 and r3.json()["code"] == "idempotency_conflict"
    assert folder_files(tenant, "task", run.task or "") == {"src/big.bin": data}
    with tenant.client() as c:
        sync = c.get(tenant.folder("task", run.task or "") + "/sync").json()
        assert sync["runs"][0]["state"] == "saved" and sync["runs"][0]["lastSavedAt"]
        # An agent save is not a direct file operation.
        assert sync["lastOperationAt"] is None


def test_rename_of_unchanged_file_ships_as_reference(tenant: Tenant) -> None:
    run = start_run(tenant)
    data = b"saved content"
    with tenant.client() as c:
        c.put(
            tenant.folder("task", run.task or "") + "/content",
            params={"path": "old.txt"},
            content=data,
            headers=OCTET,
        )
    digest = hashlib.sha256(data).hexdigest()
    r = run.commit(
        "task",
        [
            {"op": "delete", "path": "old.txt"},
            {"op": "put", "path": "new.txt", "digest": digest, "executable": False},
        ],
    )
    assert r.status_code == 200, r.text
    assert folder_files(tenant, "task", run.task or "") == {"new.txt": data}


def test_last_accepted_write_wins_and_kind_conflicts_go_to_trash(tenant: Tenant) -> None:
    run = start_run(tenant)
    with tenant.client() as c:
        c.put(
            tenant.folder("task", run.task or "") + "/content",
            params={"path": "a/b"},
            content=b"server",
            headers=OCTET,
        )
    # The sandbox made `a` a file: its later write wins, the server's dir goes to trash.
    r = run.save("task", {"a": b"sandbox file"})
    assert r.status_code == 200, r.text
    assert folder_files(tenant, "task", run.task or "") == {"a": b"sandbox file"}
    with tenant.client() as c:
        trash = c.get(tenant.folder("task", run.task or "") + "/", params={"trash": "true"}).json()[
            "entries"
        ]
        assert {e["path"] for e in trash} == {"a", "a/b"}


def test_stale_lease_is_refused(tenant: Tenant) -> None:
    first = start_run(tenant, sandbox="box-A")
    up = first.upload("task", b"old lease")
    assert up.status_code == 200
    r = first.commit(
        "task",
        [{"op": "put", "path": "f", "digest": up.json()["digest"], "executable": False}],
        leaseEpoch=first.lease_epoch - 1 or 99,
    )
    assert r.status_code == 409 and r.json()["code"] == "stale_lease"
    # A newer lease for the same sandbox fences the old run completely.
    ctl = tenant.controller
    ctl.admin(
        "start-run",
        tenant.company_id,
        "--agent",
        first.agent,
        "--task",
        first.task or "",
        "--sandbox",
        "box-A",
    )
    r = first.commit(
        "task", [{"op": "put", "path": "f", "digest": up.json()["digest"], "executable": False}]
    )
    assert r.status_code == 401
    assert folder_files(tenant, "task", first.task or "") == {}


def test_user_folder_save_refused_after_membership_revoked(tenant: Tenant) -> None:
    member_id, _ = tenant.new_member()
    ctl = tenant.controller
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    out = ctl.admin("start-run", tenant.company_id, "--agent", agent, "--user", member_id)
    run = Run(tenant, out["run_id"], out["token"], out["lease_epoch"], agent, None, None)
    up = run.upload("user", b"private notes")
    assert up.status_code == 200
    ctl.admin("remove-member", tenant.company_id, member_id)
    r = run.commit(
        "user", [{"op": "put", "path": "n.txt", "digest": up.json()["digest"], "executable": False}]
    )
    assert r.status_code == 403 and r.json()["code"] == "membership_revoked"
    with ctl.db() as conn:
        state, error = conn.execute(
            "SELECT state, error FROM runs WHERE id = %s", (run.run_id,)
        ).fetchone()
        assert state == "failed" and "membership_revoked" in error
        count = conn.execute(
            "SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
            " WHERE d.scope = 'user' AND d.owner_id = %s",
            (member_id,),
        ).fetchone()
        assert count == (0,)


def test_hostile_checkpoints_change_nothing(tenant: Tenant) -> None:
    run = start_run(tenant)
    other = tenant.controller.admin("bootstrap", "--email", f"{uuid.uuid4().hex}@evil.example")
    other_tenant = Tenant(tenant.controller, other["company_id"], other["user_id"], other["token"])
    foreign = os.urandom(64)
    with other_tenant.client() as c:
        c.put(
            other_tenant.my_folder + "/content",
            params={"path": "theirs"},
            content=foreign,
            headers=OCTET,
        )
    with tenant.client() as c:  # same company, another folder (project)
        project_only = os.urandom(64)
        c.put(
            tenant.folder("project", run.project or "") + "/content",
            params={"path": "p"},
            content=project_only,
            headers=OCTET,
        )
    good = run.upload("task", b"legit").json()["digest"]
    put = {"op": "put", "digest": good, "executable": False}
    hostile = [
        [{**put, "path": "../escape"}],
        [{**put, "path": "/etc/passwd"}],
        [{**put, "path": "a/.fsagent/x"}],
        [{**put, "path": "a\x00b"}],
        [{"op": "symlink", "path": "l", "target": "/etc/passwd"}],
        [{"op": "link", "path": "h", "target": "legit"}],
        [{"op": "mknod", "path": "dev"}],
        [{**put, "path": "ok", "digest": hashlib.sha256(foreign).hexdigest()}],
        [{**put, "path": "ok", "digest": hashlib.sha256(project_only).hexdigest()}],
        [{**put, "path": "ok", "digest": "0" * 64}],
        [{**put, "path": "ok", "digest": "ZZ"}],
        [{**put, "path": "ok", "executable": "yes"}],
        [{**put, "path": "ok"}, {**put, "path": "x" * 1100}],  # one bad entry spoils all
        [{**put, "path": "ok", "byteSize": 1}],
    ]
    for entries in hostile:
        r = run.commit("task", entries)
        assert r.status_code in (400, 422), (entries, r.text)
    with run.client() as c:
        r = c.post(
            "/folders/task/checkpoints",
            content=b"{nope",
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400
        r = c.post(
            "/folders/task/checkpoints",
            json={"operationId": "x", "leaseEpoch": True, "entries": []},
        )
        assert r.status_code == 400
        r = c.post(
            "/folders/nope/checkpoints", json={"operationId": "x", "leaseEpoch": 1, "entries": []}
        )
        assert r.status_code == 400
    wrong = httpx.post(
        tenant.controller.url + "/bridge/v1/folders/task/checkpoints",
        headers={"Authorization": "Bearer fsa_r_forged"},
        json={"operationId": "x", "leaseEpoch": 1, "entries": [{**put, "path": "ok"}]},
    )
    assert wrong.status_code == 401
    assert folder_files(tenant, "task", run.task or "") == {}


def test_hostile_uploads_store_nothing(tenant: Tenant) -> None:
    run = start_run(tenant)
    cctx = zstandard.ZstdCompressor()
    data = b"A" * 1000
    good_frame = encode_frame(data, cctx)
    corrupt = bytearray(good_frame)
    corrupt[-1] ^= 0xFF
    wrong_sum = frame_header(len(good_frame) - 16, len(data), 12345) + good_frame[16:]
    huge_claim = frame_header(10, 64 << 20, 0) + b"x" * 10
    cases = [
        bytes(corrupt) + END_FRAME,
        wrong_sum + END_FRAME,
        huge_claim + END_FRAME,
        good_frame,
        good_frame + END_FRAME + b"trailing",
    ]
    with run.client() as c:
        for body in cases:
            r = c.put("/folders/task/uploads", content=body)
            assert r.status_code == 400 and r.json()["code"] == "bad_frame", r.text
        r = c.put(
            "/folders/task/uploads", content=framed(data), headers={"X-Content-SHA256": "0" * 64}
        )
        assert r.status_code == 422 and r.json()["code"] == "digest_mismatch"
    spool = tenant.controller.data_dir / "spool"
    assert [p for p in spool.iterdir() if p.name.startswith("bridge-")] == []
    with tenant.controller.db() as conn:
        assert conn.execute(
            "SELECT count(*) FROM run_uploads WHERE run_id = %s", (run.run_id,)
        ).fetchone() == (0,)


def test_run_that_ends_while_saving_is_reported_failed(tenant: Tenant) -> None:
    run = start_run(tenant)
    with run.client() as c:
        assert c.post("/run/report", json={"state": "saving"}).status_code == 200
    tenant.controller.admin("end-run", run.run_id)
    with tenant.client() as c:
        sync = c.get(tenant.folder("task", run.task or "") + "/sync").json()["runs"][0]
    assert sync["state"] == "failed" and sync["active"] is False
    assert "ended while a save was in progress" in sync["error"]
    with tenant.client() as c:
        r = c.post(tenant.folder("task", run.task or "") + "/refresh", json={"runId": run.run_id})
        assert r.status_code == 409 and r.json()["code"] == "run_not_active"


def test_refresh_is_queued_for_a_running_run(tenant: Tenant) -> None:
    run = start_run(tenant)
    with tenant.client() as c:
        r = c.post(tenant.folder("task", run.task or "") + "/refresh", json={"runId": run.run_id})
        assert r.status_code == 202 and r.json() == {"queued": True}
        sync = c.get(tenant.folder("task", run.task or "") + "/sync").json()["runs"][0]
        assert sync["refreshRequested"] is True


def test_one_runs_folders_commit_concurrently_without_deadlock(tenant: Tenant) -> None:
    """The four folders of a run save at the same time at stop; none may fail."""
    import concurrent.futures

    run = start_run(tenant)
    scopes = ["task", "agent", "project", "user"]
    digests = {s: run.upload(s, f"content of {s}".encode()).json()["digest"] for s in scopes}
    for round_ in range(5):

        def commit(scope: str, n: int = round_) -> int:
            entry = {
                "op": "put",
                "path": f"r{n}.txt",
                "digest": digests[scope],
                "executable": False,
            }
            return run.commit(scope, [entry], final=True).status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(commit, scopes))
        assert codes == [200, 200, 200, 200], codes
    owners = {"task": run.task, "agent": run.agent, "project": run.project, "user": tenant.user_id}
    for scope in scopes:
        files = folder_files(tenant, scope, owners[scope] or "")
        expected = {f"r{n}.txt": f"content of {scope}".encode() for n in range(5)}
        if scope == "agent":
            expected["AGENTS.md"] = b""  # a new agent's empty instruction entry
        assert files == expected
