"""One collection served as a plain directory (dir mode), where FUSE is unavailable.

The collection is an ordinary directory at the path a mount would have used.
Start order: ask the controller who the run is, open the state dir and check
its binding (as in FUSE mode), claim it for dir mode, pin the directory
(fsagent.dirmode.fs), then:

* **first start**: the directory must be empty. The manifest is read and every
  file downloaded (``--prefetch`` at a time, each object verified against its
  digest) and placed by a rename, with progress on a terminal (fsagent.dirmode.progress); one
  ``syncfs`` makes them durable, and only then do the baseline and what was
  placed become the state, in one commit. A crash before that hydrates again.
* **warm start**: ship what changed locally first (a checkpoint), then apply
  the server's changes since the baseline to the paths not changed locally.
* **an unbound collection**: an empty directory made read-only (immutable too
  when fsagent is root, where modes do not stop a write; where the flag
  cannot be set, a WARNING names the directory, and ``fsagent status`` shows
  it from the record beside the state dir, :func:`unbound_record`).

Then checkpoints every ``--checkpoint-interval`` seconds, at most one in
flight, through the same shipper as FUSE mode (fsagent.checkpoint.ship): a checkpoint
is a scan of the directory (fsagent.dirmode.scan) and the change set against the
baseline (fsagent.dirmode.store). ``fsagent flush`` asks for one over the control
socket; SIGTERM/SIGINT/SIGHUP or ``flush --final`` run the final save and
stop. A failed save is recorded (``fsagent status``), the directory is left as
it is, and the daemon exits 4 when the final save failed (not for the agent
folder's refusal over a storage limit: a warning, exit 0).

Nothing here imports pyfuse3: a sandbox without libfuse runs this mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from common import logs
from common.errors import InvalidPath, ResyncRequired
from common.limits import CHECKPOINT_INTERVAL_SECONDS
from common.paths import ancestors, validate_path
from common.types import Digest
from fsagent.bridge.base import BridgeClient, ManifestEntry
from fsagent.checkpoint import lifecycle
from fsagent.checkpoint.lifecycle import StopBoundary, final_save
from fsagent.checkpoint.ship import (
    STOP_SIGNALS,
    SaveResult,
    Shipper,
    checkpoint_loop,
    raise_first_failure,
)
from fsagent.control.server import (
    ControlSocket,
    FlushHandler,
    StatsHandler,
    WhenThereIsRoom,
    announce_ready,
    write_record,
)
from fsagent.dirmode.fs import (
    is_empty,
    make_directory,
    open_root,
    place_file,
    remove_path,
    staging,
    syncfs,
)
from fsagent.dirmode.progress import describe, write_figures
from fsagent.dirmode.scan import TICK_NS, DirScan, local_refusals, report, shown_name
from fsagent.dirmode.store import DirStore
from fsagent.errors import (
    FULL_DISK,
    ControllerRefused,
    MountFailed,
    ObjectUnavailable,
    SaveFailed,
)
from fsagent.mountguard import set_immutable
from fsagent.state.hydrate import manifest_row
from fsagent.state.records import EMPTY_DIGEST, BaseEntry, Binding, Kind, LocalEntry, ManifestRow
from fsagent.state.statedir import discard_state_dir

log = logging.getLogger("fsagent.dirmode")

FINAL_RETRIES = 3
"""Scans a final save makes while files are still changing: there is no next
checkpoint to pick them up."""
PROGRESS_EVERY = 0.5


@dataclass(frozen=True, slots=True)
class DirOptions:
    scope: str
    directory: Path
    state_dir: Path
    reason: str
    """Why dir mode (shown by ``fsagent status`` and ``doctor``)."""
    prefetch: int = 4
    """Downloads in flight while hydrating."""
    checkpoint_interval: float = CHECKPOINT_INTERVAL_SECONDS
    ready_file: Path | None = None
    ready_fd: int | None = None
    """An inherited pipe to say it is ready on instead (``fsagent up``:
    fsagent.control.server.announce_ready)."""
    progress_file: Path | None = None
    """Where to write the hydration figures for the process that started this
    one (fsagent.dirmode.progress), which shows them and says when it is ready; the
    daemon then prints neither to its stderr."""


@dataclass
class DirStop(StopBoundary):
    """How the daemon ended, as in FUSE mode (fsagent.checkpoint.lifecycle.StopBoundary),
    and the stop asked for (a signal or ``flush --final``)."""

    requested: trio.Event = field(default_factory=trio.Event)


class DirShipper(Shipper):
    """The shared shipper (fsagent.checkpoint.ship), with a scan of the directory before
    each checkpoint, inside its lock: at most one scan and one checkpoint in
    flight."""

    def __init__(self, store: DirStore, client: BridgeClient, scope: str, lease_epoch: int) -> None:
        super().__init__(store, client, scope, lease_epoch)
        self.dir_store = store
        self.last_report: dict[str, Any] | None = None
        self.refusals: dict[str, object] = {}
        """The last scan's refusals as a checkpoint body names them."""

    async def _ship(self, *, final: bool) -> SaveResult:
        scan = await trio.to_thread.run_sync(self.dir_store.rescan)
        for _ in range(FINAL_RETRIES if final else 0):
            if not scan.unstable:
                break
            await trio.sleep(0.2)  # a file still being written: give it a moment
            scan = await trio.to_thread.run_sync(self.dir_store.rescan)
        self.last_report = report(scan)
        self.refusals = local_refusals(scan)
        if scan.problems:
            log.info("%d path(s) refused by the scan: %s", len(scan.problems), _names(scan))
        result = await super()._ship(final=final)
        if final and scan.unstable:
            # What held still is saved; what kept changing is not, and while
            # any directory kept changing no deletion could ship (a file moved
            # into it may be in neither listing). A plain directory cannot
            # refuse writes during the stop, so this final save is not whole:
            # it must not be taken for one (the agent folder's local copy is
            # discarded after a final save that succeeded).
            shown = sorted(scan.unstable, key=lambda p: p.encode("utf-8", "surrogateescape"))
            raise SaveFailed(
                f"the folder kept changing during the final save: {len(shown)} path(s) "
                f"still changing not saved{'' if scan.stable else ', nor any deletion'} "
                f"({', '.join(shown_name(p) for p in shown[:5])}{', ...' if len(shown) > 5 else ''})"
            )
        return result

    def body_extras(self) -> dict[str, Any]:
        # The controller's receipt names what the scan refused (``localRefusals``).
        if not self.refusals.get("localRefusals") and not self.refusals.get("localRefusedMore"):
            return {}
        return dict(self.refusals)


def _names(scan: DirScan, limit: int = 10) -> str:
    shown = [f"{p} ({why})" for p, why in sorted(scan.problems.items())[:limit]]
    more = len(scan.problems) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


# --- fetching ---------------------------------------------------------------------


async def fetch_verified(client: BridgeClient, scope: str, digest: Digest, objects: Path) -> Path:
    """Download one object into the state dir and check its SHA-256; the
    caller places (renames) or removes the returned file."""
    tmp = objects / f".tmp-{digest}-{secrets.token_hex(4)}"
    try:
        if digest == EMPTY_DIGEST:
            await trio.to_thread.run_sync(tmp.write_bytes, b"")
            return tmp
        got, size = await client.fetch_object(scope, digest, tmp)
        if got != digest:
            raise ObjectUnavailable(
                f"object {digest[:12]}: received {size} bytes hashing to {got[:12]}; "
                "refusing to place it"
            )
        return tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _local(st: os.stat_result, digest: Digest | None) -> LocalEntry:
    kind: Kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
    return LocalEntry(
        kind, st.st_dev, st.st_ino, st.st_size if kind == "file" else 0, st.st_mode,
        st.st_mtime_ns, st.st_ctime_ns, digest, 0,
    )  # fmt: skip


async def _settled(placed: dict[str, LocalEntry]) -> dict[str, LocalEntry]:
    """What was placed, with the time it became trustworthy: a tick after the
    last placement (no one else wrote meanwhile: the agent has not started),
    so the first scan reads none of it again (fsagent.dirmode.scan)."""
    await trio.sleep(TICK_NS / 1e9)
    verified = time.time_ns()
    return {p: e._replace(verified_ns=verified) for p, e in placed.items()}


class Progress:
    """Hydration progress: on a terminal, one line rewritten in place; with a
    progress file, the figures there, for the process that shows them
    (fsagent.dirmode.progress)."""

    def __init__(
        self, scope: str, files: int, total_bytes: int, to_file: Path | None = None
    ) -> None:
        self.scope = scope
        self.files = files
        self.total_bytes = total_bytes
        self.done = 0
        self.done_bytes = 0
        self.to_file = to_file
        self.tty = to_file is None and sys.stderr.isatty()

    def figures(self) -> dict[str, Any]:
        return {"scope": self.scope, "files": self.files, "done": self.done,
                "bytes": self.total_bytes, "doneBytes": self.done_bytes}  # fmt: skip

    def line(self) -> str:
        return f"fsagent: {describe(self.figures())}"

    async def show(self) -> None:
        while self.tty or self.to_file is not None:
            self._emit(end="")
            await trio.sleep(PROGRESS_EVERY)

    def finish(self) -> None:
        if self.tty or self.to_file is not None:
            self._emit(end="\n")

    def _emit(self, end: str) -> None:
        if self.to_file is not None:
            write_figures(self.to_file, self.figures())
        else:
            print(f"\r{self.line()}\x1b[K", end=end, file=sys.stderr, flush=True)


async def _place_rows(
    store: DirStore,
    client: BridgeClient,
    scope: str,
    root_fd: int,
    rows: list[ManifestRow],
    concurrency: int,
    progress_file: Path | None = None,
) -> dict[str, LocalEntry]:
    """Directories, then every file (each object fetched once, however many
    paths show it), ``concurrency`` downloads at a time; what was placed."""
    placed: dict[str, LocalEntry] = {}
    by_digest: dict[Digest, list[ManifestRow]] = defaultdict(list)
    for row in rows:
        if row.kind == "directory":
            placed[row.path] = _local(
                await trio.to_thread.run_sync(make_directory, root_fd, row.path), None
            )
        elif row.digest is not None:
            by_digest[row.digest].append(row)
    progress = Progress(scope, sum(len(v) for v in by_digest.values()),
                        sum(r.byte_size for v in by_digest.values() for r in v),
                        progress_file)  # fmt: skip
    limiter = trio.CapacityLimiter(max(1, concurrency))

    def place_group(source: Path, group: list[ManifestRow], staged: int) -> None:
        # Every path showing this object, in one worker thread: copies, and
        # the downloaded file itself renamed into the last place.
        for i, row in enumerate(group):
            last = i == len(group) - 1
            st = place_file(
                root_fd, row.path, source, row.executable, keep_source=not last, staging_fd=staged
            )
            placed[row.path] = _local(st, row.digest)
            progress.done += 1
            progress.done_bytes += row.byte_size

    async def one(digest: Digest, group: list[ManifestRow], staged: int) -> None:
        async with limiter:
            source = await fetch_verified(client, scope, digest, store.objects)
            try:
                await trio.to_thread.run_sync(place_group, source, group, staged)
            finally:
                source.unlink(missing_ok=True)

    # No staging directory when there is no file to place: an empty folder
    # is served on a disk without a free inode (a sandbox started again on a
    # full disk, its agent folder emptied at the last stop).
    stage = staging(root_fd) if by_digest else contextlib.nullcontext(-1)
    try:
        with stage as staged:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(progress.show)
                async with trio.open_nursery() as fetches:
                    for digest, group in by_digest.items():
                        fetches.start_soon(one, digest, group, staged)
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise_first_failure(group)  # one failed download fails the hydration, as itself
    progress.finish()
    # Directories last: placing their files moved their times.
    for row in rows:
        if row.kind == "directory":
            with contextlib.suppress(FileNotFoundError):
                st = await trio.to_thread.run_sync(
                    partial(os.stat, row.path, dir_fd=root_fd, follow_symlinks=False)
                )
                placed[row.path] = _local(st, None)
    return placed


def _hydratable(rows: list[ManifestRow]) -> list[ManifestRow]:
    """Rows in path order, without those below a file (a file sits where a
    directory should be: the file is kept, as a FUSE hydration does)."""
    files: set[str] = set()
    out = []
    for row in sorted(rows, key=lambda r: r.path.encode("utf-8")):
        if any(a in files for a in ancestors(row.path)):
            continue
        if row.kind == "file":
            files.add(row.path)
        out.append(row)
    return out


def _valid(entry: ManifestEntry) -> bool:
    try:
        validate_path(entry.path)
    except InvalidPath:
        # The controller validates paths; one that slips through is not placed.
        log.warning("skipping manifest entry with invalid path %r", entry.path)
        return False
    return True


async def hydrate_directory(
    store: DirStore,
    client: BridgeClient,
    scope: str,
    root_fd: int,
    concurrency: int,
    progress_file: Path | None = None,
) -> tuple[int, float]:
    """Fill the (empty) directory from the folder's manifest; (entries, seconds)."""
    started = time.monotonic()
    rows: list[ManifestRow] = []
    high_water = 0
    async for page in client.iter_manifest(scope, 0):
        high_water = page.high_water
        rows.extend(manifest_row(e) for e in page.entries if not e.deleted and _valid(e))
    rows = _hydratable(rows)
    store.begin_hydration()
    placed = await _place_rows(store, client, scope, root_fd, rows, concurrency, progress_file)
    await trio.to_thread.run_sync(syncfs, root_fd)
    store.finish_hydration(rows, await _settled(placed), high_water)
    return len(rows), time.monotonic() - started


# --- the server's changes -------------------------------------------------------------


async def take_incoming(store: DirStore, client: BridgeClient, scope: str) -> int:
    """Apply the server's changes since the baseline to paths not changed locally.

    Only while no agent runs (warm start, and after the final save). A path
    changed here, refused or still being written, or below such a path, keeps
    the local version; so does a directory with such a path below it. Returns
    the paths updated.
    """
    since = store.journal.baseline().high_water
    incoming: list[tuple[str, ManifestRow | None]] = []
    high_water = since
    try:
        async for page in client.iter_manifest(scope, since):
            high_water = max(high_water, page.high_water)
            for e in page.entries:
                if not _valid(e):
                    continue
                incoming.append((e.path, None if e.deleted else manifest_row(e)))
    except ControllerRefused as exc:
        if not exc.means(ResyncRequired):
            raise
        log.warning("changes since %d are incomplete on the server; keeping local state", since)
        return 0
    scan = await trio.to_thread.run_sync(store.rescan)
    dirty = {c.path for c in store.changes_since_baseline()} | set(scan.problems) | scan.unstable
    dirty_dirs = {a for p in dirty for a in ancestors(p)}
    root_fd = store.directory()
    saved: dict[str, BaseEntry | None] = {}
    seen: dict[str, LocalEntry | None] = {}
    applied = 0

    def base_of(path: str) -> BaseEntry | None:
        return saved[path] if path in saved else store.saved().get(path)

    staged = contextlib.ExitStack()  # the staging directory, made at the first copy
    staging_fd: int | None = None

    def forget_below(path: str) -> None:
        prefix = path + "/"
        for p in [*store.saved(), *saved]:
            if p.startswith(prefix):
                saved[p] = None
        for p in [*store.seen(), *seen]:
            if p.startswith(prefix):
                seen[p] = None

    failed: list[str] = []
    with staged:
        for path, row in incoming:
            if path in dirty or any(a in dirty for a in ancestors(path)):
                continue
            base = base_of(path)
            if (
                row is not None
                and base is not None
                and (
                    (base.kind, base.digest, base.executable)
                    == (row.kind, row.digest, row.executable)
                )
            ):
                saved[path] = row.base_entry()  # our own save coming back: note its version
                continue
            if path in dirty_dirs and (row is None or row.kind != "directory"):
                continue  # it would remove a directory with local changes below
            try:
                if row is None:
                    if base is None and path not in scan.entries:
                        continue
                    await trio.to_thread.run_sync(remove_path, root_fd, path)
                    saved[path], seen[path] = None, None
                    forget_below(path)
                elif row.kind == "directory":
                    current = scan.entries.get(path)
                    if current is not None and current.kind != "directory":
                        await trio.to_thread.run_sync(remove_path, root_fd, path)
                    st = await trio.to_thread.run_sync(make_directory, root_fd, path)
                    saved[path], seen[path] = row.base_entry(), _local(st, None)
                else:
                    assert row.digest is not None
                    source = await fetch_verified(client, scope, row.digest, store.objects)
                    try:
                        current = scan.entries.get(path)
                        if current is not None and current.kind == "directory":
                            await trio.to_thread.run_sync(remove_path, root_fd, path)
                            forget_below(path)
                        if staging_fd is None:
                            staging_fd = staged.enter_context(staging(root_fd))
                        place = partial(place_file, keep_source=False, staging_fd=staging_fd)
                        st = await trio.to_thread.run_sync(
                            place, root_fd, row.path, source, row.executable
                        )
                    finally:
                        source.unlink(missing_ok=True)
                    saved[path], seen[path] = row.base_entry(), _local(st, row.digest)
            except OSError as exc:  # a parent that is a file here, say
                failed.append(path)
                log.warning("server change at %s not applied: %s", path, exc)
                continue
            applied += 1
    if failed:
        # The baseline keeps its mark: the next start asks for these changes
        # again (what was applied now comes back as already saved).
        high_water = since
    if applied:
        await trio.to_thread.run_sync(syncfs, root_fd)
    placed = await _settled({p: e for p, e in seen.items() if e is not None})
    seen.update(placed)
    store.record_applied(saved, seen, high_water)
    return applied


async def warm_start(
    store: DirStore, client: BridgeClient, shipper: DirShipper, scope: str
) -> None:
    """Ship what changed here first, then take the server's newer changes
    (fsagent.checkpoint.lifecycle)."""
    await lifecycle.warm_start(shipper, partial(take_incoming, store, client, scope))


async def refresh_after_stop(store: DirStore, client: BridgeClient, scope: str) -> None:
    """An explicit refresh waits for the run to stop and its final save to succeed."""
    await lifecycle.refresh_after_stop(client, partial(take_incoming, store, client, scope))


# --- serving -----------------------------------------------------------------------------


async def _final_save(shipper: DirShipper | None, stop: DirStop) -> None:
    """The final save (fsagent.checkpoint.lifecycle), naming what the scan refused."""

    def saved_line(result: SaveResult) -> str:
        count = (shipper.last_report or {}).get("refusedCount", 0) if shipper else 0
        return f"final save: {result.entries} change(s) saved" + (
            f"; {count} path(s) refused (fsagent status names them)" if count else ""
        )

    await final_save(shipper, stop, kept="directory and state kept", saved_line=saved_line)


def _control(shipper: DirShipper, stop: DirStop) -> tuple[FlushHandler, StatsHandler]:
    """The control socket's answers (protocol: fsagent.control.protocol); a flush reply
    also names what the scan refused and what it will look at again."""

    async def flush(final: bool) -> dict[str, Any]:
        if final:
            await _final_save(shipper, stop)
            stop.requested.set()
            return {**stop.flush_reply(), "dir": shipper.last_report}
        started = trio.current_time()
        result = await shipper.ship_checkpoint()
        seconds = round(trio.current_time() - started, 4)  # scan and save, in the daemon
        report = {**(shipper.last_report or {}), "saveSeconds": seconds}
        return {"ok": True, "result": {**result.to_json(), "dir": report}}

    def live() -> dict[str, Any]:
        return {
            "mode": "dir",
            "queueDepth": shipper.queue_depth,
            "lastCheckpoint": shipper.last_checkpoint,
            "dir": shipper.last_report,
        }

    return flush, live


async def _wait_for_signal(signals: AsyncIterator[int], stop: DirStop) -> None:
    """Ask the daemon to save and stop at the first of ``signals``: a receiver
    of :data:`STOP_SIGNALS` opened before the daemon said it is ready, so a
    stop asked for right after that line is a save, not the default action."""
    async for signum in signals:
        log.info("signal %d: saving and stopping", signum)
        stop.requested.set()
        return


def _announce(opts: DirOptions, unbound: bool, warning: str | None = None) -> None:
    """The ready record (``fsagent up``'s pipe, a detaching ``mount``'s file) and
    one line on stderr."""
    announce_ready({"pid": os.getpid(), "scope": opts.scope, "mode": "dir",
                    "reason": opts.reason, "path": str(opts.directory),
                    **({"warning": warning} if warning else {})},
                   opts.ready_file, opts.ready_fd)  # fmt: skip
    if opts.progress_file is None:  # else the process showing the progress says it
        print(
            f"fsagent: {opts.scope} ready at {opts.directory} (dir mode"
            f"{', unbound, read-only' if unbound else ''}: {opts.reason})",
            file=sys.stderr,
        )


def _pin(directory: Path) -> int:
    try:
        return open_root(directory)
    except OSError as exc:
        raise MountFailed(
            f"{directory} cannot be used as the collection's directory: {exc.strerror} "
            "(it must be an existing directory, not a symbolic link)"
        ) from None


async def serve_dir(client: BridgeClient, opts: DirOptions) -> DirStop:
    """Serve one collection as a plain directory until signalled or flushed final."""
    run = await client.get_run()
    logs.process_fields.update(runId=run.run_id, scope=opts.scope)
    owner = run.bindings.get(opts.scope)
    binding = Binding(run.company_id, opts.scope, owner, dict(run.bindings))
    if owner is None:
        return await _serve_unbound(opts, binding)
    state_dir = opts.state_dir.absolute()
    directory = opts.directory.absolute()
    if state_dir == directory or directory in state_dir.parents:
        raise MountFailed(f"the state dir {state_dir} must not be inside {directory}")
    # The agent folder contract (the controller names the entry): its
    # instruction entry is never deleted by a save, and this run's local copy,
    # the directory and its state, lives only until the stop boundary.
    contract = opts.scope == "agent" and run.agent_entry is not None
    stop = DirStop()
    if contract:
        stop.hold_agent_contract(opts.scope, run.warnings)
    root_fd = _pin(directory)
    try:
        _clear_immutable(root_fd)
        await trio.to_thread.run_sync(finish_discard, root_fd, state_dir)
        store = DirStore.open(state_dir)
        try:
            store.dir.bind(binding)
            store.dir.claim_mode("dir", opts.reason, str(directory))
            store.attach(root_fd)
            store.protected = run.agent_entry if contract else None
            await _serve_bound(client, opts, store, run.lease_epoch, root_fd, stop)
        finally:
            store.close()
        if not stop.keeps_local_copy(contract):
            left = await trio.to_thread.run_sync(discard_local_copy, root_fd, state_dir)
            if left is None:
                print(
                    "fsagent: agent folder's local copy discarded"
                    f"{'' if stop.saved else ' (not saved: the next run gets the last saved folder)'}",
                    file=sys.stderr,
                )
            else:
                print(
                    f"fsagent: warning: agent folder's local copy not fully discarded: {left};"
                    " the next start discards the rest before it fills the directory",
                    file=sys.stderr,
                )
    finally:
        os.close(root_fd)
    return stop


DISCARDING = "discarding"
"""A file in the state dir: its directory is being discarded (the agent folder
at its stop boundary). Written, durably, before the first file goes, and
gone with the state dir once the directory is empty; a start that finds it
finishes the discard first (:func:`finish_discard`) and fills the directory
afresh. Without it, a daemon killed halfway through (or stopped while
something kept writing there) left its state dir beside a half-emptied
directory, and the next start shipped every file removed as the agent's
deletion."""

DISCARD_ROUNDS = 12
"""Passes over a directory that something keeps writing in (about 3.6 s in
all) before the discard leaves the rest to the next start."""


def discard_local_copy(root_fd: int, state_dir: Path) -> str | None:
    """The agent folder contract at the stop boundary: everything in the
    directory and in its state dir goes, saved or not; the next run fills the
    directory with the folder as last saved (no retained copy, no partial
    save). A daemon killed before its stop boundary discards nothing: its
    next start ships what the directory holds, as for every collection; one
    killed during the discard leaves :data:`DISCARDING`, and its next start
    finishes it. Returns None when done, else what is left and why (the
    directory kept changing): the state dir then stays, marked, for the
    next start. The state dir is made again at once, new and empty, in the
    room the old one freed (fsagent.state.statedir.discard_state_dir)."""
    (state_dir / DISCARDING).touch(mode=0o600)  # its name is the mark: the directory's fsync
    dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    left = empty_directory(root_fd)
    if left is None:
        discard_state_dir(state_dir, fresh=True)
    return left


def empty_directory(root_fd: int, rounds: int = DISCARD_ROUNDS) -> str | None:
    """Remove everything in the directory, in passes while something keeps
    writing there; None once it is empty, else what was left and the last error."""
    error: OSError | None = None
    for attempt in range(rounds):
        with os.scandir(root_fd) as it:
            names = [e.name for e in it]
        if not names:
            return None
        for name in names:
            try:
                remove_path(root_fd, name)
            except OSError as exc:  # ENOTEMPTY: a file appeared meanwhile
                error = exc
        time.sleep(min(0.5, 0.01 * 2**attempt))
    with os.scandir(root_fd) as it:
        names = sorted(e.name for e in it)
    if not names:
        return None
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    why = f" ({error.strerror})" if error is not None and error.strerror else ""
    return f"{len(names)} name(s) still there after {rounds} passes ({shown}){why}"


def finish_discard(root_fd: int, state_dir: Path) -> bool:
    """A discard that a stopped daemon left unfinished (:data:`DISCARDING`):
    done now, before anything reads the state dir. True when there was one."""
    if not (state_dir / DISCARDING).exists():
        return False
    left = empty_directory(root_fd)
    if left is not None:
        raise MountFailed(
            f"the agent folder's local copy in {state_dir} was being discarded and"
            f" cannot be: {left}; stop what writes there"
        )
    discard_state_dir(state_dir)
    print("fsagent: finished discarding the last run's local copy", file=sys.stderr)
    return True


async def _serve_bound(
    client: BridgeClient,
    opts: DirOptions,
    store: DirStore,
    lease_epoch: int,
    root_fd: int,
    stop: DirStop,
) -> None:
    shipper = DirShipper(store, client, opts.scope, lease_epoch) if client.writable else None
    stop.report_failed = lifecycle.failure_reporter(store.journal, client, opts.scope)
    st = os.fstat(root_fd)
    known = store.directory_record()
    hydrated = store.journal.baseline().hydrated and not store.hydrating()
    if hydrated and known is not None and (known["dev"], known["ino"]) != (st.st_dev, st.st_ino):
        with contextlib.suppress(OSError):
            before = os.lstat(known["path"])
            if (before.st_dev, before.st_ino) == (known["dev"], known["ino"]):
                raise MountFailed(
                    f"the state dir {opts.state_dir} belongs to the directory {known['path']}, "
                    "which is still there (with any unsaved work); serve that directory, or "
                    "use another --state-dir"
                )
        if not is_empty(root_fd):
            raise MountFailed(
                f"{opts.directory} is not the directory this state dir was filled into "
                f"({known['path']}), and it is not empty; nothing was changed"
            )
        print(f"fsagent: {opts.directory} was replaced by an empty directory; filling it "
              "again from the server", file=sys.stderr)  # fmt: skip
        hydrated = False
    if not hydrated:
        if not store.hydrating() and not is_empty(root_fd):
            raise MountFailed(
                f"{opts.directory} is not empty; dir mode fills an empty directory "
                "(move its contents away first, or use the state dir they belong to)"
            )
        store.record_directory(opts.directory.absolute(), st)
        entries, seconds = await hydrate_directory(
            store, client, opts.scope, root_fd, opts.prefetch, opts.progress_file
        )
        log.info("hydrated %d entries in %.2fs", entries, seconds)
        if opts.progress_file is None:
            print(f"fsagent: hydrated {entries} entries in {seconds:.2f}s", file=sys.stderr)
    else:
        store.record_directory(opts.directory.absolute(), st)
        await trio.to_thread.run_sync(store.load)
        if shipper is not None:
            await warm_start(store, client, shipper, opts.scope)
    daemon_file = opts.state_dir / "daemon.json"
    info = {"pid": os.getpid(), "mountpoint": str(opts.directory.absolute()), "mode": "dir",
            "startedAt": time.time()}  # fmt: skip
    record = WhenThereIsRoom(
        f"the daemon's record {daemon_file}", partial(write_record, daemon_file, info)
    )
    # Listening before the ready record: whoever sees it can ask for a save (on
    # a full disk, once there is room: fsagent.control.server).
    control = ControlSocket(opts.state_dir / "control.sock") if shipper is not None else None
    try:
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            _announce(opts, unbound=False)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_wait_for_signal, signals, stop)
                nursery.start_soon(record.made)
                if shipper is not None and control is not None:
                    nursery.start_soon(checkpoint_loop, shipper, opts.checkpoint_interval)
                    flush, live = _control(shipper, stop)
                    nursery.start_soon(control.serve, flush, live)
                await stop.requested.wait()
                nursery.cancel_scope.cancel()
        await _final_save(shipper, stop)
        if shipper is not None and stop.saved and store.protected is None:
            await refresh_after_stop(store, shipper.client, opts.scope)
    finally:
        if control is not None:
            control.close()
        daemon_file.unlink(missing_ok=True)
        if opts.ready_file is not None:
            opts.ready_file.unlink(missing_ok=True)


async def _serve_unbound(opts: DirOptions, binding: Binding) -> DirStop:
    """An empty directory made read-only until stopped; nothing is ever saved."""
    lifecycle.refuse_other_binding(opts.state_dir, binding)
    root_fd = _pin(opts.directory)
    stop = DirStop()
    try:
        _clear_immutable(root_fd)
        if not is_empty(root_fd):
            raise MountFailed(
                f"{opts.directory} is not empty; an unbound collection is an empty directory"
            )
        mode = stat.S_IMODE(os.fstat(root_fd).st_mode)
        os.fchmod(root_fd, 0o555)
        record = unbound_record(opts.state_dir)
        try:
            missing = set_immutable(root_fd, True)
            warning = None
            if missing is not None:
                warning = (
                    f"{opts.directory} is read-only by its mode alone: the immutable flag "
                    f"cannot be set there ({missing}), so a process running as root can "
                    "still write into it, and nothing written there is saved"
                )
                log.warning("%s", warning)
            try:
                write_record(record, {"pid": os.getpid(), "scope": opts.scope, "mode": "dir",
                                     "reason": opts.reason, "path": str(opts.directory),
                                     "warning": warning})  # fmt: skip
            except OSError as exc:
                if exc.errno not in FULL_DISK:
                    raise
                # Only `fsagent status` reads it: the directory is served without it.
                log.warning("cannot write %s: %s; `fsagent status` will not show %s",
                            record, exc.strerror, opts.scope)  # fmt: skip
            with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
                _announce(opts, unbound=True, warning=warning)
                await _wait_for_signal(signals, stop)
        finally:
            record.unlink(missing_ok=True)
            set_immutable(root_fd, False)
            os.fchmod(root_fd, mode)
            if opts.ready_file is not None:
                opts.ready_file.unlink(missing_ok=True)
    finally:
        os.close(root_fd)
    return stop


def unbound_record(state_dir: Path) -> Path:
    """Where an unbound collection's daemon says what it serves, while it does
    (``fsagent status`` reads it): beside the state dir, which an unbound
    collection never creates, so a later run bound to the scope finds it as
    it was."""
    return state_dir.with_name(state_dir.name + ".unbound")


def _clear_immutable(fd: int) -> None:
    """An unbound run killed with -9 leaves the flag behind."""
    set_immutable(fd, False)


def release_directory(path: Path) -> None:
    """Undo what serving an unbound collection did to its directory (the
    immutable flag), e.g. after the daemon was killed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        set_immutable(fd, False)
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)
