"""Ship the journal to the controller as checkpoints.

One checkpoint, start to finish (:meth:`Shipper.ship_checkpoint`):

1. If a checkpoint was committed but its answer never arrived (the pending
   record says ``committing``), send exactly that body again under the same
   operation id: the controller answers with the original receipt and applies
   nothing twice, so a lost response can never overwrite a later writer.
   Only while the body can still succeed as stored: one stored under another
   lease epoch (an earlier run of this sandbox whose final save was fenced,
   or could not reach the controller at its stop) is met with ``stale_lease``
   however often it is sent, so it is dropped and its changes, which nothing
   acknowledged, are listed afresh (step 2) under a new operation id and this
   run's lease; so is a body the controller refused for what it holds
   (:data:`BODY_REFUSALS`: a limit, a malformed or too large body, content
   the run may not reference), which the agent can change.
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

Parts. The run may keep at most ``--max-pending-upload-bytes`` uploaded
but uncommitted (the controller's 429 ``upload_quota_exceeded``), so a change
set whose uploads exceed that allowance is committed in parts, steps 2 to 4
once per part: each part has its own operation id (durable before its
bytes), its own stored body and receipt, and is acknowledged before the
next part uploads anything, so a crash between two parts loses nothing and
sends nothing twice (the next listing holds only what no part saved). The
shipper learns the allowance from the run info (``maxPendingUploadBytes``,
asked once) and gives each part at most 1/:data:`PART_SHARE` of it, in path
order, first fit (a larger file up to the whole allowance goes alone).
Directories and references go with the first part, deletions with the last:
each part is a valid checkpoint, and a file deleted by a rename stays on the
controller until its new path is saved. Only the last part of a final save
says ``final``. Each part also names at most the run info's
``maxCheckpointEntries`` entries, creates at most ``maxCheckpointRows`` rows
(each path and its ancestors once, as the controller counts) and holds at
most :data:`PART_BODY_BYTES` of entries, so a change set of any size saves
(the agent folder's save excepted: it is one checkpoint, saved whole or
refused as a limit; the controller takes twice the
folder's entry limit in one): a deletion under a deleted directory is not
named (the directory's deletion takes its subtree to the trash) but is
acknowledged with it, and when the entries still need more than one part,
the deletions go first, so that no part leaves a folder holding more entries
than the change set does (old and new trees at once would meet the folder's
entry limit that the saved state is within). Whatever the plan, the
controller decides: a refusal of an upload by the allowance (a controller
that does not announce it, another folder of the run uploading too) is no
failure, the part commits what was uploaded and the rest goes in the next
part; when nothing fits (uploads that
no checkpoint of this folder can commit hold the allowance) the shipper
waits, with backoff, up to the client's retry deadline. A file larger than
the whole allowance is never sent: the other changes are saved and the save
fails with :data:`OVER_ALLOWANCE` (``fsagent status`` shows the code), at
each checkpoint, without a retry loop.

Everything the shipper reads or writes in the state dir goes through a
:class:`ShipState`: this one runs each step on the shipper's own loop, which
is the mount's in tests and for sources without a network; a mount with a
controller runs the shipper on a thread of its own (:mod:`fsagent.checkpoint.thread`),
so that hashing, compression, HTTP and JSON never delay a FUSE request.

If the dropped body was applied after all (an earlier run's commit whose
answer was lost), the checkpoint listed afresh sends its changes once more,
as a later save of the same changes, and the controller's rules make that
harmless (:mod:`controller.changeset`): a put names the digest the sandbox
holds, which is the one the lost commit wrote if the file has not changed
since (the row gets a new version, with the same bytes), else the newer
content; a delete of a path the lost commit deleted finds nothing live there
and does nothing (no version, no second trash entry); an mkdir of a
directory that exists does nothing. As for any later save, last writer wins:
a person's write to one of those paths between the two saves is overwritten
(a delete sends it to the trash). One case is not restated: a path the lost
commit changed that the sandbox then put back as the baseline has it (a new
file removed again; in a plain directory, a deleted file written again with
its old bytes) lists no change, so the controller keeps the lost commit's
version of it. Only a sandbox that changed such a path between a commit
whose answer was lost and the end of its run, and never saved again in that
run, gets there; at a stop, whose final save lists the state the agent left,
it does not arise.

At most one checkpoint is in flight (a trio lock). Transient failures
(network, 5xx, 429) are retried with backoff and jitter up to a deadline;
permanent refusals (403/404/409/422) stop at once and are recorded so
``fsagent status`` shows them. A ``stale_lease`` refusal or a 401 fences the
shipper: a newer run owns the folder or this run has ended, so nothing is
uploaded or committed again by this daemon (every later save fails at once,
without a request) and the state dir keeps every change.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, Final, NoReturn, Protocol, TypeVar

import trio
import zstandard

from common.bridge import (
    BATCH_MAX_BYTES,
    BATCH_MAX_MEMBERS,
    BATCH_MEMBER_MAX,
    CHUNK_MAX,
    END_FRAME,
    MAX_CHECKPOINT_BODY,
    MAX_CHECKPOINT_ENTRIES,
    MAX_CHECKPOINT_ROWS,
    compressible,
    encode_frame,
)
from common.errors import (
    AgentFilesLimitExceeded,
    CheckpointRowLimit,
    FolderEntryLimit,
    IdempotencyConflict,
    InvalidPath,
    PayloadTooLarge,
    StaleLease,
    UnknownContent,
    ValidationError,
    WorkFolderError,
)
from common.paths import ancestors
from common.types import Digest, FileVersion
from fsagent.bridge.base import BridgeClient, UploadAllowanceRefused
from fsagent.control.protocol import LIMIT_CODE
from fsagent.errors import ControllerRefused, FsagentError, SaveFailed
from fsagent.state.store import BaseEntry, Change, InodeNo, JournalSeq

log = logging.getLogger("fsagent.ship")

UPLOAD_CONCURRENCY = 8
"""Uploads in flight at once (a batch counts as one); memory stays bounded at
about one frame per single upload and one batch body per batch."""

LARGE_UPLOAD_CONCURRENCY = 3
"""Of those, single-file uploads: each is a stream of frames that keeps a core
busy on both ends (read and send here; decode, hash and write on the
controller). Ten 64 MiB files saved at 310-317 MB/s with eight in flight and
326-362 MB/s with three (bench.save, 2026-12-05, 2 cores)."""

BATCH_TARGET_MEMBERS = 256
BATCH_TARGET_BYTES = 4 << 20
"""A batch closes at this many files or bytes (within the contract's bounds):
several smaller batches keep both ends busy where one large one would not."""

PART_SHARE = 2
"""A part of a checkpoint uploads at most 1/PART_SHARE of the run's upload
allowance (a single larger file, up to the whole allowance, goes alone).
The allowance is the run's, shared by its four folders' daemons, and
uploads of an attempt that never committed (a crash, a refused commit)
keep counting until they expire: a part of the whole allowance would meet
429 whenever anything else waits."""

ALLOWANCE_ASK_SECONDS = 10.0
"""How long a checkpoint waits to learn the run's upload allowance (once
per shipper): without it, the parts follow the controller's refusals."""

OVER_ALLOWANCE: Final = "upload_over_allowance"
"""The stable code of a file larger than the run's whole upload allowance
(:class:`common.errors.UploadOverAllowance`): never saved by this run, the
other changes are; ``fsagent status`` shows it in ``lastError.code``."""

QUOTA_EXCEEDED: Final = "upload_quota_exceeded"
"""The code of a save given up because the allowance stayed taken by uploads
no checkpoint of this folder can commit (:class:`common.errors.UploadQuotaExceeded`)."""


BODY_REFUSALS: Final[tuple[type[WorkFolderError], ...]] = (
    AgentFilesLimitExceeded,
    FolderEntryLimit,
    CheckpointRowLimit,
    ValidationError,
    InvalidPath,
    PayloadTooLarge,
    UnknownContent,
    IdempotencyConflict,
)
"""Refusals of what a checkpoint body holds: sent again as it is, it would be
refused again, and it was not applied (the controller refuses these while
parsing the body, or after finding no receipt of its operation id, or, for
``idempotency_conflict``, because another request holds that id). The
stored body is dropped; the next checkpoint lists the changes afresh, so an
agent that removes files gets its next save through. A refusal of the run's
authority (a stale lease, a revoked member) is no such refusal: the body is
kept for the run that may still save it."""


def drops_the_body(exc: ControllerRefused) -> bool:
    """Whether the controller refused what the body holds (:data:`BODY_REFUSALS`)."""
    return any(exc.means(refusal) for refusal in BODY_REFUSALS)


T = TypeVar("T")


def batches(items: list[T], size_of: Callable[[T], int]) -> list[list[T]]:
    """Small uploads grouped into batches, by listed size (also used for
    repository checkpoints, :mod:`fsagent.repos.save`)."""
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


PART_BODY_BYTES: Final = MAX_CHECKPOINT_BODY // 2
"""Estimated JSON bytes of one part's entries at most (:meth:`PartRoom.take`),
well within the controller's body limit, whatever the paths' lengths."""

ENTRY_JSON_BYTES: Final = 128
"""An entry's JSON besides its path (op, digest, executable, separators)."""


class PartRoom:
    """What one part of a checkpoint may still name: ``entries`` entries that
    create at most ``rows`` rows, counted as the controller counts them (each
    path and each of its ancestors once, controller.quotas.checkpoint_row_bound),
    in at most ``body`` bytes of JSON. The first entry always fits, so every
    part makes progress. ``None``: no bound (an agent folder's save is one
    checkpoint, whole or refused, and the controller takes twice its limit)."""

    def __init__(self, entries: int | None, rows: int | None, body: int | None = None) -> None:
        self.entries = entries
        self.rows = rows
        self.body = body
        self.taken = 0
        self._bytes = 0
        self._seen: set[str] = set()

    def take(self, path: str) -> bool:
        """Count ``path`` in this part if it fits; False (nothing counted) if not."""
        if self.entries is None:
            self.taken += 1
            return True
        new = [p for p in (path, *ancestors(path)) if p not in self._seen]
        size = len(json.dumps(path)) + ENTRY_JSON_BYTES
        if self.taken and (
            self.taken >= self.entries
            or (self.rows is not None and len(self._seen) + len(new) > self.rows)
            or (self.body is not None and self._bytes + size > self.body)
        ):
            return False
        self._seen.update(new)
        self._bytes += size
        self.taken += 1
        return True

    def take_while(
        self, items: list[list[Change]]
    ) -> tuple[list[list[Change]], list[list[Change]]]:
        """The leading units of ``items`` that fit (a unit is named by its
        first change), and the rest."""
        for i, unit in enumerate(items):
            if not self.take(unit[0].path):
                return items[:i], items[i:]
        return items, []


def plan_part(
    uploads: list[Change], budget: int | None, room: PartRoom | None = None
) -> tuple[list[Change], list[Change]]:
    """The uploads of the next part of a checkpoint, and the rest: first fit in
    listed (path) order within ``budget`` bytes (None: all of them) and
    ``room``; the first upload goes whatever its size, so every part makes
    progress."""
    part: list[Change] = []
    rest: list[Change] = []
    total = 0
    for change in uploads:
        fits = budget is None or not part or total + change.size <= budget
        if fits and (room is None or room.take(change.path)):
            part.append(change)
            total += change.size
        else:
            rest.append(change)
    return part, rest


def delete_units(deletes: Iterable[Change]) -> list[list[Change]]:
    """Deletions grouped under the deleted directory that covers them, in path
    order: a unit's first change is the one the checkpoint names; the others
    (its subtree, deleted too) are acknowledged with it, not named, since the
    controller sends a deleted directory's whole subtree to the trash."""
    units: list[list[Change]] = []
    cover: str | None = None
    for change in by_path(c for c in deletes if c.action == "delete"):
        if cover is not None and change.path.startswith(cover + "/"):
            units[-1].append(change)
            continue
        units.append([change])
        is_dir = change.base is not None and change.base.kind == "directory"
        cover = change.path if is_dir else None
    return units


def flat(units: Iterable[list[Change]]) -> list[Change]:
    return [change for unit in units for change in unit]


def by_path(changes: Iterable[Change]) -> list[Change]:
    """Sorted as the change set lists them (UTF-8 bytes): parents before children."""
    return sorted(changes, key=lambda c: c.path.encode("utf-8"))


@dataclass
class Uploaded:
    """What :meth:`Shipper._upload_all` did with a part's uploads."""

    digests: dict[str, Digest] = field(default_factory=dict)
    """Path → the digest the controller computed, for each file uploaded whole."""
    deferred: list[Change] = field(default_factory=list)
    """Refused by the run's allowance for now (or not started after such a
    refusal): they go in a later part."""
    over: list[Change] = field(default_factory=list)
    """Larger than the whole allowance (the controller's 413): no part of this
    save can take them."""


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
    seconds: float = 0.0
    """From the request to the receipt in the daemon, a wait for the checkpoint
    in flight included: what a save costs without the asking process's start."""
    parts: int = 0
    """Commits this save took: more than one when its uploads did not fit the
    run's upload allowance at once (``operation_id`` and ``receipt`` are the
    last part's; ``entries`` counts them all)."""
    byte_size: int | None = None
    """Bytes of the files saved, over all parts (the receipts' ``byteSize``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "operationId": self.operation_id,
            "entries": self.entries,
            "skippedTorn": self.skipped_torn,
            "receipt": self.receipt,
            "seconds": round(self.seconds, 4),
            "parts": self.parts,
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


Shipped = list[tuple[Change, Digest | None, FileVersion]]
"""What a receipt acknowledges: each change, the digest saved for it, the version."""


class HasGeneration(Protocol):
    @property
    def generation(self) -> int: ...


class ContentReader(Protocol):
    def open_read(self, ino: int) -> BinaryIO: ...


class ShipJournal(Protocol):
    """The checkpoint records of a state dir (:class:`fsagent.state.journal.Journal`)."""

    def pending_checkpoint(self) -> dict[str, Any] | None: ...

    def set_pending_checkpoint(self, record: dict[str, Any] | None) -> None: ...

    def record_save_error(self, message: str, code: str | None = None) -> None: ...

    def save_status(self) -> dict[str, Any]: ...


class ShipStore(Protocol):
    """What the shipper reads and writes of a collection's state: a FUSE
    mount's :class:`fsagent.state.store.Store` (the journal, inodes and ``upper/``)
    or a plain directory's :class:`fsagent.dirmode.store.DirStore` (a scan; files
    read from the directory). Both keep their checkpoint records in
    ``journal``. An upload's ``inode`` and ``generation`` are whatever ``get``
    and ``upper`` understand: the shipper only compares the generation before
    and after reading."""

    @property
    def upper(self) -> ContentReader: ...

    @property
    def journal(self) -> ShipJournal: ...

    def changes_since_baseline(self) -> list[Change]: ...

    def get(self, ino: int) -> HasGeneration: ...

    def inline_data(self, ino: InodeNo) -> bytes | None: ...

    def finish_checkpoint(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], receipt: dict[str, Any]
    ) -> int: ...


class ShipState:
    """The shipper's view of the state dir, on the loop that serves the mount.

    Every step runs on the calling loop, as a FUSE handler would, so each is
    atomic with respect to the handlers: the in-memory inodes are the truth.
    :class:`fsagent.checkpoint.thread.ThreadState` keeps the same contract for a
    shipper on another thread.
    """

    def __init__(self, store: ShipStore) -> None:
        self.store = store

    @property
    def upper(self) -> ContentReader:
        return self.store.upper

    async def pending(self) -> dict[str, Any] | None:
        return self.store.journal.pending_checkpoint()

    async def changes(self) -> list[Change]:
        return self.store.changes_since_baseline()

    async def set_pending(self, record: dict[str, Any] | None) -> None:
        """Durable before it returns (operation ids before bytes)."""
        self.store.journal.set_pending_checkpoint(record)

    async def contents(self, changes: list[Change]) -> list[tuple[Change, bytes | None]]:
        """The uploads still at their listed write generation, each with its
        inline contents read at that generation (None: the file is in ``upper/``)."""
        out: list[tuple[Change, bytes | None]] = []
        for change in changes:
            assert change.inode is not None
            try:
                if self.store.get(change.inode).generation != change.generation:
                    continue
            except KeyError:
                continue  # unlinked since the listing: the next listing says delete
            out.append((change, self.store.inline_data(change.inode)))
        return out

    async def unchanged(self, changes: list[Change]) -> list[bool]:
        """Whether each upload is still at its listed write generation (read
        after its bytes were sent: anything written meanwhile is torn)."""
        return live_unchanged(self.store, changes)

    async def finish(self, shipped: Shipped, receipt: dict[str, Any]) -> None:
        self.store.finish_checkpoint(shipped, receipt)

    async def record_error(self, message: str, code: str | None = None) -> None:
        self.store.journal.record_save_error(message, code)

    async def failed(self) -> bool:
        """Whether the last save failed (``fsagent status`` shows ``lastError``)."""
        return "lastError" in self.store.journal.save_status()


class Checkpoints(Protocol):
    """What the mount asks of its checkpoints: a :class:`Shipper` on the mount's
    loop, or one on a thread of its own (:class:`fsagent.checkpoint.thread.ShipThread`)."""

    async def ship_checkpoint(self, *, final: bool = False) -> SaveResult: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def last_checkpoint(self) -> dict[str, Any] | None: ...


def live_unchanged(store: ShipStore, changes: list[Change]) -> list[bool]:
    """Whether each upload's live inode is still at its listed write generation;
    on the mount's loop (it reads the in-memory inodes)."""
    out = []
    for change in changes:
        assert change.inode is not None
        try:
            out.append(store.get(change.inode).generation == change.generation)
        except KeyError:
            out.append(False)
    return out


class Shipper:
    """Checkpoints for one collection; owned by the daemon that serves the mount."""

    def __init__(
        self,
        store: ShipStore,
        client: BridgeClient,
        scope: str,
        lease_epoch: int,
        *,
        state: ShipState | None = None,
    ) -> None:
        self.state = ShipState(store) if state is None else state
        self.client = client
        self.scope = scope
        self.lease_epoch = lease_epoch
        self._lock = trio.Lock()
        self.fenced: str | None = None
        """Why the controller fenced this run off (stale lease, or a 401: the run
        ended); None while shipping."""
        self.last_checkpoint: dict[str, Any] | None = None
        """Duration, entries and bytes of the last checkpoint that committed."""
        self.upload_allowance: int | None = None
        """The run's allowance of uncommitted upload bytes, once known (the run
        info's ``maxPendingUploadBytes``, or a refusal's ``limit``)."""
        self._allowance_asked = False
        self.checkpoint_entries: int | None = None
        self.checkpoint_rows: int | None = None
        """The run info's bounds of one checkpoint, once known (module docstring, "Parts")."""

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def queue_depth(self) -> int:
        """Checkpoints in flight or waiting for the one in flight."""
        return int(self.busy) + self._lock.statistics().tasks_waiting

    async def ship_checkpoint(self, *, final: bool = False) -> SaveResult:
        """Save everything changed since the baseline; raises SaveFailed."""
        asked = trio.current_time()
        async with self._lock:
            if self.fenced is not None:
                message = f"not saved, {self.fenced}"
                await self.state.record_error(message)
                raise SaveFailed(message, refused=True)
            try:
                started = trio.current_time()
                result = await self._ship(final=final)
                if result.receipt is not None:
                    self.last_checkpoint = {
                        "seconds": round(trio.current_time() - started, 3),
                        "entries": result.entries,
                        "bytes": result.byte_size,
                    }
                return replace(result, seconds=trio.current_time() - asked)
            except (FsagentError, OSError) as exc:
                message = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ControllerRefused) and exc.fences_the_run:
                    why = (
                        "a newer run holds the lease"
                        if exc.means(StaleLease)
                        else "the run has ended or was superseded"
                    )
                    self.fenced = f"{why}: {message}"
                code = exc.code if isinstance(exc, ControllerRefused) else None
                await self.state.record_error(message, code)
                over_limit = isinstance(exc, ControllerRefused) and exc.means(
                    AgentFilesLimitExceeded
                )
                if isinstance(exc, ControllerRefused) and drops_the_body(exc):
                    # This body was not applied and never will be (a storage
                    # limit, for one, is checked only for an operation the
                    # controller has no receipt of). The next checkpoint lists
                    # the changes afresh (the agent may have cleaned up) under
                    # a new operation id.
                    await self.state.set_pending(None)
                # A storage limit is a warning of the run, which the controller
                # keeps with the refusal; it does not make the run a failed one.
                recorded = isinstance(exc, ControllerRefused) and exc.recorded
                if not over_limit:
                    # A refused commit has its receipt on the controller
                    # already; any other failure (network, 5xx, an I/O error
                    # here, an upload refused, a file over the allowance) is
                    # reported for this folder, where it stands until the
                    # folder saves again (another folder's save does not
                    # clear it). A fenced run can report nothing. The final
                    # save's attempts get one explicit, final failure
                    # receipt once they are given up (fsagent.checkpoint.lifecycle).
                    own_receipt = recorded or final or self.fenced is not None
                    scope = None if own_receipt else self.scope
                    with trio.move_on_after(10):
                        try:
                            await self.client.report_state("failed", message, scope=scope)
                        except FsagentError as report_exc:
                            log.warning("could not report the failed save: %s", report_exc)
                # A 429 (the run's upload allowance held by uploads not this
                # save's to commit) may pass: a later attempt can succeed.
                refused = isinstance(exc, ControllerRefused) and exc.status != 429
                limit = exc.details if isinstance(exc, ControllerRefused) and over_limit else None
                raise SaveFailed(
                    message,
                    refused=refused,
                    over_limit=over_limit,
                    details=limit,
                    recorded=recorded,
                ) from exc

    async def _ship(self, *, final: bool) -> SaveResult:
        pending = await self.state.pending()
        replayed: SaveResult | None = None
        if pending is not None and pending.get("state") == "committing":
            stored_epoch = pending["body"].get("leaseEpoch")
            if stored_epoch != self.lease_epoch:
                # Another run's body (module docstring, step 1): the controller
                # fences it, so it is listed again below, never replayed.
                log.info(
                    "checkpoint %s was stored under lease epoch %s, this run holds %s:"
                    " its changes are listed again under a new operation id",
                    pending["operationId"],
                    stored_epoch,
                    self.lease_epoch,
                )
                await self.state.set_pending(None)
            else:
                # The answer to this body may have been lost: replay it verbatim.
                # (A part of a larger save: the parts after it are listed below.)
                receipt = await self._commit(pending)
                if pending["body"].get("final"):
                    # It was a final save already: no second, empty one after it.
                    count = len(pending["body"]["entries"])
                    replayed = SaveResult(
                        pending["operationId"], count, 0, receipt, 0, 1, receipt.get("byteSize")
                    )
            pending = None
        changes = await self.state.changes()
        if not changes and (replayed is not None or not (final or await self.state.failed())):
            return replayed or SaveResult(None, 0, 0, None)
        # Nothing to send after a failed save (the final one of an earlier run,
        # say): an empty checkpoint, so that both this status and the
        # controller's show the folder saved again, not the old failure.
        op_id = pending["operationId"] if pending else new_operation_id()
        return await self._ship_parts(changes, op_id, final=final)

    async def _ship_parts(self, changes: list[Change], op_id: str, *, final: bool) -> SaveResult:
        """Ship ``changes`` as one checkpoint, or in parts when their uploads do
        not fit the run's upload allowance at once (module docstring, "Parts").

        Each part is a checkpoint of its own: its operation id durable before
        its bytes, its body stored before its commit, acknowledged before the
        next part starts. Directories and references go with the first part,
        deletions with the last (first when the entries alone need several
        parts), the uploads in between in path order; no part names more
        entries or rows than the run info allows."""
        uploads = [c for c in changes if c.action == "upload"]
        early = [[c] for c in changes if c.action in ("mkdir", "reference")]
        deletes = delete_units([c for c in changes if c.action == "delete"])
        if uploads or len(early) + len(deletes) > 1:
            await self._learn_allowance()
        remaining, over = self._within_allowance(uploads)
        max_entries, max_rows = self._entry_bounds()
        # Deletions first when the entries need several parts anyway (module
        # docstring, "Parts"): otherwise with the last part.
        lead: list[list[Change]] = []
        if max_entries is not None and len(early) + len(uploads) + len(deletes) > max_entries:
            lead, deletes = deletes, []
        parts: list[SaveResult] = []
        torn = 0
        stuck_since: float | None = None
        waits = 0
        while True:
            budget = self._part_budget()
            room = PartRoom(max_entries, max_rows, None if max_entries is None else PART_BODY_BYTES)
            head, lead = room.take_while(lead)
            if not lead:
                more, early = room.take_while(early)
                head += more
            part: list[Change] = []
            if not lead and not early:
                part, remaining = plan_part(remaining, budget, room)
            await self.state.set_pending({"operationId": op_id, "state": "uploading"})
            outcome = await self._upload_all(part)
            remaining, newly_over = self._within_allowance(by_path([*outcome.deferred, *remaining]))
            over += outcome.over + newly_over
            uploaded = [c for c in part if c.path in outcome.digests]
            unsent = {c.path for c in outcome.deferred} | {c.path for c in outcome.over}
            torn += sum(1 for c in part if c.path not in outcome.digests and c.path not in unsent)
            # Nothing of this part fit: the allowance is held by uploads this
            # save cannot commit (another folder's, an earlier attempt's).
            stuck = bool(outcome.deferred) and not uploaded
            give_up = False
            if stuck:
                now = trio.current_time()
                stuck_since = now if stuck_since is None else stuck_since
                give_up = now - stuck_since >= self.client.retry_deadline
            else:
                stuck_since, waits = None, 0
            tail: list[list[Change]] = []
            if not lead and not early and (not remaining or give_up):
                tail, deletes = room.take_while(deletes)
            last = not lead and not early and not deletes and (not remaining or give_up)
            listed = by_path([*flat(head), *uploaded, *flat(tail)])
            # Deleted with their directory's subtree (delete_units): acknowledged, not named.
            covered = {c.path for unit in (*head, *tail) for c in unit[1:]}
            complete = last and not remaining and not over
            if listed or (last and not parts and complete):
                if len(parts) or not last:
                    log.info(
                        "checkpoint part %d: %d file(s), %d bytes, within the run's upload"
                        " allowance of %s bytes",
                        len(parts) + 1,
                        len(uploaded),
                        sum(c.size for c in uploaded),
                        self.upload_allowance,
                    )
                parts.append(
                    await self._commit_part(
                        op_id,
                        listed,
                        outcome.digests,
                        final=final and complete,
                        final_save=final,
                        covered=covered,
                    )
                )
                op_id = new_operation_id()
            if last:
                break
            if stuck:
                waits += 1
                delay = random.uniform(0.5, 1.0) * min(5.0, 0.2 * 2**waits)
                log.info(
                    "the run's upload allowance is held by uploads waiting for other"
                    " checkpoints; %d file(s) wait %.2fs",
                    len(remaining),
                    delay,
                )
                await trio.sleep(delay)
        if over:
            raise over_allowance(over, self.upload_allowance, waiting=len(remaining))
        if remaining:
            raise UploadAllowanceRefused(
                f"{len(remaining)} file(s) not saved: the run's upload allowance"
                f" ({self.upload_allowance} bytes) stayed taken by uploads no checkpoint"
                f" of this folder can commit for {self.client.retry_deadline:.0f}s",
                429,
                QUOTA_EXCEEDED,
                limit=self.upload_allowance,
            )
        sizes = [p.byte_size for p in parts if p.byte_size is not None]
        last_part = parts[-1] if parts else SaveResult(None, 0, 0, None)
        return SaveResult(
            last_part.operation_id,
            sum(p.entries for p in parts),
            torn,
            last_part.receipt,
            parts=len(parts),
            byte_size=sum(sizes) if sizes else None,
        )

    async def _learn_allowance(self) -> None:
        """Ask the run for its upload allowance, once per shipper (the run
        info's ``maxPendingUploadBytes``). A failure is no failure of the
        save: without it, parts follow the controller's refusals."""
        if self._allowance_asked:
            return
        with trio.move_on_after(ALLOWANCE_ASK_SECONDS):
            try:
                run = await self.client.get_run()
            except FsagentError as exc:
                log.info("the run's upload allowance is not known yet: %s", exc)
                return
            self._allowance_asked = True
            if run.upload_allowance is not None:
                self.upload_allowance = run.upload_allowance
            self.checkpoint_entries = run.checkpoint_entries
            self.checkpoint_rows = run.checkpoint_rows

    def _entry_bounds(self) -> tuple[int | None, int | None]:
        """Entries one part may name and rows it may create: the run info's,
        else the controller's defaults; no bound for the agent folder, whose
        save is one checkpoint (:class:`PartRoom`)."""
        if self.scope == "agent":
            return None, None
        return (
            self.checkpoint_entries or MAX_CHECKPOINT_ENTRIES,
            self.checkpoint_rows or MAX_CHECKPOINT_ROWS,
        )

    def _part_budget(self) -> int | None:
        if self.upload_allowance is None:
            return None
        return max(1, self.upload_allowance // PART_SHARE)

    def _within_allowance(self, uploads: list[Change]) -> tuple[list[Change], list[Change]]:
        """(uploads that fit the whole allowance, those larger): a file over it
        is never sent, since no commit can make room for it."""
        limit = self.upload_allowance
        if limit is None:
            return uploads, []
        return [c for c in uploads if c.size <= limit], [c for c in uploads if c.size > limit]

    def _learn_from(self, exc: UploadAllowanceRefused, sent: int) -> None:
        """The allowance a refusal names; for a request over the whole allowance
        without a figure, less than what was sent (parts then shrink)."""
        if exc.limit is not None:
            self.upload_allowance = exc.limit
        elif exc.code == OVER_ALLOWANCE and sent > 1:
            self.upload_allowance = min(self.upload_allowance or sent, sent - 1)

    async def _commit_part(
        self,
        op_id: str,
        changes: list[Change],
        digests: dict[str, Digest],
        *,
        final: bool,
        final_save: bool = False,
        covered: frozenset[str] | set[str] = frozenset(),
    ) -> SaveResult:
        """Build one part's body from ``changes`` (uploads with their digests),
        store it (state ``committing``), send it and acknowledge its receipt.
        The deletions at ``covered`` are acknowledged without being named:
        a directory deleted in the same part takes them (:func:`delete_units`).
        ``final``: the last part of a final save; ``final_save``: any part of one."""
        entries: list[dict[str, Any]] = []
        shipped: list[list[Any]] = []
        for change in changes:
            if change.path in covered:
                shipped.append([*change_to_json(change), None])
            elif change.action in ("upload", "reference"):
                digest = digests[change.path] if change.action == "upload" else change.digest
                entries.append(
                    {
                        "op": "put",
                        "path": change.path,
                        "digest": digest,
                        "executable": change.executable,
                    }
                )
                shipped.append([*change_to_json(change), digest])
            else:
                entries.append({"op": change.action, "path": change.path})
                shipped.append([*change_to_json(change), None])
        body = {
            "operationId": op_id,
            "leaseEpoch": self.lease_epoch,
            "final": final,
            "entries": entries,
            **self.body_extras(),
        }
        if final_save:
            # Every part of a final save says so: a refused part is the final
            # save's receipt, whichever part it was (only the last is final).
            body["finalSave"] = True
        record = {"operationId": op_id, "state": "committing", "body": body, "shipped": shipped}
        await self.state.set_pending(record)
        receipt = await self._commit(record)
        return SaveResult(op_id, len(entries), 0, receipt, 0, 1, receipt.get("byteSize"))

    def body_extras(self) -> dict[str, Any]:
        """Fields a mode adds to each checkpoint body, each part of one included
        (dir mode: its scan's refusals, which each receipt then names); none for
        a FUSE mount, whose kernel side refused at write time."""
        return {}

    async def _commit(self, record: dict[str, Any]) -> dict[str, Any]:
        try:
            receipt = await self.client.commit_checkpoint(self.scope, record["body"])
        except ControllerRefused as exc:
            exc.recorded = True  # the controller keeps a receipt of a refused commit
            raise
        # Entries the folder refused one by one (the agent's instruction entry)
        # were not saved: they stay in the journal, unsaved, for the next checkpoint.
        refused = {str(r.get("path")) for r in receipt.get("refusedEntries") or []}
        for r in receipt.get("refusedEntries") or []:
            log.warning("%s was not saved: %s %s", r.get("path"), r.get("code"), r.get("message"))
        shipped = [
            (change_from_json(raw[:-1]), raw[-1], FileVersion(int(receipt["highWater"])))
            for raw in record["shipped"]
            if not refused or (raw[0] not in refused and refused.isdisjoint(ancestors(raw[0])))
        ]
        await self.state.finish(shipped, receipt)
        log.info(
            "checkpoint %s saved: %d entries (high water %s)",
            record["operationId"],
            len(shipped),
            receipt.get("highWater"),
        )
        return receipt

    async def _upload_all(self, changes: list[Change]) -> Uploaded:
        """Upload several files at once: each answer waits for a durable store on
        the controller, so one at a time would leave the link idle. Small files
        go up many per request (:meth:`_upload_batch`), the others one each.

        A refusal by the run's upload allowance fails no upload: the file (or
        batch) is deferred to a later part, and so is every upload not started
        yet once the allowance said no (those in flight finish)."""
        out = Uploaded()
        limiter = trio.CapacityLimiter(UPLOAD_CONCURRENCY)
        streams = trio.CapacityLimiter(LARGE_UPLOAD_CONCURRENCY)
        small = [c for c in changes if c.size <= BATCH_MEMBER_MAX]
        large = [c for c in changes if c.size > BATCH_MEMBER_MAX]
        full = False

        def refused(exc: UploadAllowanceRefused, group: list[Change]) -> None:
            nonlocal full
            self._learn_from(exc, sum(c.size for c in group))
            if exc.code == OVER_ALLOWANCE and len(group) == 1:
                out.over.extend(group)  # this file alone is over the whole allowance
                return
            if exc.code != OVER_ALLOWANCE:
                full = True
            out.deferred.extend(group)

        async def one(change: Change) -> None:
            async with streams, limiter:
                if full:
                    out.deferred.append(change)
                    return
                try:
                    digest = await self._upload(change)
                except UploadAllowanceRefused as exc:
                    refused(exc, [change])
                    return
            if digest is not None:
                out.digests[change.path] = digest

        async def batch(group: list[Change]) -> None:
            async with limiter:
                if full:
                    out.deferred.extend(group)
                    return
                try:
                    out.digests.update(await self._upload_batch(group))
                except UploadAllowanceRefused as exc:
                    refused(exc, group)

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
        return out

    async def _upload_batch(self, group: list[Change]) -> dict[str, Digest]:
        """One request for many small files, with the same torn-read rule as
        :meth:`_upload`: a file written to since it was listed is left out."""
        ready = await self.state.contents(group)
        upper = self.state.upper

        def read_all() -> list[bytes | None]:
            out: list[bytes | None] = []
            for change, inline in ready:
                if inline is not None:
                    out.append(inline)
                    continue
                assert change.inode is not None
                try:
                    with upper.open_read(change.inode) as fh:
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
            still = await self.state.unchanged([change for change, _ in sent])
            for (change, data), (digest, size), same in zip(sent, answers, still, strict=True):
                if not same or size != len(data):
                    log.info("%s changed while it was uploaded; it stays dirty", change.path)
                    continue
                results[change.path] = Digest(digest)
        for change in grown:
            try:
                single = await self._upload(change)
            except UploadAllowanceRefused as exc:
                # Planned by its listed size, refused at its new one: it changed
                # since the listing, so it stays dirty and the next listing
                # plans it (or refuses it) by what it is now.
                log.info("%s grew while listed and stays dirty: %s", change.path, exc)
                continue
            if single is not None:
                results[change.path] = single
        return results

    async def _upload(self, change: Change) -> Digest | None:
        """Stream one upper copy; None when it changed while being read (stays dirty)."""
        assert change.inode is not None
        ino = change.inode
        ready = await self.state.contents([change])
        if not ready:
            return None  # written or unlinked since the listing: stays dirty
        # Read at the listed generation: an inline copy is exactly its content.
        inline = ready[0][1]
        upper = self.state.upper
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
            fh = await trio.to_thread.run_sync(upper.open_read, ino)

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
        if not (await self.state.unchanged([change]))[0] or size != sent:
            log.info("%s changed while it was uploaded; it stays dirty", change.path)
            return None
        return Digest(digest)


def new_operation_id() -> str:
    return f"cp-{uuid.uuid4()}"


def over_allowance(files: list[Change], limit: int | None, *, waiting: int) -> ControllerRefused:
    """The refusal of files larger than the run's whole upload allowance: the
    controller's code (:data:`OVER_ALLOWANCE`), decided here without sending
    their bytes once the allowance is known. ``waiting``: other files the
    allowance had no room for (given up on meanwhile)."""
    shown = ", ".join(f"{c.path} ({c.size} bytes)" for c in files[:5])
    more = f" and {len(files) - 5} more" if len(files) > 5 else ""
    rest = (
        f"; {waiting} other file(s) found no room in the allowance and wait too"
        if waiting
        else "; the other changes were saved"
    )
    return ControllerRefused(
        f"{OVER_ALLOWANCE}: {shown}{more} not saved: larger than the run's upload"
        f" allowance of {limit} bytes (--max-pending-upload-bytes){rest}",
        413,
        OVER_ALLOWANCE,
    )


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


async def checkpoint_loop(
    shipper: Checkpoints, interval: float, *, max_backoff: float = 300.0
) -> None:
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


STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals a daemon answers with its final save and a clean stop, in
both modes (a receiver of them is opened before the daemon says it is ready)."""


@dataclass
class FinalSave:
    """How a daemon's stop boundary ended (FUSE: fsagent.fuse.mount.StopState; dir
    mode: fsagent.dirmode.serve.DirStop): ``saved`` is False when the final save did
    not save.

    ``attempts``: final saves tried before giving up on failures that are not
    refusals (the agent folder contract's three; one otherwise, whose own
    retries run until ``--retry-deadline``). ``report_scope``: with the
    contract, the folder whose given-up final save gets an explicit failure
    receipt on the controller. ``limit_warning``: with the contract, the
    controller refused the final save over the agent folder's storage limit:
    a recorded refusal (its receipt, the run's warning), not a failed save
    (a non-blocking warning), so ``ok`` holds and the
    daemon exits 0.
    """

    saved: bool = True
    error: str | None = None
    final_done: bool = False
    attempts: int = 1
    report_scope: str | None = None
    limit_warning: str | None = None

    @property
    def ok(self) -> bool:
        """Saved, or refused over an agent folder's storage limit (a warning)."""
        return self.saved or self.limit_warning is not None

    def flush_reply(self) -> dict[str, Any]:
        """The answer to ``fsagent flush --final`` (protocol: fsagent.control.protocol);
        a refusal over the storage limit carries its code, as a flush that is
        not final does (fsagent.control.protocol.limit_reply)."""
        reply: dict[str, Any] = {
            "ok": self.ok,
            "saved": self.saved,
            "error": None if self.ok else self.error,
            "warning": self.limit_warning,
            "final": True,
        }
        if self.limit_warning is not None:
            reply["code"] = LIMIT_CODE
        return reply


def limit_warning(exc: SaveFailed, contract: bool) -> str | None:
    """The warning a final save refused over a storage limit leaves under the
    agent folder contract (the next run gets the folder as last saved); None
    for any other failure, which stays a failed save."""
    if not (contract and exc.over_limit):
        return None
    return (
        "agent folder not saved, over its storage limit (recorded in the run's"
        f" receipt; the next run gets the folder as last saved): {exc}"
    )
