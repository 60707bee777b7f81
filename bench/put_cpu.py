"""REST PUTs alone, and the CPU each one costs, on a real controller.

    python -m bench.put_cpu [--puts 3000] [--clients 8] [--rounds 3]

A controller (embedded PostgreSQL, local disk) takes ``--puts`` PUTs of
4 KiB, new paths each, from ``--clients`` clients at once, after 50 to warm
up; each round on paths of its own. Beside the rate it reads from ``/proc``
the CPU each PUT cost the controller, PostgreSQL (the postmaster and its
backends) and this client, and the CPU time left idle, per PUT, on the
machine's cores. ``bench.api_bench`` measures PUTs among other work and its
native comparison; this one measures where a PUT's time goes, which a
change to the write path moves.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.api_bench import put_small_files
from bench.machine import add_output_options, load_line, machine_line, record
from tests.support.controller import ControllerProcess

WARM_UP = 50


def _ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def _postgres_ticks(postmaster: int) -> int:
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if int(stat.parent.name) == postmaster or int(fields[1]) == postmaster:
                total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError):
            continue  # a backend that ended meanwhile
    return total


def _idle_ticks() -> int:
    with open("/proc/stat") as fh:
        return int(fh.readline().split()[4])


def one_round(
    ctl: ControllerProcess, base: str, folder: str, token: str, puts: int, clients: int, tag: str
) -> dict[str, float]:
    payloads = [os.urandom(4096) for _ in range(puts + WARM_UP)]
    put_range = functools.partial(put_small_files, base, token, folder, tag, payloads)

    put_range(range(WARM_UP))
    assert ctl.proc is not None
    pidfile = ctl.data_dir / "pg" / "data" / "postmaster.pid"
    postmaster = int(pidfile.read_text().split("\n", 1)[0])
    hz = os.sysconf("SC_CLK_TCK")
    step = puts // clients
    chunks = [range(WARM_UP + k * step, WARM_UP + (k + 1) * step) for k in range(clients)]
    done = step * clients
    before = (_ticks(ctl.proc.pid), _postgres_ticks(postmaster), _idle_ticks(), os.times())
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(put_range, chunks))
    took = time.perf_counter() - started
    after = (_ticks(ctl.proc.pid), _postgres_ticks(postmaster), _idle_ticks(), os.times())
    ms = 1000 / hz / done
    client = (after[3].user + after[3].system - before[3].user - before[3].system) * 1000 / done
    return {
        "puts_per_s": done / took,
        "controller_ms": (after[0] - before[0]) * ms,
        "postgres_ms": (after[1] - before[1]) * ms,
        "client_ms": client,
        "idle_ms": (after[2] - before[2]) * ms,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puts", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    add_output_options(ap)
    args = ap.parse_args()
    if args.puts < args.clients or args.clients < 1 or args.rounds < 1:
        ap.error("--puts must be at least --clients, and both and --rounds positive")

    work = Path(tempfile.mkdtemp(prefix="fsa-putcpu-", dir=args.base))
    os.chmod(work, 0o711)  # the embedded PostgreSQL runs as its own user
    data = work / "controller"
    data.mkdir()
    port = 17000 + os.getpid() % 1000
    load_before = load_line()
    ctl = ControllerProcess(None, data, port=port, gc_args=["--gc-interval", "0"])
    boot = ctl.admin("bootstrap")
    ctl.start(timeout=60)
    try:
        base = f"http://127.0.0.1:{port}"
        folder = f"/api/companies/{boot['company_id']}/work-folders/user/{boot['user_id']}"
        rounds = [
            one_round(ctl, base, folder, boot["token"], args.puts, args.clients, f"r{k}")
            for k in range(args.rounds)
        ]
    finally:
        ctl.stop(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    def med(key: str) -> str:
        values = [r[key] for r in rounds]
        fmt = "{:.0f}" if key == "puts_per_s" else "{:.2f}"
        return (
            f"{fmt.format(statistics.median(values))} ({', '.join(fmt.format(v) for v in values)})"
        )

    text = "\n".join(
        [
            f"\n## REST PUTs and their CPU ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n",
            f"Machine: {machine_line(args.base)}. Command: `python -m bench.put_cpu` (puts={args.puts}, "
            f"clients={args.clients}, rounds={args.rounds}). Load average (1/5/15 min) "
            f"before: {load_before}, after: {load_line()}.\n",
            "| per 4 KiB PUT | median (rounds) |",
            "| --- | --- |",
            f"| PUT/s | {med('puts_per_s')} |",
            f"| controller CPU, ms | {med('controller_ms')} |",
            f"| PostgreSQL CPU, ms | {med('postgres_ms')} |",
            f"| client CPU, ms | {med('client_ms')} |",
            f"| CPU left idle, ms (all cores) | {med('idle_ms')} |",
            "",
        ]
    )
    print(text)
    record(text, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
