"""The machine / load line every benchmark result section carries.

The real parts a benchmark starts (fsagent mounts, controllers, sources) come
from the test-support package, :mod:`tests.support`, so a benchmark measures
the same code path the tests prove.
"""

from __future__ import annotations

import argparse
import os
import platform
from datetime import UTC, datetime
from pathlib import Path

from tests.support.constants import REPO

RESULTS_DIR = REPO / "bench" / "results"


def results_file(topic: str) -> Path:
    """The dated log a run goes to by default: ``bench/results/YYYY-MM-DD-<topic>.md`` (UTC)."""
    return RESULTS_DIR / f"{datetime.now(UTC):%Y-%m-%d}-{topic}.md"


def add_output_options(ap: argparse.ArgumentParser, *, base: bool = True) -> None:
    """``--base`` (where the work dir goes), ``--results`` and ``--no-record``.

    ``--results`` defaults to today's log named after the benchmark's module
    (``bench/results/2026-12-06-repos.md`` for ``python -m bench.repos``).
    """
    if base:
        ap.add_argument("--base", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--results", type=Path, default=results_file(Path(ap.prog).stem))
    ap.add_argument("--no-record", action="store_true", help="print only")


def record(text: str, args: argparse.Namespace) -> None:
    """Append a result section to ``--results`` unless ``--no-record``."""
    if not args.no_record:
        with open(args.results, "a") as fh:
            fh.write(text)


def machine_line() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.node()}, {os.cpu_count()} cores ({cpu}), Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"
