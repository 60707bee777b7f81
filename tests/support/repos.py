"""Repository checkpoints from the controller's side: a task with workspaces,
a run bound to it, and a client of the repository routes that builds
checkpoint bodies directly (fsagent has the real scanner)."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from common.bridge import (
    BATCH_HEADER,
    BATCH_MAGIC,
    BATCH_MEMBER_MAX,
    FRAME_HEADER,
    MEMBER_HEADER,
    PREFIX,
    encode_batch,
)
from common.wire import Frame, decode_frame
from tests.support.bridge import framed
from tests.support.controller import Tenant, client_tls


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_member(path: str, data: bytes, executable: bool = False) -> dict[str, Any]:
    return {
        "path": path,
        "kind": "file",
        "digest": sha(data),
        "byteSize": len(data),
        "executable": executable,
    }


def link_member(path: str, target: str) -> dict[str, Any]:
    return {"path": path, "kind": "symlink", "target": target}


def dir_member(path: str) -> dict[str, Any]:
    return {"path": path, "kind": "dir"}


HEAD = b"ref: refs/heads/main\n"


def small_repo() -> dict[str, bytes | str | None]:
    """A checkout as path -> content (bytes: a file; str: a symlink target;
    None: a directory): a minimal repository with a working tree."""
    return {
        ".git": None,
        ".git/HEAD": HEAD,
        ".git/refs/heads/main": b"0123456789abcdef0123456789abcdef01234567\n",
        ".git/objects/ab/cdef": b"loose object bytes",
        ".git/index": b"DIRC index bytes",
        "README.md": b"# app\n",
        "bin/run.sh": b"#!/bin/sh\necho hi\n",
        "src/main.py": b"print('hello')\n",
        "docs/link.md": "../README.md",
    }


def members_of(
    tree: dict[str, bytes | str | None], executable: set[str] | None = None
) -> list[dict[str, Any]]:
    out = []
    for path, content in tree.items():
        if content is None:
            out.append(dir_member(path))
        elif isinstance(content, str):
            out.append(link_member(path, content))
        else:
            out.append(file_member(path, content, path in (executable or {"bin/run.sh"})))
    return out


def decode_batch(body: bytes) -> list[tuple[bytes, bytes]]:
    """A fetched batch body as (declared SHA-256, bytes) per member, every
    frame verified (no size limits: a restore fetches objects of any size)."""
    magic, count = BATCH_HEADER.unpack_from(body)
    assert magic == BATCH_MAGIC
    pos = BATCH_HEADER.size
    out = []
    for _ in range(count):
        size, digest = MEMBER_HEADER.unpack_from(body, pos)
        pos += MEMBER_HEADER.size
        raw = bytearray()
        while True:
            clen, rlen, checksum = FRAME_HEADER.unpack_from(body, pos)
            pos += FRAME_HEADER.size
            if clen == 0 and rlen == 0:
                break
            raw += decode_frame(Frame(rlen, checksum, bytes(body[pos : pos + clen])))
            pos += clen
        assert len(raw) == size
        out.append((digest, bytes(raw)))
    assert pos == len(body), "bytes after the last member"
    return out


@dataclass
class RepoRun:
    """A run of a task whose project has workspaces, with the run token's client."""

    tenant: Tenant
    project: str
    task: str
    agent: str
    run_id: str
    token: str
    lease_epoch: int
    env: dict[str, str]
    repos: list[dict[str, Any]]
    workspaces: dict[str, str] = field(default_factory=dict)
    """Workspace id by the name the test gave it."""

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.tenant.controller.url + PREFIX,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=120,
            verify=client_tls(),
        )

    def ws(self, name: str | None = None) -> str:
        return self.workspaces[name] if name else next(iter(self.workspaces.values()))

    def listing(self) -> dict[str, Any]:
        with self.client() as c:
            r = c.get("/repos")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def upload(self, ws: str, data: bytes) -> httpx.Response:
        with self.client() as c:
            return c.put(f"/repos/{ws}/uploads", content=framed(data))

    def upload_all(self, ws: str, blobs: list[bytes]) -> None:
        """Every blob: small ones in batches (one request per 1,000), the
        others one per request."""
        small = [b for b in blobs if len(b) <= BATCH_MEMBER_MAX]
        with self.client() as c:
            for start in range(0, len(small), 1000):
                part = small[start : start + 1000]
                r = c.put(f"/repos/{ws}/uploads/batch", content=encode_batch(part))
                assert r.status_code == 200, r.text
            for blob in blobs:
                if len(blob) > BATCH_MEMBER_MAX:
                    r = c.put(f"/repos/{ws}/uploads", content=framed(blob))
                    assert r.status_code == 200 and r.json()["digest"] == sha(blob), r.text

    def missing(self, ws: str, digests: list[str]) -> httpx.Response:
        with self.client() as c:
            return c.post(f"/repos/{ws}/missing", json={"digests": digests})

    def commit(
        self,
        ws: str,
        members: list[dict[str, Any]],
        *,
        base: str | None = None,
        removed: list[str] | None = None,
        config: list[list[str]] | None = None,
        operation_id: str | None = None,
        lease_epoch: int | None = None,
    ) -> httpx.Response:
        body = {
            "operationId": operation_id or str(uuid.uuid4()),
            "leaseEpoch": self.lease_epoch if lease_epoch is None else lease_epoch,
            "base": base,
            "members": members,
            "removed": removed or [],
            "config": config or [],
        }
        with self.client() as c:
            return c.post(f"/repos/{ws}/checkpoints", json=body)

    def save(self, ws: str, tree: dict[str, bytes | str | None], **fields: Any) -> dict[str, Any]:
        """Upload the tree's contents and commit it whole; the receipt."""
        blobs = [c for c in tree.values() if isinstance(c, bytes)]
        self.upload_all(ws, blobs)
        r = self.commit(ws, members_of(tree), **fields)
        assert r.status_code == 200, r.text
        receipt: dict[str, Any] = r.json()
        return receipt

    def manifest(self, ws: str, checkpoint: str = "current") -> httpx.Response:
        with self.client() as c:
            return c.get(f"/repos/{ws}/checkpoints/{checkpoint}/manifest")

    def fetch(self, ws: str, digests: list[str]) -> httpx.Response:
        with self.client() as c:
            return c.post(f"/repos/{ws}/objects/batch", json={"digests": digests})


def add_workspace(tenant: Tenant, project: str, url: str, *extra: str) -> dict[str, Any]:
    return tenant.controller.admin("add-workspace", project, "--repo-url", url, *extra)


def repo_run(
    tenant: Tenant,
    urls: dict[str, str] | None = None,
    *,
    primary: str | None = None,
    sandbox: str | None = None,
    project: str | None = None,
    task: str | None = None,
) -> RepoRun:
    """A project with one workspace per ``urls`` entry (test name -> repo URL),
    a task, and a run of it (which binds them)."""
    ctl = tenant.controller
    if project is None:
        project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    if task is None:
        task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    workspaces = {}
    for name, url in (
        urls if urls is not None else {"app": "https://git.example/o/app.git"}
    ).items():
        extra = ["--primary"] if name == primary else []
        workspaces[name] = add_workspace(tenant, project, url, *extra)["workspace_id"]
    args = [
        "start-run",
        tenant.company_id,
        "--agent",
        agent,
        "--task",
        task,
        "--home",
        "/home/agent",
    ]
    if sandbox:
        args += ["--sandbox", sandbox]
    out = ctl.admin(*args)
    return RepoRun(
        tenant,
        project,
        task,
        agent,
        out["run_id"],
        out["token"],
        out["lease_epoch"],
        out["env"],
        out["repos"],
        workspaces,
    )


def restart(run: RepoRun, sandbox: str | None = None) -> RepoRun:
    """Another run of the same task (a new sandbox unless ``sandbox``)."""
    ctl = run.tenant.controller
    args = ["start-run", run.tenant.company_id, "--agent", run.agent, "--task", run.task]
    if sandbox:
        args += ["--sandbox", sandbox]
    out = ctl.admin(*args, "--home", "/home/agent")
    return RepoRun(
        run.tenant,
        run.project,
        run.task,
        run.agent,
        out["run_id"],
        out["token"],
        out["lease_epoch"],
        out["env"],
        out["repos"],
        dict(run.workspaces),
    )


__all__ = [
    "HEAD",
    "RepoRun",
    "add_workspace",
    "decode_batch",
    "dir_member",
    "file_member",
    "link_member",
    "members_of",
    "repo_run",
    "restart",
    "sha",
    "small_repo",
]
