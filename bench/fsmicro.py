"""Small-file operations, per operation: wall time and the FUSE daemon's CPU time.

For A/B work on fsagent's FUSE path: native, bindfs and any number of fsagent
variants (each a mount of a directory source with its own environment and
options) take turns within each round; the table shows, per phase, the median
over the rounds of the wall time per operation and of the daemon's CPU time
per operation (all its threads, from /proc/PID/task/*/schedstat). On a shared
machine the CPU figures move much less with the load than the wall times.

    python -m bench.fsmicro [--files 3000] [--dirs 50] [--rounds 5] [--extra]
        [--variant 'NAME|ENV=V;ENV2=V|--spin-us 0' ...] [--no-native] [--no-bindfs]

Without --variant there is one: ``fsagent`` with this process's environment.
``--extra`` adds a SQLite WAL loop (300 commits), 2,000 line-buffered appends
and a 64 MiB write + fsync and read. Nothing is recorded; the command line
and its output go into a dated log under bench/results/ by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.fspeers import FusePeer
from bench.machine import load_line, machine_line
from tests.support.mount import FsagentMount
from tests.support.source import make_source

SMALL = 4096
MIB = 1 << 20


def cpu_ns(pid: int | None) -> int:
    """CPU time of every thread of ``pid`` so far (0 for no process: native)."""
    if pid is None:
        return 0
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total


def workload(
    root: Path, files: int, dirs: int, extra: bool, pid: int | None
) -> dict[str, tuple[float, float]]:
    """Every phase once under ``root``: (wall µs, daemon CPU µs) per operation."""
    out: dict[str, tuple[float, float]] = {}
    paths = [os.path.join(root, f"d{i % dirs:02d}", f"f{i:05d}") for i in range(files)]
    payload = os.urandom(SMALL)
    buf = bytearray(SMALL * 2)

    def phase(name: str, count: int, fn: Callable[[], object]) -> None:
        cpu, started = cpu_ns(pid), time.perf_counter()
        fn()
        wall = time.perf_counter() - started
        out[name] = (wall / count * 1e6, (cpu_ns(pid) - cpu) / count / 1e3)

    def create() -> None:
        for d in range(dirs):
            os.mkdir(root / f"d{d:02d}")
        for p in paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, payload)
            os.close(fd)

    def read_all() -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.readv(fd, [buf])
            os.close(fd)

    def unlink_all() -> None:
        for p in paths:
            os.unlink(p + ".r")
        for d in range(dirs):
            os.rmdir(root / f"d{d:02d}")

    phase("create", files, create)
    phase("stat", files, lambda: [os.stat(p) for p in paths])
    phase("walk", files, lambda: sum(len(f) for _, _, f in os.walk(root)))
    phase("read", files, read_all)
    phase("rename", files, lambda: [os.rename(p, p + ".r") for p in paths])
    phase("unlink", files, unlink_all)
    if extra:
        block = os.urandom(MIB)
        big = bytearray(MIB)

        def sqlite_loop() -> None:
            db = sqlite3.connect(root / "db.sqlite", isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
            row = os.urandom(1024)
            for _ in range(300):
                db.execute("BEGIN")
                db.execute("INSERT INTO t (v) VALUES (?)", (row,))
                db.execute("COMMIT")
            db.close()

        def appends() -> None:
            with open(root / "log.txt", "a") as fh:
                for i in range(2000):
                    fh.write(f"line {i} {'x' * 80}\n")
                    fh.flush()

        def seq_write() -> None:
            fd = os.open(root / "big", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for _ in range(64):
                os.write(fd, block)
            os.fsync(fd)
            os.close(fd)

        def seq_read() -> None:
            fd = os.open(root / "big", os.O_RDONLY)
            while os.readv(fd, [big]):
                pass
            os.close(fd)

        phase("sqlite commit", 300, sqlite_loop)
        phase("append+flush", 2000, appends)
        phase("64 MiB write+fsync", 1, seq_write)
        phase("64 MiB read", 1, seq_read)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--dirs", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--extra", action="store_true")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME|ENV=V;ENV2=V|fsagent mount options")  # fmt: skip
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--no-bindfs", action="store_true")
    ap.add_argument("--base", type=Path, default=Path("/var/tmp"))
    args = ap.parse_args()

    before = load_line()
    work = Path(tempfile.mkdtemp(prefix="fsa-micro-", dir=args.base))
    roots: dict[str, Path] = {}
    pids: dict[str, int | None] = {}
    mounts: list[FsagentMount] = []
    bindfs: FusePeer | None = None
    try:
        if not args.no_native:
            roots["native"] = work / "native"
            roots["native"].mkdir()
            pids["native"] = None
        for spec in args.variant or ["fsagent||"]:
            name, env_text, options = spec.split("|")
            env = dict(os.environ)
            for pair in filter(None, env_text.split(";")):
                key, value = pair.split("=", 1)
                env[key] = value
            source = make_source(work / f"src-{name}", {"agent": {}})
            m = FsagentMount("agent", work / f"mnt-{name}", work / f"state-{name}",
                             f"dir:{source}", extra=options.split(), log_dir=work, env=env)  # fmt: skip
            mounts.append(m.start())
            roots[name] = m.mountpoint
            assert m.proc is not None
            pids[name] = m.proc.pid
        if not args.no_bindfs and shutil.which("bindfs"):
            src, mnt = work / "bindfs-src", work / "bindfs-mnt"
            bindfs = FusePeer("bindfs", mnt, [src], argv=["bindfs", "-f", str(src), str(mnt)],
                              log=work / "bindfs.log")  # fmt: skip
            bindfs.start()
            roots["bindfs"] = mnt
            assert bindfs.proc is not None
            pids["bindfs"] = bindfs.proc.pid
        names = list(roots)
        runs: dict[str, list[dict[str, tuple[float, float]]]] = {n: [] for n in names}
        for k in range(args.rounds):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                root = roots[name] / f"r{k}"
                root.mkdir()
                runs[name].append(workload(root, args.files, args.dirs, args.extra, pids[name]))
                shutil.rmtree(root)
    finally:
        for m in mounts:
            m.stop()
        if bindfs is not None:
            bindfs.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{machine_line(args.base)}; load average before {before}, after {load_line()}")
    print(f"{args.files} files in {args.dirs} directories; median of {args.rounds} rounds\n")
    phases = list(runs[names[0]][0])
    for title, index in (("wall time per operation (µs)", 0), ("daemon CPU per operation (µs)", 1)):
        print(f"| {title} | " + " | ".join(names) + " |")
        print("| --- | " + " | ".join("---:" for _ in names) + " |")
        for p in phases:
            cells = [statistics.median(r[p][index] for r in runs[n]) for n in names]
            if index == 1 and "native" in names:
                cells[names.index("native")] = float("nan")
            print(f"| {p} | " + " | ".join("-" if c != c else f"{c:.1f}" for c in cells) + " |")
        print()


if __name__ == "__main__":
    main()
