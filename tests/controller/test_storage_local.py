"""Checks only the ``local_disk`` provider can have: files under its root,
fsync failures, symlinks planted in the store, stray and stale files.

The behaviour every provider shares is in ``test_storage.py``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.errors import StorageUnavailable
from controller.storage import LocalDiskProvider, object_key
from controller.storage import local_disk as local_disk_module
from tests.support.storage import (
    COMPANY,
    MiB,
    leftovers,
    random_bytes,
    sha256,
    store,
    write_source,
)


def _fail_fsync_of(kind: Callable[[int], bool]) -> Callable[[int], None]:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if kind(os.fstat(fd).st_mode):
            raise OSError(5, "Input/output error (injected fsync failure)")
        real_fsync(fd)

    return fsync


def test_local_fsync_failure_of_the_copy_stores_nothing(
    local_provider: LocalDiskProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(3 * MiB, seed=7)
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    monkeypatch.setattr(local_disk_module.os, "fsync", _fail_fsync_of(stat.S_ISREG))
    with pytest.raises(StorageUnavailable, match="injected fsync"):
        local_provider.put_file(key, write_source(tmp_path, data), len(data), digest)
    monkeypatch.undo()
    assert local_provider.exists(key) is False
    assert leftovers(local_provider, None) == []
    assert local_provider.put_file(key, write_source(tmp_path, data), len(data), digest) is True


def test_local_fsync_failure_of_the_directory_withdraws_the_object(
    local_provider: LocalDiskProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"linked but not yet durable"
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    # Directories made on the way are synced too, so let the ones for this key
    # exist first and fail only the sync after the link.
    (local_provider.root / key).parent.mkdir(parents=True)
    monkeypatch.setattr(local_disk_module.os, "fsync", _fail_fsync_of(stat.S_ISDIR))
    with pytest.raises(StorageUnavailable, match="injected fsync"):
        local_provider.put_file(key, write_source(tmp_path, data), len(data), digest)
    monkeypatch.undo()
    # Reporting failure while leaving the object visible would make the retry
    # answer "already exists" for an object that might not survive a crash.
    assert local_provider.exists(key) is False
    assert leftovers(local_provider, None) == []


def _refuse_anonymous_files(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the provider's filesystem one without ``O_TMPFILE``; the list
    counts the refusals."""
    real_open = os.open
    refused: list[int] = []

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            refused.append(flags)
            raise OSError(errno.EOPNOTSUPP, "Operation not supported (injected)")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local_disk_module.os, "open", refusing_open)
    return refused


@pytest.mark.parametrize("anonymous", [True, False])
def test_local_put_bytes_with_and_without_anonymous_files(
    local_provider: LocalDiskProvider, monkeypatch: pytest.MonkeyPatch, anonymous: bool
) -> None:
    """An anonymous file where the filesystem makes them, and the temp
    directory not even opened (here: missing, and not made again); else a
    named temp file there, removed once linked."""
    refused = [] if anonymous else _refuse_anonymous_files(monkeypatch)
    if anonymous:
        (local_provider.root / "tmp").rmdir()
    data = b"a small upload, kept in memory"
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    assert local_provider.put_bytes(key, data, digest) is True
    assert local_provider.put_bytes(key, data, digest) is False  # there already
    assert b"".join(local_provider.read_chunks(key, 0, None)) == data
    assert (local_provider.root / "tmp").exists() is not anonymous
    assert anonymous or (leftovers(local_provider, None) == [] and len(refused) == 1)


def test_local_put_bytes_in_c_stores_what_the_python_steps_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C store (controller/storage/_objfile.c, built by ``make deps``)
    and the Python steps leave the same file, answer the same, and both
    refuse a symlinked directory on the way."""
    real = local_disk_module._put_new
    assert real is not None, "the C store was not built"
    answers: list[int] = []

    def counted(*args: Any) -> int:
        answers.append(real(*args))
        return answers[-1]

    stored: dict[str, bytes] = {}
    for way in ("c", "python"):
        monkeypatch.setattr(local_disk_module, "_put_new", counted if way == "c" else None)
        provider = LocalDiskProvider(tmp_path / way)
        for data in (b"small, stored as it is", random_bytes(256 * 1024, seed=3), b"x" * 65536):
            digest = sha256(data)
            key = object_key(COMPANY, digest)
            assert provider.put_bytes(key, data, digest) is True  # its directories made
            again = object_key(COMPANY, sha256(data + b"!"))
            (provider.root / again).parent.mkdir(parents=True, exist_ok=True)
            assert provider.put_bytes(again, data + b"!", sha256(data + b"!")) is True
            assert provider.put_bytes(key, data, digest) is False
            assert b"".join(provider.read_chunks(key, 0, None)) == data
            for k in (key, again):
                stored[f"{way}:{k}"] = (provider.root / k).read_bytes()
                assert stat.S_IMODE((provider.root / k).stat().st_mode) == 0o600
        assert leftovers(provider, None) == []
        outside = tmp_path / f"outside-{way}"
        outside.mkdir()
        other = "0b9e9f0e-0000-4000-8000-000000000000"
        (provider.root / "objects" / other).symlink_to(outside)
        data = b"would land outside"
        with pytest.raises(StorageUnavailable):
            provider.put_bytes(object_key(other, sha256(data)), data, sha256(data))
        assert list(outside.iterdir()) == []
    # C: a directory to make (-1), stored (1), there already (0), and the
    # symlink refused by raising.
    assert answers == [-1, 1, 0] * 3, answers
    keys = {k.split(":", 1)[1] for k in stored}
    assert len(keys) == 6
    assert all(stored[f"c:{k}"] == stored[f"python:{k}"] for k in keys)


def test_local_put_bytes_from_the_event_loop_on_the_c_stores_threads(tmp_path: Path) -> None:
    """``put_bytes_async``: the C store's own threads store what ``put_bytes``
    stores, answer the same, fall back where a directory is missing, refuse
    a symlinked directory, and keep answering the others when a caller is
    cancelled; a second event loop takes over the eventfd."""
    provider = LocalDiskProvider(tmp_path / "objects-root")
    datas = [random_bytes(4096, seed=n) for n in range(64)] + [b"y" * 65536]
    keys = [object_key(COMPANY, sha256(d)) for d in datas]

    async def put_all() -> list[bool]:
        return await asyncio.gather(
            *(provider.put_bytes_async(k, d, sha256(d)) for k, d in zip(keys, datas, strict=True))
        )

    assert asyncio.run(put_all()) == [True] * len(datas)  # directories made on the way
    assert local_disk_module._native is not None, "the C store's threads did not start"
    assert asyncio.run(put_all()) == [False] * len(datas)  # a second loop, and all there
    for k, d in zip(keys, datas, strict=True):
        assert b"".join(provider.read_chunks(k, 0, None)) == d
        assert stat.S_IMODE((provider.root / k).stat().st_mode) == 0o600
    assert leftovers(provider, None) == []

    other = "0b9e9f0e-0000-4000-8000-000000000000"
    outside = tmp_path / "outside"
    outside.mkdir()
    (provider.root / "objects" / other).symlink_to(outside)
    data = b"would land outside"
    with pytest.raises(StorageUnavailable):
        asyncio.run(provider.put_bytes_async(object_key(other, sha256(data)), data, sha256(data)))
    assert list(outside.iterdir()) == []

    async def one_cancelled() -> list[bool]:
        more = [random_bytes(4096, seed=100 + n) for n in range(16)]
        for d in more:  # their directories exist: all go to the C store's threads
            (provider.root / object_key(COMPANY, sha256(d))).parent.mkdir(
                parents=True, exist_ok=True
            )
        tasks = [
            asyncio.ensure_future(
                provider.put_bytes_async(object_key(COMPANY, sha256(d)), d, sha256(d))
            )
            for d in more
        ]
        await asyncio.sleep(0)
        tasks[0].cancel()
        answers = await asyncio.gather(*tasks[1:])
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        return answers

    assert asyncio.run(one_cancelled()) == [True] * 15


def test_local_objects_are_files_under_root(
    local_provider: LocalDiskProvider, tmp_path: Path
) -> None:
    key, _ = store(local_provider, tmp_path, b"on disk")
    path = local_provider.root / key
    assert path.read_bytes() == b"on disk"
    assert path.is_relative_to(local_provider.root)


def _plant_outside(tmp_path: Path, digest: str) -> Path:
    outside = tmp_path / "outside"
    (outside / digest[:2]).mkdir(parents=True)
    (outside / digest[:2] / digest).write_bytes(b"secret outside root")
    return outside


def test_local_refuses_symlinked_directories(
    local_provider: LocalDiskProvider, tmp_path: Path
) -> None:
    data = b"would land outside"
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    outside = _plant_outside(tmp_path, digest)
    (local_provider.root / "objects").mkdir()
    (local_provider.root / "objects" / COMPANY).symlink_to(outside)

    with pytest.raises(StorageUnavailable):
        local_provider.read_chunks(key)
    with pytest.raises(StorageUnavailable):
        local_provider.size(key)
    with pytest.raises(StorageUnavailable):
        local_provider.put_file(key, write_source(tmp_path, data), len(data), digest)
    with pytest.raises(StorageUnavailable):
        local_provider.delete(key)
    assert list(local_provider.iter_keys()) == []
    assert sorted(p.name for p in outside.rglob("*")) == sorted([digest[:2], digest])
    assert (outside / digest[:2] / digest).read_bytes() == b"secret outside root"


def test_local_refuses_symlinked_objects(local_provider: LocalDiskProvider, tmp_path: Path) -> None:
    digest = sha256(b"secret outside root")
    key = object_key(COMPANY, digest)
    outside = _plant_outside(tmp_path, digest)
    target = local_provider.root / key
    target.parent.mkdir(parents=True)
    target.symlink_to(outside / digest[:2] / digest)

    with pytest.raises(StorageUnavailable):
        local_provider.read_chunks(key)
    with pytest.raises(StorageUnavailable):
        local_provider.size(key)
    assert list(local_provider.iter_keys()) == []
    # Deleting removes the link inside root, never the file it points at.
    local_provider.delete(key)
    assert not target.is_symlink()
    assert (outside / digest[:2] / digest).read_bytes() == b"secret outside root"


def test_local_iter_keys_skips_foreign_files(
    local_provider: LocalDiskProvider, tmp_path: Path
) -> None:
    key, _ = store(local_provider, tmp_path, b"real")
    (local_provider.root / "tmp" / "put-inflight").write_bytes(b"partial")
    (local_provider.root / key).with_name("notes.txt").write_text("junk")
    (local_provider.root / "objects" / "README").write_text("junk")
    assert list(local_provider.iter_keys()) == [key]


def test_local_sweeps_stale_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    LocalDiskProvider(root)
    stale, fresh = root / "tmp" / "put-stale", root / "tmp" / "put-fresh"
    stale.write_bytes(b"from a put that died")
    fresh.write_bytes(b"from a put still running elsewhere")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    LocalDiskProvider(root)
    assert sorted(os.listdir(root / "tmp")) == ["put-fresh"]


def test_local_check(local_provider: LocalDiskProvider, tmp_path: Path) -> None:
    local_provider.check()
    assert leftovers(local_provider, None) == []
    tmp_dir = local_provider.root / "tmp"
    tmp_dir.rmdir()
    tmp_dir.symlink_to(tmp_path)
    with pytest.raises(StorageUnavailable):
        local_provider.check()
