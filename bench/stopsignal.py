"""How long ``fsagent up`` runs before a stop signal is a clean stop.

Until a process installs a SIGTERM handler, SIGTERM kills it by the default
action (``up`` exits -15, nothing saves). This measures, per start, the time
from ``exec`` of ``python -m fsagent.cli up`` (as the sandbox's unit starts
it) to the first moment its ``SigCgt`` mask (/proc/PID/status) holds SIGTERM:
the window in which a stop is lost. ``--baseline MODULE`` measures the same
for ``python -m MODULE`` (``json.tool``, say: the interpreter's own start-up,
which no handler can precede); ``--also DIR`` measures ``up`` from another
checkout too (an earlier commit, say), interleaved with the others so that
all meet the same load. The controller it names is not listening:
``up`` never gets past fetching its run, and is killed once measured.

    python -m bench.stopsignal --starts 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.machine import add_output_options, load_line, machine_line, record
from fsagent.commands.up import handles_sigterm
from tests.support.constants import REPO


def window(argv: list[str], cwd: Path = REPO) -> float:
    """Seconds from exec to a SIGTERM handler in the process of ``argv``."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        while not handles_sigterm(proc.pid):
            if proc.poll() is not None:
                raise SystemExit(f"{argv} exited {proc.returncode} before handling SIGTERM")
            time.sleep(0.0005)
        return time.monotonic() - started
    finally:
        proc.kill()  # measured: nothing of it has started (its run is never fetched)
        proc.wait()


def up_argv(base: Path) -> list[str]:
    (base / "token").write_text("fsa_r_unused")
    return [sys.executable, "-m", "fsagent.cli", "up", "--home", str(base / "home"),
            "--controller", "http://127.0.0.1:9", "--token-file", str(base / "token"),
            "--state-root", str(base / "state"), "--env-file", str(base / "env")]  # fmt: skip


def baseline_argv(module: str) -> list[str]:
    """A module that installs a SIGTERM handler first thing: the interpreter's start-up."""
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        f"import {module}; time.sleep(60)"
    )
    return [sys.executable, "-c", code]


def summary(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    return f"{statistics.median(ms):.0f} ms (min {ms[0]:.0f}, max {ms[-1]:.0f})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--baseline", default="json", help="module the baseline imports")
    ap.add_argument("--also", type=Path, help="another checkout whose up is measured too")
    add_output_options(ap, base=False)
    args = ap.parse_args()

    load_before = load_line()
    ups: list[float] = []
    base: list[float] = []
    also: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fsa-stopsig-") as tmp:
        for i in range(args.starts):  # interleaved, so that all meet the same load
            work = Path(tmp) / str(i)
            work.mkdir()
            ups.append(window(up_argv(work)))
            base.append(window(baseline_argv(args.baseline)))
            if args.also:
                (work / "also").mkdir()
                also.append(window(up_argv(work / "also"), cwd=args.also))
    load_after = load_line()

    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join(
        [
            f"\n## Stop signals: exec to a SIGTERM handler in `fsagent up` ({stamp})\n",
            f"Machine: {machine_line()}. Command: `python -m bench.stopsignal --starts "
            f"{args.starts}{f' --also {args.also}' if args.also else ''}`. Load average (1/5/15 min) before: {load_before}, after: "
            f"{load_after}. Starts interleaved; median (min, max).\n",
            "| process | exec to SIGTERM handled |",
            "| --- | ---: |",
            f"| `python -m fsagent.cli up` | {summary(ups)} |",
            f"| `python -c` handler first, then `import {args.baseline}` | {summary(base)} |",
            *([f"| `python -m fsagent.cli up` in {args.also} | {summary(also)} |"] if also else []),
            "",
        ]
    )
    print(text)
    record(text, args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
