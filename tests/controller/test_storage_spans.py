"""Storing many objects from one spool (``put_spans``: one sync for the batch)
and taking over a spool file (``adopt_file``: no second copy), on both providers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import controller.storage.local_disk as local_disk
from common.errors import StorageUnavailable
from controller.storage.base import SourceMismatch, Span, StorageProvider, object_key
from controller.storage.local_disk import LocalDiskProvider
from controller.storage.s3 import S3Provider
from tests.support.storage import sha256

COMPANY = "5d1c3a3e-2b7f-4c39-8f0e-1d2a3b4c5d6e"


def spool_of(tmp_path: Path, members: list[bytes]) -> tuple[Path, list[Span]]:
    src = tmp_path / "spool"
    src.write_bytes(b"".join(members))
    spans, offset = [], 0
    for m in members:
        spans.append(Span(object_key(COMPANY, sha256(m)), offset, len(m), sha256(m)))
        offset += len(m)
    return src, spans


def read(provider: StorageProvider, key: str) -> bytes:
    return b"".join(provider.read_chunks(key))


@pytest.fixture(params=["local_disk", "s3"])
def provider(request: pytest.FixtureRequest, local_provider: LocalDiskProvider) -> StorageProvider:
    if request.param == "s3":
        s3: S3Provider = request.getfixturevalue("s3_provider")
        return s3
    return local_provider


def test_put_spans_stores_each_member_once(provider: StorageProvider, tmp_path: Path) -> None:
    members = [os.urandom(100 + i) for i in range(20)] + [b""]
    src, spans = spool_of(tmp_path, members)
    first = provider.put_file(spans[3].key, _file(tmp_path, members[3]), 103, sha256(members[3]))
    assert first is True
    created = provider.put_spans(src, spans)
    assert created == [i != 3 for i in range(len(members))]
    for span, data in zip(spans, members, strict=True):
        assert read(provider, span.key) == data
    assert provider.put_spans(src, spans) == [False] * len(members)


def test_a_member_that_does_not_match_stores_nothing(
    provider: StorageProvider, tmp_path: Path
) -> None:
    members = [os.urandom(500) for _ in range(5)]
    src, spans = spool_of(tmp_path, members)
    spans[3] = Span(object_key(COMPANY, sha256(b"x")), spans[3].offset, 500, sha256(b"x"))
    with pytest.raises((SourceMismatch, StorageUnavailable)):
        provider.put_spans(src, spans)
    if isinstance(provider, LocalDiskProvider):  # all or nothing on local disk
        assert not any(provider.exists(s.key) for s in spans)
    assert not provider.exists(spans[3].key)


def test_local_put_spans_syncs_once_and_undoes_its_links_when_the_sync_fails(
    local_provider: LocalDiskProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[int] = []
    real = local_disk._syncfs
    monkeypatch.setattr(local_disk, "_syncfs", lambda fd: (syncs.append(fd), real(fd)))
    src, spans = spool_of(tmp_path, [os.urandom(64) for _ in range(50)])
    assert local_provider.put_spans(src, spans) == [True] * 50
    assert len(syncs) == 1
    assert list((local_provider.root / "tmp").iterdir()) == []

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local_disk, "_syncfs", broken)
    src, spans = spool_of(tmp_path, [os.urandom(64) for _ in range(10)])
    with pytest.raises(StorageUnavailable):
        local_provider.put_spans(src, spans)
    assert not any(local_provider.exists(s.key) for s in spans)


def test_local_adopt_file_links_the_spool_instead_of_copying(
    local_provider: LocalDiskProvider, tmp_path: Path
) -> None:
    data = os.urandom(3 << 20)
    spool = _file(tmp_path, data)
    key = object_key(COMPANY, sha256(data))
    with pytest.raises(SourceMismatch):
        local_provider.adopt_file(key, spool, len(data) - 1, sha256(data))
    assert not local_provider.exists(key)
    assert local_provider.adopt_file(key, spool, len(data), sha256(data)) is True
    stored = local_provider.root / key
    assert stored.stat().st_ino == spool.stat().st_ino  # the same file: no copy
    spool.unlink()  # as the controller does once the object is stored
    assert read(local_provider, key) == data
    again = _file(tmp_path, data)
    assert local_provider.adopt_file(key, again, len(data), sha256(data)) is False


def test_adopt_file_stores_the_bytes_on_s3(s3_provider: S3Provider, tmp_path: Path) -> None:
    data = os.urandom(10_000)
    key = object_key(COMPANY, sha256(data))
    assert s3_provider.adopt_file(key, _file(tmp_path, data), len(data), sha256(data)) is True
    assert read(s3_provider, key) == data


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / f"src-{sha256(data)[:12]}"
    path.write_bytes(data)
    return path
