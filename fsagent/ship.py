"""Ship the journal to the controller as checkpoints.

One checkpoint, start to finish (:meth:`Shipper.ship_checkpoint`):

1. If a checkpoint was committed but its answer never arrived (the pending
   record says ``committing``), send exactly that body again under the same
   operation id: the controller answers with the original receipt and applies
   nothing twice, so a lost response can never overwrite a later writer.
2. List the coalesced change set since the baseline
   (:meth:`Store.changes_since_baseline`) and, before a single byte is sent,
   commit a fresh operation id to LMDB and sync it.
3. Upload new contents: each upper file streams in zstd frames of at most 4
   MiB with an xxh64 per frame (memory stays bounded whatever the file size).
   The file's write generation is read before and after: a file written to
   while it was read is left out and stays dirty for the next checkpoint, so
   torn content is never shipped. Renamed unchanged files and exec-bit
   changes ship as references to their saved digest, without bytes.
4. Persist the exact commit body (state ``committing``), send it, and on the
   receipt fold what was saved into the baseline (:meth:`Store.acknowledge`)
   and clear the pending record in one LMDB transaction.

At most one checkpoint is in flight (a trio lock). Transient failures
(network, 5xx, 429) are retried with backoff and jitter up to a deadline;
permanent refusals (403/404/409/422) stop at once and are recorded so
``fsagent status`` shows them. A ``stale_lease`` refusal fences the shipper:
a newer run owns the folder, so nothing is uploaded or committed again by
this daemon (every later save fails at once) and the state dir keeps every
change.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, NoReturn, Protocol, TypeVar

import trio
import zstandard

from common.bridge import (
    BATCH_MAX_BYTES,
    BATCH_MAX_MEMBERS,
    BATCH_MEMBER_MAX,
    CHUNK_MAX,
    END_FRAME,
    compressible,
    encode_frame,
)
from common.errors import StaleLease
from common.types import Digest, FileVersion
from fsagent.client import BridgeClient
from fsagent.errors import ControllerRefused, FsagentError, SaveFailed
from fsagent.store import BaseEntry, Change, InodeNo, JournalSeq

log = logging.getLogger(__name__)

UPLOAD_CONCURRENCY = 8
"""Uploads in flight at once (a batch counts as one); memory stays bounded at
about one frame per single upload and one batch body per batch."""

BATCH_TARGET_MEMBERS = 256
BATCH_TARGET_BYTES = 4 << 20
"""A batch closes at this many files or bytes (within the contract's bounds):
several smaller batches keep both ends busy where one large one would not."""


T = TypeVar("T")


def batches(items: list[T], size_of: Callable[[T], int]) -> list[list[T]]:
    """Small uploads grouped into batches, by listed size (also used for
    repository checkpoints, :mod:`fsagent.reposave`)."""
    members = min(BATCH_TARGET_MEMBERS, BATCH_MAX_MEMBERS)
    budget = min(BATCH_TARGET_BYTES, BATCH_MAX_BYTES - BATCH_MEMBER_MAX)
    out: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        item_size = size_of(item)
        if current and (len(current) >= members or size + item_size > budget):
            out.append(current)
            current, size = [], 0
        current.append(item)
        size += item_size
    if current:
        out.append(current)
    return out


async def file_frames(
    fh: BinaryIO, compressor: zstandard.ZstdCompressor, tally: Callable[[int], None]
) -> AsyncIterator[bytes]:
    """The upload frames of an open file, read and compressed in worker
    threads, then :data:`END_FRAME`; ``tally`` hears each chunk's raw size.
    Whether to compress is decided on the first block: incompressible data
    goes up as stored frames."""
    use: zstandard.ZstdCompressor | None = compressor
    first = True
    while True:
        raw = await trio.to_thread.run_sync(fh.read, CHUNK_MAX)
        if not raw:
            break
        if first:  # the compressibility check is CPU work too: a thread
            frame, use = await trio.to_thread.run_sync(encode_first, raw, compressor)
            first = False
        else:
            frame = await trio.to_thread.run_sync(encode_frame, raw, use)
        tally(len(raw))
        yield frame
    yield END_FRAME


@dataclass(frozen=True)
class SaveResult:
    operation_id: str | None
    entries: int
    skipped_torn: int
    receipt: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "operationId": self.operation_id,
            "entries": self.entries,
            "skippedTorn": self.skipped_torn,
            "receipt": self.receipt,
        }


def change_to_json(c: Change) -> list[Any]:
    base = None if c.base is None else c.base.encode().decode()
    return [c.path, c.action, c.seq, base, c.inode, c.digest, c.size, c.executable, c.generation]


def change_from_json(raw: list[Any]) -> Change:
    path, action, seq, base, inode, digest, size, exe, gen = raw
    return Change(
        path,
        action,
        JournalSeq(seq),
        None if base is None else BaseEntry.decode(base.encode()),
        None if inode is None else InodeNo(inode),
        None if digest is None else Digest(digest),
        size,
        exe,
        gen,
    )


class HasGeneration(Protocol):
    @property
    def generation(self) -> int: ...


class ContentReader(Protocol):
    def open_read(self, ino: int) -> BinaryIO: ...


class ShipStore(Protocol):
    """What the shipper reads and writes of a collection's state: a FUSE
    mount's :class:`fsagent.store.Store` (the journal, inodes and ``upper/``)
    or a plain directory's :class:`fsagent.dirstore.DirStore` (a scan; files
    read from the directory). An upload's ``inode`` and ``generation`` are
    whatever ``get`` and ``upper`` understand: the shipper only compares the
    generation before and after reading."""

    @property
    def upper(self) -> ContentReader: ...

    def pending_checkpoint(self) -> dict[str, Any] | None: ...

    def set_pending_checkpoint(self, record: dict[str, Any] | None) -> None: ...

    def changes_since_baseline(self) -> list[Change]: ...

    def get(self, ino: int) -> HasGeneration: ...

    def inline_data(self, ino: InodeNo) -> bytes | None: ...

    def finish_checkpoint(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], receipt: dict[str, Any]
    ) -> int: ...

    def record_save_error(self, message: str) -> None: ...


class Shipper:
    """Checkpoints for one collection; owned by the daemon that serves it."""

    def __init__(
        self, store: ShipStore, client: BridgeClient, scope: str, lease_epoch: int
    ) -> None:
        self.store = store
        self.client = client
        self.scope = scope
        self.lease_epoch = lease_epoch
        self._lock = trio.Lock()
        self.fenced: str | None = None
        """Why the controller fenced this run off (stale lease); None while shipping."""
        self.last_checkpoint: dict[str, Any] | None = None
        """Duration, entries and bytes of the last checkpoint that committed."""

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def queue_depth(self) -> int:
        """Checkpoints in flight or waiting for the one in flight."""
        return int(self.busy) + self._lock.statistics().tasks_waiting

    async def ship_checkpoint(self, *, final: bool = False) -> SaveResult:
        """Save everything changed since the baseline; raises SaveFailed."""
        async with self._lock:
            if self.fenced is not None:
                message = f"not saved, a newer run holds the lease: {self.fenced}"
                self.store.record_save_error(message)
                raise SaveFailed(message)
            try:
                started = trio.current_time()
                result = await self._ship(final=final)
                if result.receipt is not None:
                    self.last_checkpoint = {
                        "seconds": round(trio.current_time() - started, 3),
                        "entries": result.entries,
                        "bytes": result.receipt.get("byteSize"),
                    }
                return result
            except (FsagentError, OSError) as exc:
                message = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ControllerRefused) and exc.means(StaleLease):
                    self.fenced = message
                self.store.record_save_error(message)
                with trio.move_on_after(10):
                    try:
                        await self.client.report_state("failed", message)
                    except FsagentError as report_exc:
                        log.warning("could not report the failed save: %s", report_exc)
                raise SaveFailed(message) from exc

    async def _ship(self, *, final: bool) -> SaveResult:
        pending = self.store.pending_checkpoint()
        if pending is not None and pending.get("state") == "committing":
            # The answer to this body may have been lost: replay it verbatim.
            await self._commit(pending)
            pending = None
        changes = self.store.changes_since_baseline()
        if not changes and not final:
            return SaveResult(None, 0, 0, None)
        op_id = pending["operationId"] if pending else f"cp-{uuid.uuid4()}"
        self.store.set_pending_checkpoint({"operationId": op_id, "state": "uploading"})
        uploaded = await self._upload_all([c for c in changes if c.action == "upload"])
        entries: list[dict[str, Any]] = []
        shipped: list[list[Any]] = []
        torn = 0
        for change in changes:
            if change.action == "upload":
                digest = uploaded.get(change.path)
                if digest is None:
                    torn += 1
                    continue
                entries.append(
                    {
                        "op": "put",
                        "path": change.path,
                        "digest": digest,
                        "executable": change.executable,
                    }
                )
                shipped.append([*change_to_json(change), digest])
            elif change.action == "reference":
                entries.append(
                    {
                        "op": "put",
                        "path": change.path,
                        "digest": change.digest,
                        "executable": change.executable,
                    }
                )
                shipped.append([*change_to_json(change), change.digest])
            else:
                entries.append({"op": change.action, "path": change.path})
                shipped.append([*change_to_json(change), None])
        body = {
            "operationId": op_id,
            "leaseEpoch": self.lease_epoch,
            "final": final,
            "entries": entries,
        }
        record = {"operationId": op_id, "state": "committing", "body": body, "shipped": shipped}
        self.store.set_pending_checkpoint(record)
        receipt = await self._commit(record)
        return SaveResult(op_id, len(entries), torn, receipt)

    async def _commit(self, record: dict[str, Any]) -> dict[str, Any]:
        receipt = await self.client.commit_checkpoint(self.scope, record["body"])
        shipped = [
            (change_from_json(raw[:-1]), raw[-1], FileVersion(int(receipt["highWater"])))
            for raw in record["shipped"]
        ]
        self.store.finish_checkpoint(shipped, receipt)
        log.info(
            "checkpoint %s saved: %d entries (high water %s)",
            record["operationId"],
            len(shipped),
            receipt.get("highWater"),
        )
        return receipt

    async def _upload_all(self, changes: list[Change]) -> dict[str, Digest]:
        """Upload several files at once: each answer waits for a durable store on
        the controller, so one at a time would leave the link idle. Small files
        go up many per request (:meth:`_upload_batch`), the others one each."""
        results: dict[str, Digest] = {}
        limiter = trio.CapacityLimiter(UPLOAD_CONCURRENCY)
        small = [c for c in changes if c.size <= BATCH_MEMBER_MAX]
        large = [c for c in changes if c.size > BATCH_MEMBER_MAX]

        async def one(change: Change) -> None:
            async with limiter:
                digest = await self._upload(change)
            if digest is not None:
                results[change.path] = digest

        async def batch(group: list[Change]) -> None:
            async with limiter:
                results.update(await self._upload_batch(group))

        try:
            async with trio.open_nursery() as nursery:
                for group in batches(small, lambda c: c.size):
                    if len(group) == 1:
                        nursery.start_soon(one, group[0])  # a batch of one is an upload
                    else:
                        nursery.start_soon(batch, group)
                for change in large:
                    nursery.start_soon(one, change)
        except BaseExceptionGroup as group:
            raise_first_failure(group)
        return results

    async def _upload_batch(self, group: list[Change]) -> dict[str, Digest]:
        """One request for many small files, with the same torn-read rule as
        :meth:`_upload`: a file written to since it was listed is left out."""
        ready: list[tuple[Change, bytes | None]] = []
        for change in group:
            assert change.inode is not None
            try:
                if self.store.get(change.inode).generation != change.generation:
                    continue
            except KeyError:
                continue  # unlinked since the listing: the next listing says delete
            ready.append((change, self.store.inline_data(change.inode)))

        def read_all() -> list[bytes | None]:
            out: list[bytes | None] = []
            for change, inline in ready:
                if inline is not None:
                    out.append(inline)
                    continue
                assert change.inode is not None
                try:
                    with self.store.upper.open_read(change.inode) as fh:
                        out.append(fh.read(BATCH_MEMBER_MAX + 1))
                except FileNotFoundError:
                    out.append(None)
            return out

        datas = await trio.to_thread.run_sync(read_all)
        sent: list[tuple[Change, bytes]] = []
        grown: list[Change] = []
        for (change, _), data in zip(ready, datas, strict=True):
            if data is None:
                continue
            if len(data) > BATCH_MEMBER_MAX:
                grown.append(change)  # grew past the batch bound since the listing
            else:
                sent.append((change, data))
        results: dict[str, Digest] = {}
        if sent:
            answers = await self.client.upload_batch(self.scope, [d for _, d in sent])
            for (change, data), (digest, size) in zip(sent, answers, strict=True):
                assert change.inode is not None
                try:
                    after = self.store.get(change.inode).generation
                except KeyError:
                    continue
                if after != change.generation or size != len(data):
                    log.info("%s changed while it was uploaded; it stays dirty", change.path)
                    continue
                results[change.path] = Digest(digest)
        for change in grown:
            single = await self._upload(change)
            if single is not None:
                results[change.path] = single
        return results

    async def _upload(self, change: Change) -> Digest | None:
        """Stream one upper copy; None when it changed while being read (stays dirty)."""
        assert change.inode is not None
        ino = change.inode
        try:
            before = self.store.get(change.inode).generation
        except KeyError:
            return None  # unlinked since the listing: the next listing says delete
        if before != change.generation:
            return None
        # Read with the generation check above (no await in between): an
        # inline copy is exactly the content of that generation.
        inline = self.store.inline_data(change.inode)
        compressor = zstandard.ZstdCompressor(level=3)
        sent = 0

        async def frames() -> AsyncIterator[bytes]:
            nonlocal sent
            sent = 0  # called again for each attempt: count this attempt's bytes only
            if inline is not None:
                sent = len(inline)
                if inline:
                    # Decided on the first block: incompressible data goes up stored.
                    use = compressor if compressible(inline) else None
                    yield encode_frame(inline, use)  # at most INLINE_MAX < CHUNK_MAX
                yield END_FRAME
                return
            fh = await trio.to_thread.run_sync(self.store.upper.open_read, ino)

            def tally(n: int) -> None:
                nonlocal sent
                sent += n

            try:
                async for frame in file_frames(fh, compressor, tally):
                    yield frame
            finally:
                fh.close()

        try:
            digest, size = await self.client.upload_object(self.scope, frames)
        except FileNotFoundError:
            return None
        try:
            after = self.store.get(change.inode).generation
        except KeyError:
            return None
        if after != change.generation or size != sent:
            log.info("%s changed while it was uploaded; it stays dirty", change.path)
            return None
        return Digest(digest)


def raise_first_failure(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """One failed upload fails the checkpoint: raise the first fsagent or OS
    error of a nursery's group like a single failure (anything else, the
    group as it is)."""
    matched, _ = group.split((FsagentError, OSError))
    if matched is None:
        raise group
    first: BaseException = matched
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    raise first from group


def encode_first(
    raw: bytes, compressor: zstandard.ZstdCompressor
) -> tuple[bytes, zstandard.ZstdCompressor | None]:
    """The first frame of a file and the compressor for the rest of it: none
    when the first block does not compress (then every frame goes up stored)."""
    use = compressor if compressible(raw) else None
    return encode_frame(raw, use), use


async def checkpoint_loop(shipper: Shipper, interval: float, *, max_backoff: float = 300.0) -> None:
    """Ship every ``interval`` seconds; a failure is recorded and retried next time.

    Anything else that goes wrong (a bug) is logged with its traceback and
    retried with a growing delay, up to ``max_backoff``: never fatal to the
    mount, whose final save still runs at stop.
    """
    failures = 0
    delay = interval
    while True:
        await trio.sleep(delay)
        delay = interval
        started = time.monotonic()
        try:
            result = await shipper.ship_checkpoint()
        except SaveFailed as exc:
            log.warning("checkpoint failed (kept for the next one): %s", exc)
            continue
        except Exception:
            failures += 1
            delay = min(max_backoff, max(interval, 1.0) * 2**failures)
            log.exception("checkpoint failed unexpectedly; retrying in %.1fs", delay)
            continue
        failures = 0
        if result.entries:
            log.info(
                "checkpoint of %d entries in %.2fs", result.entries, time.monotonic() - started
            )
