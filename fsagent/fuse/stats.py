"""Live figures of one mount for ``fsagent status --json`` (via the control socket).

FUSE requests are counted per operation and their latencies kept in a fixed
ring of the most recent :data:`LATENCY_RING` samples: recording one is a dict
increment and a list store, so the request path pays next to nothing, and the
percentiles are computed only when asked. FORGET (which has no reply) is
counted too, once per batch the kernel sends. ``fsyncDataOnly`` counts the
FSYNCs answered by the upper file's own ``fdatasync`` alone (fsagent.fuse.fs,
``fsync``): the ones that skipped the LMDB sync. ``stateWritebacks`` counts
the times the state's dirty LMDB pages were sent to disk in the background
(fsagent.fuse.mount, ``_write_back_store``); ``upperWritebacks`` the times
a large file's dirty pages were started on their way to disk while it was
being written (fsagent.fuse.fs, ``_write_back_uppers``). ``writesBehind``
counts the WRITEs to a durable file answered without an LMDB commit, their
size and generation left for the next batch (fsagent.fuse.content).
"""

from __future__ import annotations

import time
from typing import Any

LATENCY_RING = 4096
"""Latency samples kept (the most recent requests, all operations together)."""


class FuseStats:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.errors = 0
        self.fsync_data_only = 0
        self.state_writebacks = 0
        self.upper_writebacks = 0
        self.writes_behind = 0
        self._ring = [0] * LATENCY_RING
        self._next = 0
        self._filled = False

    def record(self, op: str, ns: int, failed: bool) -> None:
        self.counts[op] = self.counts.get(op, 0) + 1
        if failed:
            self.errors += 1
        self._ring[self._next] = ns
        self._next += 1
        if self._next == LATENCY_RING:
            self._next = 0
            self._filled = True

    def to_json(self) -> dict[str, Any]:
        samples = sorted(self._ring if self._filled else self._ring[: self._next])

        def pct(p: float) -> float | None:
            if not samples:
                return None
            return round(samples[min(len(samples) - 1, int(p * len(samples)))] / 1e6, 3)

        return {
            "requests": sum(self.counts.values()),
            "errors": self.errors,
            "byOperation": dict(sorted(self.counts.items())),
            "fsyncDataOnly": self.fsync_data_only,
            "stateWritebacks": self.state_writebacks,
            "upperWritebacks": self.upper_writebacks,
            "writesBehind": self.writes_behind,
            "latencyMs": {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99),
                          "samples": len(samples)},
        }  # fmt: skip


FUSE = FuseStats()
"""This process's mount (one mount per process)."""


def now_ns() -> int:
    return time.perf_counter_ns()
