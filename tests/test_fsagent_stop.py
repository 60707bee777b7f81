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
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.bridge import start_run
from tests.support.controller import Tenant
from tests.support.mount import MountFactory, mount_factory
from tests.support.pyfuse3_patch import handles_env, patched_pyfuse3_env
from tests.test_fsagent_crash import AGENT_WRITER, BUSY_LOOP, _acks

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


@pytest.mark.parametrize("scope", ["agent", "task"])
def test_a_write_answered_before_the_stop_ends_is_in_the_final_save(
    stop_mounts: MountFactory, tenant: Tenant, scope: str
) -> None:
    mounts = stop_mounts
    token = mounts.base / "token"
    run = start_run(tenant)
    token.write_text(run.token)
    owner = run.agent if scope == "agent" else run.task
    assert owner is not None
    folder = tenant.folder(scope, owner)
    m = mounts.mount(tenant.controller.url, scope, token_file=token)
    log = mounts.base / "writer.log"
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP])]
    try:
        with open(log, "wb") as out:
            writer = subprocess.Popen(
                [sys.executable, "-c", AGENT_WRITER, str(m.mountpoint), "1"],
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
