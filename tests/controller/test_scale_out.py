"""Two controller replicas on one external PostgreSQL and one S3 bucket, behind
a round-robin load balancer, with fsagent mounts and REST clients writing
through both at once.

The PostgreSQL cluster is the test session's (``tests/support``), not either
replica's embedded one; the bucket is on the session's S3-protocol server.
Replica A runs the GC sweeper continuously (every 0.3 s, every deletion due at
once); replica B sweeps never. Checked:

* every write is there exactly once, with its bytes;
* versions read through either replica never go back, and one writer's
  successive writes to a folder get increasing versions;
* the sweeps on A, racing commits on B of the same contents (a small shared
  set that writers keep unreferencing and referencing again), never delete an
  object a file references: every referenced digest is still in the bucket;
* a replica killed with SIGKILL while it holds a checkpoint commit loses
  nothing: fsagent retries through the other replica.

The test runs with FUSE mounts, then with plain directories (dir mode): the
same writers, the same kill, the same assertions.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.foldercore import EMPTY_DIGEST
from fsagent.control import protocol as control
from tests.support.balancer import RoundRobinBalancer
from tests.support.controller import ControllerProcess, PgCluster, world_searchable_tmpdir
from tests.support.mount import FsagentMount, MountFactory
from tests.support.s3server import FAKE_CREDENTIALS, S3Server
from tests.support.storage import s3_client

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

OCTET = {"Content-Type": "application/octet-stream"}
_rng = random.Random(17)
SHARED = [_rng.randbytes(_rng.randrange(1024, 24 * 1024)) for _ in range(6)]
"""Contents every writer uses, so the same digests are referenced, left
unreferenced and referenced again in several folders at once."""
HOT = [_rng.randbytes(_rng.randrange(1024, 8 * 1024)) for _ in range(3)]
"""Contents REST writers keep writing and purging (so the sweeper keeps finding
them unreferenced) while the mounts save them in new files."""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Cluster:
    a: ControllerProcess
    b: ControllerProcess
    lb: RoundRobinBalancer
    s3: S3Server
    bucket: str
    company: str
    owner_token: str
    operator_token: str

    @property
    def replicas(self) -> list[ControllerProcess]:
        return [self.a, self.b]

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.lb.url,
            headers={"Authorization": f"Bearer {token or self.owner_token}"},
            timeout=120,
        )

    def folder(self, scope: str, owner: str) -> str:
        return f"/api/companies/{self.company}/work-folders/{scope}/{owner}"

    def bucket_keys(self) -> set[str]:
        client, keys, token = s3_client(self.s3), set(), None
        while True:
            page = client.list_objects_v2(
                Bucket=self.bucket, **({"ContinuationToken": token} if token else {})
            )
            keys |= {o["Key"] for o in page.get("Contents", [])}
            token = page.get("NextContinuationToken")
            if token is None:
                return keys


@pytest.fixture
def cluster(pg_cluster: PgCluster, s3_server: S3Server, s3_bucket: str) -> Iterator[Cluster]:
    s3_client(s3_server).create_bucket(Bucket=s3_bucket)
    database = pg_cluster.create_database()  # shared by both; neither one's own cluster
    storage = [
        "--storage", "s3", "--s3-endpoint", s3_server.endpoint_url,
        "--s3-bucket", s3_bucket, "--s3-region", "us-east-1",
    ]  # fmt: skip
    dirs = [world_searchable_tmpdir("fsa-replica-") for _ in range(2)]
    a = ControllerProcess(database, dirs[0], storage, env=FAKE_CREDENTIALS,
                          gc_args=["--gc-delay", "0", "--gc-interval", "0.3"])  # fmt: skip
    b = ControllerProcess(database, dirs[1], storage, env=FAKE_CREDENTIALS,
                          gc_args=["--gc-delay", "0", "--gc-interval", "0"])  # fmt: skip
    lb = RoundRobinBalancer([a.url, b.url])
    try:
        # Both start at once: their migrations serialize on an advisory lock.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(a.start), pool.submit(b.start)]:
                started.result()
        lb.start()
        boot = a.admin("bootstrap", "--email", f"scale-{uuid.uuid4().hex[:8]}@example.com")
        op = b.admin("create-operator-token", boot["company_id"], "--name", "orchestrator")
        yield Cluster(a, b, lb, s3_server, s3_bucket, boot["company_id"], boot["token"],
                      op["token"])  # fmt: skip
    finally:
        lb.stop()
        for ctl in (a, b):
            ctl.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


# --- writers ---------------------------------------------------------------------------


@dataclass
class VersionLog:
    """Folder versions as read through the balancer, in the order read."""

    seen: dict[str, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, folder: str, version: int) -> None:
        with self.lock:
            self.seen.setdefault(folder, []).append(version)


def send(c: httpx.Client, method: str, url: str, ok: tuple[int, ...], **kw: Any) -> httpx.Response:
    """A request retried on 502/503 and dropped connections (a replica dying);
    callers that change something send an ``Idempotency-Key`` so a retry of a
    request the dead replica applied is answered, not applied again."""
    deadline = time.monotonic() + 60
    while True:
        try:
            r = c.request(method, url, **kw)
            if r.status_code not in (502, 503):
                assert r.status_code in ok, (method, url, r.status_code, r.text)
                return r
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{method} {url} kept failing"
        time.sleep(0.2)


@dataclass
class RestWriter:
    """Writes ``rest{k}/f{i}.bin`` once each (a shared content), and a
    ``tmp{i}`` (a HOT content or a unique one) it deletes and purges at once:
    the purge leaves the digest to the sweeper while others write it again."""

    cluster: Cluster
    folder: str
    k: int
    count: int
    expected: dict[str, bytes] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)

    def run(self) -> None:
        with self.cluster.client() as c:
            for i in range(self.count):
                path, data = f"rest{self.k}/f{i}.bin", SHARED[(i + self.k) % len(SHARED)]
                r = self._put(c, path, data)
                self.expected[path] = data
                self.versions.append(r.json()["file"]["version"])
                tmp = HOT[i % len(HOT)] if i % 2 else os.urandom(2048)
                r = self._put(c, f"rest{self.k}/tmp{i}.bin", tmp)
                file_id = r.json()["file"]["id"]
                for action in ({"action": "delete", "path": f"rest{self.k}/tmp{i}.bin"},
                               {"action": "purge", "fileId": file_id}):  # fmt: skip
                    send(c, "POST", self.folder + "/operations", (200,), json=action,
                         headers={"Idempotency-Key": str(uuid.uuid4())})  # fmt: skip

    def _put(self, c: httpx.Client, path: str, data: bytes) -> httpx.Response:
        headers = {**OCTET, "Idempotency-Key": str(uuid.uuid4())}
        return send(c, "PUT", self.folder + "/content", (200, 201), params={"path": path},
                    content=data, headers=headers)  # fmt: skip


@dataclass
class MountWriter:
    """Writes batches of new files into a mount (a HOT content and shared
    ones), overwrites ``churn.bin``, deletes an earlier file, and saves each batch."""

    mount: FsagentMount
    expected: dict[str, bytes] = field(default_factory=dict)

    def batch(self, n: int, files: int = 4) -> None:
        root = self.mount.mountpoint
        (root / f"b{n}").mkdir(exist_ok=True)
        for i in range(files):
            path = f"b{n}/f{i}.bin"
            data = HOT[n % len(HOT)] if i == 0 else SHARED[(n + i) % len(SHARED)]
            (root / path).write_bytes(data)
            self.expected[path] = data
        churn = SHARED[n % len(SHARED)]
        (root / "churn.bin").write_bytes(churn)
        self.expected["churn.bin"] = churn
        if n > 0:
            (root / f"b{n - 1}/f1.bin").unlink()
            del self.expected[f"b{n - 1}/f1.bin"]

    def save(self) -> dict[str, Any]:
        """``fsagent flush``'s request on the daemon's control socket (the
        command itself would only add a Python start per save)."""
        return control.request(self.mount.state_dir / "control.sock", {"cmd": "flush"}, 120)


def read_versions(
    cluster: Cluster, folders: list[str], log: VersionLog, stop: threading.Event
) -> None:
    with cluster.client() as c:
        while not stop.is_set():
            for folder in folders:
                try:
                    r = c.get(folder + "/changes")
                except httpx.TransportError:
                    continue
                if r.status_code == 200:
                    log.add(folder, r.json()["version"])
            stop.wait(0.1)


def all_done(futures: list[concurrent.futures.Future[Any]]) -> None:
    for f in futures:
        f.result()


# --- the test ----------------------------------------------------------------------------


@pytest.fixture
def mounts(mode_mounts: MountFactory) -> MountFactory:
    """FUSE mounts, then plain directories: the same kill, the same assertions."""
    return mode_mounts


def test_two_replicas_share_postgresql_and_s3(cluster: Cluster, mounts: MountFactory) -> None:
    company = cluster.company
    with cluster.client(cluster.operator_token) as op:
        project = send(op, "POST", f"/api/companies/{company}/projects", (201,),
                       json={"name": "scale"}).json()["id"]  # fmt: skip
        runs = []
        for n in range(2):
            agent = send(op, "POST", f"/api/companies/{company}/agents", (201,),
                         json={"name": f"agent{n}"}).json()["id"]  # fmt: skip
            task = send(op, "POST", f"/api/companies/{company}/tasks", (201,),
                        json={"projectId": project, "title": f"t{n}"}).json()["id"]  # fmt: skip
            runs.append(send(op, "POST", f"/api/companies/{company}/runs", (201,),
                             json={"agentId": agent, "taskId": task,
                                   "sandbox": f"box{n}"}).json())  # fmt: skip
    writers = []
    for run in runs:
        token = mounts.base / f"token-{run['runId']}"
        token.write_text(run["token"])
        for scope in ("task", "agent"):
            m = mounts.mount(cluster.lb.url, scope=scope, token_file=token, start=False)
            # A new agent's folder starts with its empty instruction entry.
            writers.append(MountWriter(m, {"AGENTS.md": b""} if scope == "agent" else {}))
    with concurrent.futures.ThreadPoolExecutor(len(writers)) as pool:
        all_done([pool.submit(w.mount.start) for w in writers])
    rest = [RestWriter(cluster, cluster.folder("project", project), k, 6) for k in range(3)]
    watched = [
        cluster.folder("project", project),
        *(cluster.folder(s, r["bindings"][s]) for r in runs for s in ("task", "agent")),
    ]
    log, stop = VersionLog(), threading.Event()

    # Phase 1: everyone writes through both replicas while A sweeps.
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(writers) + len(rest) + 1) as pool:
        reader = pool.submit(read_versions, cluster, watched, log, stop)
        try:

            def mount_work(w: MountWriter) -> None:
                for n in range(2):
                    w.batch(n)
                    reply = w.save()
                    assert reply["ok"] is True, reply

            all_done([*(pool.submit(mount_work, w) for w in writers),
                      *(pool.submit(r.run) for r in rest)])  # fmt: skip
            served_before_kill = list(cluster.lb.served)

            # Phase 2: the replica holding the next checkpoint commit is killed with
            # SIGKILL mid-request; every mount saves anyway, through the other one.
            def kill(index: int) -> None:
                proc = cluster.replicas[index].proc
                assert proc is not None
                proc.kill()

            for w in writers:
                w.batch(2)
            cluster.lb.kill_during("POST", r"/bridge/v1/folders/\w+/checkpoints$", kill)
            late = RestWriter(cluster, cluster.folder("project", project), 9, 4)
            saves = [pool.submit(w.save) for w in writers]
            late_done = pool.submit(late.run)
            for s in saves:
                reply = s.result()
                assert reply["ok"] is True, reply
            late_done.result()
        finally:
            stop.set()  # the reader ends whatever happened, so the pool can close
        reader.result()
    elapsed = time.monotonic() - started
    rest.append(late)

    assert len(cluster.lb.faults_fired) == 1, cluster.lb.faults_fired
    [(_, _, killed)] = cluster.lb.faults_fired
    dead = cluster.replicas[killed]
    assert dead.proc is not None and dead.proc.wait(timeout=10) == -9
    survivor = cluster.replicas[1 - killed]
    assert min(served_before_kill) > 20, served_before_kill  # both replicas served

    # Every write is there exactly once, with its bytes (read through the survivor).
    with cluster.client() as c:
        for w in writers:
            folder = cluster.folder(w.mount.scope, _owner(runs, w))
            check_files(c, folder, w.expected)
        project_expected = {p: d for r in rest for p, d in r.expected.items()}
        check_files(c, cluster.folder("project", project), project_expected)
    with survivor.db() as db:
        dup = db.execute(
            "SELECT d.scope, f.path, count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
            " WHERE d.company_id = %s AND f.kind = 'file' AND f.path ~ '^rest[0-9]+/f'"
            " GROUP BY 1, 2 HAVING count(*) <> 1",
            (company,),
        ).fetchall()
        assert dup == []  # a retried PUT answered from its receipt, never applied twice

        # No referenced object is gone: every digest a file (live or in the
        # trash) references is still in the bucket.
        referenced = {
            r[0]
            for r in db.execute(
                "SELECT DISTINCT f.digest FROM files f JOIN folders d ON d.id = f.folder_id"
                " WHERE d.company_id = %s AND f.digest IS NOT NULL",
                (company,),
            )
        }
        outcomes = dict(
            db.execute(
                "SELECT outcome, count(*) FROM deletion_journal WHERE company_id = %s"
                " AND done_at IS NOT NULL GROUP BY 1",
                (company,),
            ).fetchall()
        )
    keys = cluster.bucket_keys()
    # Empty files (the agents' new entries) reference no stored object.
    stored = referenced - {EMPTY_DIGEST}
    missing = [d for d in stored if f"objects/{company}/{d[:2]}/{d}" not in keys]
    assert missing == []
    assert {sha(h) for h in HOT} <= referenced
    # The sweeps really raced the writers: they deleted purged contents and
    # found others referenced again.
    assert outcomes.get("deleted", 0) > 0 and outcomes.get("referenced", 0) > 0, outcomes

    # Versions never went back, whichever replica answered.
    assert set(log.seen) == set(watched)
    for folder, versions in log.seen.items():
        assert versions == sorted(versions), folder
        assert len(set(versions)) > 1, folder
    for r in rest:
        assert r.versions == sorted(r.versions) and len(set(r.versions)) == len(r.versions)
    print(f"writes through both replicas and the kill: {elapsed:.1f}s")


def _owner(runs: list[dict[str, Any]], w: MountWriter) -> str:
    token = (w.mount.token_file or Path()).read_text()
    [run] = [r for r in runs if r["token"] == token]
    return str(run["bindings"][w.mount.scope])


def _digests(c: httpx.Client, folder: str) -> dict[str, str]:
    """The folder's live files and their digests, through the balancer."""
    out: dict[str, str] = {}
    cursor = None
    while True:
        r = send(c, "GET", folder + "/", (200,),
                 params={"limit": 1000, **({"cursor": cursor} if cursor else {})})  # fmt: skip
        out |= {e["path"]: e["digest"] for e in r.json()["entries"] if e["kind"] == "file"}
        cursor = r.json()["nextCursor"]
        if cursor is None:
            return out


def check_files(c: httpx.Client, folder: str, expected: dict[str, bytes]) -> None:
    """Exactly the expected files, each with its digest; and every file of the
    shared hot content read back byte for byte."""
    assert _digests(c, folder) == {p: sha(d) for p, d in expected.items()}, folder
    for path, data in expected.items():
        if data in HOT or path == "churn.bin":
            got = send(c, "GET", folder + "/content", (200,), params={"path": path})
            assert got.content == data, (folder, path)
