"""The one small interface every object storage provider implements.

Objects are immutable and content-addressed: the key is derived from the owning
company and the SHA-256 of the bytes, so two writers of the same key always
write the same bytes. That is what lets ``put_file`` treat "already there" as
success and lets the S3 provider fall back to an unconditional PUT when a
server does not support conditional writes.

What a provider stores under a key is the object's stored form
(``packed.py``): compressed when that pays, else raw. Every method speaks
of the logical bytes (sizes, ranges, digests); only the backend sees the
stored form.

The methods are synchronous on purpose. The controller runs them in worker
threads (``asyncio.to_thread``) because boto3 blocks, and the local provider is
plain file I/O; one calling convention keeps the providers interchangeable.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import re
import tempfile
import uuid
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.errors import WorkFolderError

# Lower-case hyphenated UUID, the only spelling ``str(uuid.UUID(...))`` produces.
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
OBJECT_KEY_RE = re.compile(
    rf"objects/(?P<company>{_UUID})/(?P<fanout>[0-9a-f]{{2}})/(?P<digest>[0-9a-f]{{64}})"
)

DEFAULT_CHUNK_SIZE = 1 << 20


class ObjectMissing(WorkFolderError):
    """A key the metadata says exists is absent from storage.

    Status 500, not 404: a file row points at this object, so its absence is a
    fault on our side (lost data, a GC bug), never something a client did.
    """

    code = "object_missing"
    status = 500
    message = "Stored object is missing"


class SourceMismatch(ValueError):
    """The local source file does not have the size or SHA-256 the caller declared.

    Storing it anyway would put bytes under a key that names different bytes,
    which breaks every reader that trusts the content address.
    """


def object_key(company_id: str, digest: str) -> str:
    """The storage key for an object of ``company_id`` whose bytes hash to ``digest``.

    Keys are built only from these two validated values, never from a path a
    client sent, so nothing a sandbox controls can steer where bytes land.
    """
    if not isinstance(company_id, str) or not isinstance(digest, str):
        raise ValueError("company id and digest must be strings")
    try:
        canonical = str(uuid.UUID(company_id))
    except ValueError as exc:
        raise ValueError(f"company id is not a UUID: {company_id!r}") from exc
    # uuid.UUID also accepts braces, "urn:uuid:", upper case and missing hyphens;
    # demanding the canonical spelling keeps one key per company.
    if canonical != company_id:
        raise ValueError(f"company id is not in canonical form: {company_id!r}")
    if not _DIGEST_RE.fullmatch(digest):
        raise ValueError(f"digest is not 64 lower-case hex characters: {digest!r}")
    return f"objects/{company_id}/{digest[:2]}/{digest}"


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if ``object_key`` could have produced it, else raise ValueError.

    Providers check every key they are handed even though callers should only
    ever pass ``object_key`` results: a key is turned into a file path or an S3
    key, and one malformed key must not be able to reach outside the object tree.
    """
    match = OBJECT_KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if match is None or match["digest"][:2] != match["fanout"]:
        raise ValueError(f"not an object key: {key!r}")
    return key


def check_put_arguments(key: str, size: int, sha256_hex: str) -> None:
    """Reject a put whose key does not name the declared digest.

    A mix-up here would file bytes under another object's address, and every
    later reader of that address would get the wrong content.
    """
    validate_key(key)
    if key.rsplit("/", 1)[1] != sha256_hex:
        raise ValueError(f"key {key!r} does not name the declared digest {sha256_hex!r}")
    if size < 0:
        raise ValueError(f"negative size: {size}")


def is_object_key(key: str) -> bool:
    try:
        validate_key(key)
    except ValueError:
        return False
    return True


def check_range(start: int, end: int | None, chunk_size: int) -> None:
    if start < 0:
        raise ValueError(f"range start must not be negative: {start}")
    if end is not None and end < start:
        raise ValueError(f"range end {end} is before its start {start}")
    if chunk_size <= 0:
        raise ValueError(f"chunk size must be positive: {chunk_size}")


def open_stream(chunks: Generator[bytes, None, None]) -> Iterator[bytes]:
    """Run a provider's chunk generator up to its first yield and hand it back.

    Each provider's generator opens the object, then yields ``b""`` before any
    data. Running it that far here means a missing object or an unreachable
    backend raises when ``read_chunks`` is called, so an HTTP handler can still
    answer with an error status instead of failing halfway through a response
    it has already started. A generator that has started is closed (and its
    file or HTTP body released) when it is garbage collected, even if the
    caller never iterates it.
    """
    opened = next(chunks)
    if opened != b"":
        raise AssertionError("chunk generators must yield b'' once the object is open")
    return chunks


@dataclass(frozen=True)
class Span:
    """One object whose bytes are ``size`` bytes at ``offset`` of a source file."""

    key: str
    offset: int
    size: int
    sha256_hex: str


def copy_span(src: Path, span: Span, dest: Path) -> None:
    with src.open("rb") as source, dest.open("wb") as out:
        source.seek(span.offset)
        out.write(source.read(span.size))


class StorageProvider(abc.ABC):
    """Durable, immutable object storage addressed by ``object_key`` keys."""

    name: str

    @abc.abstractmethod
    def put_file(self, key: str, src: Path, size: int, sha256_hex: str) -> bool:
        """Store the bytes of local file ``src`` under ``key`` unless an object is already there.

        Returns True when this call created the object and False when it already
        existed (left untouched). The object is durable when this returns, and a
        partial object is never visible under ``key``, even if the process dies
        mid-copy. ``src`` is neither modified nor removed.

        Raises SourceMismatch if ``src`` does not have ``size`` bytes hashing to
        ``sha256_hex`` (nothing is stored), ValueError for a malformed key, and
        StorageUnavailable when the backend fails.
        """

    def adopt_file(self, key: str, src: Path, size: int, sha256_hex: str) -> bool:
        """``put_file`` for a spool file the caller wrote and hashed itself and
        removes afterwards: a provider may take the file over instead of
        copying and hashing it again. The caller must not write to ``src``
        any more. Same answer and guarantees as ``put_file``."""
        return self.put_file(key, src, size, sha256_hex)

    def put_bytes(self, key: str, data: bytes, sha256_hex: str) -> bool:
        """``put_file`` for a small object already in memory (an upload's body
        that never needed a spool file). Same answer and guarantees as
        ``put_file``; this default goes through a temp file, a provider may
        store the bytes directly."""
        check_put_arguments(key, len(data), sha256_hex)
        fd, name = tempfile.mkstemp(prefix="put-bytes-")
        try:
            with open(fd, "wb", closefd=True) as out:
                out.write(data)
            return self.put_file(key, Path(name), len(data), sha256_hex)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    async def put_bytes_async(self, key: str, data: bytes, sha256_hex: str) -> bool:
        """``put_bytes`` from the event loop, which goes on meanwhile; this
        default runs it in a worker thread."""
        return await asyncio.to_thread(self.put_bytes, key, data, sha256_hex)

    def put_spans(self, src: Path, spans: Sequence[Span]) -> list[bool]:
        """Store several objects whose bytes are ranges of ``src``, as ``put_file``
        would each (one answer per span, in order). All are durable when this
        returns; a provider may make them durable together, with one sync."""
        created: list[bool] = []
        fd, name = tempfile.mkstemp(dir=src.parent, prefix="span-")
        os.close(fd)
        try:
            for span in spans:
                copy_span(src, span, Path(name))
                created.append(self.put_file(span.key, Path(name), span.size, span.sha256_hex))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        return created

    @abc.abstractmethod
    def read_chunks(
        self, key: str, start: int = 0, end: int | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> Iterator[bytes]:
        """Iterate over bytes ``[start, end)`` of the object (``end=None``: to its end).

        A range reaching past the end of the object is cut at the end. Raises
        ObjectMissing (or StorageUnavailable) when called, before the first
        chunk, so callers can choose a response status before streaming.
        """

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in (logical) bytes, or None if there is no object under ``key``."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a key that is already absent is not an error."""

    @abc.abstractmethod
    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """Every object key starting with ``prefix``, in lexicographic order.

        Anything in the backend that is not an object key (temporary files,
        foreign objects in a shared bucket) is skipped, so a sweeper iterating
        here can only ever be handed keys it may pass back to ``delete``.
        """

    @abc.abstractmethod
    def sweep_abandoned_writes(self, started_before: float) -> int:
        """Remove what puts that never finished left behind, if they started
        before ``started_before`` (seconds since the epoch); return how many.

        A put that fails cleans up after itself; one whose process died
        (``kill -9``, a crash, a lost machine) cannot: its temp file or S3
        multipart upload stays, invisible under any key but taking space.
        Only the provider's own writes are touched (temp files of its root,
        multipart uploads of object keys), and only old ones: a younger one
        may be a live put of another replica.
        """

    @abc.abstractmethod
    def check(self) -> None:
        """Raise StorageUnavailable unless the backend is reachable and usable."""
