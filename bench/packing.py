"""Objects compressed at rest: what packing saves on real trees and
what it costs in save and read throughput.

Each tree's distinct files (one object per content, as the controller stores
them) go into a fresh ``local_disk`` store twice, once with packing off (every
object raw, the code before packing) and once as shipped, through the same
calls the batch upload makes: ``put_spans`` over spool files of up to 64 MiB
(one ``syncfs`` each). Then every object is read back whole through
``read_chunks`` and checked. Reported per tree and mode: logical bytes,
stored bytes (file sizes) and disk usage (allocated blocks), save and read
throughput in MB/s of logical bytes, by the clock and (in parentheses) by
the process's CPU time, which a busy shared machine disturbs less. Reads
come from the page cache (the store was just written) and include checking
each object's SHA-256; saves leave out the one ``syncfs`` per batch, which
flushes the whole filesystem and so would time other processes' writes.

    python -m bench.packing [--tree PATH ...] [--rounds 3]

Default trees: this checkout with its ``.git`` (the virtualenv and build
output left out) and the virtualenv's ``site-packages``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

from controller.storage import LocalDiskProvider, local_disk, object_key
from controller.storage import packed as packing
from controller.storage.base import Span

REPO = Path(__file__).resolve().parents[1]
COMPANY = "0b6f3c1e-6a3e-4c59-9a53-2f8f1d0f7a11"
SPOOL_BYTES = 64 << 20
SKIP_DIRS = {".venv", "build", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def tree_files(root: Path, skip: set[str]) -> dict[str, Path]:
    """Digest -> one regular file with those bytes (symlinks not followed)."""
    found: dict[str, Path] = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = Path(top, name)
            if not path.is_file() or path.is_symlink():
                continue
            h = hashlib.sha256()
            with path.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
            found.setdefault(h.hexdigest(), path)
    return found


def spools(files: dict[str, Path], work: Path) -> list[tuple[Path, list[Span]]]:
    """The files concatenated into spool files of up to SPOOL_BYTES, with spans."""
    out: list[tuple[Path, list[Span]]] = []
    spans: list[Span] = []
    spool = work / f"spool-{len(out)}"
    fh = spool.open("wb")
    offset = 0
    for digest, path in sorted(files.items(), key=lambda kv: kv[1].stat().st_size):
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            continue  # changed since it was hashed
        if spans and offset + len(data) > SPOOL_BYTES:
            fh.close()
            out.append((spool, spans))
            spans, offset = [], 0
            spool = work / f"spool-{len(out)}"
            fh = spool.open("wb")
        fh.write(data)
        spans.append(Span(object_key(COMPANY, digest), offset, len(data), digest))
        offset += len(data)
    fh.close()
    out.append((spool, spans))
    return out


@contextmanager
def packing_off(off: bool) -> Iterator[None]:
    if off:
        with mock.patch.object(packing, "worth_packing", lambda size: False):
            yield
    else:
        yield


def measure(batches: list[tuple[Path, list[Span]]], store_dir: Path, raw: bool) -> dict[str, float]:
    shutil.rmtree(store_dir, ignore_errors=True)
    provider = LocalDiskProvider(store_dir)
    logical = sum(s.size for _, spans in batches for s in spans)
    # syncfs flushes the whole filesystem, other processes' dirty pages
    # too: on a shared machine it times the neighbours, not packing.
    with packing_off(raw), mock.patch.object(local_disk, "_syncfs", lambda fd: None):
        t0, c0 = time.perf_counter(), time.process_time()
        for spool, spans in batches:
            provider.put_spans(spool, spans)
        saved, saved_cpu = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        read = 0
        for _, spans in batches:
            for span in spans:
                h = hashlib.sha256()
                for chunk in provider.read_chunks(span.key):
                    h.update(chunk)
                    read += len(chunk)
                assert h.hexdigest() == span.sha256_hex, span.key
        reading, reading_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert read == logical
    stored = blocks = 0
    packed_objects = 0
    for path in (store_dir / "objects").rglob("*"):
        if path.is_file():
            st = path.lstat()
            stored += st.st_size
            blocks += st.st_blocks * 512
            with path.open("rb") as fh:
                packed_objects += fh.read(len(packing.MAGIC)) == packing.MAGIC
    return {
        "logical": logical,
        "stored": stored,
        "disk": blocks,
        "packed": packed_objects,
        "save_mbs": logical / saved / 1e6,
        "save_cpu_mbs": logical / saved_cpu / 1e6,
        "read_mbs": logical / reading / 1e6,
        "read_cpu_mbs": logical / reading_cpu / 1e6,
    }


def mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = args.tree or [REPO, REPO / ".venv/lib/python3.11/site-packages"]
    print(
        f"zstd level {packing.LEVEL}, {packing.FRAME_BYTES >> 20} MiB frames, rounds {args.rounds}"
    )
    print(
        "| tree | objects | mode | logical MiB | stored MiB | disk MiB | packed objects"
        " | save MB/s (CPU) | read MB/s (CPU) |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tree in trees:
        files = tree_files(tree, SKIP_DIRS if tree == REPO else set())
        with tempfile.TemporaryDirectory(prefix="bench-packing-", dir=REPO / "build") as tmp:
            work = Path(tmp)
            batches = spools(files, work)
            runs: dict[str, list[dict[str, float]]] = {"raw": [], "packed": []}
            for i in range(args.rounds):
                order = ["raw", "packed"] if i % 2 == 0 else ["packed", "raw"]
                for mode in order:
                    runs[mode].append(measure(batches, work / "store", mode == "raw"))
            name = str(tree.relative_to(REPO)) if tree != REPO else "this checkout (.git included)"
            for mode in ("raw", "packed"):
                r = runs[mode]
                med = {k: statistics.median(x[k] for x in r) for k in r[0]}
                print(
                    f"| {name} | {len(files):,} | {mode} | {mib(med['logical'])} | "
                    f"{mib(med['stored'])} | {mib(med['disk'])} | {int(med['packed']):,} | "
                    f"{med['save_mbs']:,.0f} ({med['save_cpu_mbs']:,.0f}) | "
                    f"{med['read_mbs']:,.0f} ({med['read_cpu_mbs']:,.0f}) |"
                )


if __name__ == "__main__":
    main()
