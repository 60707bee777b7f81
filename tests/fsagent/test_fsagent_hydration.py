"""Lazy hydration: metadata first (100,000 entries mount in seconds), contents on demand.

Runs against a DirectoryBridgeClient source and against the real controller.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import pytest

from common.bridge import MANIFEST_PAGE_MAX
from common.limits import MAX_ENTRIES
from tests.support.controller import ControllerProcess, Tenant
from tests.support.lossy_proxy import LossyProxy
from tests.support.mount import MountError, MountFactory, sha256

pytestmark = pytest.mark.fuse

OCTET = {"Content-Type": "application/octet-stream"}


def big_manifest_source(root: Path, n: int, agent_entry: str | None = None) -> Path:
    """``n`` files in 100 directories sharing a handful of objects (metadata-heavy);
    with ``agent_entry``, an agent folder under its contract (that entry)."""
    contents = [f"content {i}\n".encode() for i in range(4)]
    objects = root / "agent" / "objects"
    objects.mkdir(parents=True)
    for data in contents:
        (objects / sha256(data)).write_bytes(data)
    entries = []
    for i in range(n):
        data = contents[i % 4]
        entries.append({"path": f"d{i % 100:03d}/f{i:06d}.txt", "kind": "file",
                        "digest": sha256(data), "byteSize": len(data),
                        "executable": i % 7 == 0, "version": i + 1, "deleted": False})  # fmt: skip
    (root / "agent" / "manifest.json").write_text(json.dumps({"entries": entries, "highWater": n}))
    owner = str(uuid.uuid4())
    run = {"runId": str(uuid.uuid4()), "companyId": str(uuid.uuid4()), "agentId": owner,
           "leaseEpoch": 1, "active": True,
           "bindings": {"task": None, "agent": owner, "user": None, "project": None}}  # fmt: skip
    if agent_entry is not None:
        run["agentEntry"] = agent_entry
    (root / "run.json").write_text(json.dumps(run))
    return root


def test_hydrate_100k_entries_mounts_in_seconds(mounts: MountFactory) -> None:
    src = big_manifest_source(mounts.base / "big", 100_000)
    started = time.monotonic()
    m = mounts.mount(src)
    mount_seconds = time.monotonic() - started
    print(f"\n100,000-entry manifest: mounted in {mount_seconds:.2f}s ({m.stderr().strip()})")
    assert mount_seconds < 30, f"mount took {mount_seconds:.1f}s"
    assert len(os.listdir(m.mountpoint)) == 100
    assert len(os.listdir(m.mountpoint / "d042")) == 1000
    st = os.stat(m.mountpoint / "d007" / "f000007.txt")
    assert st.st_size == len(b"content 3\n") and st.st_mode & 0o100
    assert (m.mountpoint / "d099" / "f099999.txt").read_bytes() == b"content 3\n"
    assert m.changes() == {}
    status = m.fsagent("status")["collections"][0]
    assert status["unsavedChanges"] == 0 and status["state"] == "mounted"


def test_first_open_waits_for_that_file_only(mounts: MountFactory) -> None:
    files: dict[str, bytes | None] = {f"f{i:02d}": os.urandom(1000 + i) for i in range(40)}
    src = mounts.source({"agent": files}, fetch_delay=0.4)
    # Background prefetch is running (one at a time, 0.4 s each: 16 s for all).
    m = mounts.mount(src, extra=["--prefetch", "1"])
    started = time.monotonic()
    assert (m.mountpoint / "f39").read_bytes() == files["f39"]
    waited = time.monotonic() - started
    assert waited < 3, f"open waited {waited:.1f}s: it queued behind the prefetch"
    have = {p.name for p in (m.state_dir / "objects").iterdir()}
    assert sha256(files["f39"] or b"") in have
    assert len(have) < 20, "the whole folder was fetched before the first open returned"


def test_without_prefetch_only_opened_files_are_fetched(mounts: MountFactory) -> None:
    files: dict[str, bytes | None] = {f"f{i}": f"data {i}".encode() for i in range(10)}
    m = mounts.mount(mounts.source({"agent": files}), extra=["--prefetch", "0"])
    assert list((m.state_dir / "objects").iterdir()) == []
    assert sorted(os.listdir(m.mountpoint)) == sorted(files)
    assert os.stat(m.mountpoint / "f3").st_size == len(b"data 3")  # metadata needs no fetch
    assert (m.mountpoint / "f3").read_bytes() == b"data 3"
    assert [p.name for p in (m.state_dir / "objects").iterdir()] == [sha256(b"data 3")]


def test_object_with_wrong_bytes_is_refused(mounts: MountFactory) -> None:
    src = mounts.source({"agent": {"good": b"good", "forged": b"original"}})
    forged = src / "agent" / "objects" / sha256(b"original")
    forged.chmod(0o644)
    forged.write_bytes(b"tampered")
    m = mounts.mount(src, extra=["--prefetch", "0"])
    assert (m.mountpoint / "good").read_bytes() == b"good"
    with pytest.raises(OSError) as info:
        (m.mountpoint / "forged").read_bytes()
    assert info.value.errno == errno.EIO
    assert sha256(b"original") not in {p.name for p in (m.state_dir / "objects").iterdir()}


# --- against the real controller ----------------------------------------------------


def start_run(tenant: Tenant, *extra: str) -> tuple[str, dict[str, object]]:
    agent = tenant.controller.admin("create-agent", tenant.company_id, "bot")["id"]
    run = tenant.controller.admin("start-run", tenant.company_id, "--agent", agent, *extra)
    return agent, run


def test_hydrates_from_controller_lazily(mounts: MountFactory, tenant: Tenant) -> None:
    agent, run = start_run(tenant)
    files = {f"docs/n{i}.md": f"note {i}\n".encode() * (i + 1) for i in range(12)}
    files["bin/tool"] = b"#!/bin/sh\necho hi\n"
    with tenant.client() as c:
        for path, data in files.items():
            headers = {**OCTET, "X-File-Executable": "true" if path == "bin/tool" else "false"}
            r = c.put(tenant.folder("agent", agent) + "/content", params={"path": path},
                      content=data, headers=headers)  # fmt: skip
            assert r.status_code in (200, 201), r.text
    token_file = mounts.base / "token"
    token_file.write_text(str(run["token"]))
    m = mounts.mount(tenant.controller.url, token_file=token_file, extra=["--prefetch", "0"])
    assert sorted(os.listdir(m.mountpoint / "docs")) == sorted(p[5:] for p in files if "docs/" in p)
    assert list((m.state_dir / "objects").iterdir()) == []
    assert (m.mountpoint / "docs" / "n5.md").read_bytes() == files["docs/n5.md"]
    assert [p.name for p in (m.state_dir / "objects").iterdir()] == [
        hashlib.sha256(files["docs/n5.md"]).hexdigest()
    ]
    assert os.stat(m.mountpoint / "bin" / "tool").st_mode & 0o100
    for path, data in files.items():
        assert (m.mountpoint / path).read_bytes() == data
    # The unbound task collection of the same run: empty and read-only.
    t = mounts.mount(tenant.controller.url, scope="task", token_file=token_file)
    assert os.listdir(t.mountpoint) == []
    with pytest.raises(OSError) as info:
        (t.mountpoint / "x").write_bytes(b"x")
    assert info.value.errno == errno.EROFS


def test_ended_run_is_refused_with_a_clear_error(mounts: MountFactory, tenant: Tenant) -> None:
    _, run = start_run(tenant)
    tenant.controller.admin("end-run", str(run["run_id"]))
    token_file = mounts.base / "token"
    token_file.write_text(str(run["token"]))
    m = mounts.mount(tenant.controller.url, token_file=token_file, start=False)
    with pytest.raises(MountError) as info:
        m.start()
    assert "exited with 4" in str(info.value) and "HTTP 401" in str(info.value)
    with httpx.Client() as c:  # the controller itself is fine
        assert c.get(tenant.controller.url + "/healthz").status_code == 200


@pytest.fixture
def proxy(controller: ControllerProcess) -> Iterator[LossyProxy]:
    """Requested before the mounts, so it outlives them (tests/system/test_batch_faults.py)."""
    p = LossyProxy(controller.url).start()
    try:
        yield p
    finally:
        p.stop()


def test_hydrates_100k_entries_from_controller_in_seconds(
    proxy: LossyProxy, mounts: MountFactory, tenant: Tenant
) -> None:
    """The controller pages the manifest by keyset, 5,000 per page: the mount
    asks for each page once, from the last version of the one before, and
    fetches no content."""
    agent, run = start_run(tenant)
    with tenant.client() as c:
        r = c.put(tenant.folder("agent", agent) + "/content", params={"path": "template.txt"},
                  content=b"same bytes\n", headers=OCTET)  # fmt: skip
        assert r.status_code in (200, 201), r.text
    # Uploading 100,000 files through the API would take minutes: clone the
    # template's row in SQL instead (same object, fresh paths and versions).
    with tenant.controller.db() as conn:
        row = conn.execute(
            "SELECT folder_id FROM files WHERE path = 'template.txt' AND digest = %s LIMIT 1",
            (hashlib.sha256(b"same bytes\n").hexdigest(),),
        ).fetchone()
        assert row is not None
        conn.execute(
            "INSERT INTO files (id, folder_id, path, parent, kind, digest, byte_size, executable,"
            " version) SELECT gen_random_uuid(), f.folder_id,"
            " 'bulk/d' || lpad((i %% 100)::text, 3, '0') || '/f' || lpad(i::text, 6, '0'),"
            " 'bulk/d' || lpad((i %% 100)::text, 3, '0'), f.kind, f.digest, f.byte_size, false,"
            " d.version_counter + i"
            " FROM files f JOIN folders d ON d.id = f.folder_id, generate_series(1, 99999) AS i"
            " WHERE f.path = 'template.txt' AND f.folder_id = %s",
            (row[0],),
        )
        # Versions count per folder: the folder's counter covers the new rows,
        # and its entry count includes them.
        conn.execute(
            "UPDATE folders SET version_counter = version_counter + 99999,"
            " live_entries = live_entries + 99999 WHERE id = %s",
            (row[0],),
        )
        versions = [
            int(v)
            for (v,) in conn.execute(
                "SELECT version FROM files WHERE folder_id = %s ORDER BY version", (row[0],)
            ).fetchall()
        ]
    token_file = mounts.base / "token"
    token_file.write_text(str(run["token"]))
    started = time.monotonic()
    m = mounts.mount(proxy.url, token_file=token_file)
    seconds = time.monotonic() - started
    print(f"\n100,000 entries from the controller: mounted in {seconds:.2f}s")
    assert seconds < 60, f"mount took {seconds:.1f}s"
    # A request whose exchange broke on the way (a reset on a busy machine)
    # is asked again, as it should be: only the others count.
    answered = list(proxy.queries)
    for broken in proxy.broken:
        answered.remove(broken)
    pages = [parse_qs(q) for _, path, q in answered if path.endswith("/agent/manifest")]
    assert len(versions) > 100_000
    # One request per page, each from the last version of the page before.
    cursors = [0, *versions[MANIFEST_PAGE_MAX - 1 :: MANIFEST_PAGE_MAX]]
    assert pages == [{"since": [str(c)], "limit": [str(MANIFEST_PAGE_MAX)]} for c in cursors]
    assert not [p for _, p, _ in proxy.queries if "/objects/" in p]
    assert len(os.listdir(m.mountpoint / "bulk")) == 100
    assert (
        sum(len(os.listdir(m.mountpoint / "bulk" / d)) for d in os.listdir(m.mountpoint / "bulk"))
        == 99_999
    )
    assert (m.mountpoint / "bulk" / "d042" / "f000042").read_bytes() == b"same bytes\n"
    assert m.changes() == {}


def test_entry_limit_is_refused_at_write_time(mounts: MountFactory) -> None:
    # 100 directories + 99,899 files = one entry short of the controller's limit.
    src = big_manifest_source(mounts.base / "full", MAX_ENTRIES - 101)
    m = mounts.mount(src, extra=["--prefetch", "0"])
    (m.mountpoint / "last-one").write_bytes(b"fits")
    with pytest.raises(OSError) as info:
        (m.mountpoint / "one-too-many").write_bytes(b"x")
    assert info.value.errno == errno.EDQUOT
    with pytest.raises(OSError) as info:
        (m.mountpoint / "dir-too-many").mkdir()
    assert info.value.errno == errno.EDQUOT
    os.unlink(m.mountpoint / "last-one")
    (m.mountpoint / "room-again").write_bytes(b"ok")
    assert (m.mountpoint / "room-again").read_bytes() == b"ok"


def test_an_agent_folder_takes_entries_past_its_limit_while_the_agent_runs(
    mounts: MountFactory,
) -> None:
    """The agent folder's 100,000 entries are a sync-validation limit, not a
    live quota: the mount takes more, and the save
    over the limit is what the controller refuses (test_agent_limits.py)."""
    src = big_manifest_source(mounts.base / "agent-full", MAX_ENTRIES - 101, "AGENTS.md")
    m = mounts.mount(src, extra=["--prefetch", "0"])
    for name in ("last-one", "one-too-many", "two-too-many"):
        (m.mountpoint / name).write_bytes(name.encode())
    (m.mountpoint / "dir-too-many").mkdir()
    (m.mountpoint / "dir-too-many" / "inside").write_bytes(b"in")
    assert (m.mountpoint / "two-too-many").read_bytes() == b"two-too-many"
    assert {p: c["action"] for p, c in m.changes().items()} == {
        "last-one": "upload",
        "one-too-many": "upload",
        "two-too-many": "upload",
        "dir-too-many": "mkdir",
        "dir-too-many/inside": "upload",
    }
