"""Lazy hydration: metadata first, contents on demand and in the background.

The mount is ready as soon as the manifest is in LMDB (:func:`hydrate_manifest`).
Contents are fetched by :class:`ContentFetcher`: an open of a file whose
object is missing waits for that object only (it never queues behind the
background prefetch), while :meth:`ContentFetcher.prefetch_all` pulls the
rest with bounded concurrency.  Every object is verified against its digest
before it is published into ``objects/`` by an atomic rename, so a reader can
never see a partial or forged object.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import time
from pathlib import Path

import trio

from common.errors import InvalidPath
from common.paths import validate_path
from common.types import Digest
from fsagent.bridge.base import BridgeClient, ManifestEntry, ManifestPage
from fsagent.errors import ObjectUnavailable
from fsagent.state.store import EMPTY_DIGEST, Kind, ManifestRow, Store

log = logging.getLogger("fsagent.hydrate")


def manifest_row(entry: ManifestEntry) -> ManifestRow:
    """The store's record of a live manifest entry."""
    kind: Kind = "directory" if entry.kind == "directory" else "file"
    return ManifestRow(
        entry.path, kind, entry.digest, entry.byte_size, entry.executable, entry.version
    )


def _valid_rows(entries: list[ManifestEntry]) -> list[ManifestRow]:
    rows = []
    for entry in entries:
        if entry.deleted:
            continue
        try:
            validate_path(entry.path)
        except InvalidPath:
            # The controller validates paths; one that slips through is not
            # worth failing the whole mount over, but must not be shown.
            log.warning("skipping manifest entry with invalid path %r", entry.path)
            continue
        rows.append(manifest_row(entry))
    return rows


async def hydrate_manifest(store: Store, client: BridgeClient, scope: str) -> tuple[int, float]:
    """Read the folder's full manifest into the store; returns (entries, seconds).

    Pages are requested back to back: while the controller prepares the next
    page, a worker thread validates the previous one.  The tree is written in
    one transaction at the end (:meth:`fsagent.state.tree.Tree.hydrate`), so a
    failure leaves nothing behind.
    """
    started = time.monotonic()
    rows: list[ManifestRow] = []
    high_water = 0
    send, receive = trio.open_memory_channel[ManifestPage](2)

    async def fetch_pages() -> None:
        async with send:
            async for page in client.iter_manifest(scope, 0):
                await send.send(page)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch_pages)
            async with receive:
                async for page in receive:
                    high_water = page.high_water
                    rows.extend(await trio.to_thread.run_sync(_valid_rows, page.entries))
    except BaseExceptionGroup as group:
        # Report the client's own error (ControllerRefused, ...) as it is.
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
            raise group.exceptions[0] from None
        raise
    await trio.to_thread.run_sync(store.tree.hydrate, rows, high_water)
    return len(rows), time.monotonic() - started


class ContentFetcher:
    """Fetches saved contents into ``objects/`` on demand and in the background."""

    def __init__(self, store: Store, client: BridgeClient, scope: str) -> None:
        self.store = store
        self.client = client
        self.scope = scope
        self._inflight: dict[str, trio.Event] = {}
        self.fetched = 0

    def path(self, digest: Digest) -> Path:
        return self.store.objects / digest

    def present(self, digest: Digest) -> bool:
        # One stat of a local directory entry: cheaper than a thread hop.
        return os.path.exists(self.store.objects / digest)

    async def ensure(self, digest: Digest) -> Path:
        """Return the local path of ``digest``, fetching it first if needed."""
        path = self.path(digest)
        while not self.present(digest):
            event = self._inflight.get(digest)
            if event is not None:
                await event.wait()
                if not self.present(digest):
                    raise ObjectUnavailable(f"object {digest[:12]} could not be fetched")
                break
            event = self._inflight[digest] = trio.Event()
            try:
                await self._fetch(digest, path)
            finally:
                del self._inflight[digest]
                event.set()
        return path

    async def _fetch(self, digest: Digest, path: Path) -> None:
        tmp = self.store.objects / f".tmp-{digest}-{secrets.token_hex(4)}"
        try:
            if digest == EMPTY_DIGEST:
                await trio.to_thread.run_sync(tmp.write_bytes, b"")
            else:
                got, size = await self.client.fetch_object(self.scope, digest, tmp)
                if got != digest:
                    raise ObjectUnavailable(
                        f"object {digest[:12]}: received {size} bytes hashing to {got[:12]}; "
                        "refusing to publish it"
                    )
            os.chmod(tmp, 0o444)
            os.replace(tmp, path)
            self.fetched += 1
        finally:
            if tmp.exists():
                os.unlink(tmp)

    async def prefetch_all(self, concurrency: int) -> None:
        """Fetch every missing object, ``concurrency`` at a time; failures are logged only.

        A failed prefetch is not fatal: the next open of that file tries again
        and reports EIO to the reader if it still fails.
        """
        if concurrency <= 0:
            return
        missing = await trio.to_thread.run_sync(self.store.tree.missing_digests)
        if not missing:
            return
        log.info("prefetching %d objects (%d at a time)", len(missing), concurrency)
        limiter = trio.CapacityLimiter(concurrency)
        failed = 0
        disk_full = False

        async def one(digest: Digest) -> None:
            nonlocal failed, disk_full
            try:
                await self.ensure(digest)
            except Exception as exc:  # logged only: the open path retries
                failed += 1
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    disk_full = True
                if failed <= 10:  # a dead controller would otherwise log every object
                    log.warning("prefetch of %s failed: %s", digest[:12], exc)
            finally:
                limiter.release_on_behalf_of(digest)

        async with trio.open_nursery() as nursery:
            for digest, _size in missing:
                await limiter.acquire_on_behalf_of(digest)
                if disk_full:
                    # The cache must not eat the room the agent's own writes need.
                    limiter.release_on_behalf_of(digest)
                    log.warning("prefetch stopped: the disk is full")
                    break
                nursery.start_soon(one, digest)
        log.info("prefetch done: %d objects, %d failed", len(missing), failed)
