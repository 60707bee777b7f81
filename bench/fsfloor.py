"""The floor the FUSE protocol sets under fsagent's SQLite and ``rm -rf`` phases.

bench.fsops measures fsagent against native and its FUSE peers over fourteen
phases. Two of its targets are ratios to native: the SQLite loop within 2x
and the ``rm -rf`` of a package tree within 3x. This benchmark runs just
those two phases, after the same burst of 3,000 creates, renames and unlinks
that comes before them in bench.fsops, on native, fsagent and libfuse's
low-level passthrough example in C (bench.fspeers, ``passthrough_ll``) with
and without the writeback cache, over more rounds. A C daemon that only
forwards each request to the disk is as cheap as a FUSE daemon gets: its
ratio to native is what the protocol itself costs on this kernel, below
which no daemon's ratio can go.

    python -m bench.fsfloor [--rounds 7] [--files 3000] [--dirs 50]
        [--tree-files 2000] [--base /var/tmp] [--results FILE | --no-record]

The filesystems take turns within each round (the order rotates); the table
shows the medians and each one's ratio to native.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.fsops import (
    SMALL,
    SQLITE_COMMITS,
    _paths,
    create_files,
    package_tree,
    sqlite_loop,
)
from bench.fspeers import FsagentPeer, Peer, c_passthrough, stop_all
from bench.machine import add_output_options, load_line, machine_line, record

PHASES = ("SQLite WAL, 300 commits", "rm -rf package tree")


def burst(root: Path, files: int, dirs: int) -> None:
    """bench.fsops's create, rename and unlink phases, untimed."""
    paths = _paths(root, files, dirs)
    renamed = _paths(root, files, dirs, ".r")
    create_files(root, dirs, paths, [os.urandom(SMALL)])
    for a, b in zip(paths, renamed, strict=True):
        os.rename(a, b)
    for p in renamed:
        os.unlink(p)
    for d in range(dirs):
        os.rmdir(root / f"d{d:02d}")


def one_round(root: Path, files: int, dirs: int, tree: Path) -> dict[str, float]:
    """The burst, then the two timed phases: seconds per phase."""
    burst(root, files, dirs)
    t = time.perf_counter()
    sqlite_loop(root / "db.sqlite", SQLITE_COMMITS)
    sqlite_s = time.perf_counter() - t
    copy = root / "pkg"
    shutil.copytree(tree, copy)
    t = time.perf_counter()
    subprocess.run(["rm", "-rf", str(copy)], check=True)
    return {PHASES[0]: sqlite_s, PHASES[1]: time.perf_counter() - t}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--dirs", type=int, default=50)
    ap.add_argument("--tree-files", type=int, default=2000)
    add_output_options(ap)
    args = ap.parse_args()
    load_before, started = load_line(), time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fsa-fsfloor-", dir=args.base))
    peers: list[Peer] = [Peer("native", work / "native"), FsagentPeer(work)]
    for writeback in (True, False):
        peer = c_passthrough(work, writeback=writeback)
        if peer is None:
            print(
                "libfuse's passthrough_ll could not be built (libfuse3-dev, gcc)", file=sys.stderr
            )
            return 2
        peers.append(peer)
    runs: dict[str, list[dict[str, float]]] = {p.name: [] for p in peers}
    try:
        try:
            tree, tree_files, tree_dirs = package_tree(work, args.tree_files)
            for peer in peers:
                peer.start()
            for k in range(args.rounds):
                for peer in peers[k % len(peers) :] + peers[: k % len(peers)]:
                    root = peer.root / f"run{k}"
                    root.mkdir()
                    runs[peer.name].append(one_round(root, args.files, args.dirs, tree))
                    shutil.rmtree(root)
                print(f"round {k + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            stop_all(peers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## The FUSE floor under SQLite and rm -rf ({stamp})\n",
        f"Machine: {machine_line(args.base)}. Command: `python -m bench.fsfloor` "
        f"(rounds={args.rounds}, files={args.files}, dirs={args.dirs}, base={args.base}). "
        f"Load average (1/5/15 min) before: {load_before}, after: {load_line()}; run took "
        f"{time.monotonic() - started:.0f} s. Each round, on each filesystem in turn: "
        f"{args.files:,} creates, renames and unlinks in {args.dirs} directories (untimed), "
        f"the SQLite loop ({SQLITE_COMMITS} WAL commits), then a copy (untimed) and "
        f"`rm -rf` of {tree_files:,} files in {tree_dirs:,} directories. Medians of the "
        "rounds, and the ratio to native.\n",
        "| phase | " + " | ".join(runs) + " |",
        "| --- | " + " | ".join("---:" for _ in runs) + " |",
    ]
    for phase in PHASES:
        med = {n: statistics.median(r[phase] for r in rounds) for n, rounds in runs.items()}
        cells = [f"{med[n] * 1000:.1f} ms ({med[n] / med['native']:.2f}x)" for n in runs]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    for name, rounds in runs.items():
        print(f"  {name}: " + "; ".join(
            ", ".join(f"{r[p] * 1000:.0f}" for p in PHASES) for r in rounds), file=sys.stderr)  # fmt: skip
    record(text, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
