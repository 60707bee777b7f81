"""Peak memory of the controller while large request bodies arrive at once.

The attack the body budget answers: ``--bodies`` checkpoint bodies of
``--mib`` MiB each, sent at the same moment with ``--tokens`` run tokens
(``--bodies / --tokens`` per token, within the per-token cap), to one
``controller serve`` on its own database of a private PostgreSQL cluster.
Each body is valid JSON (a checkpoint with a padding field), so it is
buffered, parsed and then refused by validation: what it costs is the memory
of buffering and parsing it.

Reported: the controller's resident set before the attack and its peak
(``VmHWM`` of the serving process, which has no worker processes), the
answers by status, and the wall time. Extra arguments after ``--`` go to
``controller serve`` (``-- --max-buffered-body-bytes 268435456``).

    python -m bench.body_memory [--bodies 16] [--tokens 4] [--mib 60] [-- SERVE_ARGS...]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import shutil
import sys
import time
import uuid

import httpx

from common.bridge import PREFIX
from tests.support.bridge import start_run
from tests.support.controller import ControllerProcess, PgCluster, bootstrap_tenant
from tests.support.tmp import world_searchable_tmpdir


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def checkpoint_body(mib: int, epoch: int) -> bytes:
    head = {"operationId": str(uuid.uuid4()), "leaseEpoch": epoch, "final": False, "entries": []}
    pad = mib * 1024 * 1024 - len(json.dumps(head)) - 12
    return json.dumps({**head, "pad": "x" * pad}).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bodies", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--mib", type=int, default=60)
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()

    cluster = PgCluster()
    tmp = world_searchable_tmpdir("fsa-bench-bodies-")
    ctl = ControllerProcess(cluster.create_database(), tmp, list(args.serve_args))
    try:
        ctl.start()
        assert ctl.proc is not None
        pid = ctl.proc.pid
        tenant = bootstrap_tenant(ctl)
        runs = [start_run(tenant) for _ in range(args.tokens)]
        bodies = {r.token: checkpoint_body(args.mib, r.lease_epoch) for r in runs}
        # One request first, so the baseline includes a warmed-up server.
        with httpx.Client(base_url=ctl.url, timeout=600) as c:
            c.get(PREFIX + "/run", headers={"Authorization": f"Bearer {runs[0].token}"})
        before = status_kib(pid, "VmRSS")

        def send(i: int) -> int:
            run = runs[i % len(runs)]
            with httpx.Client(base_url=ctl.url + PREFIX, timeout=600) as c:
                r = c.post(
                    "/folders/task/checkpoints",
                    content=bodies[run.token],
                    headers={
                        "Authorization": f"Bearer {run.token}",
                        "Content-Type": "application/json",
                    },
                )
                return r.status_code

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.bodies) as pool:
            codes = collections.Counter(pool.map(send, range(args.bodies)))
        elapsed = time.monotonic() - start
        peak = status_kib(pid, "VmHWM")
        print(
            f"bodies {args.bodies} x {args.mib} MiB from {args.tokens} tokens;"
            f" serve args {' '.join(args.serve_args) or '(defaults)'}"
        )
        print(f"RSS before {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB")
        print(f"answers {dict(sorted(codes.items()))} in {elapsed:.1f} s")
        return 0
    finally:
        ctl.stop()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
