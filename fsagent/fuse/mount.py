"""One mounted collection: bind the state, hydrate, serve FUSE until unmounted.

Start order: ask the controller who the run is, open the state dir and check
that it belongs to this run's binding (a different task/agent/user/project
refuses, leaving the state untouched), repair what a crash left behind,
hydrate the manifest on first use, then mount.  The mount is ready once the
manifest is in LMDB; contents follow lazily.

Warm start (the state dir was hydrated before): first ship the changes that
were never checkpointed, then apply the server's changes since the baseline
to paths not changed locally, then mount.

While mounted, a checkpoint ships every ``checkpoint_interval`` seconds (at
most one in flight), and ``fsagent flush`` asks for one now through a unix
socket in the state dir (``control.sock``).  With a controller, checkpoints
run on a thread of their own (fsagent.checkpoint.thread), from warm start to the
final save, so that the FUSE loop only serves requests.

Stop: SIGTERM/SIGINT flush the kernel's dirty pages (``sync -f`` in a child
process while the loop keeps serving the resulting writes), ship the final
checkpoint, then end the FUSE loop and unmount.  ``fusermount3 -u`` ends the
loop directly; the final checkpoint then ships after the unmount.  The daemon
exits non-zero when the final save failed, and the state dir keeps every
change for the next start.

The agent folder, when the controller names the agent's instruction entry
(``RunInfo.agent_entry``: the agent folder contract),
differs in three ways: the entry cannot be unlinked or renamed away
(``fs.py``); the final save is tried up to three times when it fails on the
way, then an explicit failure receipt is reported, while a final save the
controller refuses over a storage limit is a recorded refusal and a warning
of the run, not a failure (the daemon exits 0); and at the stop boundary
the state dir is emptied whatever the outcome (:func:`discard_local_copy`):
the run's local copy never outlives the run, so the next run hydrates the
folder as last saved. A daemon killed before its stop boundary discards
nothing; its next start ships what it kept, like every collection.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyfuse3
import trio

from common import logs
from common.errors import ResyncRequired
from common.limits import CHECKPOINT_INTERVAL_SECONDS
from fsagent import SPIN_US
from fsagent.bridge.base import BridgeClient
from fsagent.checkpoint import lifecycle
from fsagent.checkpoint.lifecycle import StopBoundary, final_save
from fsagent.checkpoint.ship import (
    STOP_SIGNALS,
    Checkpoints,
    Shipper,
    checkpoint_loop,
)
from fsagent.checkpoint.thread import ShipThread
from fsagent.control.server import (
    ControlSocket,
    FlushHandler,
    StatsHandler,
    WhenThereIsRoom,
    write_record,
)
from fsagent.errors import ControllerRefused, MountFailed
from fsagent.fuse import stats
from fsagent.fuse.fs import NO_OPEN_SUPPORT, HandlesFS, WorkFolderFS, make_fs
from fsagent.mountguard import MountGuard, adopt_strays
from fsagent.state.hydrate import ContentFetcher, hydrate_manifest, manifest_row
from fsagent.state.statedir import discard_state_dir
from fsagent.state.store import Binding, ManifestRow, Store

log = logging.getLogger("fsagent.mount")


@dataclass(frozen=True, slots=True)
class MountOptions:
    scope: str
    mountpoint: Path
    state_dir: Path
    allow_other: bool = False
    prefetch: int = 4
    checkpoint_interval: float = CHECKPOINT_INTERVAL_SECONDS
    spin_us: int = SPIN_US
    mode_reason: str = "--mode fuse"
    """Why FUSE serves this collection (``fsagent status`` shows it; fsagent.fuse.probe)."""
    guard: MountGuard | None = None
    """The guarded directory underneath the mountpoint (fsagent.mountguard):
    what was written there while nothing served it is adopted once mounted."""


StopState = StopBoundary
"""How the daemon ended (fsagent.checkpoint.lifecycle.StopBoundary)."""


READAHEAD_KIB = 1024
"""Readahead for the mount when fsagent may set it (root): the kernel's
default of 128 KiB splits a sequential read into 128 KiB READ requests, each a
round trip to this daemon; at 1 MiB there are eight times fewer."""

STORE_WRITEBACK_S: Final = 0.25
"""How often the state's dirty LMDB pages start going to disk (``_write_back_store``)."""


def mount_device(mountpoint: Path) -> str | None:
    """``major:minor`` of what is mounted at ``mountpoint`` (alive or dead), or
    None, from /proc/self/mountinfo.

    Not from stat(): the daemon must not touch its own mount before it
    serves it, and a dead mount answers ENOTCONN.
    """
    target = os.path.abspath(mountpoint)  # realpath() would stat the mount itself
    found = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            for line in fh:
                fields = line.split(" ")
                # Mount points are octal-escaped (\040 for a space, and so on).
                where = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
                if where == target:
                    found = fields[2]  # the last one is the newest mount there
    except (OSError, IndexError):
        return None
    return found


async def _raise_readahead(fs: WorkFolderFS, mountpoint: Path) -> None:
    """Once INIT is answered: the kernel lowers readahead to what the INIT
    reply allows, and that is the value it offered, the default."""
    await fs.initialized.wait()
    _set_readahead(mountpoint)


async def _adopt_strays(fs: WorkFolderFS, guard: MountGuard, mountpoint: Path) -> None:
    """Once the mount serves: take in what was written underneath it while
    nothing served the path (fsagent.mountguard), from a worker thread."""
    await fs.initialized.wait()
    try:
        adopted = await trio.to_thread.run_sync(adopt_strays, guard, mountpoint)
    except OSError as exc:
        log.warning("%s: could not adopt what was written underneath the mount: %s",
                    mountpoint, exc)  # fmt: skip
        return
    if adopted:
        print(
            f"fsagent: adopted {adopted} file(s) written under {mountpoint} while no "
            "daemon served it",
            file=sys.stderr,
        )


async def _write_back_store(fs: WorkFolderFS) -> None:
    """For the life of the mount: every ``STORE_WRITEBACK_S`` with commits since
    the last time, start writing the state's dirty LMDB pages to disk from a
    worker thread (``GuardedEnv.start_writeback``), so that an fsync does not
    wait for the pages of the bursts before it."""
    env = fs.store.dir.env
    seen = env.commits
    while True:
        await trio.sleep(STORE_WRITEBACK_S)
        if env.commits == seen:
            continue
        seen = env.commits
        try:
            await trio.to_thread.run_sync(env.start_writeback)
            stats.FUSE.state_writebacks += 1
        except OSError as exc:  # the next sync writes them; nothing is lost
            log.warning("writing back the state's pages failed: %s", exc)


def _set_readahead(mountpoint: Path) -> None:
    """Best effort: raise the mount's readahead to READAHEAD_KIB (needs root)."""
    device = mount_device(mountpoint)
    if device is None:
        return
    try:
        with open(f"/sys/class/bdi/{device}/read_ahead_kb", "w") as fh:
            fh.write(str(READAHEAD_KIB))
    except OSError as exc:
        log.debug("readahead of %s stays at the default: %s", mountpoint, exc)


def _pyfuse3_version() -> str:
    try:
        return importlib.metadata.version("pyfuse3")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _fuse_options(opts: MountOptions, readonly: bool) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    options |= {f"fsname=fsagent-{opts.scope}", "subtype=fsagent", "noatime"}
    if opts.allow_other:
        # Needed when the agent runs as another user than fsagent; with
        # default_permissions the kernel still enforces the file modes.
        options.add("allow_other")
    elif os.geteuid() == 0:
        # Only root can reach this mount, and root passes every mode check but
        # exec, which the kernel still checks for FUSE files (and fs.access for
        # access(2)). Without default_permissions the kernel no longer fetches
        # a directory's attributes again (GETATTR) after each change in it.
        options.discard("default_permissions")
    if readonly:
        options.add("ro")
    return options


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: Path) -> None:
    """syncfs(2) without holding the GIL.

    The kernel answers syncfs on our own mount by sending us the dirty pages
    as write requests, which the trio thread must serve meanwhile.
    ``pyfuse3.syncfs`` keeps the GIL during the system call and so deadlocks
    here; a ctypes call releases it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(path))
    finally:
        os.close(fd)


async def _stop_on_signal(
    signals: AsyncIterator[int],
    fs: WorkFolderFS,
    mountpoint: Path,
    shipper: Checkpoints | None,
    stop: StopState,
) -> None:
    """Save and unmount at the first of ``signals``: a receiver of
    :data:`STOP_SIGNALS` opened before the mount appeared, so a stop asked
    for as soon as it is seen is a save, not the default action."""
    async for signum in signals:
        log.info("signal %d: flushing dirty pages, saving and unmounting", signum)
        await _freeze(fs, mountpoint)
        await final_save(shipper, stop)
        pyfuse3.terminate()
        return


async def _flush_kernel(mountpoint: Path) -> None:
    """Push the kernel's dirty pages (mmap, writeback cache) to us before saving.

    From a child process (``sync -f``), not a thread of this one: a thread
    waiting in the kernel for its own mount's answers cannot be killed, so a
    ``kill -9`` during the stop left a daemon that never died, holding its
    FUSE connection (and the mount) open for good. A child waiting on the
    mount is freed when this process dies and the connection aborts.
    """
    sync = shutil.which("sync")
    if sync is None:  # no coreutils: the system call from a worker thread
        try:
            # Not pyfuse3.syncfs: it holds the GIL through the call and deadlocks (see syncfs).
            await trio.to_thread.run_sync(syncfs, mountpoint)
        except OSError as exc:
            log.warning("syncfs on %s failed: %s", mountpoint, exc)
        return
    done = await trio.run_process(
        [sync, "-f", str(mountpoint)], check=False, capture_stderr=True, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        log.warning("syncfs on %s failed: %s", mountpoint, done.stderr.decode(errors="replace"))


async def _freeze(fs: WorkFolderFS, mountpoint: Path) -> None:
    """The start of a stop: the kernel's dirty pages flushed to us, then every
    later change refused (EROFS), so that the final save holds every write
    that was answered. A write the agent makes after it fails and is not
    acknowledged; without the freeze it was answered, missed by the final
    save's listing, and lost with the agent folder's discarded copy or with
    the sandbox."""
    await _flush_kernel(mountpoint)
    fs.freeze()


def _control_handler(
    fs: WorkFolderFS, mountpoint: Path, shipper: Checkpoints, stop: StopState
) -> FlushHandler:
    """What a valid ``fsagent flush`` request does (protocol: fsagent.control.protocol)."""

    async def flush(final: bool) -> dict[str, Any]:
        if final:
            await _freeze(fs, mountpoint)
        else:
            await _flush_kernel(mountpoint)
        if final:
            await final_save(shipper, stop)
            pyfuse3.terminate()
            return stop.flush_reply()
        result = await shipper.ship_checkpoint()
        return {"ok": True, "result": result.to_json()}

    return flush


def _stats_handler(shipper: Checkpoints) -> StatsHandler:
    """What a ``stats`` request answers: the live part of ``fsagent status --json``."""

    def live() -> dict[str, Any]:
        return {
            "fuse": stats.FUSE.to_json(),
            "queueDepth": shipper.queue_depth,
            "lastCheckpoint": shipper.last_checkpoint,
        }

    return live


async def warm_start(store: Store, client: BridgeClient, shipper: Checkpoints, scope: str) -> None:
    """Ship what was never checkpointed, then take the server's newer changes
    (fsagent.checkpoint.lifecycle)."""
    await lifecycle.warm_start(shipper, functools.partial(take_incoming, store, client, scope))


async def take_incoming(store: Store, client: BridgeClient, scope: str) -> int:
    """Apply the server's changes since the baseline to paths not changed locally.

    Only while nothing is mounted: the kernel must not cache what changes here.
    """
    since = store.journal.baseline().high_water
    incoming: list[ManifestRow | tuple[str, bool]] = []
    high_water = since
    try:
        async for page in client.iter_manifest(scope, since):
            high_water = max(high_water, page.high_water)
            for e in page.entries:
                incoming.append((e.path, True) if e.deleted else manifest_row(e))
    except ControllerRefused as exc:
        if not exc.means(ResyncRequired):
            raise
        log.warning("changes since %d are incomplete on the server; keeping local state", since)
        return 0
    applied = store.tree.apply_incoming(incoming)
    store.acknowledge([], high_water)
    return applied


async def refresh_after_stop(store: Store, client: BridgeClient, scope: str) -> None:
    """An explicit refresh waits for the run to stop and its final save to succeed."""
    await lifecycle.refresh_after_stop(
        client, functools.partial(take_incoming, store, client, scope)
    )


async def serve(client: BridgeClient, opts: MountOptions) -> StopState:
    """Mount one collection and serve it until unmounted or signalled."""
    run = await client.get_run()
    logs.process_fields.update(runId=run.run_id, scope=opts.scope)
    owner = run.bindings.get(opts.scope)
    binding = Binding(run.company_id, opts.scope, owner, dict(run.bindings))
    scratch: Path | None = None
    # The agent folder contract (the controller names the entry): its
    # instruction entry is protected, and this run's local copy lives only
    # until the stop boundary.
    contract = opts.scope == "agent" and owner is not None and run.agent_entry is not None
    stop = StopState()
    if contract:
        stop.hold_agent_contract(opts.scope, run.warnings)
    if owner is None:
        lifecycle.refuse_other_binding(opts.state_dir, binding)
        # An unbound collection is an empty read-only directory: a throwaway store.
        scratch = Path(tempfile.mkdtemp(prefix=f"fsagent-unbound-{opts.scope}-"))
        store = Store.open(scratch / "state")
    else:
        store = Store.open(opts.state_dir)
    try:
        # The ship thread (if any) stops before the store closes.
        async with contextlib.AsyncExitStack() as threads:
            await _serve_store(
                client,
                opts,
                store,
                binding,
                run.lease_epoch,
                threads,
                stop,
                protected=run.agent_entry if contract else None,
            )
    finally:
        store.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if not stop.keeps_local_copy(contract):
        discard_local_copy(opts.state_dir)
        print(
            "fsagent: agent folder's local copy discarded"
            f"{'' if stop.saved else ' (not saved: the next run gets the last saved folder)'}",
            file=sys.stderr,
        )
    return stop


Cadence = Callable[[trio.Nursery], None]
"""Starts a mount's checkpoint cadence once it serves (given the mount's nursery)."""


async def _open_shipper(
    store: Store,
    client: BridgeClient,
    opts: MountOptions,
    lease_epoch: int,
    threads: contextlib.AsyncExitStack,
) -> tuple[Checkpoints, Cadence]:
    """The mount's checkpoints and how to start their cadence.

    A client that can serve another thread gets a ship thread with its own
    copy of the client, and the cadence runs there; another one ships here.
    """
    interval = opts.checkpoint_interval
    ship_client = client.fork()
    if ship_client is None:
        shipper = Shipper(store, client, opts.scope, lease_epoch)
        return shipper, lambda nursery: nursery.start_soon(checkpoint_loop, shipper, interval)
    thread = await threads.enter_async_context(
        ShipThread(store, ship_client, opts.scope, lease_epoch)
    )
    return thread, lambda _nursery: thread.start_cadence(interval)


async def _serve_store(
    client: BridgeClient,
    opts: MountOptions,
    store: Store,
    binding: Binding,
    lease_epoch: int,
    threads: contextlib.AsyncExitStack,
    stop: StopState,
    *,
    protected: str | None,
) -> None:
    """:func:`serve` once the state dir is open; ``protected`` is the agent
    folder's instruction entry under its contract (None otherwise)."""
    owner = binding.owner_id
    shipper: Checkpoints | None = None
    cadence: Cadence | None = None
    stop.report_failed = lifecycle.failure_reporter(store.journal, client, opts.scope)
    if owner is not None:
        store.dir.bind(binding)
        store.dir.claim_mode("fuse", opts.mode_reason, str(opts.mountpoint.absolute()))
        freed, fixed = store.tree.recover()
        if freed or fixed:
            log.info("recovered state: %d orphans freed, %d sizes repaired", freed, fixed)
        if client.writable:
            shipper, cadence = await _open_shipper(store, client, opts, lease_epoch, threads)
        if not store.journal.baseline().hydrated:
            entries, seconds = await hydrate_manifest(store, client, opts.scope)
            log.info("hydrated %d entries in %.2fs", entries, seconds)
            print(f"fsagent: hydrated {entries} entries in {seconds:.2f}s", file=sys.stderr)
        elif shipper is not None:
            await warm_start(store, client, shipper, opts.scope)
    fetcher = ContentFetcher(store, client, opts.scope)
    fs = make_fs(
        store,
        fetcher,
        readonly=owner is None,
        spin_ns=opts.spin_us * 1000,
        handles=not NO_OPEN_SUPPORT or os.environ.get("FSAGENT_FUSE_HANDLES") == "1",
        protected=protected,
    )
    log.info(
        "FUSE: %s (pyfuse3 %s)",
        "open/release handles" if isinstance(fs, HandlesFS) else '"no open" mode',
        _pyfuse3_version(),
    )
    # Listening before the mount appears: whoever sees the mount can ask it
    # to save (on a full disk, once there is room: fsagent.control.server).
    control = ControlSocket(opts.state_dir / "control.sock") if shipper is not None else None
    signals = threads.enter_context(trio.open_signal_receiver(*STOP_SIGNALS))
    if opts.guard is not None:
        opts.guard.open_for_mount()
    try:
        pyfuse3.init(fs, str(opts.mountpoint), _fuse_options(opts, owner is None))
    except RuntimeError as exc:
        if control is not None:
            control.close()
        raise MountFailed(
            f"could not mount {opts.mountpoint}: {exc} (is /dev/fuse available, "
            "fusermount3 installed, and the mountpoint an existing, unused directory?)"
        ) from exc
    finally:
        if opts.guard is not None:
            opts.guard.lock()  # underneath the mount now, or unserved again
    daemon_file = opts.state_dir / "daemon.json" if owner is not None else None
    record: WhenThereIsRoom[None] | None = None
    if daemon_file is not None:
        info = {"pid": os.getpid(), "mountpoint": str(opts.mountpoint.absolute()),
                "startedAt": time.time()}  # fmt: skip
        record = WhenThereIsRoom(
            f"the daemon's record {daemon_file}", functools.partial(write_record, daemon_file, info)
        )
    print(
        f"fsagent: {opts.scope} mounted at {opts.mountpoint}"
        f"{' (unbound, read-only)' if owner is None else ''}",
        file=sys.stderr,
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, fs, opts.mountpoint, shipper, stop)
            nursery.start_soon(fs.spinner.run)
            nursery.start_soon(fs.write_behind)
            nursery.start_soon(_write_back_store, fs)
            nursery.start_soon(_raise_readahead, fs, opts.mountpoint)
            if opts.guard is not None and owner is not None:
                nursery.start_soon(_adopt_strays, fs, opts.guard, opts.mountpoint)
            if owner is not None:
                nursery.start_soon(fetcher.prefetch_all, opts.prefetch)
            if record is not None:
                nursery.start_soon(record.made)
            if shipper is not None and cadence is not None and control is not None:
                cadence(nursery)
                nursery.start_soon(
                    control.serve,
                    _control_handler(fs, opts.mountpoint, shipper, stop),
                    _stats_handler(shipper),
                )
            await pyfuse3.main()
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)
        if control is not None:
            control.close()
        fs.shutdown()
        if daemon_file is not None:
            daemon_file.unlink(missing_ok=True)
    # Unmounted from outside (fusermount3 -u): the run is stopping; save.
    await final_save(shipper, stop)
    if shipper is not None and stop.saved and protected is None:
        await refresh_after_stop(store, client, opts.scope)


def discard_local_copy(state_dir: Path) -> None:
    """Remove everything in the agent folder's state dir at the stop boundary:
    the journal, the upper layer and the content cache. The next run of the
    agent hydrates the folder as last saved: no retained archive, no partial
    save. (A daemon killed before its stop boundary discards nothing, and its
    next start ships what it kept, as for every collection; one killed during
    the discard leaves the whole state dir or none, see
    :func:`fsagent.state.statedir.discard_state_dir`.) The state dir is made
    again at once, new and empty, in the room the old one freed: the next
    start finds it even on a disk filled meanwhile."""
    discard_state_dir(state_dir, fresh=True)
