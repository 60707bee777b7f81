"""The agent's instruction entry: every new agent's folder
starts with an empty ``AGENTS.md``; the entry is UTF-8 of at most 1 MiB and
cannot be deleted, through the API (409 ``entry_protected``), the mount
(``EPERM``) or a checkpoint (refused for that entry, reported in the receipt).
Real controller, PostgreSQL and FUSE."""

from __future__ import annotations

import errno
import hashlib
import os
import signal

import pytest

from common.limits import ENTRY_MAX_BYTES
from tests.support.agentfiles import (
    agent_files,
    folder_counters,
    mount_agent,
    new_agent,
    operate,
    put,
    run_receipts,
    start_agent_run,
)
from tests.support.bridge import Run
from tests.support.checkpoints import assert_local_copy_discarded
from tests.support.controller import Tenant
from tests.support.mount import MountFactory

EMPTY = hashlib.sha256(b"").hexdigest()
NOT_UTF8 = b"caf\xe9 au lait\n"


def test_a_new_agent_starts_with_an_empty_entry_that_cannot_be_deleted(tenant: Tenant) -> None:
    agent = new_agent(tenant)
    assert agent_files(tenant, agent) == {"AGENTS.md": b""}
    before = folder_counters(tenant, "agent", agent)
    with tenant.client() as c:
        described = c.get(f"/api/companies/{tenant.company_id}/agents/{agent}").json()
        assert described["entryPath"] == "AGENTS.md"
        assert described["usage"] == {"entries": 1, "totalBytes": 0}

        r = operate(c, tenant, "agent", agent, action="delete", path="AGENTS.md")
        assert r.status_code == 409 and r.json()["code"] == "entry_protected", r.text
        r = operate(c, tenant, "agent", agent, action="move", path="AGENTS.md", to="OLD.md")
        assert r.status_code == 409 and r.json()["code"] == "entry_protected", r.text

        r = put(c, tenant, "agent", agent, "AGENTS.md", NOT_UTF8)
        assert r.status_code == 422 and r.json()["code"] == "entry_not_utf8", r.text
        assert r.json()["details"][0]["path"] == "AGENTS.md"
        r = put(c, tenant, "agent", agent, "AGENTS.md", b"x" * (ENTRY_MAX_BYTES + 1))
        assert r.status_code == 422 and r.json()["code"] == "entry_too_large", r.text
        assert folder_counters(tenant, "agent", agent) == before  # nothing changed

        # Other files of the folder may hold any bytes; the entry takes text.
        assert put(c, tenant, "agent", agent, "notes.bin", NOT_UTF8).status_code == 201
        text = "# Instructions\n\nBe brief. ✓\n".encode()
        r = put(c, tenant, "agent", agent, "AGENTS.md", text, **{"If-Match": f'"{EMPTY}"'})
        assert r.status_code == 200, r.text
        big_text = b"a" * ENTRY_MAX_BYTES
        assert put(c, tenant, "agent", agent, "AGENTS.md", big_text).status_code == 200
        assert put(c, tenant, "agent", agent, "AGENTS.md", text).status_code == 200
    assert agent_files(tenant, agent) == {"AGENTS.md": text, "notes.bin": NOT_UTF8}


def test_set_agent_entry_moves_the_protection(tenant: Tenant) -> None:
    ctl = tenant.controller
    agent = new_agent(tenant)
    out = ctl.admin("set-agent-entry", agent, "docs/INSTRUCTIONS.md")
    assert out == {"agent_id": agent, "entry_path": "docs/INSTRUCTIONS.md", "created": True}
    assert agent_files(tenant, agent) == {"AGENTS.md": b"", "docs/INSTRUCTIONS.md": b""}
    with tenant.client() as c:
        # A directory holding the entry cannot go either; the old entry can.
        r = operate(c, tenant, "agent", agent, action="delete", path="docs")
        assert r.status_code == 409 and r.json()["code"] == "entry_protected", r.text
        r = operate(c, tenant, "agent", agent, action="move", path="docs", to="manual")
        assert r.status_code == 409 and r.json()["code"] == "entry_protected", r.text
        r = operate(c, tenant, "agent", agent, action="delete", path="AGENTS.md")
        assert r.status_code == 200, r.text
        assert put(c, tenant, "agent", agent, "big.md", b"b" * (ENTRY_MAX_BYTES + 1)).status_code
    code, _, err = ctl.cli("admin", "set-agent-entry", agent, "docs")
    assert code == 1 and "docs is a directory" in err, err
    code, _, err = ctl.cli("admin", "set-agent-entry", agent, "big.md")
    assert code == 1 and "entry_too_large" in err, err
    code, _, err = ctl.cli("admin", "set-agent-entry", agent, "../escape.md")
    assert code == 1 and "invalid_path" in err, err
    code, _, err = ctl.cli("admin", "set-agent-entry", "not-a-uuid", "x.md")
    assert code == 1 and "agent must be a UUID" in err, err
    # Setting an existing text file keeps its content.
    ctl.admin("set-agent-entry", agent, "docs/INSTRUCTIONS.md")
    with tenant.client() as c:
        described = c.get(f"/api/companies/{tenant.company_id}/agents/{agent}").json()
    assert described["entryPath"] == "docs/INSTRUCTIONS.md"


def bridge_run(tenant: Tenant, agent: str) -> Run:
    run = start_agent_run(tenant, agent, user=tenant.user_id)
    return Run(tenant, run.run_id, run.token, run.lease_epoch, agent, None, None)


def test_a_checkpoint_is_refused_only_for_the_entry_and_says_so(tenant: Tenant) -> None:
    agent = new_agent(tenant)
    run = bridge_run(tenant, agent)
    notes, bad = run.upload("agent", b"notes"), run.upload("agent", NOT_UTF8)
    assert notes.status_code == bad.status_code == 200
    r = run.commit(
        "agent",
        [
            {"op": "delete", "path": "AGENTS.md"},
            {
                "op": "put",
                "path": "notes.md",
                "digest": notes.json()["digest"],
                "executable": False,
            },
        ],
    )
    assert r.status_code == 200, r.text
    assert [(e["path"], e["code"]) for e in r.json()["refusedEntries"]] == [
        ("AGENTS.md", "ENTRY_PROTECTED")
    ]
    r = run.commit(
        "agent",
        [
            {"op": "put", "path": "AGENTS.md", "digest": bad.json()["digest"], "executable": False},
            {"op": "mkdir", "path": "AGENTS.md/inside"},
            {"op": "mkdir", "path": "memory"},
        ],
    )
    assert r.status_code == 200, r.text
    assert [(e["path"], e["code"]) for e in r.json()["refusedEntries"]] == [
        ("AGENTS.md", "ENTRY_NOT_UTF8"),
        ("AGENTS.md/inside", "ENTRY_PROTECTED"),
    ]
    assert agent_files(tenant, agent) == {"AGENTS.md": b"", "notes.md": b"notes"}
    receipts = run_receipts(tenant, run.run_id)
    assert [(r["outcome"], r["filesChanged"]) for r in receipts] == [("saved", 1), ("saved", 1)]
    assert receipts[1]["refusedEntries"][0]["code"] == "ENTRY_NOT_UTF8"
    assert {w["code"] for w in receipts[1]["warnings"]} == {"ENTRY_NOT_UTF8", "ENTRY_PROTECTED"}
    # An entry over 1 MiB is refused for the entry alone; the rest is saved.
    huge, more = run.upload("agent", b"e" * (ENTRY_MAX_BYTES + 1)), run.upload("agent", b"more")
    assert huge.status_code == more.status_code == 200
    r = run.commit(
        "agent",
        [
            {
                "op": "put",
                "path": "AGENTS.md",
                "digest": huge.json()["digest"],
                "executable": False,
            },
            {"op": "put", "path": "more.md", "digest": more.json()["digest"], "executable": False},
        ],
    )
    assert r.status_code == 200, r.text
    assert [(e["path"], e["code"]) for e in r.json()["refusedEntries"]] == [
        ("AGENTS.md", "ENTRY_TOO_LARGE")
    ]
    assert agent_files(tenant, agent) == {
        "AGENTS.md": b"",
        "notes.md": b"notes",
        "more.md": b"more",
    }
    last = run_receipts(tenant, run.run_id)[-1]
    assert (last["outcome"], last["filesChanged"]) == ("saved", 1)
    assert [w["code"] for w in last["warnings"]] == ["ENTRY_TOO_LARGE"]


@pytest.mark.fuse
def test_the_mount_protects_the_entry_and_keeps_a_refused_entry_unsaved(
    mounts_in_both_modes: MountFactory, tenant: Tenant
) -> None:
    """In the kernel's "no open" mode as with OPEN/RELEASE handles."""
    ctl = tenant.controller
    agent = new_agent(tenant)
    ctl.admin("set-agent-entry", agent, "guide/AGENTS.md")
    run = start_agent_run(tenant, agent, user=tenant.user_id)
    m = mount_agent(mounts_in_both_modes, run)
    root = m.mountpoint
    assert (root / "guide" / "AGENTS.md").read_bytes() == b""
    for attempt in (
        lambda: os.unlink(root / "guide" / "AGENTS.md"),
        lambda: os.rename(root / "guide" / "AGENTS.md", root / "guide" / "OLD.md"),
        lambda: os.rename(root / "guide", root / "manual"),
    ):
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EPERM
    # Replacing its content is fine, in place or by renaming a file over it.
    (root / "guide" / "draft.md").write_bytes(b"# Guide\n")
    os.replace(root / "guide" / "draft.md", root / "guide" / "AGENTS.md")
    (root / "AGENTS.md").unlink()  # no longer the entry: an ordinary file
    reply = m.fsagent("flush", "agent")
    assert reply["ok"] is True, reply
    assert agent_files(tenant, agent) == {"guide/AGENTS.md": b"# Guide\n"}

    # Invalid content cannot be refused at write time: the save leaves it out.
    (root / "guide" / "AGENTS.md").write_bytes(NOT_UTF8)
    (root / "memory.md").write_bytes(b"remember")
    reply = m.fsagent("flush", "agent")
    assert reply["ok"] is True, reply
    refused = reply["result"]["receipt"]["refusedEntries"]
    assert [(e["path"], e["code"]) for e in refused] == [("guide/AGENTS.md", "ENTRY_NOT_UTF8")]
    assert agent_files(tenant, agent) == {"guide/AGENTS.md": b"# Guide\n", "memory.md": b"remember"}
    assert set(m.changes()) == {"guide/AGENTS.md"}  # still unsaved
    (root / "guide" / "AGENTS.md").write_bytes(b"# Guide, fixed\n")
    assert m.signal(signal.SIGTERM) == 0, m.stderr()
    assert agent_files(tenant, agent)["guide/AGENTS.md"] == b"# Guide, fixed\n"
    # The stop boundary discarded the run's local copy of the agent folder.
    assert_local_copy_discarded(m.state_dir)


def test_a_stale_editor_save_is_409_stale_save_and_changes_nothing(tenant: Tenant) -> None:
    """The editor sends the digest it read as X-Base-Digest: a stale one is
    409 ``stale_save``, and nothing is written."""
    agent = new_agent(tenant)
    folder = tenant.folder("agent", agent)
    with tenant.client() as c:
        read = c.get(folder + "/content", params={"path": "AGENTS.md"})
        base = read.headers["etag"].strip('"')
        assert put(c, tenant, "agent", agent, "AGENTS.md", b"# theirs\n").status_code == 200
        before = folder_counters(tenant, "agent", agent)
        r = put(c, tenant, "agent", agent, "AGENTS.md", b"# mine\n", **{"X-Base-Digest": base})
        assert r.status_code == 409 and r.json()["code"] == "stale_save", r.text
        theirs = hashlib.sha256(b"# theirs\n").hexdigest()
        assert r.json()["details"] == [{"path": "AGENTS.md", "exists": True, "digest": theirs}]
        # "none": the editor read no file, and one is there now.
        r = put(c, tenant, "agent", agent, "AGENTS.md", b"x", **{"X-Base-Digest": "none"})
        assert r.status_code == 409 and r.json()["code"] == "stale_save", r.text
        # A base naming a file that was deleted since.
        r = put(c, tenant, "agent", agent, "GONE.md", b"x", **{"X-Base-Digest": theirs})
        assert r.status_code == 409 and r.json()["details"][0]["exists"] is False
        assert folder_counters(tenant, "agent", agent) == before
        # Malformed, or sent with an HTTP condition: 400, nothing written.
        for headers in (
            {"X-Base-Digest": f'"{theirs}"'},
            {"X-Base-Digest": "abc"},
            {"X-Base-Digest": theirs, "If-Match": f'"{theirs}"'},
            {"X-Base-Digest": "none", "If-None-Match": "*"},
        ):
            r = put(c, tenant, "agent", agent, "AGENTS.md", b"# mine\n", **headers)
            assert r.status_code == 400, (headers, r.text)
            assert r.json()["details"][0]["code"] == "invalid_precondition", r.text
        assert folder_counters(tenant, "agent", agent) == before
        # Based on the version it now sees, the save goes through; a new file with none.
        r = put(c, tenant, "agent", agent, "AGENTS.md", b"# mine\n", **{"X-Base-Digest": theirs})
        assert r.status_code == 200, r.text
        r = put(c, tenant, "agent", agent, "NEW.md", b"new\n", **{"X-Base-Digest": "none"})
        assert r.status_code == 201, r.text
    assert agent_files(tenant, agent) == {"AGENTS.md": b"# mine\n", "NEW.md": b"new\n"}


def test_a_failed_if_match_is_412_for_other_clients(tenant: Tenant) -> None:
    """HTTP's conditions keep HTTP's status: If-Match (and If-None-Match) that
    does not hold is 412 ``precondition_failed``, and nothing is written."""
    agent = new_agent(tenant)
    folder = tenant.folder("agent", agent)
    with tenant.client() as c:
        read = c.get(folder + "/content", params={"path": "AGENTS.md"})
        etag = read.headers["etag"]
        assert etag == f'"{EMPTY}"'
        # Someone else saves first (another tab, or an agent run's save).
        assert put(c, tenant, "agent", agent, "AGENTS.md", b"# theirs\n").status_code == 200
        before = folder_counters(tenant, "agent", agent)
        r = put(c, tenant, "agent", agent, "AGENTS.md", b"# mine\n", **{"If-Match": etag})
        assert r.status_code == 412 and r.json()["code"] == "precondition_failed", r.text
        theirs = hashlib.sha256(b"# theirs\n").hexdigest()
        assert r.json()["details"] == [{"path": "AGENTS.md", "exists": True, "digest": theirs}]
        r = put(c, tenant, "agent", agent, "NEW.md", b"x", **{"If-Match": "*"})
        assert r.status_code == 412 and r.json()["details"][0]["exists"] is False
        r = put(c, tenant, "agent", agent, "AGENTS.md", b"x", **{"If-None-Match": "*"})
        assert r.status_code == 412
        assert folder_counters(tenant, "agent", agent) == before
        trash = c.get(folder + "/", params={"trash": "true"}).json()["entries"]
        # Only the replaced empty entry of the first save; nothing of the refused ones.
        assert [(e["path"], e["byteSize"]) for e in trash] == [("AGENTS.md", 0)]
        # With the digest it now sees, the overwrite goes through.
        r = put(c, tenant, "agent", agent, "AGENTS.md", b"# mine\n", **{"If-Match": f'"{theirs}"'})
        assert r.status_code == 200, r.text
    assert agent_files(tenant, agent) == {"AGENTS.md": b"# mine\n"}
