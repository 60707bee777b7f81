"""The machine / load line every benchmark result section carries.

The real parts a benchmark starts (fsagent mounts, controllers, sources) come
from the test-support package, :mod:`tests.support`, so a benchmark measures
the same code path the tests prove.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
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


def machine_line(work: Path | None = None) -> str:
    """CPU, kernel and Python; with ``work``, also the filesystem it is on
    (:func:`filesystem_line`)."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    line = (
        f"{platform.node()}, {os.cpu_count()} cores ({cpu}), Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )
    return line if work is None else f"{line}; {filesystem_line(work)}"


def filesystem_line(path: Path) -> str:
    """The filesystem ``path`` is on, for a result's machine line: its type,
    and for ext4 whether it has a journal and is mounted with ``discard``.

    Both change figures a lot. Without a journal, ext4 will not reuse an
    inode freed in the last minute (six while its inode table block is
    dirty), and each new inode looks at every such inode of its block group
    again: after a burst of deletes, creating a file there costs up to about
    half a millisecond of kernel CPU, whoever creates it. The controller
    storing a save of 3,000 files and 300 MiB spent 2.6 s of system CPU
    beside a directory just emptied, against 0.9 s in a block group without
    recent deletes. ``discard`` makes deletes slower, and native times jump
    between runs.
    """
    found = _mount_of(path.resolve())
    if found is None:
        return f"`{path}` on an unknown filesystem"
    fstype, source, options = found
    if fstype != "ext4":
        return f"`{path}` on {fstype}"
    device = Path(source).name
    journal = any(Path("/proc/fs/jbd2").glob(f"{device}-*"))
    extras = [] if journal else ["no journal"]
    if "discard" in options.split(","):
        extras.append("discard")
    return f"`{path}` on ext4" + (f" ({', '.join(extras)})" if extras else "")


def _mount_of(path: Path) -> tuple[str, str, str] | None:
    """(type, source, superblock options) of the mount holding ``path``."""
    best: tuple[int, tuple[str, str, str]] | None = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # \040: space
        inside = point == "/" or str(path) == point or str(path).startswith(point + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), (tail[0], tail[1], f"{fields[5]},{tail[2]}"))
    return None if best is None else best[1]


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"
