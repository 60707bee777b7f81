"""A stop while the agent still writes: every write acknowledged before the
daemon exits is in its final save (in dir mode, every write made before the
stop began: a plain directory cannot refuse the ones after).

At the stop boundary the agent folder's local copy is discarded and the
sandbox usually goes away, so a write answered after the final save listed
its changes would be lost. The stop freezes the folder once the kernel's
dirty pages are flushed: from then on a write fails (EROFS), and the final
save holds everything answered before.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.fsagent.test_fsagent_crash import AGENT_WRITER, BUSY_LOOP, _acks
from tests.support.bridge import start_run
from tests.support.checkpoints import try_flush
from tests.support.controller import Tenant
from tests.support.mount import FsagentMount, MountFactory, mount_factory
from tests.support.pyfuse3_patch import handles_env, patched_pyfuse3_env

UNPACED = ["1000000", "0"]
"""The crash test's writer, as fast as it can and without a cap: here the
writes must still be arriving when the stop begins."""

pytestmark = [pytest.mark.fuse]


@pytest.fixture(params=["no-open", "handles", "dir"])
def stop_mounts(request: pytest.FixtureRequest) -> Iterator[MountFactory]:
    mode = "dir" if request.param == "dir" else "fuse"
    with mount_factory(mode=mode) as factory:
        if request.param == "no-open":
            factory.env = patched_pyfuse3_env()
        elif request.param == "handles":
            factory.env = handles_env()
        yield factory


def mount_for_a_run(mounts: MountFactory, tenant: Tenant, scope: str) -> tuple[FsagentMount, str]:
    """A new run's ``scope`` folder served by ``mounts``, and its API path."""
    token = mounts.base / "token"
    run = start_run(tenant)
    token.write_text(run.token)
    owner = run.agent if scope == "agent" else run.task
    assert owner is not None
    return mounts.mount(tenant.controller.url, scope, token_file=token), tenant.folder(scope, owner)


@pytest.mark.parametrize("scope", ["agent", "task"])
def test_a_write_answered_before_the_stop_ends_is_in_the_final_save(
    stop_mounts: MountFactory, tenant: Tenant, scope: str
) -> None:
    mounts = stop_mounts
    m, folder = mount_for_a_run(mounts, tenant, scope)
    log = mounts.base / "writer.log"
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP])]
    try:
        with open(log, "wb") as out:
            writer = subprocess.Popen(
                [sys.executable, "-c", AGENT_WRITER, str(m.mountpoint), "1", *UNPACED],
                stdout=out,
                stderr=out,
            )
        try:
            deadline = time.monotonic() + 120
            while len(_acks(log)) < 40:
                assert writer.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the writer was never acknowledged"
                time.sleep(0.05)
            if m.mode == "dir":
                # A plain directory takes writes whatever fsagent does: there the
                # promise is what was written before the stop began.
                writer.kill()
                writer.wait()
            assert m.signal(signal.SIGTERM, timeout=300) == 0, m.stderr()
        finally:
            writer.kill()
            writer.wait()
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    acked = _acks(log)
    assert len(acked) >= 40
    with tenant.client() as c:
        missing = []
        for name, digest in sorted(acked.items()):
            got = c.get(folder + "/content", params={"path": name})
            if got.status_code != 200 or hashlib.sha256(got.content).hexdigest() != digest:
                missing.append(name)
    assert not missing, (
        f"{len(missing)} of {len(acked)} acknowledged writes not saved: {missing[:10]}"
    )


CHURNER = """
import os, sys
d = sys.argv[1]
if os.geteuid() == 0:
    os.nice(-15)  # it must run while the final save scans, on a busy machine too
os.makedirs(d, exist_ok=True)
i = 0
while True:
    p = os.path.join(d, "t%d" % (i % 4))
    open(p, "wb").close()
    os.unlink(p)
    i += 1
"""


@pytest.mark.parametrize("scope", ["agent", "task"])
def test_a_dir_mode_stop_saves_deletions_while_another_directory_churns(
    tenant: Tenant, scope: str
) -> None:
    """A rename and a delete made before the stop, while some process goes on
    creating and removing files in another directory of the folder through the
    final save: the final save holds the rename and the delete, or it says it
    failed; it never claims a save that kept the old paths (for the agent
    folder, whose local copy the stop discards, they would come back in the
    next run)."""
    with mount_factory(mode="dir") as mounts:
        m, folder = mount_for_a_run(mounts, tenant, scope)
        (m.mountpoint / "keep").mkdir()
        (m.mountpoint / "keep" / "a.txt").write_bytes(b"moved content")
        (m.mountpoint / "keep" / "c.txt").write_bytes(b"deleted content")
        code, reply = try_flush(m)
        assert code == 0, reply
        os.rename(m.mountpoint / "keep" / "a.txt", m.mountpoint / "keep" / "b.txt")
        os.unlink(m.mountpoint / "keep" / "c.txt")
        churners = [
            subprocess.Popen([sys.executable, "-c", CHURNER, str(m.mountpoint / d)])
            for d in ("churn", "keep/churn")
        ]
        try:
            deadline = time.monotonic() + 60
            while not (m.mountpoint / "keep" / "churn").is_dir():
                assert time.monotonic() < deadline and churners[1].poll() is None
                time.sleep(0.05)
            code = m.signal(signal.SIGTERM, timeout=300)
        finally:
            for churner in churners:
                churner.kill()
                churner.wait()
        with tenant.client() as c:
            got = {
                p: c.get(folder + "/content", params={"path": p})
                for p in ("keep/a.txt", "keep/b.txt", "keep/c.txt")
            }
        saved = {p: r.content for p, r in got.items() if r.status_code == 200}
        print(f"exit {code}, saved {sorted(saved)}:\n{m.stderr()}")
        if code == 0:
            assert saved == {"keep/b.txt": b"moved content"}, (saved, m.stderr())
        else:
            # Not whole: said so, with the acknowledged rename's new path saved.
            assert "final save FAILED" in m.stderr(), m.stderr()
            assert "kept changing during the final save" in m.stderr(), m.stderr()
            assert saved.get("keep/b.txt") == b"moved content", saved
