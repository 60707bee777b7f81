"""The one reader of the bridge's framed zstd bodies (format: :mod:`common.bridge`):
the controller's uploads, fsagent's batch fetches and the in-memory test
client all cut and decode frames here.

Contract: the body is a sequence of frames, each ``FRAME_HEADER`` (compressed
length, raw length, xxh64 of the raw bytes) followed by exactly one zstd frame,
ended by :data:`common.bridge.END_FRAME` with nothing after it. Every refusal
raises :class:`common.errors.BadFrame`; nothing else escapes for any input
(``tests/fuzz/fuzz_upload.py`` holds the reader to that). A batch upload
(:class:`BatchSplitter`) adds member headers around the same frames; it
refuses with BadFrame, PayloadTooLarge (413: too many members or bytes) or, for frames that do not
add up to a member's declared size, DigestMismatch (422; :attr:`BatchSplitter.member`
is the member it is about). These are the controller's answers as they are;
fsagent maps every one of them to its ``BadBatch``.

Two halves, so that the event loop only ever does cheap work:

* :class:`FrameSplitter` cuts the byte stream into frames and checks the
  header's bounds. It copies bytes and nothing more.
* :func:`decode_frame` decompresses and verifies one frame. It is CPU-bound and
  runs in a worker thread.

Memory is bounded before any decompression: the zstd frame must declare its
content size, and that size must equal the header's raw length, which is at
most :data:`CHUNK_MAX`. Without that check a frame of a few KiB that declares
gigabytes made the decompressor allocate the declared size up front (zstd
sizes its output buffer from the frame header, whatever ``max_output_size``
says).

Reading only: the caller owns the bytes' source and where the results go.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import xxhash
import zstandard

from common.bridge import (
    BATCH_HEADER,
    BATCH_MAGIC,
    BATCH_MAX_BYTES,
    BATCH_MAX_MEMBERS,
    BATCH_MEMBER_MAX,
    CHUNK_MAX,
    FRAME_HEADER,
    MEMBER_HEADER,
)
from common.errors import BadFrame, DigestMismatch, PayloadTooLarge

MAX_COMPRESSED_FRAME = CHUNK_MAX + 1024
"""Largest compressed payload of one frame (zstd stores incompressible data raw)."""

MAX_WINDOW = 8 << 20
"""Decoder window cap: a frame's window never needs to exceed its content."""


@dataclass(frozen=True)
class Frame:
    """One upload frame as sent: header fields and the compressed payload."""

    raw_len: int
    checksum: int
    payload: bytes


class FrameSplitter:
    """Cut an upload body into frames; buffers at most one frame plus one chunk."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.done = False

    def feed(self, data: bytes) -> list[Frame]:
        """The frames completed by ``data``; BadFrame on a header out of bounds."""
        if self.done:
            if data:
                raise BadFrame("data after the end frame")
            return []
        self._buf += data
        frames: list[Frame] = []
        header = FRAME_HEADER.size
        while len(self._buf) >= header:
            clen, rlen, checksum = FRAME_HEADER.unpack_from(self._buf)
            if clen == 0 and rlen == 0:
                if checksum != 0:
                    raise BadFrame("the end frame must be all zeros")
                if len(self._buf) > header:
                    raise BadFrame("data after the end frame")
                self.done = True
                self._buf.clear()
                break
            if not 0 < rlen <= CHUNK_MAX or not 0 < clen <= MAX_COMPRESSED_FRAME:
                raise BadFrame("frame larger than allowed")
            if len(self._buf) < header + clen:
                break
            frames.append(Frame(rlen, checksum, bytes(self._buf[header : header + clen])))
            del self._buf[: header + clen]
        return frames

    def finish(self) -> None:
        """The body ended: refuse it unless the end frame was seen."""
        if not self.done:
            raise BadFrame("body ended before the end frame")


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    # A decompression context is not thread-safe; one per worker thread.
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    return dctx


def decode_frame(frame: Frame) -> bytes:
    """The raw bytes of ``frame``, verified; BadFrame for anything else.

    Exactly one zstd frame with a declared content size equal to the header's
    raw length, no trailing bytes, and the xxh64 of the result must match.
    """
    try:
        declared = zstandard.frame_content_size(frame.payload)
    except zstandard.ZstdError:
        raise BadFrame("payload is not a zstd frame") from None
    # frame_content_size answers -1 (not CONTENTSIZE_UNKNOWN) for "not declared".
    if declared < 0 or declared == zstandard.CONTENTSIZE_UNKNOWN:
        # Streaming such a frame would need an output bound of its own; every
        # writer (encode_frame) declares the size, so refusing costs nothing.
        raise BadFrame("zstd frame does not declare its content size")
    if declared != frame.raw_len:
        raise BadFrame(f"zstd frame declares {declared} bytes, the frame header {frame.raw_len}")
    try:
        raw = _decompressor().decompress(
            frame.payload, max_output_size=frame.raw_len, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        # "unused data" is a second zstd frame or trailing junk in the payload.
        raise BadFrame(f"zstd: {exc}") from None
    if len(raw) != frame.raw_len or xxhash.xxh64_intdigest(raw) != frame.checksum:
        raise BadFrame("frame checksum or length mismatch")
    return raw


# --- batch uploads -------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """The start of one batch member: its declared size and SHA-256."""

    raw_len: int
    sha256: bytes


@dataclass(frozen=True)
class MemberEnd:
    """A member's end frame."""


class BatchSplitter:
    """Cut a batch body (:mod:`common.bridge`) into member starts, frames and
    member ends; checks every bound before buffering more than one frame.

    The defaults are the controller's bounds on a batch upload. A reader of a
    batch answer (fsagent's object fetch) passes ``expect``, the member count
    it asked for (then the only count accepted), and None for the bounds the
    answer does not have (``member_max``, ``max_bytes``): its members are whole
    files.
    """

    def __init__(
        self,
        *,
        expect: int | None = None,
        member_max: int | None = BATCH_MEMBER_MAX,
        max_bytes: int | None = BATCH_MAX_BYTES,
    ) -> None:
        self._expect = expect
        self._member_max = member_max
        self._max_bytes = max_bytes
        self._buf = bytearray()
        self._count: int | None = None
        self._seen = 0
        self._member: Member | None = None
        self._member_bytes = 0
        self._total = 0
        self.done = False

    @property
    def member(self) -> Member | None:
        """The member being read (None between members): the one a refusal is about."""
        return self._member

    def feed(self, data: bytes) -> list[Member | Frame | MemberEnd]:
        if self.done:
            if data:
                raise BadFrame("data after the last member")
            return []
        self._buf += data
        out: list[Member | Frame | MemberEnd] = []
        while not self.done and self._step(out):
            pass
        return out

    def _step(self, out: list[Member | Frame | MemberEnd]) -> bool:
        """Take one item off the buffer; False when more bytes are needed."""
        if self._count is None:
            if len(self._buf) < BATCH_HEADER.size:
                return False
            magic, count = BATCH_HEADER.unpack_from(self._buf)
            if magic != BATCH_MAGIC:
                raise BadFrame("not a batch upload")
            if self._expect is not None:
                if count != self._expect:
                    raise BadFrame(f"batch holds {count} members, {self._expect} were asked for")
            elif not 0 < count <= BATCH_MAX_MEMBERS:
                raise PayloadTooLarge(f"a batch carries 1-{BATCH_MAX_MEMBERS} members")
            self._count = count
            del self._buf[: BATCH_HEADER.size]
            return True
        if self._member is None:
            if self._seen == self._count:
                if self._buf:
                    raise BadFrame("data after the last member")
                self.done = True
                return False
            if len(self._buf) < MEMBER_HEADER.size:
                return False
            raw_len, sha = MEMBER_HEADER.unpack_from(self._buf)
            if self._member_max is not None and raw_len > self._member_max:
                raise PayloadTooLarge(f"a batch member carries at most {self._member_max} bytes")
            self._total += raw_len
            if self._max_bytes is not None and self._total > self._max_bytes:
                raise PayloadTooLarge(f"a batch carries at most {self._max_bytes} bytes")
            del self._buf[: MEMBER_HEADER.size]
            self._member = Member(raw_len, sha)
            self._member_bytes = 0
            out.append(self._member)
            return True
        header = FRAME_HEADER.size
        if len(self._buf) < header:
            return False
        clen, rlen, checksum = FRAME_HEADER.unpack_from(self._buf)
        if clen == 0 and rlen == 0:
            if checksum != 0:
                raise BadFrame("the end frame must be all zeros")
            if self._member_bytes != self._member.raw_len:
                raise DigestMismatch("a batch member's frames do not add up to its declared size")
            del self._buf[:header]
            self._member = None
            self._seen += 1
            out.append(MemberEnd())
            return True
        if not 0 < rlen <= CHUNK_MAX or not 0 < clen <= MAX_COMPRESSED_FRAME:
            raise BadFrame("frame larger than allowed")
        if self._member_bytes + rlen > self._member.raw_len:
            raise DigestMismatch("a batch member's frames exceed its declared size")
        if len(self._buf) < header + clen:
            return False
        self._member_bytes += rlen
        out.append(Frame(rlen, checksum, bytes(self._buf[header : header + clen])))
        del self._buf[: header + clen]
        return True

    def finish(self) -> None:
        if not self.done:
            raise BadFrame("body ended before the last member")
