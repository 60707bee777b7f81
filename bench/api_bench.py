"""Controller API benchmark: a real controller (embedded PostgreSQL, local_disk).

Measures small-file PUT rate (4 KiB), 256 MiB upload and download, and listing
a 10,000-entry folder; next to each, the same work done natively on the same
disk (write + fsync of the same files) so the ratio is measured in one run.

The 8-client PUT rate is measured twice, with new files each time: by httpx
clients on threads of this process (as an application would send), and by a
lean load of one process per client that sends each request in one write and
reads only its status and length. On a 2-core machine the clients share the
CPUs with the controller and PostgreSQL, and httpx's clients use about half a
controller's CPU per request; the lean load uses a tenth of that, so its rate
is closer to what the controller can serve. Both are recorded, with the CPU
the controller and the clients used per PUT.

    python -m bench.api_bench [--files 2000] [--large-mib 256] [--list-entries 10000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import hashlib
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.machine import load_line, machine_line, results_file
from bench.save import cpu_seconds
from tests.support.controller import ControllerProcess

OCTET = {"Content-Type": "application/octet-stream"}


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def put_small_files(
    base: str, token: str, folder: str, prefix: str, payloads: list[bytes], indices: range
) -> None:
    """PUT ``payloads[i]`` as ``<prefix>/d<i % 50>/f<i>.bin`` of ``folder`` for
    each ``i`` of ``indices``, one after the other on one connection; raise
    unless each is answered 200 or 201."""
    headers = {"Authorization": f"Bearer {token}", **OCTET}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
        for i in indices:
            r = c.put(
                f"{folder}/content",
                params={"path": f"{prefix}/d{i % 50}/f{i}.bin"},
                content=payloads[i],
            )
            if r.status_code not in (200, 201):
                raise RuntimeError(f"PUT answered {r.status_code}: {r.text}")


def _read_answer(answers: Any) -> tuple[int, bytes]:
    """One HTTP/1.1 answer from ``answers`` (a binary file on the socket):
    its status and body, which must come with a Content-Length."""
    status_line = answers.readline()
    parts = status_line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise RuntimeError(f"not an HTTP answer: {status_line!r}")
    length = None
    while (line := answers.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise RuntimeError(f"an answer without a Content-Length: {status_line!r}")
    body = answers.read(length)
    if len(body) != length:
        raise RuntimeError("the connection closed inside an answer")
    return int(parts[1]), body


def lean_puts(
    port: int, token: str, folder: str, prefix: str, indices: range, start: Any, out: Any
) -> None:
    """One client of the lean load (runs in a process of its own): a PUT of a
    new random 4 KiB file as ``<prefix>/d<i % 50>/f<i>.bin`` for each ``i`` of
    ``indices``, one after the other on one keep-alive connection, each
    request sent in one write. Puts ``("ok", CPU seconds)`` on ``out``, or
    ``("error", why)`` at the first answer other than 200 or 201."""
    try:
        payloads = {i: os.urandom(4096) for i in indices}
        head = (
            f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: 4096\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with sock.makefile("rb") as answers:
                start.wait(timeout=300)
                cpu = time.process_time()
                for i in indices:
                    line = f"PUT {folder}/content?path={prefix}/d{i % 50}/f{i}.bin HTTP/1.1\r\n"
                    sock.sendall(line.encode() + head + payloads[i])
                    status, body = _read_answer(answers)
                    if status not in (200, 201):
                        raise RuntimeError(f"PUT answered {status}: {body[:500]!r}")
                out.put(("ok", time.process_time() - cpu))
    except Exception as exc:  # reported to the parent, which raises it
        start.abort()
        out.put(("error", repr(exc)))


def lean_parallel(
    port: int, token: str, folder: str, prefix: str, chunks: list[range]
) -> tuple[float, float]:
    """The lean load: one process per chunk (:func:`lean_puts`), all started
    at once once connected. Returns the seconds from the start to the last
    client's end and the CPU seconds the clients used; raises the first
    client's error."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(len(chunks) + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=lean_puts, args=(port, token, folder, prefix, chunk, start, out))
        for chunk in chunks
    ]
    for proc in procs:
        proc.start()
    try:
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait(timeout=300)  # broken: a client failed, its report says why
        t = time.perf_counter()
        reports = [out.get(timeout=600) for _ in procs]
        elapsed = time.perf_counter() - t
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [why for kind, why in reports if kind == "error"]
    if errors:
        raise RuntimeError(f"a lean client failed: {errors[0]}")
    return elapsed, sum(cpu for _, cpu in reports)


def native_small_files(root: Path, n: int, payloads: list[bytes]) -> float:
    def run() -> None:
        for i in range(n):
            p = root / f"d{i % 50}" / f"f{i}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "wb") as f:
                f.write(payloads[i])
                f.flush()
                os.fsync(f.fileno())

    return timed(run)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--large-mib", type=int, default=256)
    ap.add_argument("--list-entries", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--results", type=Path, default=results_file("api_bench"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fsa-bench-", dir="/var/tmp"))
    machine, load = machine_line(work), load_line()
    os.chmod(work, 0o711)
    data = work / "controller"
    data.mkdir()
    port = 18000 + os.getpid() % 1000
    # Its own embedded PostgreSQL under data/, GC sweeps only on demand.
    ctl = ControllerProcess(None, data, port=port, gc_args=["--gc-interval", "0"])
    boot = ctl.admin("bootstrap")
    ctl.start(timeout=60)
    results: dict[str, Any] = {}
    try:
        base = f"http://127.0.0.1:{port}"
        folder = f"/api/companies/{boot['company_id']}/work-folders/user/{boot['user_id']}"
        headers = {"Authorization": f"Bearer {boot['token']}"}
        payloads = [os.urandom(4096) for _ in range(args.files)]

        put_range = functools.partial(
            put_small_files, base, boot["token"], folder, "small", payloads
        )

        n = args.files
        t1 = timed(lambda: put_range(range(n // 4)))
        results["put_4k_serial_files_per_s"] = (n // 4) / t1
        step = n // args.concurrency
        chunks = [
            range(n // 4 + k * step, n // 4 + (k + 1) * step) for k in range(args.concurrency)
        ]
        chunks = [range(c.start, min(c.stop, n)) for c in chunks if c.start < n]

        def parallel() -> None:
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(put_range, chunks))

        assert ctl.proc is not None
        pid = ctl.proc.pid
        parallel_puts = sum(len(c) for c in chunks)
        ctl_cpu, own_cpu = cpu_seconds(pid), time.process_time()
        tp = timed(parallel)
        results["put_4k_parallel_files_per_s"] = parallel_puts / tp
        results["httpx_controller_ms"] = (cpu_seconds(pid) - ctl_cpu) * 1000 / parallel_puts
        results["httpx_client_ms"] = (time.process_time() - own_cpu) * 1000 / parallel_puts

        ctl_cpu = cpu_seconds(pid)
        tl, lean_cpu = lean_parallel(port, boot["token"], folder, "lean", chunks)
        results["put_4k_lean_files_per_s"] = parallel_puts / tl
        results["lean_controller_ms"] = (cpu_seconds(pid) - ctl_cpu) * 1000 / parallel_puts
        results["lean_client_ms"] = lean_cpu * 1000 / parallel_puts
        native_dir = work / "native"
        tn = native_small_files(native_dir, n, payloads)
        results["native_write_fsync_4k_files_per_s"] = n / tn

        big = work / "big.bin"
        with open(big, "wb") as f:
            for _ in range(args.large_mib):
                f.write(os.urandom(1 << 20))
        size = big.stat().st_size
        mib = size / (1 << 20)

        def upload() -> None:
            with (
                httpx.Client(base_url=base, headers=headers, timeout=600) as c,
                open(big, "rb") as f,
            ):
                r = c.put(
                    f"{folder}/content", params={"path": "large/big.bin"}, content=f, headers=OCTET
                )
                assert r.status_code in (200, 201), r.text

        results["upload_256mib_mb_per_s"] = mib / timed(upload)
        sha = hashlib.sha256()

        def download() -> None:
            with (
                httpx.Client(base_url=base, headers=headers, timeout=600) as c,
                c.stream("GET", f"{folder}/content", params={"path": "large/big.bin"}) as r,
            ):
                for chunk in r.iter_bytes(1 << 20):
                    sha.update(chunk)

        results["download_256mib_mb_per_s"] = mib / timed(download)
        with open(big, "rb") as f:
            assert sha.hexdigest() == hashlib.file_digest(f, "sha256").hexdigest()

        def native_copy() -> None:
            with open(big, "rb") as src, open(work / "copy.bin", "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())

        results["native_copy_fsync_256mib_mb_per_s"] = mib / timed(native_copy)

        # 10,000 entries in one directory, then list it whole (1000 per page).
        def fill(indices: range) -> None:
            with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
                for i in indices:
                    c.post(
                        f"{folder}/operations", json={"action": "mkdir", "path": f"many/e{i:05d}"}
                    )

        per = args.list_entries // args.concurrency
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(fill, [range(k * per, (k + 1) * per) for k in range(args.concurrency)]))

        def list_all() -> None:
            with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
                cursor, count = None, 0
                while True:
                    params = {
                        "dir": "many",
                        "limit": "1000",
                        **({"cursor": cursor} if cursor else {}),
                    }
                    body = c.get(folder + "/", params=params).json()
                    count += len(body["entries"])
                    cursor = body["nextCursor"]
                    if cursor is None:
                        break
                assert count == per * args.concurrency, count

        results["list_10k_seconds"] = timed(list_all)
        native_many = work / "native-many"
        native_many.mkdir()
        for i in range(per * args.concurrency):
            (native_many / f"e{i:05d}").mkdir()
        results["native_scandir_10k_seconds"] = timed(lambda: sorted(os.listdir(native_many)))
    finally:
        ctl.stop(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## Controller API ({stamp})\n",
        f"Machine: {machine}; load {load} at the start. Command: `python -m bench.api_bench` (files={args.files}, "
        f"concurrency={args.concurrency}, embedded PostgreSQL 15, local_disk).\n",
        "| measure | controller | native, same disk | ratio |",
        "| --- | ---: | ---: | ---: |",
        f"| 4 KiB PUT, 1 client | {results['put_4k_serial_files_per_s']:.0f} files/s | "
        f"{results['native_write_fsync_4k_files_per_s']:.0f} files/s (write+fsync) | "
        f"{results['native_write_fsync_4k_files_per_s'] / results['put_4k_serial_files_per_s']:.1f}x |",
        f"| 4 KiB PUT, {args.concurrency} clients | {results['put_4k_parallel_files_per_s']:.0f} files/s | | |",
        f"| 4 KiB PUT, {args.concurrency} clients, lean load | "
        f"{results['put_4k_lean_files_per_s']:.0f} files/s | | |",
        f"| 256 MiB upload | {results['upload_256mib_mb_per_s']:.0f} MiB/s | "
        f"{results['native_copy_fsync_256mib_mb_per_s']:.0f} MiB/s (copy+fsync) | "
        f"{results['native_copy_fsync_256mib_mb_per_s'] / results['upload_256mib_mb_per_s']:.1f}x |",
        f"| 256 MiB download | {results['download_256mib_mb_per_s']:.0f} MiB/s | | |",
        f"| list 10,000 entries (10 pages) | {results['list_10k_seconds'] * 1000:.0f} ms | "
        f"{results['native_scandir_10k_seconds'] * 1000:.1f} ms (listdir) | |",
        "",
        f"CPU per PUT with {args.concurrency} clients: controller "
        f"{results['httpx_controller_ms']:.2f} ms and clients {results['httpx_client_ms']:.2f} ms "
        f"(httpx, threads of the benchmark); controller {results['lean_controller_ms']:.2f} ms "
        f"and clients {results['lean_client_ms']:.2f} ms (lean load, a process per client).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.results.exists():
        args.results.write_text(
            "# Benchmark results\n\nEach section names the command, machine and date of the run.\n"
        )
    with open(args.results, "a") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
