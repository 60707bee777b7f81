"""The one-time import of an existing agent workspace
(``controller admin import-agent-files AGENT DIR [--dry-run]``): CLI homes,
caches, Git metadata and credential stores are excluded, links and special
files reported and never followed, the rest imported with its bytes and exec
bits; a controller-side marker refuses any replay. Real controller and
PostgreSQL, local-disk storage."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from common.limits import AGENT_MAX_FILE_BYTES
from controller.agentimport import scan, store_objects
from controller.config import AgentLimits
from controller.storage.local_disk import LocalDiskProvider
from tests.support.agentfiles import agent_files, new_agent
from tests.support.controller import Tenant
from tests.support.tmp import private_tmpdir

INSTRUCTIONS = "# Agent\n\nKeep notes in notes/. ✓\n".encode()


@pytest.fixture
def workspace() -> Path:
    root = private_tmpdir("fsa-import-")
    files = {
        "AGENTS.md": INSTRUCTIONS,
        "notes/memory.md": b"remember this",
        "bin/tool.sh": b"#!/bin/sh\necho tool\n",
        ".config/app/settings.toml": b"ok = true",
        "empty-dir/.keep": b"",
        # excluded by name, at any depth
        ".git/config": b"[core]",
        "proj/.git": b"gitdir: elsewhere",
        ".codex/config.toml": b"model = x",
        ".claude/settings.json": b"{}",
        "node_modules/left-pad/index.js": b"module.exports = 1",
        "src/__pycache__/a.cpython-311.pyc": b"\x00",
        ".cache/pip/x": b"cached",
        ".ssh/id_ed25519": b"PRIVATE KEY",
        ".aws/credentials": b"[default]",
        ".gnupg/pubring.kbx": b"k",
        ".netrc": b"machine x password y",
        ".config/gh/hosts.yml": b"oauth_token: secret",
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    os.chmod(root / "bin" / "tool.sh", 0o755)
    (root / "link-to-secret").symlink_to(root / ".ssh" / "id_ed25519")
    (root / "linked-dir").symlink_to(root / "notes")
    os.mkfifo(root / "pipe")
    (root / "cafe\u0301.md").write_bytes(b"not NFC")  # an NFD name breaks the path rules
    with open(root / "huge.bin", "wb") as fh:  # sparse: never read, refused by size
        fh.truncate(AGENT_MAX_FILE_BYTES + 1)
    return root


@pytest.fixture(autouse=True)
def cleanup(workspace: Path) -> object:
    yield None
    shutil.rmtree(workspace, ignore_errors=True)


EXCLUDED = {
    ".aws": "credentials",
    ".cache": "cache",
    ".claude": "CLI home",
    ".codex": "CLI home",
    ".config/gh": "credentials",
    ".git": "Git metadata",
    ".gnupg": "credentials",
    ".netrc": "credentials",
    ".ssh": "credentials",
    "node_modules": "cache",
    "proj/.git": "Git metadata",
    "src/__pycache__": "cache",
}


def import_json(tenant: Tenant, agent: str, workspace: Path, *extra: str) -> dict[str, Any]:
    return tenant.controller.admin("import-agent-files", agent, str(workspace), *extra)


def test_import_excludes_reports_and_runs_only_once(tenant: Tenant, workspace: Path) -> None:
    agent = new_agent(tenant)
    dry = import_json(tenant, agent, workspace, "--dry-run")
    assert dry["dry_run"] is True
    assert {e["path"]: e["reason"] for e in dry["excluded"]} == EXCLUDED
    refused = {r["path"]: r["reason"] for r in dry["refused"]}
    assert set(refused) == {"cafe\u0301.md", "huge.bin", "link-to-secret", "linked-dir", "pipe"}
    assert (
        refused["link-to-secret"].startswith("symlink to ")
        and "not followed" in refused["link-to-secret"]
    )
    assert refused["pipe"] == "FIFO: not imported"
    assert "NFC" in refused["cafe\u0301.md"]
    assert "limit per file" in refused["huge.bin"]
    planned = {f["path"] for f in dry["imported"]}
    assert planned == {
        "AGENTS.md", "notes/memory.md", "bin/tool.sh", ".config/app/settings.toml",
        "empty-dir/.keep",
    }  # fmt: skip
    # A dry run changes nothing and leaves no marker.
    assert agent_files(tenant, agent) == {"AGENTS.md": b""}

    done = import_json(tenant, agent, workspace)
    assert done["dry_run"] is False and done["imported"] == dry["imported"]
    assert agent_files(tenant, agent) == {
        "AGENTS.md": INSTRUCTIONS,
        "notes/memory.md": b"remember this",
        "bin/tool.sh": b"#!/bin/sh\necho tool\n",
        ".config/app/settings.toml": b"ok = true",
        "empty-dir/.keep": b"",
    }
    with tenant.client() as c:
        folder = tenant.folder("agent", agent)
        entries = {e["path"]: e for e in c.get(folder + "/").json()["entries"]}
        assert entries["bin/tool.sh"]["executable"] is True
        assert entries["notes/memory.md"]["executable"] is False
        # The new agent's empty entry was replaced, not kept in the trash.
        assert c.get(folder + "/", params={"trash": "true"}).json()["entries"] == []

    # No replay, not even a dry run, and the folder is untouched.
    (workspace / "notes" / "memory.md").write_bytes(b"changed since")
    ctl = tenant.controller
    for extra in ((), ("--dry-run",)):
        code, _, err = ctl.cli("admin", "import-agent-files", agent, str(workspace), *extra)
        assert code == 1 and "already imported" in err, err
    assert agent_files(tenant, agent)["notes/memory.md"] == b"remember this"
    with ctl.db() as db:
        row = db.execute(
            "SELECT source, summary FROM agent_imports WHERE agent_id = %s", (agent,)
        ).fetchone()
    assert row is not None and row[0] == str(workspace)
    assert len(row[1]["imported"]) == 5 and len(row[1]["excluded"]) == len(EXCLUDED)


def test_a_broken_entry_is_refused_and_the_summary_reads_as_text(
    tenant: Tenant, workspace: Path
) -> None:
    agent = new_agent(tenant)
    (workspace / "AGENTS.md").write_bytes(b"caf\xe9\n")
    code, out, err = tenant.controller.cli(
        "admin", "import-agent-files", agent, str(workspace), "--dry-run"
    )
    assert code == 0, err
    first, *lines = out.splitlines()
    assert first.startswith("would import 4 file(s)") and "excluded 12, refused 6" in first
    assert "  refused   AGENTS.md  (the instruction entry: " in "\n".join(lines)
    assert "  excluded  .ssh  (credentials)" in lines
    code, out, err = tenant.controller.cli("admin", "import-agent-files", agent, "/nonexistent")
    assert code == 1 and "is not a directory" in err
    summary = json.loads(
        tenant.controller.cli("admin", "import-agent-files", agent, str(workspace), "--json")[1]
    )
    assert "AGENTS.md" not in {f["path"] for f in summary["imported"]}
    assert agent_files(tenant, agent)["AGENTS.md"] == b""  # the entry stays valid


def test_a_file_with_other_hard_links_is_refused_and_reported(
    tenant: Tenant, workspace: Path
) -> None:
    """A hard link in the directory to a file outside it (a host's secret, say)
    is another name of that file: it is reported, and its bytes are never read."""
    outside = private_tmpdir("fsa-import-outside-")
    try:
        secret = outside / "shadow"
        secret.write_bytes(b"root:$6$secret")
        os.link(secret, workspace / "notes" / "innocent.md")
        os.link(workspace / "bin" / "tool.sh", workspace / "tool-again.sh")  # both names inside
        agent = new_agent(tenant)
        dry = import_json(tenant, agent, workspace, "--dry-run")
        refused = {r["path"]: r["reason"] for r in dry["refused"]}
        for name in ("notes/innocent.md", "bin/tool.sh", "tool-again.sh"):
            assert refused[name].startswith("2 hard links"), refused
            assert refused[name].endswith("not imported"), refused
        done = import_json(tenant, agent, workspace)
        assert {r["path"] for r in done["refused"]} == set(refused)
        files = agent_files(tenant, agent)
        assert "notes/innocent.md" not in files and "tool-again.sh" not in files
        assert b"root:$6$secret" not in files.values()
        assert files["notes/memory.md"] == b"remember this"
    finally:
        shutil.rmtree(outside, ignore_errors=True)


@pytest.mark.parametrize("swap", ["symlink", "hard link", "renamed over"])
def test_a_name_swapped_after_the_scan_is_refused_not_read(swap: str) -> None:
    """Between the scan and the read, a planned file's name is made to lead
    elsewhere: nothing but the scanned file's bytes is ever stored."""
    root = private_tmpdir("fsa-import-swap-")
    try:
        source, outside = root / "ws", root / "outside"
        source.mkdir()
        outside.mkdir()
        secret = outside / "secret"
        secret.write_bytes(b"host secret")
        (source / "a.md").write_bytes(b"agent notes")
        plan = scan(source, "AGENTS.md", AgentLimits())
        assert [f.path for f in plan.files] == ["a.md"]
        # Held open, the scanned inode cannot be reused by the file put in its place.
        held = os.open(source / "a.md", os.O_RDONLY)
        (source / "a.md").unlink()
        if swap == "symlink":
            (source / "a.md").symlink_to(secret)
        elif swap == "hard link":
            os.link(secret, source / "a.md")
        else:
            (source / "tmp").write_bytes(b"other bytes")
            os.rename(source / "tmp", source / "a.md")
        storage = LocalDiskProvider(root / "store")
        stored, created = asyncio.run(store_objects(storage, str(uuid.uuid4()), plan))
        assert stored == {} and created == [] and plan.files == []
        assert [r["path"] for r in plan.refused] == ["a.md"]
        assert list((root / "store").rglob("objects/**/*")) == []
        os.close(held)
    finally:
        shutil.rmtree(root, ignore_errors=True)
