"""Uploads over the bridge: one object per request, or many small ones.

Contract: ``PUT /bridge/v1/folders/{scope}/uploads`` and ``.../uploads/batch``
in :mod:`common.bridge`; the repository routes (:mod:`common.repos`) take the
same bodies. The callers differ only in the authority re-checked when an
upload is registered (:data:`Confirm`) and in how long an uncommitted upload
pins its object.

A single upload (:func:`receive_upload`) streams its frames into a spool
file while hashing, reserves its bytes against the run's quotas, stores the
object and registers it in one transaction.

The batch is a transport only: every member becomes its
own object under its own digest, exactly as a single upload would store it.

1. The body streams through :class:`common.wire.BatchSplitter` (bounds
   checked before any decompression) into one spool file for the batch; each
   member is decoded, hashed and appended in a worker thread, one thread hop
   per received piece of the body, never per member. A member whose bytes are
   not its declared size and SHA-256 refuses the whole batch (422).
2. Only once every member is verified: the run's quotas, reserved
   atomically across replicas (:func:`controller.quotas.reserved`), then
   ``StorageProvider.put_spans`` stores every new object with one sync for
   the batch (local_disk: one ``syncfs``).
3. One transaction registers every member (:func:`controller.runs.record_uploads`)
   and settles the reservation; a failure anywhere releases it.
   It asks storage again only for members a GC sweep may have deleted since
   step 2 (the store mark taken before it, :func:`controller.foldercore.upsert_objects`),
   so a batch costs no storage request beyond its puts. If it fails, the
   objects this batch created are journalled for GC, which keeps any that
   something references.

Nothing is registered before step 3, so a refused or interrupted batch
leaves no upload a checkpoint could reference.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from starlette.requests import Request

from common.errors import DigestMismatch, PayloadTooLarge, StorageUnavailable
from common.wire import (
    BatchSplitter,
    Frame,
    FrameSplitter,
    Member,
    MemberEnd,
    decode_frame,
)
from controller import foldercore, quotas, runs
from controller.api.common import connection, state, transact, write_transaction
from controller.api.objects import (
    Body,
    journal_orphan,
    journal_orphans,
    open_spool,
    put_object,
    reupload_if_missing,
    spool_append,
)
from controller.auth import RunBinding
from controller.foldercore import Authority
from controller.storage.base import Span, StorageProvider, object_key

Confirm = Authority
"""Raises unless the run may still register this upload; runs inside the
registering transaction (the run's lease, and what the route is about)."""


def store_frame(frame: Frame, fd: int, hasher: Any) -> None:
    """Decode, verify, hash and spool one frame: CPU and disk work, run in a thread."""
    spool_append(fd, hasher, decode_frame(frame))


async def receive_upload(
    request: Request, run: RunBinding, confirm: Confirm, ttl: float
) -> dict[str, Any]:
    """Spool, verify, store and register one framed upload; its answer
    ``{"digest", "byteSize"}``. The upload pins its object for ``ttl`` seconds
    until a checkpoint commits it."""
    st = state(request)
    hint = request.headers.get("x-content-sha256")
    hint_len = request.headers.get("x-content-length")
    limit = st.settings.max_file_bytes
    splitter = FrameSplitter()
    size = 0
    fd, spool = await open_spool(st.settings.spool_dir, "bridge-")
    hasher = hashlib.sha256()
    try:
        try:
            async for chunk in request.stream():
                for frame in splitter.feed(chunk):
                    # Checked on the declared length, before any decompression.
                    size += frame.raw_len
                    if size > limit:
                        raise PayloadTooLarge(f"Files are limited to {limit} bytes")
                    await asyncio.to_thread(store_frame, frame, fd, hasher)
        finally:
            os.close(fd)
        splitter.finish()
        digest = hasher.hexdigest()
        if (hint is not None and hint != digest) or (
            hint_len is not None and hint_len != str(size)
        ):
            raise DigestMismatch(details=[{"digest": digest, "byteSize": size}])
        async with quotas.reserved(
            transact(request), run.company_id, run.run_id, {digest: size}, st.settings.quotas
        ) as reservation:
            async with connection(request) as conn:
                mark = await foldercore.take_store_mark(conn)
            key = object_key(run.company_id, digest)
            body = Body(size, digest, path=spool)
            created_blob = await put_object(request, key, body)
            ensure = reupload_if_missing(request, body)

            async def register(conn: AsyncConnection[Any]) -> None:
                await confirm(conn)
                await runs.record_upload(
                    conn,
                    run.run_id,
                    run.company_id,
                    digest,
                    size,
                    ensure,
                    st.settings.gc_delay,
                    ttl,
                    stored_after=mark,
                )
                await quotas.settle(conn, reservation)

            try:
                await write_transaction(request, register)
            except BaseException:
                if created_blob:
                    await journal_orphan(request, run.company_id, digest)
                raise
    finally:
        # Unlinking one spool file is a single metadata update; a thread hop
        # here would also be skipped on cancellation, leaking the file.
        spool.unlink(missing_ok=True)
    return {"digest": digest, "byteSize": size}


@dataclass
class _Spooler:
    """Decodes batch items into one spool file, recording each member's span."""

    fd: int
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    """(offset, size, sha256 hex) per member, in order."""
    offset: int = 0
    _member: Member | None = None
    _start: int = 0
    _hasher: Any = None

    def take(self, items: Iterable[Member | Frame | MemberEnd]) -> None:
        """CPU and disk work for a piece of the body: runs in a worker thread."""
        for item in items:
            if isinstance(item, Member):
                self._member, self._start = item, self.offset
                self._hasher = hashlib.sha256()
            elif isinstance(item, Frame):
                raw = decode_frame(item)
                spool_append(self.fd, self._hasher, raw)
                self.offset += len(raw)
            else:
                assert self._member is not None
                digest = self._hasher.hexdigest()
                if digest != self._member.sha256.hex():
                    raise DigestMismatch(
                        f"batch member {len(self.spans)} does not hash to its declared digest",
                        details=[{"member": len(self.spans), "digest": digest}],
                    )
                self.spans.append((self._start, self.offset - self._start, digest))
                self._member = None


async def receive_batch(
    request: Request, run: RunBinding, confirm: Confirm, ttl: float
) -> list[dict[str, Any]]:
    """Spool, verify, store and register one batch; the answer's ``objects``."""
    st = state(request)
    splitter = BatchSplitter()
    fd, spool = await open_spool(st.settings.spool_dir, "batch-")
    spooler = _Spooler(fd)
    try:
        try:
            async for chunk in request.stream():
                items = splitter.feed(chunk)
                if items:
                    await asyncio.to_thread(spooler.take, items)
            splitter.finish()
        finally:
            os.close(fd)
        await _store_and_register(request, run, spool, spooler.spans, confirm, ttl)
    finally:
        spool.unlink(missing_ok=True)
    return [{"digest": d, "byteSize": size} for _, size, d in spooler.spans]


async def _store_and_register(
    request: Request,
    run: RunBinding,
    spool: Path,
    members: list[tuple[int, int, str]],
    confirm: Confirm,
    ttl: float,
) -> None:
    st = state(request)
    first: dict[str, tuple[int, int]] = {}
    for offset, size, digest in members:
        first.setdefault(digest, (offset, size))
    sizes = {d: size for d, (_, size) in first.items()}
    async with quotas.reserved(
        transact(request), run.company_id, run.run_id, sizes, st.settings.quotas
    ) as reservation:
        async with connection(request) as conn:
            mark = await foldercore.take_store_mark(conn)
        spans = {
            d: Span(object_key(run.company_id, d), off, size, d) for d, (off, size) in first.items()
        }
        try:
            created = await put_spans(st.storage, spool, list(spans.values()))
        except BaseException:
            # A provider may have stored some members before failing (S3 puts
            # them one by one): every one is queued for GC, which keeps
            # referenced ones.
            await journal_orphans(request, run.company_id, list(spans))
            raise
        new = [span.sha256_hex for span, made in zip(spans.values(), created, strict=True) if made]
        ensure = restore_swept_spans(st.storage, spool, spans)

        async def register(conn: AsyncConnection[Any]) -> None:
            await confirm(conn)
            await runs.record_uploads(
                conn, run.run_id, run.company_id, sizes, ensure, st.settings.gc_delay, ttl, mark
            )
            await quotas.settle(conn, reservation)

        try:
            await write_transaction(request, register)
        except BaseException:
            if new:
                await journal_orphans(request, run.company_id, new)
            raise


def restore_swept_spans(
    storage: StorageProvider, spool: Path, spans: dict[str, Span]
) -> Callable[[list[str]], Awaitable[None]]:
    """The batch's ``ensure_objects`` (:func:`controller.runs.record_uploads`):
    called, with the objects locked, only for keys a sweep may have deleted
    since the batch stored them; brings back the bytes of any that are gone
    (one thread hop for the checks)."""

    async def ensure(keys: list[str]) -> None:
        def missing() -> list[Span]:
            return [spans[k.rsplit("/", 1)[1]] for k in keys if not storage.exists(k)]

        lost = await asyncio.to_thread(missing)
        if lost:
            await put_spans(storage, spool, lost)

    return ensure


async def put_spans(storage: StorageProvider, spool: Path, spans: list[Span]) -> list[bool]:
    try:
        return await asyncio.to_thread(storage.put_spans, spool, spans)
    except StorageUnavailable:
        raise
    except OSError as exc:
        raise StorageUnavailable(f"storing objects failed: {exc}") from exc
