"""Checkpoints observed from outside, for the fault tests: receipts and file
versions in PostgreSQL, the change set and status in a state dir, and
``fsagent flush`` run as a subprocess that may fail or be left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsagent.cli import change_set, collection_status
from fsagent.state.statedir import MARKER
from fsagent.state.store import Store
from tests.support.controller import ControllerProcess
from tests.support.mount import REPO, FsagentMount

OCTET = {"Content-Type": "application/octet-stream"}
BIG = 150 << 20


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def folder_id(ctl: ControllerProcess, company: str, scope: str, owner: str) -> int | None:
    with ctl.db() as conn:
        row = conn.execute(
            "SELECT id FROM folders WHERE company_id = %s AND scope = %s AND owner_id = %s",
            (company, scope, owner),
        ).fetchone()
    return None if row is None else int(row[0])


def receipts(ctl: ControllerProcess, company: str, scope: str, owner: str) -> list[str]:
    """Checkpoint receipts of the folder, oldest first (REST writes keep their own)."""
    fid = folder_id(ctl, company, scope, owner)
    if fid is None:
        return []
    with ctl.db() as conn:
        rows = conn.execute(
            "SELECT operation_id FROM receipts WHERE folder_id = %s AND operation_id LIKE 'cp-%%'"
            " ORDER BY created_at",
            (fid,),
        ).fetchall()
    return [r[0] for r in rows]


def versions(ctl: ControllerProcess, company: str, scope: str, owner: str) -> dict[str, int]:
    """Live path → server version."""
    fid = folder_id(ctl, company, scope, owner)
    if fid is None:
        return {}
    with ctl.db() as conn:
        rows = conn.execute(
            "SELECT path, version FROM files WHERE folder_id = %s AND deleted_at IS NULL",
            (fid,),
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def flush_argv(m: FsagentMount) -> list[str]:
    return [
        sys.executable,
        *("-m", "fsagent.cli", "flush", m.scope),
        *("--state-dir", str(m.state_dir), "--json"),
    ]


def try_flush(m: FsagentMount, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    """`fsagent flush` that may fail: (exit code, reply)."""
    out = subprocess.run(flush_argv(m), capture_output=True, timeout=timeout, cwd=REPO)
    return out.returncode, json.loads(out.stdout or b"{}")


def flush_in_background(m: FsagentMount) -> subprocess.Popen[bytes]:
    return subprocess.Popen(flush_argv(m), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)


def reply_of(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, dict[str, Any]]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, json.loads(out or b"{}")


def status(m: FsagentMount) -> dict[str, Any]:
    """What `fsagent status --json` reports for the mount's state dir (same code, in process)."""
    return collection_status(m.state_dir)


def journal(m: FsagentMount) -> set[str]:
    """Paths in the state dir's change set since the baseline (`fsagent changes`, in
    process): the journal of a FUSE collection, a scan of a plain directory."""
    return {c.path for c in change_set(m.state_dir)[0]}


def upload_in_progress(ctl: ControllerProcess, at_least: int = 8 << 20) -> bool:
    """The controller is spooling an upload and has received ``at_least`` bytes of it."""
    for spool in (ctl.data_dir / "spool").glob("bridge-*"):
        try:
            if spool.stat().st_size >= at_least:
                return True
        except FileNotFoundError:
            continue
    return False


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


__all__ = [
    "BIG",
    "OCTET",
    "flush_in_background",
    "folder_id",
    "journal",
    "random_file",
    "receipts",
    "reply_of",
    "status",
    "try_flush",
    "upload_in_progress",
    "versions",
    "wait_for",
]


def assert_local_copy_discarded(state_dir: Path) -> None:
    """The agent folder's local copy is gone at its stop boundary: its state
    dir is empty, or new and holding nothing (made again at once in the room
    the old one freed, fsagent.state.statedir.discard_state_dir): no binding,
    no journal, no entry, nothing in ``upper/`` or ``objects/``."""
    names = {p.name for p in state_dir.iterdir()}
    if not names:
        return
    assert names <= {MARKER, "lock", "objects", "upper", "db"}, names
    assert list((state_dir / "upper").iterdir()) == []
    assert list((state_dir / "objects").iterdir()) == []
    store = Store.open(state_dir, readonly=True)
    try:
        assert store.dir.binding() is None
        assert store.journal.entries() == []
        assert store.tree.count_entries() == 0
    finally:
        store.close()
