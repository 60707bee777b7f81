"""A minimal bridge client for controller-side tests (fsagent has the real one)."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import zstandard

from common.bridge import CHUNK_MAX, END_FRAME, PREFIX, encode_frame
from tests.support.controller import Tenant, client_tls


def framed(data: bytes, chunk: int = CHUNK_MAX) -> bytes:
    cctx = zstandard.ZstdCompressor()
    return (
        b"".join(encode_frame(data[i : i + chunk], cctx) for i in range(0, len(data), chunk))
        + END_FRAME
    )


def api_client(tenant: Tenant, token: str) -> httpx.Client:
    """A client of the API bridge: ``/api/...`` paths go to ``/bridge/v1/api/...``
    with the run token, the only way a run token reaches the API."""
    return httpx.Client(
        base_url=tenant.controller.url + PREFIX,
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
        verify=client_tls(),
    )


@dataclass
class Run:
    tenant: Tenant
    run_id: str
    token: str
    lease_epoch: int
    agent: str
    task: str | None
    project: str | None

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.tenant.controller.url + PREFIX,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=60,
            verify=client_tls(),
        )

    def api_client(self) -> httpx.Client:
        return api_client(self.tenant, self.token)

    def upload(self, scope: str, data: bytes, **headers: str) -> httpx.Response:
        with self.client() as c:
            return c.put(
                f"/folders/{scope}/uploads",
                content=framed(data),
                headers={"X-Content-SHA256": hashlib.sha256(data).hexdigest(), **headers},
            )

    def commit(self, scope: str, entries: list[dict[str, Any]], **fields: Any) -> httpx.Response:
        body = {
            "operationId": str(uuid.uuid4()),
            "leaseEpoch": self.lease_epoch,
            "final": False,
            "entries": entries,
            **fields,
        }
        with self.client() as c:
            return c.post(f"/folders/{scope}/checkpoints", json=body)

    def save(self, scope: str, files: dict[str, bytes], **fields: Any) -> httpx.Response:
        entries = []
        for path, data in files.items():
            r = self.upload(scope, data)
            assert r.status_code == 200, r.text
            entries.append(
                {"op": "put", "path": path, "digest": r.json()["digest"], "executable": False}
            )
        return self.commit(scope, entries, **fields)


def start_run(tenant: Tenant, *, user: bool = True, sandbox: str | None = None) -> Run:
    ctl = tenant.controller
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    task = ctl.admin("create-task", tenant.company_id, project, "t")["id"]
    agent = ctl.admin("create-agent", tenant.company_id, "a")["id"]
    args = ["start-run", tenant.company_id, "--agent", agent, "--task", task]
    if user:
        args += ["--user", tenant.user_id]
    if sandbox:
        args += ["--sandbox", sandbox]
    out = ctl.admin(*args)
    return Run(tenant, out["run_id"], out["token"], out["lease_epoch"], agent, task, project)
