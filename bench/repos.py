"""Repository checkpoints: what a save and a restore cost, against
the naive way, on real repositories and a real controller.

One controller (``controller serve`` with its embedded PostgreSQL and
local_disk storage) serves the whole run. For each repository size
(``--files``, default 20,000 and 2,000 files), a bare origin is built from
the installed packages (``.venv/lib/python3.11/site-packages``, files under
256 KiB, ``__pycache__`` included, sorted by path) committed in four commits
for history, bound to a task as its primary workspace, and then, through
fsagent's own code (``fsagent.repos.checkouts``, the HTTP bridge client):

* **clone**: ``fsagent repos prepare`` of a new sandbox (``git clone``);
* **first checkpoint**: a saver with an empty metadata cache saves the whole
  checkout (every file read and hashed, everything uploaded);
* **10 changed files**: 10 tracked files get a line appended, then the
  saver (warm: base and cache in memory, as ``fsagent repos watch`` runs)
  saves; ``--change-rounds`` times (15), a round of each size in turn with
  the order alternating, so both sizes see the same machine; the median.
  The same with a fresh saver (cache loaded from its file, base fetched
  from the controller, as a one-shot ``fsagent repos checkpoint``),
  ``--rounds`` times (5);
* **restore**: ``fsagent repos prepare`` into an empty sandbox home (fetch,
  verify, build, publish; no setup command), ``--rounds`` times, the median.

The naive way, measured the same way (through the same controller):

* a save is ``git bundle create --all`` plus a ``tar`` of the untracked and
  modified files, both uploaded (streamed) as objects; after 10 changes it is
  the same again (nothing is incremental);
* a restore is a local ``git clone`` of the sandbox's checkout (the floor any
  restore is compared with; it copies nothing over a network).

Targets: the 10-change checkpoint under 1 s and within 2x of the 2,000-file
figure; the restore within 2x of the local ``git clone``.

    python -m bench.repos [--files 20000 2000] [--rounds 5] [--change-rounds 15] [--quick]
                          [--no-record]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio
import zstandard

from bench.checkpoint import Controller
from bench.machine import add_output_options, load_line, machine_line, record
from fsagent.bridge.http import HttpBridgeClient
from fsagent.checkpoint.ship import file_frames
from fsagent.repos.prepare import prepare_repo
from fsagent.repos.save import RepoSaver
from tests.support.constants import REPO
from tests.support.gitrepos import git

SITE_PACKAGES = REPO / ".venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE_PACKAGES = SITE_PACKAGES / "site-packages"
MAX_SOURCE_FILE = 256 << 10
CHANGED = 10


def source_files(limit: int) -> list[Path]:
    """The first ``limit`` regular files under 256 KiB of the installed packages."""
    root = SITE_PACKAGES.resolve()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            if path.stat().st_size > MAX_SOURCE_FILE:
                continue
            found.append(path)
    found.sort()
    if len(found) < limit:
        raise SystemExit(f"only {len(found)} files under {root}; {limit} wanted")
    return found[:limit]


def build_origin(where: Path, files: int) -> tuple[Path, int]:
    """A bare repository of ``files`` files in four commits; (path, bytes)."""
    work = where / "seed"
    work.mkdir(parents=True)
    git(work, "init", "-q")
    root = SITE_PACKAGES.resolve()
    chosen = source_files(files)
    total = 0
    quarter = (len(chosen) + 3) // 4
    for n in range(4):
        for src in chosen[n * quarter : (n + 1) * quarter]:
            dest = work / "lib" / src.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            total += dest.stat().st_size
        git(work, "add", "-A")
        git(work, "commit", "-q", "-m", f"import part {n + 1}")
    bare = where / "origin.git"
    git(where, "clone", "-q", "--bare", str(work), str(bare))
    shutil.rmtree(work)
    return bare, total


@dataclass
class Figures:
    files: int
    source_bytes: int = 0
    clone_s: float = 0.0
    first_s: float = 0.0
    first_uploaded: int = 0
    first_uploaded_bytes: int = 0
    first_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)
    changed_s: list[float] = field(default_factory=list)
    changed_cold_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    naive_first_s: float = 0.0
    naive_bytes: int = 0
    naive_changed_s: list[float] = field(default_factory=list)
    local_clone_s: list[float] = field(default_factory=list)
    members: int = 0
    scan_s: list[float] = field(default_factory=list)
    upload_s: list[float] = field(default_factory=list)
    commit_s: list[float] = field(default_factory=list)
    cpu_changed_s: list[float] = field(default_factory=list)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


async def timed_async(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await fn()
    return time.perf_counter() - started, result


def change_files(checkout: Path, round_no: int) -> None:
    """Append a line to 10 tracked files (a different 10 each round)."""
    tracked = git(checkout, "ls-files", "-z", "lib").split("\0")
    tracked = [t for t in tracked if t.endswith(".py")]
    step = max(1, len(tracked) // (CHANGED * 8))
    for k in range(CHANGED):
        path = checkout / tracked[(round_no * CHANGED + k) * step % len(tracked)]
        with open(path, "a") as fh:
            fh.write(f"# changed in round {round_no}\n")


async def upload_file(client: HttpBridgeClient, workspace: str, path: Path) -> int:
    """Stream one file up as an object, as the naive capture would ship it."""
    compressor = zstandard.ZstdCompressor(level=3)
    fh = path.open("rb")
    try:

        def frames() -> Any:
            fh.seek(0)
            return file_frames(fh, compressor, lambda n: None)

        _, size = await client.upload_repo_object(workspace, frames)
    finally:
        fh.close()
    return int(size)


async def naive_save(
    client: HttpBridgeClient, workspace: str, checkout: Path, scratch: Path
) -> int:
    """``git bundle create --all`` + a tar of untracked and modified files, uploaded."""
    bundle, tarball = scratch / "repo.bundle", scratch / "files.tar"

    def capture() -> None:
        git(checkout, "bundle", "create", "-q", str(bundle), "--all")
        listed = git(checkout, "ls-files", "-z", "--others", "--modified", "--exclude-standard")
        (scratch / "list").write_text(listed)
        subprocess.run(
            ["tar", "-C", str(checkout), "--null", "-T", str(scratch / "list"), "-cf",
             str(tarball)],
            check=True,
        )  # fmt: skip

    await trio.to_thread.run_sync(capture)
    sent = await upload_file(client, workspace, bundle)
    sent += await upload_file(client, workspace, tarball)
    bundle.unlink()
    tarball.unlink()
    return sent


@dataclass
class Sandbox:
    """One repository size's sandbox: its checkout and its running saver."""

    figures: Figures
    client: HttpBridgeClient
    run: Any
    checkout: Path
    state: Path
    saver: RepoSaver
    work: Path


async def prepare(ctl: Controller, work: Path, files: int, log: Callable[[str], None]) -> Sandbox:
    """Origin, binding, clone and the first checkpoint of one size."""
    figures = Figures(files)
    origin, figures.source_bytes = build_origin(work / "origin", files)
    log(f"{files} files: origin built ({figures.source_bytes / (1 << 20):.0f} MiB)")
    project = ctl.admin("create-project", ctl.company, f"bench-repos-{files}")["id"]
    # A file:// URL: the clone receives a pack, as from a remote (a plain path
    # would hard-link the origin's loose objects).
    url = f"file://{origin}"
    ctl.admin("add-workspace", project, "--repo-url", url, "--name", "app", "--primary")
    task = ctl.admin("create-task", ctl.company, project, f"repos-{files}")["id"]
    agent = ctl.admin("create-agent", ctl.company, f"repos-{files}")["id"]
    started = ctl.admin("start-run", ctl.company, "--agent", agent, "--task", task)
    client = HttpBridgeClient(ctl.url, started["token"], retry_deadline=300)
    run = await client.get_run()
    (binding,) = (await client.list_repos()).repos
    home = work / "sandbox-a"
    figures.clone_s, result = await timed_async(
        lambda: prepare_repo(client, run, binding, home / "repos")
    )
    assert result.mode == "clone", result
    checkout = home / "repos" / "app"
    await trio.sleep(1.1)  # past the metadata cache's racy margin, as after any real start
    state = work / "state-a" / binding.workspace_id
    saver = RepoSaver(client, run, binding, checkout, state)
    figures.first_s, outcome = await timed_async(saver.checkpoint)
    figures.members = outcome.entries
    figures.first_parts = (outcome.scan.seconds, outcome.upload_seconds, outcome.commit_seconds)
    figures.first_uploaded, figures.first_uploaded_bytes = (
        outcome.uploaded,
        outcome.uploaded_bytes,
    )
    log(f"{files} files: first checkpoint {figures.first_s:.2f}s ({outcome.entries} members)")
    return Sandbox(figures, client, run, checkout, state, saver, work)


async def changed_rounds(boxes: list[Sandbox], rounds: int, log: Callable[[str], None]) -> None:
    """The 10-change checkpoints of every size, a round of each in turn (the
    order alternating), so that the sizes see the same machine."""
    for r in range(rounds):
        for box in boxes if r % 2 == 0 else boxes[::-1]:
            figures = box.figures
            change_files(box.checkout, r)
            cpu = time.process_time()
            seconds, outcome = await timed_async(box.saver.checkpoint)
            figures.cpu_changed_s.append(time.process_time() - cpu)
            assert outcome.committed and outcome.changed >= CHANGED, outcome
            figures.changed_s.append(seconds)
            figures.scan_s.append(outcome.scan.seconds)
            figures.upload_s.append(outcome.upload_seconds)
            figures.commit_s.append(outcome.commit_seconds)
    for box in boxes:
        log(f"{box.figures.files} files: 10-change checkpoints {box.figures.changed_s}")


async def finish(box: Sandbox, rounds: int, first_round: int, log: Callable[[str], None]) -> None:
    """A fresh saver's checkpoints, the restores and the naive way, of one size."""
    figures, client, run, checkout, work = box.figures, box.client, box.run, box.checkout, box.work
    for r in range(rounds):
        change_files(checkout, first_round + r)
        (binding,) = (await client.list_repos()).repos
        cold = RepoSaver(client, run, binding, checkout, box.state)
        seconds, outcome = await timed_async(cold.checkpoint)
        assert outcome.committed and not outcome.full, outcome
        figures.changed_cold_s.append(seconds)
    (binding,) = (await client.list_repos()).repos
    fresh = work / "sandbox-b"
    for _ in range(rounds):
        seconds, result = await timed_async(
            lambda: prepare_repo(client, run, binding, fresh / "repos")
        )
        assert result.mode == "restore", result
        figures.restore_s.append(seconds)
        shutil.rmtree(fresh)
    log(f"{figures.files} files: restores {figures.restore_s}")

    scratch = work / "naive"
    scratch.mkdir()
    figures.naive_first_s, figures.naive_bytes = await timed_async(
        lambda: naive_save(client, binding.workspace_id, checkout, scratch)
    )
    for r in range(rounds):
        change_files(checkout, first_round + rounds + r)
        seconds, _ = await timed_async(
            lambda: naive_save(client, binding.workspace_id, checkout, scratch)
        )
        figures.naive_changed_s.append(seconds)
    dest = work / "local-clone"
    for _ in range(rounds):
        seconds, _ = timed(lambda: git(work, "clone", "-q", str(checkout), str(dest)))
        figures.local_clone_s.append(seconds)
        shutil.rmtree(dest)
    log(
        f"{figures.files} files: naive saves {figures.naive_changed_s}, "
        f"clones {figures.local_clone_s}"
    )


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(results: list[Figures]) -> str:
    by = {f.files: f for f in results}
    sizes = sorted(by, reverse=True)
    head = "| | " + " | ".join(f"{n:,} files" for n in sizes) + " |"
    rule = "| --- |" + " --- |" * len(sizes)

    def row(label: str, cell: Callable[[Figures], str]) -> str:
        return f"| {label} | " + " | ".join(cell(by[n]) for n in sizes) + " |"

    mib = 1 << 20
    lines = [
        head,
        rule,
        row("checkout members (files, links, `.git` entries)", lambda f: f"{f.members:,}"),
        row("source size", lambda f: f"{f.source_bytes / mib:.0f} MiB"),
        row("clone (`repos prepare`, new sandbox)", lambda f: f"{f.clone_s:.2f} s"),
        row(
            "**first checkpoint** (cold cache, everything uploaded)",
            lambda f: (
                f"{f.first_s:.2f} s ({f.first_uploaded:,} objects, "
                f"{f.first_uploaded_bytes / mib:.0f} MiB)"
            ),
        ),
        row(
            "... of which scan / missing + upload / commit",
            lambda f: " / ".join(f"{x:.1f}" for x in f.first_parts) + " s",
        ),
        row(
            "**10 changed files**, saver running (median)",
            lambda f: f"{med(f.changed_s) * 1000:.0f} ms",
        ),
        row(
            "... of which scan / missing + upload / commit",
            lambda f: (
                f"{med(f.scan_s) * 1000:.0f} / {med(f.upload_s) * 1000:.0f} / "
                f"{med(f.commit_s) * 1000:.0f} ms"
            ),
        ),
        row(
            "... fsagent's CPU time (this process)",
            lambda f: f"{med(f.cpu_changed_s) * 1000:.0f} ms",
        ),
        row(
            "10 changed files, fresh saver (cache file, base from the controller)",
            lambda f: f"{med(f.changed_cold_s) * 1000:.0f} ms",
        ),
        row("**restore** into an empty sandbox (median)", lambda f: f"{med(f.restore_s):.2f} s"),
        row(
            "naive save: bundle + tar, uploaded (first)",
            lambda f: f"{f.naive_first_s:.2f} s ({f.naive_bytes / mib:.0f} MiB)",
        ),
        row("naive save after 10 changes (median)", lambda f: f"{med(f.naive_changed_s):.2f} s"),
        row("naive restore: local `git clone` (median)", lambda f: f"{med(f.local_clone_s):.2f} s"),
    ]
    big, small = by[sizes[0]], by[sizes[-1]]
    ratio = med(big.changed_s) / med(small.changed_s)
    restore_ratio = med(big.restore_s) / med(big.local_clone_s)
    verdicts = [
        f"- 10-change checkpoint at {big.files:,} files: {med(big.changed_s) * 1000:.0f} ms "
        f"(target < 1 s: {'met' if med(big.changed_s) < 1 else 'MISSED'}); "
        f"{ratio:.2f}x the {small.files:,}-file figure (target <= 2x: "
        f"{'met' if ratio <= 2 else 'MISSED'}).",
        f"- restore at {big.files:,} files: {med(big.restore_s):.2f} s, {restore_ratio:.2f}x a local "
        f"`git clone` (target <= 2x: {'met' if restore_ratio <= 2 else 'MISSED'}).",
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(verdicts) + "\n"


async def run_all(args: argparse.Namespace, work: Path) -> list[Figures]:
    def log(line: str) -> None:
        print(line, flush=True)

    ctl = Controller(None, work / "controller", [], {}, gc_args=["--gc-interval", "0"])
    boxes: list[Sandbox] = []
    try:
        ctl.start_with_company()
        for n in args.files:
            boxes.append(await prepare(ctl, work / f"r{n}", n, log))
        await changed_rounds(boxes, args.change_rounds, log)
        for box in boxes:
            await finish(box, args.rounds, args.change_rounds, log)
        return [box.figures for box in boxes]
    finally:
        for box in boxes:
            await box.client.aclose()
        ctl.stop(timeout=60)


@contextlib.contextmanager
def work_dir(base: Path) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="fsa-repos-", dir=base))
    os.chmod(work, 0o711)  # the embedded PostgreSQL runs as its own user
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, nargs="+", default=[20_000, 2_000])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the slow measurements")
    ap.add_argument(
        "--change-rounds",
        type=int,
        default=15,
        help="rounds of the 10-change checkpoint, the sizes in turn",
    )
    ap.add_argument("--quick", action="store_true", help="1,000 and 200 files, 2 rounds")
    add_output_options(ap)
    args = ap.parse_args()
    if args.quick:
        args.files, args.rounds, args.change_rounds = [1000, 200], 2, 2
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = load_line()
    with work_dir(args.base) as work:
        started = time.monotonic()
        results = trio.run(run_all, args, work)
        took = time.monotonic() - started
    command = "python -m bench.repos" + (" --quick" if args.quick else "")
    text = (
        f"\n## Repository checkpoints, {when}\n\n"
        f"Machine: {machine_line(args.base)}. Command: `{command}` (`make bench-repos`), "
        f"medians of {args.change_rounds} rounds of the 10-change checkpoint (the sizes in turn) "
        f"and {args.rounds} of the others; load average before {load}, run took {took:.0f} s.\n\n"
        + table(results)
    )
    print(text)
    record(text, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
