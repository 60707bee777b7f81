"""Objects compressed at rest: the stored form of an object, either its bytes
as they are ("raw") or "packed", zstd in independent frames behind a header.

Why: uploads arrive compressed (zstd frames) and are stored decompressed, so
without this a few kilobytes sent (gigabytes of zeros) cost the host
gigabytes of disk. Both providers store what :func:`pack` writes under the
object's usual key; a reader tells the forms apart by the header, so nothing
is migrated: an object stored before packing existed is read as raw.

Layout of a packed object (integers little-endian)::

    magic      8 bytes   MAGIC
    size       u64       bytes of the object (the logical bytes)
    frame      u32       logical bytes per frame (the last one may be shorter)
    digest     32 bytes  SHA-256 of the logical bytes: the key's digest
    table      u32 each  stored length of each frame, in order
    frames     one zstd frame per ``frame`` logical bytes, each with its size

The digest in the header is what makes the form unambiguous: a raw object
whose first 52 bytes were this magic followed by its own SHA-256 would be a
fixed point of SHA-256. Frames are independent, so a ranged read decompresses
at most one frame it does not need at either end, and memory stays at one
frame whatever the object's size.

An object is packed only when that saves at least an eighth of its size
(:data:`MIN_SAVING`); Git packs, images and archives stay raw, and are read
at the same cost as before. Digests, sizes in the database, quotas and GC are
all about the logical bytes and do not change.

A large object stored from a file is screened first (:func:`may_pay`): its
frames are compressed as packing would compress them, but nothing is
written, and the first frame that saves an eighth ends the screen. When not
one does, the packed form cannot save an eighth either, so the object is
stored raw at once: the same stored form packing would have reached, without
writing and throwing away seven eighths of it first.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import IO, Final

import zstandard

from common.errors import StorageUnavailable

from .base import SourceMismatch

MAGIC: Final = b"\x89FSWZ\r\n\x1a"
_HEADER = struct.Struct("<8sQI32s")
HEADER_LEN: Final = _HEADER.size
_LENGTH = struct.Struct("<I")
FRAME_BYTES: Final = 1 << 20
"""Logical bytes per frame: a ranged read decompresses at most two frames it
does not need; zstd at this size compresses within a few percent of one frame."""
LEVEL: Final = 3
MIN_SAVING: Final = 8
"""Pack only when the packed form is at most ``size - size // MIN_SAVING``."""
MIN_PACKED_SIZE: Final = 512
"""Below this the header alone eats most of any saving."""
SCREEN_FROM: Final = 16 * FRAME_BYTES
"""Objects of at least this size are screened (:func:`may_pay`) before they
are packed: a compressible one pays one frame compressed twice, a small
share of its packing from this size on."""
PROBE_BYTES: Final = HEADER_LEN + 1024 * _LENGTH.size
"""A first read of this many bytes holds the header and the table of any
object up to 1 GiB."""

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # A context is not thread-safe; puts run in worker threads.
    ctx = getattr(_local, "compressor", None)
    if ctx is None:
        ctx = _local.compressor = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return ctx


def _decompressor() -> zstandard.ZstdDecompressor:
    ctx = getattr(_local, "decompressor", None)
    if ctx is None:
        ctx = _local.decompressor = zstandard.ZstdDecompressor()
    return ctx


def worth_packing(size: int) -> bool:
    return size >= MIN_PACKED_SIZE


def _budget(size: int) -> int:
    return size - size // MIN_SAVING


def _frames(size: int, frame: int) -> int:
    return -(-size // frame)


def may_pay(fd: int, size: int, offset: int = 0) -> bool:
    """Whether packing the ``size`` bytes at ``offset`` of file ``fd`` can
    save an eighth: False only when the object is at least
    :data:`SCREEN_FROM` bytes and not one of its frames, compressed exactly
    as :func:`pack` compresses it, saves an eighth of its own bytes. The
    packed form is then over its budget (frames and budget are sums over the
    same bytes, and the header only adds), so :func:`pack` would give up.

    Reads the bytes with ``pread`` and writes nothing; stops at the first
    frame that saves (usually the first frame of a compressible object).
    Decides nothing about the bytes' size or digest: a source shorter than
    ``size`` answers True, and whichever form is stored checks them as before.
    """
    if size < SCREEN_FROM:
        return True
    compressor = _compressor()
    buffer = bytearray(FRAME_BYTES)
    view = memoryview(buffer)
    for start in range(0, size, FRAME_BYTES):
        want = min(FRAME_BYTES, size - start)
        if os.preadv(fd, [view[:want]], offset + start) != want:
            return True
        if len(compressor.compress(view[:want])) <= _budget(want):
            return True
    return False


# --- writing ---------------------------------------------------------------


def pack(
    read: Callable[[int], bytes],
    size: int,
    sha256_hex: str,
    out: IO[bytes],
    *,
    hashed: bool = False,
) -> int | None:
    """Write the packed form of the ``size`` bytes ``read`` returns to ``out``
    (a new, seekable file); its length, or None when packing does not save
    an eighth (``out`` then holds an unfinished prefix to throw away).

    The bytes are hashed as they are packed: SourceMismatch when they are not
    ``size`` bytes hashing to ``sha256_hex``. With ``hashed`` the caller has
    already hashed these very bytes (a spool file it wrote itself,
    ``StorageProvider.adopt_file``): only their size is checked then. Gives up
    as soon as the packed form has grown past its budget, whatever follows: a
    form only grows.
    """
    n = _frames(size, FRAME_BYTES)
    budget = _budget(size)
    stored = HEADER_LEN + n * _LENGTH.size
    if stored > budget:
        return None
    out.write(_HEADER.pack(MAGIC, size, FRAME_BYTES, bytes.fromhex(sha256_hex)))
    out.write(bytes(n * _LENGTH.size))
    digest = None if hashed else hashlib.sha256()
    lengths: list[int] = []
    compressor = _compressor()
    left = size
    while left:
        data = _read_exactly(read, min(FRAME_BYTES, left))
        if digest is not None:
            digest.update(data)
        left -= len(data)
        frame = compressor.compress(data)
        stored += len(frame)
        if stored > budget:
            return None
        lengths.append(len(frame))
        out.write(frame)
    if read(1):
        raise SourceMismatch(f"source has more than {size} bytes")
    if digest is not None and digest.hexdigest() != sha256_hex:
        raise SourceMismatch(f"source does not hash to {sha256_hex}")
    out.seek(HEADER_LEN)
    out.write(b"".join(_LENGTH.pack(length) for length in lengths))
    out.seek(stored)
    return stored


def pack_bytes(data: bytes, sha256_hex: str, *, hashed: bool = False) -> bytes | None:
    """:func:`pack` of bytes in memory (a small batch member): the packed
    form, or None when it does not pay. ``hashed``: the caller has checked
    that ``data`` hashes to ``sha256_hex``."""
    if not worth_packing(len(data)):
        return None
    out = io.BytesIO()
    view = memoryview(data)
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        if pos == 0 and n >= len(data):
            pos = len(data)
            return data  # a single frame's worth: no copy
        piece = bytes(view[pos : pos + n])
        pos += len(piece)
        return piece

    if pack(read, len(data), sha256_hex, out, hashed=hashed) is None:
        return None
    return out.getvalue()


def stored_form(data: bytes, sha256_hex: str) -> bytes:
    """What an object of ``data`` is stored as: its packed form when that
    pays, else the bytes themselves. SourceMismatch when they do not hash to
    ``sha256_hex`` (nothing may be stored then)."""
    # Hashed once up front: packing that gives up halfway would otherwise
    # leave the bytes to be hashed a second time.
    if hashlib.sha256(data).hexdigest() != sha256_hex:
        raise SourceMismatch(f"the bytes do not hash to {sha256_hex}")
    stored = pack_bytes(data, sha256_hex, hashed=True)
    return data if stored is None else stored


def _read_exactly(read: Callable[[int], bytes], n: int) -> bytes:
    data = read(n)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = read(n - got)
        if not more:
            raise SourceMismatch(f"source ended {n - got} bytes early")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


# --- reading ---------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A packed object's header and frame table."""

    size: int
    frame: int
    lengths: tuple[int, ...]

    @property
    def data_offset(self) -> int:
        return HEADER_LEN + len(self.lengths) * _LENGTH.size

    def frame_offset(self, index: int) -> int:
        return self.data_offset + sum(self.lengths[:index])


def parse_header(head: bytes, sha256_hex: str) -> tuple[int, int] | None:
    """(size, frame bytes) if ``head`` starts the packed form of the object
    named ``sha256_hex``, else None (a raw object)."""
    if len(head) < HEADER_LEN or not head.startswith(MAGIC):
        return None
    _, size, frame, digest = _HEADER.unpack_from(head)
    if digest.hex() != sha256_hex:
        return None
    if frame <= 0:
        raise StorageUnavailable(f"packed object {sha256_hex} has a frame size of {frame}")
    return size, frame


def parse_table(size: int, frame: int, table: bytes, sha256_hex: str) -> Layout:
    n = _frames(size, frame)
    if len(table) != n * _LENGTH.size:
        raise StorageUnavailable(f"packed object {sha256_hex} is cut short in its frame table")
    return Layout(size, frame, tuple(v for (v,) in _LENGTH.iter_unpack(table)))


def table_bytes(size: int, frame: int) -> int:
    return _frames(size, frame) * _LENGTH.size


RawOpener = Callable[[int, int | None], Iterator[bytes]]
"""Opens the stored bytes ``[start, end)`` of one object (``end`` None: to
its end), raising ObjectMissing or StorageUnavailable when called."""


class _Reader:
    """Exact reads from a stream of stored bytes, whatever its chunking."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = bytearray()

    def peek(self, n: int) -> bytes:
        """Up to ``n`` bytes, left in place: fewer only at the end of the stream."""
        while len(self._buf) < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buf += chunk
        return bytes(self._buf[:n])

    def take(self, n: int) -> bytes:
        data = self.peek(n)
        del self._buf[: len(data)]
        return data

    def rest(self, chunk_size: int) -> Iterator[bytes]:
        """The rest of the stream, in its own chunks (what was buffered in
        pieces of at most ``chunk_size``)."""
        data = bytes(self._buf)
        self._buf.clear()
        yield from _cut(data, chunk_size)
        yield from self._chunks


def _cut(data: bytes, chunk_size: int) -> Iterator[bytes]:
    for i in range(0, len(data), chunk_size):
        yield data[i : i + chunk_size]


def _unpack_frames(
    reader: _Reader, layout: Layout, first: int, start: int, stop: int, key: str, chunk_size: int
) -> Iterator[bytes]:
    """Logical bytes ``[start, stop)`` from frames ``first``... read in order."""
    decompressor = _decompressor()
    index = first
    pos = first * layout.frame
    while pos < stop:
        stored = reader.take(layout.lengths[index])
        want = min(layout.frame, layout.size - pos)
        if len(stored) != layout.lengths[index]:
            raise StorageUnavailable(f"packed object {key} ended early in frame {index}")
        try:
            data = decompressor.decompress(stored, max_output_size=want)
        except zstandard.ZstdError as exc:
            raise StorageUnavailable(f"packed object {key}: frame {index} is corrupt") from exc
        if len(data) != want:
            raise StorageUnavailable(f"packed object {key}: frame {index} has the wrong size")
        lo, hi = max(start - pos, 0), min(stop - pos, want)
        yield from _cut(data[lo:hi], chunk_size)
        pos += want
        index += 1


def read_logical(
    open_raw: RawOpener,
    key: str,
    start: int,
    end: int | None,
    chunk_size: int,
) -> Generator[bytes, None, None]:
    """The logical bytes ``[start, end)`` of the object stored under ``key``,
    raw or packed, in chunks of at most ``chunk_size``: a generator that
    opens the object, yields ``b""`` (``base.open_stream``), then the bytes.

    A whole read is one stream of the stored bytes; a ranged one reads the
    head first (one small read), then only the frames or bytes the range needs.
    """
    digest = key.rsplit("/", 1)[1]
    if start == 0 and end is None:
        reader = _Reader(open_raw(0, None))
        yield b""
        found = parse_header(reader.peek(HEADER_LEN), digest)
        if found is None:
            yield from reader.rest(chunk_size)
            return
        reader.take(HEADER_LEN)
        size, frame = found
        table = reader.take(table_bytes(size, frame))
        layout = parse_table(size, frame, table, digest)
        yield from _unpack_frames(reader, layout, 0, 0, size, key, chunk_size)
        return
    head = b"".join(open_raw(0, PROBE_BYTES))
    found = parse_header(head, digest)
    if found is None:
        if len(head) < PROBE_BYTES or (end is not None and end <= len(head)):
            # The head holds the whole range (or the whole object).
            yield b""
            yield from _cut(head[start:end], chunk_size)
            return
        raw = open_raw(start, end)
        yield b""
        yield from raw
        return
    size, frame = found
    table_end = HEADER_LEN + table_bytes(size, frame)
    table = head[HEADER_LEN:table_end]
    if len(head) < table_end:
        table += b"".join(open_raw(len(head), table_end))
    layout = parse_table(size, frame, table, digest)
    stop = size if end is None else min(end, size)
    if start >= stop:
        yield b""
        return
    first, last = start // frame, (stop - 1) // frame
    reader = _Reader(open_raw(layout.frame_offset(first), layout.frame_offset(last + 1)))
    yield b""
    yield from _unpack_frames(reader, layout, first, start, stop, key, chunk_size)


def logical_size(head: bytes, stored_size: int, sha256_hex: str) -> int:
    """An object's size in logical bytes from its first :data:`HEADER_LEN`
    stored bytes and its stored size."""
    found = parse_header(head, sha256_hex)
    return stored_size if found is None else found[0]
