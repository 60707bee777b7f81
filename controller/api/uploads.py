"""Batch uploads over the bridge: many small objects in one request.

Contract: ``PUT /bridge/v1/folders/{scope}/uploads/batch`` in
:mod:`common.bridge`. The batch is a transport only: every member becomes its
own object under its own digest, exactly as a single upload would store it.

1. The body streams through :class:`controller.frames.BatchSplitter` (bounds
   checked before any decompression) into one spool file for the batch; each
   member is decoded, hashed and appended in a worker thread, one thread hop
   per received piece of the body, never per member. A member whose bytes are
   not its declared size and SHA-256 refuses the whole batch (422).
2. Only once every member is verified: the run's quotas, then
   ``StorageProvider.put_spans`` stores every new object with one sync for
   the batch (local_disk: one ``syncfs``).
3. One transaction registers every member (:func:`controller.runs.record_uploads`).
   If it fails, the objects this batch created are journalled for GC, which
   keeps any that something references.

Nothing is registered before step 3, so a refused or interrupted batch
leaves no upload a checkpoint could reference.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from starlette.requests import Request

from common.errors import DigestMismatch, StorageUnavailable
from controller import quotas, runs
from controller.api.common import connection, state, write_transaction
from controller.api.objects import journal_orphans, open_spool, spool_append
from controller.auth import RunBinding, confirm_run_writes
from controller.frames import BatchSplitter, Frame, Member, MemberEnd, decode_frame
from controller.storage.base import Span, object_key


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


async def receive_batch(request: Request, run: RunBinding) -> list[dict[str, Any]]:
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
        await _store_and_register(request, run, spool, spooler.spans)
    finally:
        spool.unlink(missing_ok=True)
    return [{"digest": d, "byteSize": size} for _, size, d in spooler.spans]


async def _store_and_register(
    request: Request, run: RunBinding, spool: Path, members: list[tuple[int, int, str]]
) -> None:
    st = state(request)
    first: dict[str, tuple[int, int]] = {}
    for offset, size, digest in members:
        first.setdefault(digest, (offset, size))
    sizes = {d: size for d, (_, size) in first.items()}
    async with connection(request) as conn:
        await quotas.check_uploads(conn, run.company_id, run.run_id, sizes, st.settings.quotas)
    spans = {
        d: Span(object_key(run.company_id, d), off, size, d) for d, (off, size) in first.items()
    }
    try:
        created = await _put_spans(request, spool, list(spans.values()))
    except BaseException:
        # A provider may have stored some members before failing (S3 puts them
        # one by one): every one is queued for GC, which keeps referenced ones.
        await journal_orphans(request, run.company_id, list(spans))
        raise
    new = [span.sha256_hex for span, made in zip(spans.values(), created, strict=True) if made]

    async def ensure(keys: list[str]) -> None:
        # Inside the registration, the objects locked: bring back any bytes a
        # GC sweep removed since they were stored (one thread hop for all).
        def missing() -> list[Span]:
            return [spans[k.rsplit("/", 1)[1]] for k in keys if not st.storage.exists(k)]

        lost = await asyncio.to_thread(missing)
        if lost:
            await _put_spans(request, spool, lost)

    async def register(conn: AsyncConnection[Any]) -> None:
        await confirm_run_writes(conn, run, request.path_params["scope"])
        await runs.record_uploads(
            conn,
            run.run_id,
            run.company_id,
            sizes,
            ensure,
            st.settings.gc_delay,
            st.settings.quotas.pending_upload_ttl,
        )

    try:
        await write_transaction(request, register)
    except BaseException:
        if new:
            await journal_orphans(request, run.company_id, new)
        raise


async def _put_spans(request: Request, spool: Path, spans: list[Span]) -> list[bool]:
    try:
        return await asyncio.to_thread(state(request).storage.put_spans, spool, spans)
    except StorageUnavailable:
        raise
    except OSError as exc:
        raise StorageUnavailable(f"storing objects failed: {exc}") from exc
