"""Stored objects over HTTP: streaming reads with one ``Range`` (the object
opened before the head is sent), and upload spooling.

Used by both the work-folder API and the bridge: a body is hashed as it
arrives and kept in memory when small, else spooled to a file under the
spool directory (memory stays bounded), then put into storage; a read
streams the object in chunks from a thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import PayloadTooLarge, RangeNotSatisfiable, StorageUnavailable
from controller import foldercore
from controller.api.common import connection, state
from controller.api.params import declared_length, parse_range
from controller.foldercore import EnsureObject
from controller.storage.base import ObjectMissing

log = logging.getLogger(__name__)

SPOOL_WRITE_BYTES = 1 << 20
BODY_IN_MEMORY_BYTES = 64 * 1024
"""A body up to this long is kept in memory instead of a spool file."""


# --- reads -----------------------------------------------------------------

INLINE_TYPES = frozenset(
    ("text/plain", "application/pdf", "image/png", "image/jpeg", "image/gif", "image/webp")
)
"""The content types a download keeps. The type is the uploader's word (a
sandbox's, too), and the answer comes from the Files page's own origin:
``text/javascript``, ``text/html`` or ``image/svg+xml`` served as such is
script waiting for a browser that ignores ``attachment`` or a page that
embeds the URL. These few are inert or rendered by the browser's own viewer."""


def served_type(stored: str | None) -> str:
    """The ``Content-Type`` of a stored file's download: its media type when
    :data:`INLINE_TYPES` has it (parameters dropped; text gets UTF-8), else
    ``application/octet-stream``."""
    media = (stored or "").split(";", 1)[0].strip().lower()
    return media if media in INLINE_TYPES else "application/octet-stream"


async def in_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blocking iterator (storage reads, a stream built from them) advanced
    one chunk at a time in a worker thread, and closed there."""
    try:
        while True:
            chunk = await asyncio.to_thread(next, chunks, None)
            if chunk is None:
                return
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


def _read_prefix(storage: Any, key: str, limit: int) -> bytes:
    out = bytearray()
    for chunk in storage.read_chunks(key, 0, limit):
        out += chunk
    return bytes(out)


async def read_object_bytes(request: Request, key: str, limit: int) -> bytes:
    """The first ``limit`` bytes of a stored object, in memory (small objects only)."""
    return await asyncio.to_thread(_read_prefix, state(request).storage, key, limit)


async def read_spool_prefix(spool: Path, limit: int) -> bytes:
    """The first ``limit`` bytes of a spool file."""

    def read() -> bytes:
        with spool.open("rb") as fh:
            return fh.read(limit)

    return await asyncio.to_thread(read)


async def _exactly(chunks: Iterator[bytes], key: str, expected: int) -> AsyncIterator[bytes]:
    """The opened object's chunks; an object that ends before ``expected``
    bytes (truncated behind our back) is logged and ends the answer with an
    error, so the connection is cut rather than the download looking whole."""
    sent = 0
    async for chunk in in_thread(chunks):
        sent += len(chunk)
        yield chunk
    if sent != expected:
        log.error(
            "object %s ended after %d of %d bytes; the answer is cut off", key, sent, expected
        )
        raise ObjectMissing(f"object {key} has fewer bytes than its files say")


async def object_response(
    request: Request, key: str, size: int, headers: dict[str, str], media_type: str
) -> Response:
    """Stream a stored object, honouring one ``Range`` (206) or refusing it (416).

    The object is opened before the head is sent (the read the body needs
    anyway: an open on local disk, the GET on S3), so a missing object is
    500 ``object_missing`` and an unreachable store 503
    ``storage_unavailable``, never a 200 whose body stops short of its
    Content-Length. A HEAD checks the object's size (one stat, or one S3
    HEAD); an empty answer needs no object.
    """
    start, end, status = 0, size, 200
    range_header = request.headers.get("range")
    if range_header and size > 0:
        try:
            start, end = parse_range(range_header, size)
        except RangeNotSatisfiable as exc:
            return JSONResponse(exc.to_json(), exc.status, {"Content-Range": f"bytes */{size}"})
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    headers["Content-Length"] = str(end - start)
    if end == start:
        return Response(b"", status_code=status, headers=headers, media_type=media_type)
    storage = state(request).storage
    try:
        if request.method == "HEAD":
            stored = await asyncio.to_thread(storage.size, key)
            if stored != size:
                raise ObjectMissing(f"object {key} has {stored} bytes, its files say {size}")
            return Response(b"", status_code=status, headers=headers, media_type=media_type)
        chunks = await asyncio.to_thread(storage.read_chunks, key, start, end)
    except ObjectMissing as exc:
        # The detail (a path on this host, a bucket) is for the log, not the client.
        raise ObjectMissing() from exc
    return StreamingResponse(
        _exactly(chunks, key, end - start),
        status_code=status,
        headers=headers,
        media_type=media_type,
    )


# --- writes ----------------------------------------------------------------


async def open_spool(spool_dir: Path, prefix: str) -> tuple[int, Path]:
    """A new spool file (descriptor and path); the caller closes and removes it."""
    fd, name = await asyncio.to_thread(tempfile.mkstemp, dir=spool_dir, prefix=prefix)
    return fd, Path(name)


def spool_append(fd: int, hasher: Any, data: bytes) -> None:
    hasher.update(data)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


@dataclass(frozen=True)
class Body:
    """An upload's body, hashed as it arrived: its bytes in memory (``data``)
    when it is small, else the spool file holding them (``path``)."""

    size: int
    digest: str
    data: bytes | None = None
    path: Path | None = None

    async def prefix(self, limit: int) -> bytes:
        """The first ``limit`` bytes."""
        if self.data is not None:
            return self.data[:limit]
        assert self.path is not None
        return await read_spool_prefix(self.path, limit)

    def discard(self) -> None:
        """Remove the spool file, if there is one."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


async def spool_body(request: Request, spool_dir: Path, limit: int) -> Body:
    """Read the body while hashing it; memory stays bounded.

    A body of up to :data:`BODY_IN_MEMORY_BYTES` stays in memory: no spool
    file is made, written, synced or removed for it (a small file's PUT is
    mostly such work). A longer one streams to a spool file. Crossing
    ``limit`` aborts at once (413), whatever Content-Length claimed. On any
    failure the spool file is removed, so nothing can be published.
    """
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"Files are limited to {limit} bytes")
    fd, path = -1, None
    hasher = hashlib.sha256()
    size = 0
    buf = bytearray()
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"Files are limited to {limit} bytes")
            buf += chunk
            if path is None and len(buf) > BODY_IN_MEMORY_BYTES:
                fd, path = await open_spool(spool_dir, "upload-")
            if path is not None and len(buf) >= SPOOL_WRITE_BYTES:
                data, buf = bytes(buf), bytearray()
                await asyncio.to_thread(spool_append, fd, hasher, data)
        if path is None:
            data = bytes(buf)
            return Body(size, hashlib.sha256(data).hexdigest(), data=data)
        if buf:
            await asyncio.to_thread(spool_append, fd, hasher, bytes(buf))
    except BaseException:
        if path is not None:
            os.close(fd)
            os.unlink(path)
        raise
    os.close(fd)
    return Body(size, hasher.hexdigest(), path=path)


async def put_object(request: Request, key: str, body: Body) -> bool:
    """Store an upload's body: bytes in memory as they are
    (``StorageProvider.put_bytes_async``), a spool file this process wrote and
    hashed by handing it over (``StorageProvider.adopt_file``)."""
    storage = state(request).storage
    try:
        if body.data is not None:
            return await storage.put_bytes_async(key, body.data, body.digest)
        assert body.path is not None
        return await asyncio.to_thread(storage.adopt_file, key, body.path, body.size, body.digest)
    except StorageUnavailable:
        raise
    except OSError as exc:
        raise StorageUnavailable(f"storing object failed: {exc}") from exc


def reupload_if_missing(request: Request, body: Body) -> EnsureObject:
    """Inside the commit, with the object's row locked: bring the bytes back if a
    GC sweep removed them after our upload (see ``foldercore.register_object``)."""

    async def ensure(key: str) -> None:
        if not await asyncio.to_thread(state(request).storage.exists, key):
            await put_object(request, key, body)

    return ensure


async def journal_orphan(request: Request, company_id: str, digest: str) -> None:
    """A stored object whose commit failed is queued for GC (which keeps it if referenced)."""
    await journal_orphans(request, company_id, [digest])


async def journal_orphans(request: Request, company_id: str, digests: list[str]) -> None:
    try:
        async with connection(request) as conn:
            await foldercore.journal_deletion(
                conn, company_id, digests, "orphaned upload", state(request).settings.gc_delay
            )
    except Exception:
        log.exception("could not journal %d orphaned objects", len(digests))
