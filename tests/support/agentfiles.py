"""Helpers for the agent folder contract's tests (docs/internals/invariants.md): runs of
one agent, their mounts, the agent folder as the controller holds it, and a
run's receipts and warnings as people read them."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.constants import REPO
from tests.support.controller import Tenant
from tests.support.mount import FsagentMount, MountFactory

OCTET = {"Content-Type": "application/octet-stream"}


@dataclass
class AgentRun:
    tenant: Tenant
    run_id: str
    token: str
    lease_epoch: int
    agent: str
    task: str | None
    user: str | None

    def token_file(self, mounts: MountFactory) -> Path:
        path = mounts.base / f"token-{self.run_id}"
        path.write_text(self.token)
        return path

    def end(self) -> dict[str, Any]:
        return self.tenant.controller.admin("end-run", self.run_id)


def new_agent(tenant: Tenant, name: str = "agent") -> str:
    agent: str = tenant.controller.admin("create-agent", tenant.company_id, name)["id"]
    return agent


def start_agent_run(
    tenant: Tenant,
    agent: str,
    *,
    user: str | None = None,
    task: str | None = None,
    sandbox: str | None = None,
) -> AgentRun:
    """A run of ``agent`` (responsible user ``user``, or none), optionally on a task."""
    args = ["start-run", tenant.company_id, "--agent", agent]
    args += ["--sandbox", sandbox or f"sbx-{uuid.uuid4().hex[:8]}"]
    if user:
        args += ["--user", user]
    if task:
        args += ["--task", task]
    out = tenant.controller.admin(*args)
    return AgentRun(tenant, out["run_id"], out["token"], out["lease_epoch"], agent, task, user)


def mount_agent(
    mounts: MountFactory,
    run: AgentRun,
    *,
    controller: str | None = None,
    state_dir: Path | None = None,
    extra: list[str] | None = None,
) -> FsagentMount:
    return mounts.mount(
        controller or run.tenant.controller.url,
        scope="agent",
        token_file=run.token_file(mounts),
        state_dir=state_dir,
        extra=extra,
    )


def folder_entries(c: httpx.Client, folder: str) -> Iterator[dict[str, Any]]:
    """Every live entry of a folder (``tenant.folder(...)``), page by page."""
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
        r = c.get(folder + "/", params=params)
        assert r.status_code == 200, f"listing {folder}: HTTP {r.status_code} {r.text[:400]}"
        body = r.json()
        yield from body["entries"]
        cursor = body["nextCursor"]
        if cursor is None:
            return


def agent_files(tenant: Tenant, agent: str, token: str | None = None) -> dict[str, bytes]:
    """Every live file of the agent's folder and its bytes, through the API."""
    folder = tenant.folder("agent", agent)
    out: dict[str, bytes] = {}
    with tenant.client(token) as c:
        for e in folder_entries(c, folder):
            if e["kind"] == "file":
                got = c.get(folder + "/content", params={"path": e["path"]})
                assert got.status_code == 200, got.text
                out[e["path"]] = got.content
    return out


def put(
    c: httpx.Client, tenant: Tenant, scope: str, owner: str, path: str, data: bytes, **headers: str
) -> httpx.Response:
    return c.put(
        tenant.folder(scope, owner) + "/content",
        params={"path": path},
        content=data,
        headers={**OCTET, **headers},
    )


def operate(c: httpx.Client, tenant: Tenant, scope: str, owner: str, **body: Any) -> httpx.Response:
    return c.post(tenant.folder(scope, owner) + "/operations", json=body)


def run_detail(tenant: Tenant, run_id: str, token: str | None = None) -> httpx.Response:
    with tenant.client(token) as c:
        return c.get(f"/api/companies/{tenant.company_id}/runs/{run_id}")


def run_receipts(tenant: Tenant, run_id: str, token: str | None = None) -> list[dict[str, Any]]:
    with tenant.client(token) as c:
        r = c.get(f"/api/companies/{tenant.company_id}/runs/{run_id}/receipts")
    assert r.status_code == 200, r.text
    receipts: list[dict[str, Any]] = r.json()["receipts"]
    return receipts


def folder_counters(tenant: Tenant, scope: str, owner: str) -> tuple[int, int, int]:
    """(version counter, live entries, live bytes) of a folder, from PostgreSQL."""
    with tenant.controller.db() as db:
        row = db.execute(
            "SELECT version_counter, live_entries, live_bytes FROM folders"
            " WHERE company_id = %s AND scope = %s AND owner_id = %s",
            (tenant.company_id, scope, owner),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def flush_reply(m: FsagentMount, *, final: bool = False) -> tuple[int, dict[str, Any]]:
    """``fsagent flush SCOPE --json`` (``--final``) against the mount: exit
    code and reply (a failed save exits 4 and still prints its reply)."""
    out = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "flush", m.scope,
         "--state-dir", str(m.state_dir), "--json", *(["--final"] if final else [])],
        capture_output=True, check=False, cwd=REPO, timeout=600,
    )  # fmt: skip
    reply: dict[str, Any] = json.loads(out.stdout)
    return out.returncode, reply


def unit_stop(m: FsagentMount) -> subprocess.CompletedProcess[str]:
    """The ``ExecStop=`` of ``packaging/systemd/fsagent@.service`` for this
    mount, as systemd runs it (``$$`` is ``$``, ``%i`` the scope), with this
    checkout's fsagent: its exit status is what fails the unit's stop."""
    unit = (REPO / "packaging" / "systemd" / "fsagent@.service").read_text()
    text = unit.split("\nExecStop=", 1)[1]
    lines = [text.split("\n", 1)[0]]
    rest = text.split("\n", 1)[1]
    while lines[-1].endswith("\\"):
        line, rest = rest.split("\n", 1)
        lines.append(line)
    command = " ".join(line.rstrip("\\") for line in lines)
    command = command.replace("$$", "$").replace(
        "${FSAGENT_HOME}/.local/state/fsagent/%i", str(m.state_dir)
    )
    command = command.replace("%i", m.scope).replace(
        "/opt/fsagent/venv/bin/fsagent", str(REPO / ".venv" / "bin" / "fsagent")
    )
    return subprocess.run(
        shlex.split(command), capture_output=True, text=True, check=False, cwd=REPO, timeout=600
    )
