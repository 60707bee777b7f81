"""Save throughput: every row of its table, this tree against a baseline.

A real controller (``controller serve``, embedded PostgreSQL, local_disk or
S3 against the test S3 server) and real fsagent mounts on loopback, through
the same helpers as ``bench.checkpoint`` and ``tests/support``. Rows:

* ``small``: checkpoint of 3,000 new 4 KiB files (files/s of the flush);
* ``mixed``: checkpoint of 50,000 new files of mixed small sizes (100 B to
  64 KiB, log-uniform), timed from the flush to the receipt; the workload
  (writes through the mount) is reported next to it;
* ``large``: one 1 GiB file of random bytes;
* ``ten``: ten 64 MiB files of random bytes (MB/s in total);
* ``changed``: 10 changed files in a 99,900-file collection (median of
  ``--changed-rounds`` saves), and ``mount``: a fresh fsagent mounting that
  100,000-entry collection through the controller;
* ``manifest``: the controller's side of that mount, a 100,000-entry
  manifest paged through the bridge (5,000 per page; median of three full
  listings, and the slowest page);
* ``rest1`` / ``rest8``: REST ``PUT /content`` of 4 KiB with 1 and 8 clients
  on one folder;
* ``probe``: p99 of open + read + close of a cached 4 KiB file,
  idle and while ``fsagent flush`` saves 3,000 new 4 KiB files and a
  ``probe_mib`` MiB file; the daemon's CPU time during that flush beside it.

``--baseline REV`` checks REV out into a temporary ``git worktree`` and runs
the very same measurement there (this file, with the working directory and
``PYTHONPATH`` pointed at that checkout, in the same venv): each round runs
this tree and the baseline one after the other, alternating which goes first,
and each row reports the median over the rounds. ``--baseline before-issue``
is the code before the save path was reworked (:data:`BASELINES`). ``--provider s3`` runs the
large-file rows against the test S3 server behind a counting proxy and
reports the S3 requests per file; ``--provider all`` runs the local_disk rows,
then the S3 ones, in the same run (one table each). ``--batch-sweep`` runs
this tree once per small-file batch threshold (16, 64 and 256 KiB, through
``BENCH_BATCH_MEMBER_KIB`` for the controller and fsagent alike; rows small
and mixed, the mixed sizes up to 256 KiB unless ``--mixed-max-kib`` says
otherwise). ``--quick`` shrinks every row for a smoke test (its figures mean
nothing).

    python -m bench.save [--baseline before-issue|REV] [--rounds 3]
        [--provider local_disk|s3|all] [--batch-sweep] [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MIB = 1 << 20
BATCH_MEMBER_ENV = "BENCH_BATCH_MEMBER_KIB"
"""common.bridge's batch threshold override (not imported: the baseline tree may lack it)."""
HERE = Path(__file__).resolve()
TREE = HERE.parent.parent

BASELINES = {"before-issue": "cd25a5b"}
"""Named baselines: ``before-issue`` is the last commit before the save path
was reworked for throughput (the ``main`` of its first recorded runs)."""
SWEEP_KIB = ("16", "64", "256")

FULL = {
    "small_files": 3000,
    "mixed_files": 50_000,
    "mixed_max_kib": 64,
    "large_mib": 1024,
    "ten_mib": 64,
    "collection": 99_900,
    "changed_rounds": 5,
    "rest_files": 800,
    "probe_mib": 300,
}
QUICK = {
    "small_files": 200,
    "mixed_files": 1000,
    "mixed_max_kib": 64,
    "large_mib": 32,
    "ten_mib": 4,
    "collection": 2000,
    "changed_rounds": 2,
    "rest_files": 80,
    "probe_mib": 8,
}
ROWS = ("small", "mixed", "large", "ten", "changed", "manifest", "rest", "probe")
S3_ROWS = ("large", "ten")

# (key, label, unit, target, higher is better)
TABLE = [
    ("small_fps", "checkpoint of {small_files:,} new 4 KiB files", "files/s", 2000, True),
    (
        "mixed_s",
        "checkpoint of {mixed_files:,} new files, mixed sizes up to {mixed_max_kib} KiB",
        "s",
        30,
        False,
    ),
    ("large_mbs", "one {large_mib} MiB file", "MB/s", 300, True),
    ("ten_mbs", "ten {ten_mib} MiB files", "MB/s", 300, True),
    ("changed_ms", "10 changed files in a {collection:,}-file collection", "ms", 150, False),
    ("rest1_ps", "REST 4 KiB PUT, 1 client, one folder", "files/s", None, True),
    ("rest8_ps", "REST 4 KiB PUT, 8 clients, one folder", "files/s", 500, True),
    ("mount_s", "mount of a {collection_entries:,}-entry collection", "s", 3, False),
    ("manifest_s", "its manifest paged through the bridge", "s", 1, False),
    ("probe_ratio", "open+read+close p99 during a checkpoint, × idle p99", "x", 2, False),
]


# --- one measurement, run inside the tree under test --------------------------


def mixed_sizes(n: int, max_kib: int = 64, seed: int = 15) -> list[int]:
    """``n`` sizes from 100 B to ``max_kib`` KiB, log-uniform."""
    rng = random.Random(seed)
    top = math.log(max_kib * 1024)
    return [int(math.exp(rng.uniform(math.log(100), top))) for _ in range(n)]


def run_rows(sizes: dict[str, Any], rows: list[str], provider: str, base: Path) -> dict[str, Any]:
    """Measure ``rows`` against the code this process imports; returns the figures."""
    from bench.checkpoint import (
        Controller,
        bridge,
        bridge_manifest,
        mount,
        scenario_changed,
        scenario_large,
        seed_collection,
        timed_flush,
        write_large,
    )

    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="fsa-save-", dir=base))
    os.chmod(work, 0o711)  # the embedded PostgreSQL runs as its own user
    (work / "controller").mkdir()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        stack.push(lambda *exc: show_logs(work, exc[0] is not None))
        extra, env, counter = s3_setup(stack) if provider == "s3" else ([], {}, None)
        ctl = Controller(None, work / "controller", extra, env, gc_args=["--gc-interval", "0"])
        stack.callback(ctl.stop, timeout=60)
        ctl.start_with_company()

        def requests_during(fn: Any) -> tuple[Any, int]:
            before = len(counter.seen) if counter is not None else 0
            result = fn()
            return result, (len(counter.seen) - before if counter is not None else 0)

        helpers = {"mount": mount, "timed_flush": timed_flush, "manifest": bridge_manifest}
        if "small" in rows:
            n = sizes["small_files"]
            r = scenario_files(work, ctl, "small", [4096] * n, 50, helpers)
            out["small_fps"] = n / r["save_s"]
            if r.get("daemon_s") is not None:
                out["small_daemon_fps"] = n / r["daemon_s"]
            out["small_upload_s"] = r["upload_s"]
            out["small_commit_s"] = r["save_s"] - r["upload_s"]
        if "mixed" in rows:
            n = sizes["mixed_files"]
            spread = mixed_sizes(n, sizes["mixed_max_kib"])
            r = scenario_files(work, ctl, "mixed", spread, max(1, n // 100), helpers)
            out["mixed_s"] = r["save_s"]
            out["mixed_workload_s"] = r["workload_s"]
            out["mixed_upload_s"] = r["upload_s"]
            out["mixed_commit_s"] = r["save_s"] - r["upload_s"]
        if "large" in rows:
            r, reqs = requests_during(lambda: scenario_large(work, ctl, sizes["large_mib"]))
            out["large_mbs"] = r["mib"] * MIB / 1e6 / r["save_s"]
            out["large_rss_mib"] = r["rss_kib"] / 1024
            if counter is not None:
                out["large_requests_per_file"] = reqs
        if "ten" in rows:
            r, reqs = requests_during(
                lambda: scenario_ten(work, ctl, sizes["ten_mib"], mount, timed_flush, write_large)
            )
            out["ten_mbs"] = 10 * sizes["ten_mib"] * MIB / 1e6 / r["save_s"]
            out["ten_rss_mib"] = r["rss_kib"] / 1024
            if counter is not None:
                out["ten_requests_per_file"] = reqs / 10
        if "changed" in rows:
            r = scenario_changed(work, ctl, sizes["collection"], sizes["changed_rounds"], 2000, 500)
            out["changed_ms"] = r["save_s"] * 1000
            out["changed_noop_ms"] = r["noop_s"] * 1000
            if r.get("daemon_s") is not None:
                out["changed_daemon_ms"] = r["daemon_s"] * 1000
            out["mount_s"] = r["mount_s"]
        if "manifest" in rows:
            out.update(scenario_manifest(ctl, sizes["collection"], seed_collection, bridge))
        if "rest" in rows:
            out.update(scenario_rest(ctl, sizes["rest_files"]))
        if "probe" in rows:
            out.update(scenario_probe(work, ctl, sizes["small_files"], sizes["probe_mib"], mount))
    return out


def show_logs(work: Path, failed: bool) -> bool:
    """On a failure, the daemons' and the controller's logs go to stderr."""
    if failed:
        for log in sorted([*work.glob("*.stderr"), *work.glob("controller/*.log")]):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
    return False


def s3_setup(stack: contextlib.ExitStack) -> tuple[list[str], dict[str, str], Any]:
    """The test S3 server behind a proxy that records every request; a fresh bucket."""
    from tests.support.lossy_proxy import LossyProxy
    from tests.support.s3server import FAKE_CREDENTIALS, S3Server
    from tests.support.storage import s3_client

    server = S3Server().start()
    stack.callback(server.stop)
    proxy = LossyProxy(server.endpoint_url).start()
    stack.callback(proxy.stop)
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    s3_client(server).create_bucket(Bucket=bucket)
    args = ["--storage", "s3", "--s3-endpoint", proxy.url, "--s3-bucket", bucket]
    return [*args, "--s3-region", "us-east-1"], dict(FAKE_CREDENTIALS), proxy


def scenario_files(
    work: Path, ctl: Any, name: str, sizes: list[int], dirs: int, helpers: dict[str, Any]
) -> dict[str, Any]:
    """New files of ``sizes`` bytes in ``dirs`` directories, then one timed flush.

    The flush is split at the last upload the controller registered
    (``run_uploads.created_at``): before it the uploads, after it the commit.
    """
    run = ctl.new_run(name)
    m = helpers["mount"](work, ctl, run, name)
    paths = [f"m{i % dirs:03d}/f{i:05d}" for i in range(len(sizes))]
    try:
        t = time.perf_counter()
        for d in range(dirs):
            (m.mountpoint / f"m{d:03d}").mkdir()
        for path, size in zip(paths, sizes, strict=True):
            (m.mountpoint / path).write_bytes(os.urandom(size))
        workload = time.perf_counter() - t
        started = time.time()
        seconds, result = helpers["timed_flush"](m)
        assert result["entries"] >= len(sizes), result
        daemon = result.get("seconds")  # the save's own time in the daemon
    finally:
        m.stop(timeout=300)
    got = {
        p: e["byteSize"] for p, e in helpers["manifest"](ctl, run).items() if e["kind"] == "file"
    }
    assert got == dict(zip(paths, sizes, strict=True))
    with ctl.db() as db:
        row = db.execute(
            "SELECT extract(epoch FROM max(created_at)) FROM run_uploads WHERE run_id = %s",
            (run["run_id"],),
        ).fetchone()
    uploads = float(row[0]) - started if row and row[0] is not None else float("nan")
    return {"workload_s": workload, "save_s": seconds, "upload_s": uploads, "daemon_s": daemon}


def scenario_ten(
    work: Path, ctl: Any, mib: int, mount: Any, timed_flush: Any, write_large: Any
) -> dict[str, Any]:
    run = ctl.new_run("ten")
    m = mount(work, ctl, run, "ten")
    try:
        for k in range(10):
            write_large(m.mountpoint / f"big{k}.bin", mib, sync=False)
        seconds, result = timed_flush(m)
        assert result["entries"] == 10, result
        rss = m.peak_rss_kib()
    finally:
        m.stop(timeout=60)
    return {"save_s": seconds, "rss_kib": rss}


def scenario_manifest(ctl: Any, files: int, seed: Any, bridge: Any) -> dict[str, float]:
    """A ``files``-file folder (seeded as the changed row's) listed through the
    bridge's manifest pages, as a mount reads it: median of three listings,
    the slowest page of all and the pages per listing."""
    from common.bridge import PREFIX

    run = ctl.new_run(f"manifest-{files}")
    seed(ctl, run, files, 100, 50)
    listings: list[float] = []
    slowest, pages = 0.0, 0
    with bridge(ctl, run) as c:
        for _ in range(3):
            started, since, entries, pages = time.perf_counter(), 0, 0, 0
            while True:
                t = time.perf_counter()
                r = c.get(f"{PREFIX}/folders/task/manifest", params={"since": since})
                r.raise_for_status()
                body = r.json()
                slowest = max(slowest, time.perf_counter() - t)
                entries, pages = entries + len(body["entries"]), pages + 1
                if body["nextSince"] is None:
                    break
                since = body["nextSince"]
            listings.append(time.perf_counter() - started)
            assert entries >= files, entries
    return {
        "manifest_s": statistics.median(listings),
        "manifest_page_max_ms": slowest * 1000,
        "manifest_pages": float(pages),
    }


def scenario_rest(ctl: Any, files: int) -> dict[str, float]:
    import httpx

    boot = ctl.admin("create-user", f"rest-{uuid.uuid4().hex[:8]}@example.com")
    ctl.admin("add-member", ctl.company, boot["user_id"], "--role", "member")
    folder = f"/api/companies/{ctl.company}/work-folders/user/{boot['user_id']}"
    payload = os.urandom(4096)

    def put_some(prefix: str, n: int) -> None:
        headers = {
            "Authorization": f"Bearer {boot['token']}",
            "Content-Type": "application/octet-stream",
        }
        with httpx.Client(base_url=ctl.url, headers=headers, timeout=120) as c:
            for i in range(n):
                r = c.put(f"{folder}/content", params={"path": f"{prefix}/f{i}"}, content=payload)
                assert r.status_code in (200, 201), r.text

    out = {}
    for clients in (1, 8):
        per = files // clients if clients > 1 else files // 2
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(put_some, [f"c{clients}-{k}" for k in range(clients)], [per] * clients))
        out[f"rest{clients}_ps"] = per * clients / (time.perf_counter() - t)
    return out


PROBE_SAMPLES = 3000


def scenario_probe(work: Path, ctl: Any, files: int, mib: int, mount: Any) -> dict[str, float]:
    """p99 of open + read + close of 100 cached 4 KiB files, idle, then while a
    separate ``fsagent flush`` saves ``files`` new 4 KiB files and a ``mib`` MiB file."""
    run = ctl.new_run("probe")
    m = mount(work, ctl, run, "probe")
    try:
        hot = [m.mountpoint / f"hot{i:03d}" for i in range(100)]
        for p in hot:
            p.write_bytes(os.urandom(4096))
        m.fsagent("flush", "task")  # the probe's own files are saved first
        for d in range(50):
            (m.mountpoint / f"d{d:02d}").mkdir()
        for i in range(files):
            (m.mountpoint / f"d{i % 50:02d}/f{i:05d}").write_bytes(os.urandom(4096))
        with open(m.mountpoint / "big.bin", "wb") as fh:
            for _ in range(mib):
                fh.write(os.urandom(MIB))

        def sample() -> float:
            t = time.perf_counter()
            with open(hot[int(t * 1e6) % len(hot)], "rb", buffering=0) as fh:
                fh.read(8192)
            return time.perf_counter() - t

        for p in hot:
            p.read_bytes()
        idle = [sample() for _ in range(PROBE_SAMPLES)]
        argv = [sys.executable, "-m", "fsagent.cli", "flush", "task",
                "--state-dir", str(m.state_dir), "--json"]  # fmt: skip
        assert m.proc is not None
        cpu = cpu_seconds(m.proc.pid)
        fuse_cpu = cpu_seconds(m.proc.pid, thread=m.proc.pid)
        started = time.perf_counter()
        flush = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        busy: list[float] = []
        while flush.poll() is None:
            busy.append(sample())
            time.sleep(0.0002)
        took = time.perf_counter() - started
        cpu = cpu_seconds(m.proc.pid) - cpu
        fuse_cpu = cpu_seconds(m.proc.pid, thread=m.proc.pid) - fuse_cpu
        reply = json.loads(flush.communicate()[0] or b"{}")
        if not reply.get("ok") or reply["result"]["entries"] < files + 1:
            raise RuntimeError(f"flush during the probe failed: {reply}")
    finally:
        m.stop(timeout=300)
    idle_p99, busy_p99 = p99(idle), p99(busy)
    return {
        "probe_idle_p99_ms": idle_p99 * 1000,
        "probe_busy_p99_ms": busy_p99 * 1000,
        "probe_busy_p50_ms": statistics.median(busy) * 1000,
        "probe_ratio": busy_p99 / idle_p99,
        "probe_flush_s": took,
        "probe_cpu_s": cpu,
        "probe_fuse_cpu_s": fuse_cpu,
        "probe_samples": len(busy),
    }


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def cpu_seconds(pid: int, *, thread: int | None = None) -> float:
    """User + system CPU time so far of a process (all its threads), or of one
    of its threads (the main one, ``thread=pid``, serves FUSE)."""
    where = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(where).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the driver ---------------------------------------------------------------


def run_side(
    side: tuple[Path, dict[str, str]],
    sizes: dict[str, Any],
    rows: list[str],
    provider: str,
    base: Path,
) -> Any:
    """This file in a fresh interpreter whose imports come from the side's
    tree, with the side's environment (inherited by the controller and the
    daemons it starts)."""
    tree, extra = side
    env = {**os.environ, **extra, "PYTHONPATH": str(tree)}
    argv = [sys.executable, str(HERE), "--child", json.dumps(sizes), ",".join(rows)]
    argv += [provider, str(base)]
    proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement in {tree} failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def baseline_tree(rev: str | None) -> Iterator[Path | None]:
    if rev is None:
        yield None
        return
    where = Path(tempfile.mkdtemp(prefix="fsa-save-base-", dir="/var/tmp")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=TREE, check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=TREE, check=False)
        shutil.rmtree(where.parent, ignore_errors=True)


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "ms":
        return f"{value:.0f} ms" if value >= 10 else f"{value:.2f} ms"
    if unit == "x":
        return f"{value:.1f}x"
    return f"{value:,.0f} {unit}"


def met(value: float | None, target: float | None, higher: bool) -> str:
    if value is None or target is None:
        return ""
    return "yes" if (value >= target if higher else value <= target) else "**no**"


def median_of(results: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def report(
    args: argparse.Namespace, sizes: dict[str, Any], sides: dict[str, Any], provider: str
) -> str:
    from bench.machine import load_line, machine_line

    labels = {**sizes, "collection_entries": sizes["collection"] + 100}
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=TREE, capture_output=True, text=True
    ).stdout.strip()
    names = list(sides)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## Save throughput ({provider}) ({stamp})\n",
        f"Machine: {machine_line(args.base)}. Command: `python -m bench.save --provider {args.provider}"
        f" --rounds {args.rounds}"
        + (f" --baseline {args.baseline}" if args.baseline else "")
        + (" --quick" if args.quick else "")
        + (f" --mixed-files {args.mixed_files}" if args.mixed_files else "")
        + (f" --large-mib {args.large_mib}" if args.large_mib else "")
        + (f" --rows {args.rows}" if args.rows else "")
        + (f" --mixed-max-kib {args.mixed_max_kib}" if args.mixed_max_kib else "")
        + (" --batch-sweep" if args.batch_sweep else "")
        + f"` ({args.elapsed:.0f} s, load average after:"
        f" {load_line()}). This tree: {head}"
        + (f"; baseline: {args.baseline} ({args.baseline_sha})" if args.baseline else "")
        + ". Each round runs every column in turn (alternating which goes first); medians of "
        f"{args.rounds} round(s). Saves are `fsagent flush` wall time, from after the last "
        'close() to the controller\'s receipt; "in the daemon" rows are the same save '
        "without the flush process (its start, the control socket), from the daemon's "
        "reply.\n",
        "| measurement | target | " + " | ".join(names) + " | met |",
        "| --- | ---: | " + " | ".join("---:" for _ in names) + " | :---: |",
    ]
    for key, label, unit, target, higher in TABLE:
        values = [median_of(sides[n], key) for n in names]
        if all(v is None for v in values):
            continue
        goal = "" if target is None else ("≥ " if higher else "≤ ") + fmt(target, unit)
        cells = " | ".join(fmt(v, unit) for v in values)
        lines.append(
            f"| {label.format(**labels)} | {goal} | {cells} | {met(values[0], target, higher)} |"
        )
    extras = [
        ("small_daemon_fps", "small files: the save in the daemon (no flush process)", "files/s"),
        ("changed_daemon_ms", "10 changes: the save in the daemon (no flush process)", "ms"),
        ("changed_noop_ms", "a flush with nothing to save (process start, control socket)", "ms"),
        ("small_upload_s", "small files: flush start to the last upload registered", "s"),
        ("small_commit_s", "small files: from there to the receipt (the commit)", "s"),
        ("mixed_upload_s", "mixed files: flush start to the last upload registered", "s"),
        ("mixed_commit_s", "mixed files: from there to the receipt (the commit)", "s"),
        ("mixed_workload_s", "workload of the mixed row (writes through the mount)", "s"),
        ("manifest_page_max_ms", "manifest: the slowest page", "ms"),
        ("manifest_pages", "manifest: pages per listing", "pages"),
        ("large_requests_per_file", "S3 requests for the {large_mib} MiB file", "requests"),
        ("ten_requests_per_file", "S3 requests per {ten_mib} MiB file", "requests"),
        ("large_rss_mib", "daemon peak RSS, large file", "MiB"),
        ("ten_rss_mib", "daemon peak RSS, ten files", "MiB"),
        ("probe_idle_p99_ms", "probe: open+read+close p99 idle", "ms"),
        ("probe_busy_p99_ms", "probe: p99 during the checkpoint", "ms"),
        ("probe_busy_p50_ms", "probe: p50 during the checkpoint", "ms"),
        ("probe_flush_s", "probe: the checkpoint ({small_files:,} files + {probe_mib} MiB)", "s"),
        ("probe_cpu_s", "probe: daemon CPU during the checkpoint", "s"),
        ("probe_fuse_cpu_s", "probe: CPU of the daemon's FUSE thread meanwhile", "s"),
    ]
    for key, label, unit in extras:
        values = [median_of(sides[n], key) for n in names]
        if any(v is not None for v in values):
            cells = " | ".join(fmt(v, unit) for v in values)
            lines.append(f"| {label.format(**labels)} | | {cells} | |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        sizes, rows, provider, base = json.loads(argv[1]), argv[2].split(","), argv[3], argv[4]
        print(json.dumps(run_rows(sizes, rows, provider, Path(base))))
        return 0
    sys.path.insert(0, str(TREE))
    from bench.machine import add_output_options, record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline",
        help="git revision to measure in the same run (e.g. main), or before-issue"
        f" ({BASELINES['before-issue']}, the code before the save path was reworked)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--provider", choices=["local_disk", "s3", "all"], default="local_disk")
    ap.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--large-mib", type=int, help="size of the one large file")
    ap.add_argument("--mixed-files", type=int, help="files of the mixed row")
    ap.add_argument("--mixed-max-kib", type=int, help="largest file of the mixed row (64)")
    ap.add_argument(
        "--batch-sweep",
        action="store_true",
        help=f"this tree once per batch threshold ({', '.join(SWEEP_KIB)} KiB)",
    )
    add_output_options(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    sizes = dict(QUICK if args.quick else FULL)
    if args.large_mib:
        sizes["large_mib"] = args.large_mib
    if args.mixed_files:
        sizes["mixed_files"] = args.mixed_files
    if args.mixed_max_kib or args.batch_sweep:
        sizes["mixed_max_kib"] = args.mixed_max_kib or int(SWEEP_KIB[-1])
    providers = ["local_disk", "s3"] if args.provider == "all" else [args.provider]
    plan: list[tuple[str, list[str]]] = []
    for provider in providers:
        default = S3_ROWS if provider == "s3" else ("small", "mixed") if args.batch_sweep else ROWS
        rows = args.rows.split(",") if args.rows else list(default)
        if unknown := [r for r in rows if r not in ROWS]:
            ap.error(f"unknown rows {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
        plan.append((provider, rows))
    rev = BASELINES.get(args.baseline, args.baseline) if args.baseline else None
    started = time.monotonic()
    tables: list[tuple[str, dict[str, list[dict[str, Any]]]]] = []
    with baseline_tree(rev) as base_tree:
        trees: dict[str, tuple[Path, dict[str, str]]] = {}
        if args.batch_sweep:
            for kib in SWEEP_KIB:
                trees[f"this tree, {kib} KiB batches"] = (TREE, {BATCH_MEMBER_ENV: kib})
        else:
            trees["this tree"] = (TREE, {})
        if base_tree is not None:
            trees[f"baseline {args.baseline}"] = (base_tree, {})
            args.baseline_sha = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=base_tree, capture_output=True,
                text=True,
            ).stdout.strip()  # fmt: skip
        for provider, rows in plan:
            sides: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name in order:
                    result = run_side(trees[name], sizes, rows, provider, args.base)
                    print(f"round {r + 1} {provider} {name}: {json.dumps(result)}", file=sys.stderr)
                    sides[name].append(result)
            tables.append((provider, sides))
    args.elapsed = time.monotonic() - started
    text = "".join(report(args, sizes, sides, provider) for provider, sides in tables)
    print(text)
    record(text, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
