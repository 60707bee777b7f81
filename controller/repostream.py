"""Streamed answers built from stored objects: the batched object fetch of a
restore and the tar download of a repository checkpoint.

Both are blocking generators that read one storage chunk at a time (the API
advances them in a worker thread), so memory stays bounded by a chunk however
large the objects or the checkpoint are; nothing is assembled in memory or on
disk. A stored object that does not have the size its address was recorded
with ends the stream early (ObjectMissing), which the client sees as a
truncated body rather than as wrong bytes.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

import zstandard

from common.bridge import (
    CHUNK_MAX,
    END_FRAME,
    batch_header,
    compressible,
    encode_frame,
    member_header,
)
from controller.repomanifest import Manifest
from controller.storage.base import ObjectMissing, StorageProvider, object_key

_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


def _chunks(storage: StorageProvider, company_id: str, digest: str, size: int) -> Iterator[bytes]:
    """The object's bytes in chunks of 1 to CHUNK_MAX bytes; exactly ``size`` of them."""
    seen = 0
    for chunk in storage.read_chunks(object_key(company_id, digest), chunk_size=CHUNK_MAX):
        seen += len(chunk)
        if seen > size:
            break
        for start in range(0, len(chunk), CHUNK_MAX):
            yield chunk[start : start + CHUNK_MAX]
    if seen != size:
        raise ObjectMissing(f"object {digest} has {seen} bytes, not {size}")


def batch_body(
    storage: StorageProvider, company_id: str, objects: list[tuple[str, int]]
) -> Iterator[bytes]:
    """The batch body of :func:`common.bridge.encode_batch` for ``objects``
    (digest, size), in order: each member's header from its content address,
    then one frame per stored chunk, compressed unless its first chunk looks
    incompressible (Git packs do not compress again)."""
    compressor = zstandard.ZstdCompressor(level=1)
    yield batch_header(len(objects))
    for digest, size in objects:
        yield member_header(size, bytes.fromhex(digest))
        packer: zstandard.ZstdCompressor | None = compressor
        for i, chunk in enumerate(_chunks(storage, company_id, digest, size)):
            if i == 0 and not compressible(chunk):
                packer = None
            yield encode_frame(chunk, packer)
        yield END_FRAME


def _header(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def tar_body(
    storage: StorageProvider, company_id: str, name: str, manifest: Manifest, mtime: float
) -> Iterator[bytes]:
    """A POSIX (pax) tar of the checkpoint under ``name/``: directories 0755,
    files 0644 or 0755 (their exec bit), symlinks with their targets; every
    entry dated ``mtime`` (whole seconds). Readable by ``tarfile`` and GNU tar."""
    written = 0
    seconds = int(mtime)  # a fraction would cost a pax header per entry

    def entry(path: str, kind: bytes, mode: int, size: int = 0, target: str = "") -> bytes:
        info = tarfile.TarInfo(path)
        info.type, info.mode, info.size, info.mtime, info.linkname = (
            kind,
            mode,
            size,
            seconds,
            target,
        )
        return _header(info)

    head = entry(name, tarfile.DIRTYPE, 0o755)
    written += len(head)
    yield head
    for path in sorted(manifest.members):
        member = manifest.members[path]
        full = f"{name}/{path}"
        if member.kind == "dir":
            head = entry(full, tarfile.DIRTYPE, 0o755)
        elif member.kind == "symlink":
            assert member.target is not None
            head = entry(full, tarfile.SYMTYPE, 0o777, target=member.target)
        else:
            mode = 0o755 if member.executable else 0o644
            head = entry(full, tarfile.REGTYPE, mode, member.byte_size)
        written += len(head)
        yield head
        if member.kind != "file":
            continue
        assert member.digest is not None
        for chunk in _chunks(storage, company_id, member.digest, member.byte_size):
            written += len(chunk)
            yield chunk
        pad = -member.byte_size % _BLOCK
        if pad:
            written += pad
            yield b"\0" * pad
    # Two zero blocks end the archive; tar(1) pads to a whole record.
    end = 2 * _BLOCK
    end += -(written + end) % _RECORD
    yield b"\0" * end
