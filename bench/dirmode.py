"""Dir mode: saving 10 changed files in a plain directory of 10,000 and of
99,900 files, beside the same save on a FUSE mount and the reference
behaviour (a full scan that hashes every file).

One run, one real controller (``controller serve``, embedded PostgreSQL,
local_disk). Per collection size, one task folder is seeded as in
``bench.checkpoint`` (the first ``--api-seed`` files through the bridge, the
rest as row copies in PostgreSQL; 4 KiB files in 100 directories), then:

* **FUSE**: a fresh fsagent mount (``--prefetch 0``) hydrates it; each round
  overwrites 10 files spread over the collection and times ``fsagent flush``.
* **dir**: the mount is stopped and a fresh fsagent in dir mode fills a plain
  directory from the same folder (every file downloaded: the hydration time is
  reported); each round overwrites 10 files and times ``fsagent flush``. The
  flush reply says how many files the scan hashed: it must be exactly the 10
  changed ones (no unchanged file read again), and it gives the daemon's own
  time for scan and save (without the ``fsagent flush`` process's start).
* **reference**: the same directory scanned with nothing known (every file read
  and hashed, as a scanner without a metadata baseline must), in this process.

    python -m bench.dirmode [--rounds 3] [--sizes 10000,99900]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.checkpoint import (
    SMALL,
    Controller,
    bridge_manifest,
    mount,
    seed_collection,
    seed_path,
    timed_flush,
    write_files,
)
from bench.machine import add_output_options, load_line, machine_line, record
from fsagent.dirmode.fs import open_root
from fsagent.dirmode.scan import scan_directory
from tests.support.mount import FsagentMount

TARGET_S = 2.0


def dir_mount(work: Path, ctl: Controller, run: dict[str, Any], name: str) -> FsagentMount:
    token = work / f"token-{name}"
    token.write_text(run["token"])
    return FsagentMount(
        "task",
        work / f"dir-{name}",
        work / f"state-dir-{name}",
        ctl.url,
        token_file=token,
        extra=["--prefetch", "8", "--checkpoint-interval", "3600"],
        log_dir=work,
        poll_interval=0.01,
        mode="dir",
    ).start(timeout=3600)


def change_rounds(
    m: FsagentMount, size: int, rounds: int, salt: int
) -> tuple[list[float], list[dict[str, Any]]]:
    """Overwrite 10 files spread over the collection and time the flush, ``rounds`` times."""
    saves: list[float] = []
    results: list[dict[str, Any]] = []
    for r in range(rounds):
        picks = [(salt + r * 997 + k * 7919) % size for k in range(10)]
        paths = [m.mountpoint / seed_path(i) for i in picks]
        write_files(paths, [os.urandom(SMALL) for _ in paths], sync=False)
        seconds, result = timed_flush(m)
        assert result["entries"] == 10, result
        saves.append(seconds)
        results.append(result)
    return saves, results


def scenario(
    work: Path, ctl: Controller, size: int, rounds: int, api_files: int, objects: int
) -> dict[str, Any]:
    run = ctl.new_run(f"dirmode-{size}")
    seed_collection(ctl, run, size, api_files, objects)
    fuse = mount(work, ctl, run, f"f{size}")
    try:
        fuse_saves, _ = change_rounds(fuse, size, rounds, 1)
    finally:
        fuse.stop(timeout=120)
    d = dir_mount(work, ctl, run, f"d{size}")
    try:
        noop = timed_flush(d)[0]
        dir_saves, results = change_rounds(d, size, rounds, 2)
        hashed = [r["dir"]["scan"]["hashed"] for r in results]
        hits = [r["dir"]["scan"]["cacheHits"] for r in results]
        inner = [r["dir"]["saveSeconds"] for r in results]
        scan_s = [r["dir"]["scan"]["seconds"] for r in results]
        rss = d.peak_rss_kib()
        fd = open_root(d.mountpoint)
        try:
            started = time.perf_counter()
            full = scan_directory(fd, {})
            full_s = time.perf_counter() - started
        finally:
            os.close(fd)
    finally:
        d.stop(timeout=300)
    manifest = bridge_manifest(ctl, run)
    assert sum(1 for e in manifest.values() if e["kind"] == "file") == size
    return {
        "size": size,
        "fuse_s": statistics.median(fuse_saves),
        "fuse_saves": fuse_saves,
        "fuse_mount_s": fuse.mount_seconds,
        "dir_hydrate_s": d.mount_seconds,
        "dir_noop_s": noop,
        "dir_s": statistics.median(dir_saves),
        "dir_saves": dir_saves,
        "dir_inner_s": statistics.median(inner),
        "dir_scan_s": statistics.median(scan_s),
        "hashed": hashed,
        "hits": hits,
        "full_s": full_s,
        "full_hashed": full.stats.hashed,
        "rss_kib": rss,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="10000,99900")
    ap.add_argument("--api-seed", type=int, default=2000, help="files seeded through the bridge")
    ap.add_argument("--seed-objects", type=int, default=500, help="distinct contents")
    add_output_options(ap)
    args = ap.parse_args()

    load_before = load_line()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fsa-dirmode-", dir=args.base))
    os.chmod(work, 0o711)  # the embedded PostgreSQL runs as its own user
    (work / "controller").mkdir()
    ctl = Controller(None, work / "controller", gc_args=["--gc-interval", "0"])
    try:
        ctl.start_with_company()
        rows = []
        for s in args.sizes.split(","):
            rows.append(scenario(work, ctl, int(s), args.rounds, args.api_seed, args.seed_objects))
            print(f"{s} done", file=sys.stderr)
    finally:
        ctl.stop(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    load_after = load_line()
    elapsed = time.monotonic() - started

    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## Dir mode: 10 changes in a plain directory, beside FUSE and a full scan ({stamp})\n",
        f"Machine: {machine_line(args.base)}. Command: `python -m bench.dirmode` (`make bench-dirmode`; "
        f"rounds={args.rounds}, sizes={args.sizes}, API seed={args.api_seed}, "
        f"seed objects={args.seed_objects}, base={args.base}). Load average (1/5/15 min) "
        f"before: {load_before}, after: {load_after}; run took {elapsed:.0f} s.\n",
        "One real controller; per size one task folder of 4 KiB files in 100 directories "
        "(seeded as in `bench.checkpoint`). Save = wall time of `fsagent flush task --json` "
        "(a new process) after 10 files spread over the collection were overwritten; "
        "median of the rounds (all rounds in brackets). Dir mode in the daemon = the flush "
        "reply's own time for scan + save (no process start), and its scan alone. Hashed = "
        "files the dir-mode scan read per round, out of the collection (target: the 10 "
        "changed ones). Full scan = the same directory scanned with no baseline, every "
        "file read and hashed (in the benchmark process).\n",
        "| collection | FUSE: save | dir: save | dir: in the daemon (scan) | dir: no-op "
        "flush (a scan, nothing to send) | dir: files hashed per round | full scan hashing "
        "every file | dir: hydration | FUSE: mount | dir daemon peak RSS |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        fuse_all = ", ".join(f"{s * 1000:.0f}" for s in r["fuse_saves"])
        dir_all = ", ".join(f"{s * 1000:.0f}" for s in r["dir_saves"])
        hashed = ", ".join(str(h) for h in r["hashed"])
        lines.append(
            f"| {r['size']:,} files | {r['fuse_s'] * 1000:.0f} ms ({fuse_all}) | "
            f"{r['dir_s'] * 1000:.0f} ms ({dir_all}) | {r['dir_inner_s'] * 1000:.0f} ms "
            f"({r['dir_scan_s'] * 1000:.0f} ms) | {r['dir_noop_s'] * 1000:.0f} ms | "
            f"{hashed} of {r['size']:,} | "
            f"{r['full_s']:.2f} s ({r['full_hashed']:,} hashed) | {r['dir_hydrate_s']:.1f} s | "
            f"{r['fuse_mount_s']:.2f} s | {r['rss_kib'] / 1024:.0f} MiB |"
        )
    big = rows[-1]
    met = big["dir_s"] < TARGET_S and all(h == 10 for h in big["hashed"])
    lines += [
        "",
        f"Target (10 changes in {big['size']:,} files saved in under {TARGET_S:.0f} s, no "
        f"unchanged file hashed): {'met' if met else '**not met**'} "
        f"(flush {big['dir_s']:.2f} s, in the daemon {big['dir_inner_s']:.2f} s; "
        f"hashed {', '.join(str(h) for h in big['hashed'])} per round).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    record(text, args)
    return 0 if all(h == 10 for r in rows for h in r["hashed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
