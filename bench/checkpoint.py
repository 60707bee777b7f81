"""Checkpoints: from the end of a workload to a durable save on the controller.

A real controller (``controller serve`` with its embedded PostgreSQL and
local_disk storage) and real fsagent mounts in their own processes. Each
scenario writes through the mount, closes its files, then times
``fsagent flush`` (a separate process, as an operator or the run supervisor
would call it): it returns once the controller has committed the checkpoint,
i.e. the objects are stored and the receipt is written.

Scenarios:

* (a) overwrite 10 existing 4 KiB files in a collection of 10,000 and of
  99,900 files (with their 100 directories, the controller's 100,000-entry
  folder limit), ``--rounds`` times each (median). Seeding through the API
  costs the controller several milliseconds per entry, so a 100,000-file
  collection would take far longer than the benchmark itself. The first
  ``--api-seed`` files of each collection therefore go through the bridge with
  the run's own token (``--seed-objects`` distinct 4 KiB objects uploaded,
  then checkpoint commits that reference them); the rest are copies of those
  rows (same digests, sizes and flags, own paths, fresh versions from the
  folder's version counter) inserted into PostgreSQL in one statement,
  followed by ANALYZE. Both sizes are seeded the same way. A fresh fsagent
  mount then hydrates the manifest through the bridge; its mount time is
  reported too.
* (b) 3,000 new 4 KiB files in 50 directories.
* (c) one 256 MiB file of random (incompressible) bytes.

Mounts run with ``--prefetch 0`` (no background object downloads competing
with the save) and a one-hour checkpoint interval, so only the timed flush
ships anything. A no-op flush is timed as well: it is the fixed cost of
starting the ``fsagent flush`` process and asking the daemon. Next to each
save, the same bytes written natively on the same disk with fsync per file
give a local durability reference.

    python -m bench.checkpoint [--rounds 3] [--large-mib 256]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import zstandard

from bench.machine import add_output_options, load_line, machine_line, record
from common.bridge import END_FRAME, PREFIX, encode_frame
from tests.support.controller import ControllerProcess
from tests.support.mount import FsagentMount

SMALL = 4096
MIB = 1 << 20
SEED_BATCH = 20_000


class Controller(ControllerProcess):
    """``controller serve`` with its own embedded PostgreSQL under ``data_dir``,
    and the company every benchmark run belongs to."""

    company: str = ""

    def start_with_company(self) -> Controller:
        self.company = str(self.admin("bootstrap")["company_id"])
        self.start(timeout=120)
        return self

    def new_run(self, name: str) -> dict[str, Any]:
        """A task folder of its own and a run bound to it."""
        project = self.admin("create-project", self.company, f"bench-{name}")["id"]
        task = self.admin("create-task", self.company, project, name)["id"]
        agent = self.admin("create-agent", self.company, f"bench-{name}")["id"]
        run = self.admin("start-run", self.company, "--agent", agent, "--task", task)
        return {**run, "task": task}


def bridge(ctl: Controller, run: dict[str, Any]) -> httpx.Client:
    return httpx.Client(
        base_url=ctl.url, headers={"Authorization": f"Bearer {run['token']}"}, timeout=900
    )


def upload(client: httpx.Client, data: bytes) -> str:
    body = encode_frame(data, zstandard.ZstdCompressor(level=3)) + END_FRAME
    r = client.put(f"{PREFIX}/folders/task/uploads", content=body)
    r.raise_for_status()
    return str(r.json()["digest"])


def seed_collection(
    ctl: Controller, run: dict[str, Any], files: int, api_files: int, objects: int
) -> tuple[float, float]:
    """``files`` live 4 KiB files in 100 directories; returns (API seconds, SQL seconds).

    The first ``api_files`` go through the bridge (uploads, then checkpoint
    commits), the rest are copies of those rows inserted in one statement.
    """
    started = time.perf_counter()
    api_files = min(api_files, files)
    payloads = [os.urandom(SMALL) for _ in range(min(objects, api_files))]

    def upload_some(chunk: list[bytes]) -> list[str]:
        with bridge(ctl, run) as c:
            return [upload(c, p) for p in chunk]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        by_part = list(pool.map(upload_some, [payloads[k::4] for k in range(4)]))
    digests = [d for part in by_part for d in part]
    with bridge(ctl, run) as c:
        for first in range(0, api_files, SEED_BATCH):
            entries = [
                {
                    "op": "put",
                    "path": seed_path(i),
                    "digest": digests[i % len(digests)],
                    "executable": False,
                }
                for i in range(first, min(first + SEED_BATCH, api_files))
            ]
            body = {
                "operationId": f"bench-seed-{uuid.uuid4()}",
                "leaseEpoch": run["lease_epoch"],
                "final": False,
                "entries": entries,
            }
            c.post(f"{PREFIX}/folders/task/checkpoints", json=body).raise_for_status()
    api_s = time.perf_counter() - started
    started = time.perf_counter()
    rest = range(api_files, files)
    with psycopg.connect(ctl.db_url, autocommit=True) as db:
        row = db.execute(
            "SELECT id FROM folders WHERE scope = 'task' AND owner_id = %s", (run["task"],)
        ).fetchone()
        assert row is not None
        # Each new row copies the API-made row of seed index i % api_files
        # (digest, size, flags) under its own path, with a fresh version from
        # the folder's own counter, as the controller draws them; the counter
        # then covers the new rows, and its entry count includes them.
        db.execute(
            "INSERT INTO files (id, folder_id, path, parent, kind, digest, byte_size,"
            " executable, content_type, version)"
            " SELECT gen_random_uuid(), t.folder_id, n.path, n.parent, t.kind, t.digest,"
            " t.byte_size, t.executable, t.content_type, d.version_counter + n.k"
            " FROM unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY"
            " AS n(path, parent, template, k)"
            " JOIN files t ON t.folder_id = %s AND t.path = n.template"
            " AND t.deleted_at IS NULL JOIN folders d ON d.id = t.folder_id ORDER BY n.path",
            (
                [seed_path(i) for i in rest],
                [seed_path(i).split("/")[0] for i in rest],
                [seed_path(i % api_files) for i in rest],
                row[0],
            ),
        )
        db.execute(
            "UPDATE folders SET last_operation_at = now(), version_counter = version_counter + %s,"
            " live_entries = live_entries + %s WHERE id = %s",
            (len(rest), len(rest), row[0]),
        )
        db.execute("ANALYZE files")
        live = db.execute(
            "SELECT count(*) FROM files WHERE folder_id = %s AND kind = 'file'"
            " AND deleted_at IS NULL",
            (row[0],),
        ).fetchone()
        assert live is not None and live[0] == files, live
    return api_s, time.perf_counter() - started


def seed_path(i: int) -> str:
    return f"s{i % 100:02d}/seed{i:06d}.txt"


def bridge_manifest(ctl: Controller, run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    with bridge(ctl, run) as c:
        since = 0
        while True:
            r = c.get(f"{PREFIX}/folders/task/manifest", params={"since": since})
            r.raise_for_status()
            body = r.json()
            for e in body["entries"]:
                out[e["path"]] = e
            if body["nextSince"] is None:
                return out
            since = body["nextSince"]


def mount(work: Path, ctl: Controller, run: dict[str, Any], name: str) -> FsagentMount:
    token = work / f"token-{name}"
    token.write_text(run["token"])
    return FsagentMount(
        "task",
        work / f"mnt-{name}",
        work / f"state-{name}",
        ctl.url,
        token_file=token,
        extra=["--prefetch", "0", "--checkpoint-interval", "3600"],
        log_dir=work,
        poll_interval=0.005,
    ).start(timeout=600)


def timed_flush(m: FsagentMount) -> tuple[float, dict[str, Any]]:
    t = time.perf_counter()
    reply = m.fsagent("flush", "task")
    seconds = time.perf_counter() - t
    if not reply.get("ok"):
        raise RuntimeError(f"flush failed: {reply}")
    result = reply["result"]
    assert isinstance(result, dict)
    return seconds, result


def write_files(paths: list[Path], payloads: list[bytes], *, sync: bool) -> float:
    t = time.perf_counter()
    for p, data in zip(paths, payloads, strict=True):
        with open(p, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - t


def write_large(path: Path, mib: int, *, sync: bool) -> tuple[float, str]:
    sha = hashlib.sha256()
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib):
            block = os.urandom(MIB)
            sha.update(block)
            f.write(block)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t, sha.hexdigest()


def scenario_changed(
    work: Path, ctl: Controller, size: int, rounds: int, api_files: int, objects: int
) -> dict[str, Any]:
    run = ctl.new_run(f"changed-{size}")
    api_s, sql_s = seed_collection(ctl, run, size, api_files, objects)
    m = mount(work, ctl, run, f"c{size}")
    try:
        noop = [timed_flush(m)[0] for _ in range(rounds)]
        saves, native, daemon = [], [], []
        native_dir = work / f"native-c{size}"
        native_dir.mkdir()
        for r in range(rounds):
            picks = [(r * 997 + k * 7919) % size for k in range(10)]
            paths = [m.mountpoint / seed_path(i) for i in picks]
            payloads = [os.urandom(SMALL) for _ in paths]
            write_files(paths, payloads, sync=False)
            seconds, result = timed_flush(m)
            assert result["entries"] == 10, result
            saves.append(seconds)
            if "seconds" in result:  # the save's own time in the daemon
                daemon.append(float(result["seconds"]))
            native.append(
                write_files([native_dir / f"n{r}-{k}" for k in range(10)], payloads, sync=True)
            )
        manifest = bridge_manifest(ctl, run)
        assert len(manifest) >= size, len(manifest)
        expected = hashlib.sha256(payloads[-1]).hexdigest()
        assert manifest[seed_path(picks[-1])]["digest"] == expected
        rss = m.peak_rss_kib()
    finally:
        m.stop(timeout=60)
    return {
        "size": size,
        "api_s": api_s,
        "api_files": min(api_files, size),
        "sql_s": sql_s,
        "mount_s": m.mount_seconds,
        "noop_s": statistics.median(noop),
        "save_s": statistics.median(saves),
        "daemon_s": statistics.median(daemon) if daemon else None,
        "saves": saves,
        "native_s": statistics.median(native),
        "rss_kib": rss,
    }


def scenario_new_files(work: Path, ctl: Controller, files: int, dirs: int) -> dict[str, Any]:
    run = ctl.new_run("new-files")
    m = mount(work, ctl, run, "new")
    try:
        for d in range(dirs):
            (m.mountpoint / f"d{d:02d}").mkdir()
        paths = [m.mountpoint / f"d{i % dirs:02d}/f{i:05d}.bin" for i in range(files)]
        payloads = [os.urandom(SMALL) for _ in paths]
        workload = write_files(paths, payloads, sync=False)
        seconds, result = timed_flush(m)
        assert result["entries"] >= files, result
        rss = m.peak_rss_kib()
    finally:
        m.stop(timeout=60)
    manifest = bridge_manifest(ctl, run)
    got = {p: e["digest"] for p, e in manifest.items() if e["kind"] == "file"}
    assert got == {
        f"d{i % dirs:02d}/f{i:05d}.bin": hashlib.sha256(payloads[i]).hexdigest()
        for i in range(files)
    }
    native_dir = work / "native-new"
    native_dir.mkdir()
    native = write_files([native_dir / f"f{i:05d}.bin" for i in range(files)], payloads, sync=True)
    return {
        "files": files,
        "workload_s": workload,
        "save_s": seconds,
        "native_s": native,
        "rss_kib": rss,
        "bytes": files * SMALL,
    }


def scenario_large(work: Path, ctl: Controller, mib: int) -> dict[str, Any]:
    run = ctl.new_run("large")
    m = mount(work, ctl, run, "large")
    try:
        workload, digest = write_large(m.mountpoint / "large.bin", mib, sync=False)
        seconds, result = timed_flush(m)
        assert result["entries"] == 1, result
        rss = m.peak_rss_kib()
    finally:
        m.stop(timeout=60)
    assert bridge_manifest(ctl, run)["large.bin"]["digest"] == digest
    native, _ = write_large(work / "native-large.bin", mib, sync=True)
    return {
        "mib": mib,
        "workload_s": workload,
        "save_s": seconds,
        "native_s": native,
        "rss_kib": rss,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--sizes",
        default="10000,99900",
        help="collection sizes for (a); files and their 100 directories stay within the"
        " controller's 100,000-entry folder limit",
    )
    ap.add_argument("--api-seed", type=int, default=2000, help="files seeded through the bridge")
    ap.add_argument("--seed-objects", type=int, default=500, help="distinct contents")
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--large-mib", type=int, default=256)
    add_output_options(ap)
    args = ap.parse_args()

    load_before = load_line()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fsa-ckpt-", dir=args.base))
    os.chmod(work, 0o711)  # the embedded PostgreSQL runs as its own user
    (work / "controller").mkdir()
    # Sweeps only on demand, as before; the default GC delay stays.
    ctl = Controller(None, work / "controller", gc_args=["--gc-interval", "0"])
    try:
        ctl.start_with_company()
        changed = [
            scenario_changed(work, ctl, int(s), args.rounds, args.api_seed, args.seed_objects)
            for s in args.sizes.split(",")
        ]
        print("(a) done", file=sys.stderr)
        new = scenario_new_files(work, ctl, args.files, 50)
        print("(b) done", file=sys.stderr)
        large = scenario_large(work, ctl, args.large_mib)
        print("(c) done", file=sys.stderr)
    finally:
        ctl.stop(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    load_after = load_line()
    elapsed = time.monotonic() - started

    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## Checkpoints: end of workload to durable save ({stamp})\n",
        f"Machine: {machine_line(args.base)}. Command: `python -m bench.checkpoint` "
        f"(rounds={args.rounds}, files={args.files}, large={args.large_mib} MiB, "
        f"API seed={args.api_seed}, seed objects={args.seed_objects}, base={args.base}). "
        "Load average (1/5/15 min) "
        f"before: {load_before}, after: {load_after}; run took {elapsed:.0f} s.\n",
        "Real controller (embedded PostgreSQL, local_disk) and real fsagent mounts "
        "(`--prefetch 0`, checkpoints only on `fsagent flush`). Save = wall time of "
        "`fsagent flush task --json` (a new process) from after the workload's last "
        "close() until it returns with the controller's receipt. Native = the same bytes "
        "written on the same disk with write + fsync per file (local durability, for "
        "scale). Peak RSS = VmHWM of the mount daemon at the end of the scenario.\n",
        "### (a) 10 changed files: cost follows the changes, not the collection\n",
        f"Seeding: the first {args.api_seed:,} files through the bridge (uploads of "
        f"{args.seed_objects} distinct 4 KiB contents, then checkpoint commits), the rest "
        "as copies of those rows inserted into PostgreSQL in one statement (same digests, "
        "own paths, versions from the folder's counter), then ANALYZE: seeding "
        "100,000 files through the API would take far longer than the benchmark. The "
        "mount column is a fresh fsagent hydrating the manifest through the bridge. "
        "The 10 changed files are spread over the whole collection.\n",
        "| collection | seeding: bridge / SQL copies | mount (hydrate) | no-op flush | "
        "save of 10 changes (median; all rounds) | native write+fsync | daemon peak RSS |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in changed:
        rounds = ", ".join(f"{s * 1000:.0f}" for s in c["saves"])
        lines.append(
            f"| {c['size']:,} files | {c['api_files']:,} in {c['api_s']:.1f} s / "
            f"{c['size'] - c['api_files']:,} in {c['sql_s']:.1f} s | {c['mount_s']:.2f} s | "
            f"{c['noop_s'] * 1000:.0f} ms | {c['save_s'] * 1000:.0f} ms ({rounds} ms) | "
            f"{c['native_s'] * 1000:.1f} ms | {c['rss_kib'] / 1024:.0f} MiB |"
        )
    if len(changed) >= 2:
        small, big = changed[0], changed[-1]
        lines += [
            "",
            f"Collection {big['size'] / small['size']:.0f}x larger: save of 10 changes "
            f"{big['save_s'] / small['save_s']:.2f}x the time "
            f"({small['save_s'] * 1000:.0f} ms vs {big['save_s'] * 1000:.0f} ms).",
        ]
    mb_new = new["bytes"] / 1e6
    lines += [
        "",
        "### (b) new small files and (c) one large file\n",
        "| scenario | workload (writes through the mount) | save | save rate | "
        "workload + save rate | native write+fsync | daemon peak RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| (b) {new['files']:,} new 4 KiB files, 50 dirs | {new['workload_s']:.2f} s | "
        f"{new['save_s']:.2f} s | {new['files'] / new['save_s']:.0f} files/s, "
        f"{mb_new / new['save_s']:.1f} MB/s | "
        f"{new['files'] / (new['workload_s'] + new['save_s']):.0f} files/s | "
        f"{new['native_s']:.2f} s ({new['files'] / new['native_s']:.0f} files/s) | "
        f"{new['rss_kib'] / 1024:.0f} MiB |",
        f"| (c) one {large['mib']} MiB file (random bytes) | {large['workload_s']:.2f} s | "
        f"{large['save_s']:.2f} s | {large['mib'] * MIB / 1e6 / large['save_s']:.0f} MB/s | "
        f"{large['mib'] * MIB / 1e6 / (large['workload_s'] + large['save_s']):.0f} MB/s | "
        f"{large['native_s']:.2f} s ({large['mib'] * MIB / 1e6 / large['native_s']:.0f} MB/s)"
        f" | {large['rss_kib'] / 1024:.0f} MiB |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    record(text, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
