"""Filesystem operations: fsagent against native and four FUSE peers, one run.

The same workload runs, interleaved within each round, on a plain directory
under ``--base`` (native), on an fsagent mount of a real controller and on the
four FUSE peers (bench.fspeers has how each is set up; every backing directory
is under the same ``--base``, so all end on the same disk). The table shows
the median of each phase over ``--repeat`` rounds, and each phase's time on
libfuse's C passthrough against native: what the FUSE protocol alone costs
there on this kernel, the floor under fsagent's own ratio.

Phases, in order: create 3,000 4 KiB files in 50 directories, stat all, walk,
read all (first read, then again: cached; then once more timing only the
``pread`` calls, open and close excluded), rename all, unlink all; a SQLite
loop of 300 commits in WAL mode (default ``synchronous``, so each commit
fsyncs the WAL); a copy of a real package tree (a subset of this Python's
site-packages, about 2,000 files, by ``shutil.copytree`` from a native copy)
and its ``rm -rf``; a sequential write ending in fsync, then a sequential read
of it twice: once as it is (page cache warm) and once after
``posix_fadvise(DONTNEED)`` on the file and on the files backing it, so that
neither layer reads from the page cache. Each phase also records the CPU
time the FUSE daemon used in it, so a slow phase shows whether the daemon
was working or waiting, and, on fsagent, which FUSE requests reached the
daemon in it (per operation, from its live figures before and after).

``--allow-other`` adds a second fsagent peer mounted with ``--allow-other``
(bench.fspeers), as multi-user sandboxes run it, to measure what the
kernel's own mode checks cost against the default mount.

Then, on fsagent only: the p99 latency of open + read + close of a cached
4 KiB file, idle and while a checkpoint of 3,000 new 4 KiB files plus a
``--probe-mib`` file is in flight (``fsagent flush``). In "no open" mode such
a read never reaches the daemon, so two more kinds of sample are taken in
turn with it: the same read of a native file (the control for the
machine's load) and a read of a mount file whose pages were dropped just
before (``posix_fadvise(DONTNEED)``, untimed), which the daemon must answer.
The FUSE requests the daemon served while idle and during the checkpoint
are counted too. Last, the mount time of a 100,000-entry manifest (a
DirectoryBridgeClient source, fresh state dir).

    python -m bench.fsops [--files 3000] [--dirs 50] [--large-mib 128] [--repeat 3]
                          [--allow-other]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.fspeers import (
    ALLOW_OTHER,
    C_PASSTHROUGH,
    PASSTHROUGH,
    FsagentPeer,
    Peer,
    all_peers,
    stop_all,
)
from bench.machine import add_output_options, load_line, machine_line, record
from tests.support.mount import FsagentMount
from tests.support.source import make_source

SMALL = 4096
MIB = 1 << 20
WRITE_BLOCK = 4 * MIB
"""The sequential write's block size."""
SMALL_PHASES = ("create", "stat", "walk", "read (first)", "read (cached)", "rename", "unlink")
PHASES = (
    *SMALL_PHASES,
    "read (cached, data only)",
    "SQLite WAL, 300 commits",
    "copy package tree",
    "rm -rf package tree",
    "seq write + fsync",
    "seq read (cached)",
    "seq read (uncached)",
)
# The targets: small-file phases within 2x bindfs; ahead of the pyfuse3
# passthrough and rclone everywhere;
# SQLite within 2x native; rm -rf within 3x native; the tree copy within 10x.
NATIVE_TARGETS = {"SQLite WAL, 300 commits": 2.0, "rm -rf package tree": 3.0,
                  "copy package tree": 10.0}  # fmt: skip
BINDFS_TARGET = 2.0
SQLITE_COMMITS = 300


def _paths(root: Path, files: int, dirs: int, suffix: str = "") -> list[str]:
    return [os.path.join(root, f"d{i % dirs:02d}", f"f{i:05d}{suffix}") for i in range(files)]


def create_files(root: Path, dirs: int, paths: list[str], payloads: list[bytes]) -> None:
    """The create phase: ``dirs`` directories, then each of ``paths`` made new
    and written once (the payloads taken in turn)."""
    for d in range(dirs):
        os.mkdir(root / f"d{d:02d}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for i, p in enumerate(paths):
        fd = os.open(p, flags, 0o644)
        os.write(fd, payloads[i % len(payloads)])
        os.close(fd)


def _read_whole(path: str, buf: bytearray) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        view = memoryview(buf)
        while n := os.readv(fd, [view]):
            total += n
        return total
    finally:
        os.close(fd)


def _drop_cache(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drop_tree_cache(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            _drop_cache(os.path.join(dirpath, name))


def package_tree(work: Path, want: int) -> tuple[Path, int, int]:
    """A native copy of whole top-level packages of site-packages, about ``want``
    files (regular files and directories only); (root, files, directories)."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    dst = work / "pkg-src"
    dst.mkdir()

    def links(d: str, names: list[str]) -> list[str]:
        return [n for n in names if os.path.islink(os.path.join(d, n))]

    files = dirs = 0
    for entry in sorted(site.iterdir()):
        if files >= want:
            break
        if entry.is_symlink() or not entry.is_dir() or entry.name.startswith(("_", ".")):
            continue
        shutil.copytree(entry, dst / entry.name, symlinks=True, ignore=links)
        for _, dnames, fnames in os.walk(dst / entry.name):
            dirs += len(dnames)
            files += len(fnames)
        dirs += 1
    return dst, files, dirs


def sqlite_loop(path: Path, commits: int) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        row = os.urandom(1024)
        for _ in range(commits):
            db.execute("BEGIN")
            db.execute("INSERT INTO t (v) VALUES (?)", (row,))
            db.execute("COMMIT")
    finally:
        db.close()


Counts = dict[str, int]
"""FUSE requests per operation (fsagent's live figures)."""

SUBCOUNTS = ("fsyncDataOnly", "writesBehind")
"""Figures among the counts that count requests of another operation again."""


def count_delta(before: Counts, after: Counts) -> Counts:
    """The requests served between two readings (operations with none left out)."""
    return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0)}


def run_workload(
    root: Path, files: int, dirs: int, large_mib: int, block: bytes, peer: Peer, tree: Path
) -> tuple[dict[str, float], dict[str, float], dict[str, Counts]]:
    """Every phase once under ``root``: seconds per phase, the CPU seconds the
    peer's daemon used in each (empty for native, which has none), and the
    FUSE requests that reached it in each (empty unless the peer counts them:
    fsagent). The counts are read outside the timed part."""
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}
    requests: dict[str, Counts] = {}
    pid = peer.pid()
    payloads = [os.urandom(SMALL) for _ in range(64)]
    paths = _paths(root, files, dirs)
    renamed = _paths(root, files, dirs, ".r")

    def phase(name: str, fn: Callable[[], object]) -> None:
        before = peer.requests()
        c = _cpu_seconds(pid) if pid is not None else 0.0
        t = time.perf_counter()
        fn()
        times[name] = time.perf_counter() - t
        if pid is not None:
            cpu[name] = _cpu_seconds(pid) - c
        if before is not None:
            after = peer.requests()
            assert after is not None
            requests[name] = count_delta(before, after)

    def create() -> None:
        create_files(root, dirs, paths, payloads)

    def stat_all() -> None:
        for p in paths:
            os.stat(p)

    def walk() -> None:
        seen = sum(len(names) for _, _, names in os.walk(root))
        assert seen == files, seen

    small_buf = bytearray(SMALL * 2)

    def read_all() -> None:
        for p in paths:
            assert _read_whole(p, small_buf) == SMALL

    def read_data_only() -> float:
        spent = 0.0
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            t = time.perf_counter()
            n = os.preadv(fd, [small_buf], 0)
            spent += time.perf_counter() - t
            os.close(fd)
            assert n == SMALL
        return spent

    def rename_all() -> None:
        for a, b in zip(paths, renamed, strict=True):
            os.rename(a, b)

    def unlink_all() -> None:
        for p in renamed:
            os.unlink(p)
        for d in range(dirs):
            os.rmdir(root / f"d{d:02d}")

    big = str(root / "large.bin")

    def seq_write() -> None:
        fd = os.open(big, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(large_mib * MIB // len(block)):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)

    big_buf = bytearray(MIB)

    def seq_read() -> None:
        assert _read_whole(big, big_buf) == large_mib * MIB

    phase("create", create)
    phase("stat", stat_all)
    phase("walk", walk)
    phase("read (first)", read_all)
    phase("read (cached)", read_all)
    times["read (cached, data only)"] = read_data_only()
    phase("rename", rename_all)
    phase("unlink", unlink_all)
    phase("SQLite WAL, 300 commits", lambda: sqlite_loop(root / "db.sqlite", SQLITE_COMMITS))
    for name in ("db.sqlite", "db.sqlite-wal", "db.sqlite-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(root / name)
    copy = root / "pkg"
    phase("copy package tree", lambda: shutil.copytree(tree, copy))
    phase("rm -rf package tree", lambda: subprocess.run(["rm", "-rf", str(copy)], check=True))
    phase("seq write + fsync", seq_write)
    phase("seq read (cached)", seq_read)
    _drop_cache(big)
    for backing in peer.backing:
        _drop_tree_cache(backing)
    phase("seq read (uncached)", seq_read)
    os.unlink(big)
    return times, cpu, requests


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ticks(stat_path: str) -> int:
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_by_role(peer: FsagentPeer) -> dict[str, float]:
    """CPU seconds so far of each part of the fsagent peer: the daemon's FUSE
    thread (its main thread), the daemon's other threads (the checkpoint),
    the controller and its embedded PostgreSQL; and ``fuse_runq``, the
    seconds the FUSE thread spent runnable but waiting for a CPU."""
    m = peer.mount
    assert m is not None and m.proc is not None
    pid, hz = m.proc.pid, os.sysconf("SC_CLK_TCK")
    fuse = _ticks(f"/proc/{pid}/task/{pid}/stat")
    out = {
        "fuse": fuse / hz,
        "checkpoint": (_ticks(f"/proc/{pid}/stat") - fuse) / hz,
        "fuse_runq": int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9,
    }
    ctl = peer.controller
    if ctl.proc is not None:
        out["controller"] = _ticks(f"/proc/{ctl.proc.pid}/stat") / hz
        pidfile = ctl.data_dir / "pg" / "data" / "postmaster.pid"
        postmaster = int(pidfile.read_text().split("\n", 1)[0])
        pg = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(stat.parent.name) == postmaster or int(fields[1]) == postmaster:
                    pg += int(fields[11]) + int(fields[12])
        out["postgres"] = pg / hz
    return out


def latency_probe(
    peer: FsagentPeer, native: Path, files: int, dirs: int, probe_mib: int
) -> tuple[dict[str, float], dict[str, Counts]]:
    """p99 of open + read + close of 4 KiB files, idle and during a checkpoint.

    Three kinds of sample, taken in turn: a cached mount file (``hot``: in
    "no open" mode the page cache alone answers), a native file (``native``:
    what the checkpoint's load does to a read that never reaches the daemon
    separates the machine's share from the mount's) and a mount file whose
    pages were dropped just before, untimed (``uncached``: a READ the daemon
    must answer). Also the FUSE requests the daemon served in each window."""
    m = peer.mount
    assert m is not None and m.proc is not None
    root = m.mountpoint / "probe"
    root.mkdir()
    native.mkdir()
    hot = [str(root / f"hot{i:03d}") for i in range(100)]
    cold = [str(root / f"cold{i:03d}") for i in range(100)]
    control = [str(native / f"hot{i:03d}") for i in range(100)]
    for p in hot + cold + control:
        Path(p).write_bytes(os.urandom(SMALL))
    m.fsagent("flush", "task")  # the probe files themselves are saved first
    load = root / "load"
    load.mkdir()
    for d in range(dirs):
        (load / f"d{d:02d}").mkdir()
    for p in _paths(load, files, dirs):
        Path(p).write_bytes(os.urandom(SMALL))
    with open(load / "big.bin", "wb") as fh:
        for _ in range(probe_mib):
            fh.write(os.urandom(MIB))
    buf = bytearray(SMALL * 2)
    samples: dict[str, list[float]] = {}

    def sample(window: str) -> None:
        for kind, pool in (("hot", hot), ("native", control), ("uncached", cold)):
            path = pool[int(time.perf_counter() * 1e6) % len(pool)]
            if kind == "uncached":
                _drop_cache(path)
            t = time.perf_counter()
            _read_whole(path, buf)
            samples.setdefault(f"{window} {kind}", []).append(time.perf_counter() - t)

    for p in hot + control:
        _read_whole(p, buf)
    requests: dict[str, Counts] = {}
    before = peer.requests()
    for _ in range(3000):
        sample("idle")
    requests["idle"] = count_delta(before, peer.requests())
    argv = [sys.executable, "-m", "fsagent.cli", "flush", "task", "--state-dir",
            str(m.state_dir), "--json"]  # fmt: skip
    before = peer.requests()
    cpu = _cpu_seconds(m.proc.pid)
    roles = cpu_by_role(peer)
    started = time.perf_counter()
    flush = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        sample("busy")
        if flush.poll() is not None:
            break
        time.sleep(0.0002)
    took = time.perf_counter() - started
    cpu = _cpu_seconds(m.proc.pid) - cpu
    roles = {k: v - roles.get(k, 0.0) for k, v in cpu_by_role(peer).items()}
    requests["busy"] = count_delta(before, peer.requests())
    if flush.returncode != 0:
        raise RuntimeError(f"flush during the probe failed ({flush.returncode})")
    shutil.rmtree(root)
    shutil.rmtree(native)
    figures = {"samples": len(samples["busy hot"]), "flush_s": took, "cpu_s": cpu}
    figures.update({f"busy_{k}_s": v for k, v in roles.items()})
    for key, values in samples.items():
        window, kind = key.split()
        name = "" if kind == "hot" else f"{kind}_"
        figures[f"{name}{window}_p99"] = _p99(values)
        figures[f"{name}{window}_p50"] = statistics.median(values)
    return figures, requests


def bench_mount(
    work: Path, controller: str, mountpoint: str, state: str, extra: list[str] | None = None
) -> FsagentMount:
    """An agent mount under ``work``; the mount is polled every 5 ms to time it."""
    return FsagentMount(
        "agent",
        work / mountpoint,
        work / state,
        controller,
        extra=list(extra or []),
        log_dir=work,
        poll_interval=0.005,
    )


def measure_mount_time(work: Path, entries: int, repeat: int) -> list[float]:
    """Fresh state dir each time: the manifest is hydrated into LMDB before mounting."""
    dirs = 100
    files = entries - dirs
    contents = [os.urandom(SMALL) for _ in range(256)]
    # Directories first, then the files, in this order: versions follow it.
    agent: dict[str, bytes | None] = {f"m{d:03d}": None for d in range(dirs)}
    agent.update(
        (f"m{i % dirs:03d}/e{i:06d}.txt", contents[i % len(contents)]) for i in range(files)
    )
    source = make_source(work / "big-source", {"agent": agent}, keep_order=True)
    times = []
    for k in range(repeat):
        m = bench_mount(work, f"dir:{source}", f"big-mnt{k}", f"big-state{k}", ["--prefetch", "0"])
        try:
            m.start(timeout=120)
            times.append(m.mount_seconds)
            listed = len(os.listdir(m.mountpoint / "m007"))
            assert listed == files // dirs, listed
        finally:
            m.stop(timeout=60)
        shutil.rmtree(m.state_dir, ignore_errors=True)
    return times


def _targets(name: str, med: dict[str, float], has: set[str]) -> tuple[str, bool]:
    """The phase's targets as text, and whether fsagent meets all of them."""
    parts, met = [], True
    f = med["fsagent"]
    if name in SMALL_PHASES and "bindfs" in has:
        parts.append(f"<= {BINDFS_TARGET:g}x bindfs")
        met &= f <= BINDFS_TARGET * med["bindfs"]
    if name in NATIVE_TARGETS:
        parts.append(f"<= {NATIVE_TARGETS[name]:g}x native")
        met &= f <= NATIVE_TARGETS[name] * med["native"]
    if PASSTHROUGH in has:
        parts.append("< passthrough")
        met &= f < med[PASSTHROUGH]
    if "rclone" in has:
        parts.append("< rclone")
        met &= f < med["rclone"]
    return ", ".join(parts), met


@dataclass
class Results:
    """Everything one run measured, for :func:`report`."""

    runs: dict[str, list[dict[str, float]]]
    """Per peer, per round: seconds per phase."""
    cpu: dict[str, list[dict[str, float]]]
    """Per peer, per round: the daemon's CPU seconds per phase."""
    requests: dict[str, list[dict[str, Counts]]]
    """Per peer, per round: FUSE requests per phase (fsagent peers only)."""
    missing: list[str]
    tree: tuple[int, int]
    """The package tree's files and directories."""
    probe: dict[str, float] = field(default_factory=dict)
    probe_requests: dict[str, Counts] = field(default_factory=dict)
    rss: int = 0
    mount_times: list[float] = field(default_factory=list)


def _median_counts(rounds: list[Counts]) -> Counts:
    """Per operation, the median over the rounds (a round without it counts 0)."""
    ops = {op for r in rounds for op in r}
    med = {op: round(statistics.median(r.get(op, 0) for r in rounds)) for op in ops}
    return {op: n for op, n in med.items() if n}


def _count_text(counts: Counts) -> str:
    """``total (op n, op n, ...)``, the busiest operation first."""
    if not counts:
        return "0"
    parts = ", ".join(
        f"{op} {n:,}" for op, n in sorted(counts.items(), key=lambda i: (-i[1], i[0]))
    )
    requests = sum(n for op, n in counts.items() if op not in SUBCOUNTS)
    return f"{requests:,} ({parts})"


def _probe_lines(
    args: argparse.Namespace, probe: dict[str, float], requests: dict[str, Counts]
) -> list[str]:
    ratio = probe["busy_p99"] / probe["idle_p99"]
    uncached = probe["uncached_busy_p99"] / probe["uncached_idle_p99"]
    return [
        f"open + read + close of a cached 4 KiB file on fsagent: p99 idle "
        f"{probe['idle_p99'] * 1000:.2f} ms (p50 {probe['idle_p50'] * 1000:.2f} ms); during "
        f"a checkpoint of {args.files:,} new 4 KiB files and a {args.probe_mib} MiB file "
        f"({probe['flush_s']:.1f} s, {probe['samples']:,} samples of each kind; the daemon, "
        f"which serves FUSE on one thread and runs the checkpoint on another, used "
        f"{probe['cpu_s']:.1f} s of CPU meanwhile) p99 "
        f"{probe['busy_p99'] * 1000:.2f} ms (p50 {probe['busy_p50'] * 1000:.2f} ms): "
        f"{ratio:.2f}x idle (target <= 2x: {'yes' if ratio <= 2 else '**no**'}). "
        f"The same samples from a native directory, taken in turn: p99 idle "
        f"{probe['native_idle_p99'] * 1000:.2f} ms, during the checkpoint "
        f"{probe['native_busy_p99'] * 1000:.2f} ms "
        f"({probe['native_busy_p99'] / probe['native_idle_p99']:.2f}x idle).",
        "",
        f"open + read + close of a 4 KiB fsagent file whose pages were dropped just before "
        f"(a READ the daemon must answer), taken in turn with those: p99 idle "
        f"{probe['uncached_idle_p99'] * 1000:.2f} ms (p50 "
        f"{probe['uncached_idle_p50'] * 1000:.2f} ms); during the checkpoint p99 "
        f"{probe['uncached_busy_p99'] * 1000:.2f} ms (p50 "
        f"{probe['uncached_busy_p50'] * 1000:.2f} ms): {uncached:.2f}x idle.",
        "",
        _busy_cpu_line(probe),
        "",
        f"FUSE requests the fsagent daemon served while idle (3,000 samples of each kind): "
        f"{_count_text(requests['idle'])}; during the checkpoint: "
        f"{_count_text(requests['busy'])}.",
        "",
    ]


def _busy_cpu_line(probe: dict[str, float]) -> str:
    """Who used the 2 cores during the checkpoint, and how long the FUSE thread
    waited for one: a read the daemon must answer waits that long too."""
    parts = [
        f"{label} {probe[f'busy_{key}_s']:.2f} s"
        for key, label in (("fuse", "the daemon's FUSE thread"),
                           ("checkpoint", "its other threads (the checkpoint)"),
                           ("controller", "the controller"), ("postgres", "PostgreSQL"))
        if f"busy_{key}_s" in probe
    ]  # fmt: skip
    return (
        f"CPU used during the checkpoint ({probe['flush_s']:.1f} s, {os.cpu_count()} CPUs): "
        + ", ".join(parts)
        + f". The FUSE thread was runnable but waiting for a CPU for "
        f"{probe['busy_fuse_runq_s'] * 1000:.0f} ms of it."
    )


def _request_lines(res: Results, daemons: list[str]) -> list[str]:
    """Per phase, the FUSE requests that reached each fsagent daemon (median of the rounds)."""
    files, dirs = res.tree
    lines = [
        "FUSE requests that reached the fsagent daemon per phase (median of the rounds; "
        "`fsyncDataOnly`: FSYNCs answered by fdatasync alone, also counted as fsync; "
        "`writesBehind`: WRITEs answered without an LMDB commit, also counted as write):",
        "",
        "| phase | " + " | ".join(daemons) + " |",
        "| --- | " + " | ".join("---" for _ in daemons) + " |",
    ]
    for name in PHASES:
        if name == "read (cached, data only)":
            continue
        cells = [_count_text(_median_counts([r[name] for r in res.requests[n]])) for n in daemons]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    rm = _median_counts([r["rm -rf package tree"] for r in res.requests["fsagent"]])
    total = sum(n for op, n in rm.items() if op not in SUBCOUNTS)
    lines += [
        "",
        f"rm -rf of the package tree on fsagent: {total:,} requests for {files:,} files and "
        f"{dirs:,} directories ({total / (files + dirs):.2f} per entry removed).",
        "",
    ]
    return lines


def _allow_other_lines(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    lines = [
        f"What `--allow-other` costs (the kernel's own mode checks, `default_permissions`): "
        f"{ALLOW_OTHER} against the default fsagent mount, same run:",
        "",
        f"| phase | fsagent | {ALLOW_OTHER} | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in PHASES:
        a = statistics.median(r[name] for r in runs["fsagent"])
        b = statistics.median(r[name] for r in runs[ALLOW_OTHER])
        lines.append(f"| {name} | {a * 1000:.1f} ms | {b * 1000:.1f} ms | {b / a:.2f}x |")
    return [*lines, ""]


def report(args: argparse.Namespace, res: Results, context: tuple[str, str, float]) -> str:
    load_before, load_after, elapsed = context
    runs, cpu, missing, tree = res.runs, res.cpu, res.missing, res.tree
    names = list(runs)
    has = set(names)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    allow_other = (
        f" {ALLOW_OTHER}: the same, on another task of the same controller, mounted with "
        "`--allow-other` as multi-user sandboxes run it (the kernel checks modes itself)."
        if ALLOW_OTHER in has
        else ""
    )
    lines = [
        f"\n## Filesystem operations: fsagent vs native, bindfs, the pyfuse3 passthrough, "
        f"rclone mount and libfuse's C passthrough ({stamp})\n",
        f"Machine: {machine_line(args.base)}. Command: `python -m bench.fsops` (files={args.files}, "
        f"dirs={args.dirs}, large={args.large_mib} MiB, repeat={args.repeat}, "
        f"base={args.base}{', allow-other' if args.allow_other else ''}). Load average "
        f"(1/5/15 min) before: {load_before}, after: {load_after}; run took {elapsed:.0f} s.\n",
        "fsagent: a task mount of a real controller (embedded PostgreSQL, local_disk) with "
        "the options `fsagent up` passes (prefetch 4, checkpoints every 180 s, writeback "
        f"cache), {_fuse_mode()}; as root without `--allow-other`, so without "
        f"`default_permissions`.{allow_other} bindfs {_version(['bindfs', '--version'])} "
        "with its defaults; the pyfuse3 passthrough: pyfuse3's `examples/passthroughfs.py` "
        "with the same pyfuse3, its defaults (no writeback cache), and the `fsync` and "
        "`fsyncdir` handlers it lacks (`bench/passthrough_fsync.py`; without them its "
        "fsync(2) syncs nothing); rclone "
        f"{_version(['rclone', 'version'])} `mount` of a local directory with "
        "`--vfs-cache-mode writes`; libfuse passthrough_ll: libfuse's low-level "
        "passthrough example in C (`passthrough_ll.c` of libfuse3-dev "
        f"{_version(['pkg-config', '--modversion', 'fuse3'], 0)}) with `writeback,cache=always`, "
        "the writeback cache and long cache timeouts as fsagent mounts (its ratio to "
        "native is the floor the FUSE protocol sets). All on the same disk; median of the rounds; the "
        "filesystems take turns within each round (the order rotates). Package tree: "
        f"{tree[0]:,} files in {tree[1]:,} directories from site-packages"
        + (f". Not installed, so not measured: {', '.join(missing)}" if missing else "")
        + ".\n",
        "| phase | "
        + " | ".join(names)
        + " | fsagent / native | fsagent / bindfs "
        + ("| C passthrough / native " if C_PASSTHROUGH in has else "")
        + "| target | met |",
        "| --- | "
        + " | ".join("---:" for _ in names)
        + " | ---: | ---: | "
        + ("---: | " if C_PASSTHROUGH in has else "")
        + "--- | :---: |",
    ]
    for name in PHASES:
        med = {n: statistics.median(r[name] for r in runs[n]) for n in names}
        cells = []
        for n in names:
            rate = f" ({args.large_mib / med[n]:.0f} MiB/s)" if name.startswith("seq") else ""
            cells.append(f"{med[n] * 1000:.1f} ms{rate}")
        vs_bindfs = f"{med['fsagent'] / med['bindfs']:.2f}x" if "bindfs" in has else "-"
        floor = f"{med[C_PASSTHROUGH] / med['native']:.2f}x | " if C_PASSTHROUGH in has else ""
        target, met = _targets(name, med, has)
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {med['fsagent'] / med['native']:.2f}x | "
            f"{vs_bindfs} | {floor}{target} | {'yes' if met else '**no**'} |"
        )
    lines += [
        "",
        *_probe_lines(args, res.probe, res.probe_requests),
        f"fsagent daemon peak RSS (VmHWM) over all rounds: {res.rss / 1024:.0f} MiB.",
        "",
    ]
    daemons = [n for n in names if cpu[n] and cpu[n][0]]
    if daemons:
        lines += [
            "CPU time of each FUSE daemon per phase (user + system, median of the rounds), "
            "beside the phase's wall time on that filesystem:",
            "",
            "| phase | " + " | ".join(f"{n} CPU / wall" for n in daemons) + " |",
            "| --- | " + " | ".join("---:" for _ in daemons) + " |",
        ]
        for name in PHASES:
            if name == "read (cached, data only)":
                continue
            cells = []
            for n in daemons:
                c = statistics.median(r[name] for r in cpu[n])
                w = statistics.median(r[name] for r in runs[n])
                cells.append(f"{c * 1000:.0f} / {w * 1000:.0f} ms")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    counted = [n for n in names if res.requests[n] and res.requests[n][0]]
    if counted:
        lines += _request_lines(res, counted)
    if ALLOW_OTHER in has:
        lines += _allow_other_lines(runs)
    if res.mount_times:
        lines += [
            f"Mount time, fresh state dir, {args.manifest_entries:,}-entry manifest "
            f"({args.manifest_entries - 100:,} files in 100 directories, directory source), "
            f"daemon start to mounted: {', '.join(f'{t:.2f} s' for t in res.mount_times)} "
            f"(median {statistics.median(res.mount_times):.2f} s).",
            "",
        ]
    return "\n".join(lines)


def _fuse_mode() -> str:
    """Which pyfuse3 the daemons import (they inherit this process's environment)."""
    from fsagent.fuse.fs import NO_OPEN_SUPPORT

    mode = '"no open" mode' if NO_OPEN_SUPPORT else "OPEN/RELEASE handles"
    return f"pyfuse3 {importlib.metadata.version('pyfuse3')} ({mode})"


def _version(argv: list[str], word: int = 1) -> str:
    """Word ``word`` of what ``argv`` prints (the version in ``NAME VERSION``); "?" without it."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
    except OSError:
        return "?"
    words = out.split()
    return words[word] if len(words) > word else "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--dirs", type=int, default=50)
    ap.add_argument("--large-mib", type=int, default=128)
    ap.add_argument("--probe-mib", type=int, default=300)
    ap.add_argument("--tree-files", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--manifest-entries", type=int, default=100_000, help="0: skip")
    ap.add_argument(
        "--allow-other",
        action="store_true",
        help=f"also measure {ALLOW_OTHER!r}: fsagent mounted with --allow-other",
    )
    add_output_options(ap)
    args = ap.parse_args()
    if args.large_mib <= 0 or args.large_mib * MIB % WRITE_BLOCK:
        ap.error(f"--large-mib must be a positive multiple of {WRITE_BLOCK // MIB}")

    load_before = load_line()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fsa-fsops-", dir=args.base))
    block = os.urandom(WRITE_BLOCK)
    peers, missing = all_peers(work, allow_other=args.allow_other)
    res = Results(
        runs={p.name: [] for p in peers},
        cpu={p.name: [] for p in peers},
        requests={p.name: [] for p in peers},
        missing=missing,
        tree=(0, 0),
    )
    try:  # the work dir goes whatever happens; every mount is stopped before
        try:
            tree, tree_files, tree_dirs = package_tree(work, args.tree_files)
            res.tree = (tree_files, tree_dirs)
            for peer in peers:
                peer.start()
            for k in range(args.repeat):
                order = peers[k % len(peers) :] + peers[: k % len(peers)]
                for peer in order:
                    root = peer.root / f"run{k}"
                    root.mkdir()
                    times, used, requests = run_workload(
                        root, args.files, args.dirs, args.large_mib, block, peer, tree
                    )
                    res.runs[peer.name].append(times)
                    res.cpu[peer.name].append(used)
                    res.requests[peer.name].append(requests)
                    shutil.rmtree(root)
                print(f"round {k + 1}/{args.repeat} done", file=sys.stderr)
            fsagent = next(p for p in peers if p.name == "fsagent")
            assert isinstance(fsagent, FsagentPeer) and fsagent.mount is not None
            res.probe, res.probe_requests = latency_probe(
                fsagent, work / "probe-native", args.files, args.dirs, args.probe_mib
            )
            res.rss = fsagent.mount.peak_rss_kib()
        finally:
            stop_all(peers)
        if args.manifest_entries:
            res.mount_times = measure_mount_time(work, args.manifest_entries, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(args, res, (load_before, load_line(), time.monotonic() - started))
    print(text)
    print("rounds (ms):", file=sys.stderr)
    for name, rounds in res.runs.items():
        for r in rounds:
            print(f"  {name}: " + ", ".join(f"{p}: {r[p] * 1000:.0f}" for p in PHASES),
                  file=sys.stderr)  # fmt: skip
    record(text, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
