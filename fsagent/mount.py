"""One mounted collection: bind the state, hydrate, serve FUSE until unmounted.

Start order: ask the controller who the run is, open the state dir and check
that it belongs to this run's binding (a different task/agent/user/project
refuses, leaving the state untouched), repair what a crash left behind,
hydrate the manifest on first use, then mount.  The mount is ready once the
manifest is in LMDB; contents follow lazily.

Stop: SIGTERM/SIGINT flush the kernel's dirty pages (``syncfs`` from a worker
thread while the loop keeps serving the resulting writes), then end the FUSE
loop and unmount.  ``fusermount3 -u`` ends the loop directly.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import trio

from fsagent.client import BridgeClient
from fsagent.errors import MountFailed
from fsagent.fs import WorkFolderFS
from fsagent.hydrate import ContentFetcher, hydrate_manifest
from fsagent.store import MARKER, Binding, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MountOptions:
    scope: str
    mountpoint: Path
    state_dir: Path
    allow_other: bool = False
    prefetch: int = 4


def _fuse_options(opts: MountOptions, readonly: bool) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    options |= {f"fsname=fsagent-{opts.scope}", "subtype=fsagent", "noatime"}
    if opts.allow_other:
        # Needed when the agent runs as another user than fsagent; with
        # default_permissions the kernel still enforces the file modes.
        options.add("allow_other")
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


async def _stop_on_signal(mountpoint: Path) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: flushing dirty pages and unmounting", signum)
            try:
                await trio.to_thread.run_sync(syncfs, mountpoint)
            except OSError as exc:
                log.warning("syncfs on %s failed: %s", mountpoint, exc)
            pyfuse3.terminate()
            return


async def serve(client: BridgeClient, opts: MountOptions) -> None:
    """Mount one collection and serve it until unmounted or signalled."""
    run = await client.get_run()
    owner = run.bindings.get(opts.scope)
    binding = Binding(run.company_id, opts.scope, owner, dict(run.bindings))
    scratch: Path | None = None
    if owner is None:
        if (opts.state_dir / MARKER).exists():
            # A run without this scope may not pick up another binding's state.
            existing = Store.open(opts.state_dir)
            try:
                existing.bind(binding)
            finally:
                existing.close()
        # An unbound collection is an empty read-only directory: a throwaway store.
        scratch = Path(tempfile.mkdtemp(prefix=f"fsagent-unbound-{opts.scope}-"))
        store = Store.open(scratch / "state")
    else:
        store = Store.open(opts.state_dir)
    try:
        if owner is not None:
            store.bind(binding)
            freed, fixed = store.recover()
            if freed or fixed:
                log.info("recovered state: %d orphans freed, %d sizes repaired", freed, fixed)
            if not store.baseline().hydrated:
                entries, seconds = await hydrate_manifest(store, client, opts.scope)
                log.info("hydrated %d entries in %.2fs", entries, seconds)
                print(f"fsagent: hydrated {entries} entries in {seconds:.2f}s", file=sys.stderr)
        fetcher = ContentFetcher(store, client, opts.scope)
        fs = WorkFolderFS(store, fetcher, readonly=owner is None)
        try:
            pyfuse3.init(fs, str(opts.mountpoint), _fuse_options(opts, owner is None))
        except RuntimeError as exc:
            raise MountFailed(
                f"could not mount {opts.mountpoint}: {exc} (is /dev/fuse available, "
                "fusermount3 installed, and the mountpoint an existing, unused directory?)"
            ) from exc
        daemon_file = opts.state_dir / "daemon.json" if owner is not None else None
        if daemon_file is not None:
            daemon_file.write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "mountpoint": str(opts.mountpoint.absolute()),
                        "startedAt": time.time(),
                    }
                )
            )
        print(
            f"fsagent: {opts.scope} mounted at {opts.mountpoint}"
            f"{' (unbound, read-only)' if owner is None else ''}",
            file=sys.stderr,
        )
        unmount = True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signal, opts.mountpoint)
                if owner is not None:
                    nursery.start_soon(fetcher.prefetch_all, opts.prefetch)
                await pyfuse3.main()
                nursery.cancel_scope.cancel()
        finally:
            pyfuse3.close(unmount=unmount)
            fs.shutdown()
            if daemon_file is not None:
                daemon_file.unlink(missing_ok=True)
    finally:
        store.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
