"""Adaptive compression on the wire: what fsagent sends the controller, read
from the request bodies. Data that does not compress goes up as stored zstd
frames (raw blocks), data that does goes up compressed, in batches and in
single uploads alike; the controller stores the same bytes either way."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest
import zstandard

from common.bridge import (
    BATCH_HEADER,
    BATCH_MAGIC,
    CHUNK_MAX,
    FRAME_HEADER,
    MEMBER_HEADER,
    stored_zstd,
)
from tests.support.controller import ControllerProcess, Tenant
from tests.support.lossy_proxy import LossyProxy
from tests.support.mount import MountFactory
from tests.system.test_checkpoints import flush, start_run, token_file

pytestmark = pytest.mark.fuse
UPLOADS = r"/folders/task/uploads(/batch)?$"

Frames = list[tuple[int, bytes]]
"""(raw length, zstd payload) of each frame of one object."""


@pytest.fixture
def proxy(controller: ControllerProcess) -> Iterator[LossyProxy]:
    """Requested before the mounts, so it outlives them (tests/system/test_batch_faults.py)."""
    p = LossyProxy(controller.url).start()
    try:
        yield p
    finally:
        p.stop()


def read_frames(body: bytes, pos: int) -> tuple[Frames, int]:
    frames: Frames = []
    while True:
        clen, rlen, _ = FRAME_HEADER.unpack_from(body, pos)
        pos += FRAME_HEADER.size
        if clen == 0 and rlen == 0:
            return frames, pos
        frames.append((rlen, body[pos : pos + clen]))
        pos += clen


def objects_sent(bodies: list[tuple[str, bytes]]) -> dict[str, tuple[str, Frames]]:
    """SHA-256 of each object sent → ("batch" or "single", its frames)."""
    out: dict[str, tuple[str, Frames]] = {}
    for what, body in bodies:
        if what.endswith("/batch"):
            magic, count = BATCH_HEADER.unpack_from(body)
            assert magic == BATCH_MAGIC
            pos = BATCH_HEADER.size
            for _ in range(count):
                _, sha = MEMBER_HEADER.unpack_from(body, pos)
                frames, pos = read_frames(body, pos + MEMBER_HEADER.size)
                out[sha.hex()] = ("batch", frames)
            assert pos == len(body)
        else:
            frames, pos = read_frames(body, 0)
            assert pos == len(body)
            raw = b"".join(zstandard.ZstdDecompressor().decompress(p) for _, p in frames)
            out[hashlib.sha256(raw).hexdigest()] = ("single", frames)
    return out


def text(size: int) -> bytes:
    line = b"the quick brown fox jumps over the lazy dog, again and again\n"
    return (line * (size // len(line) + 1))[:size]


def test_incompressible_data_goes_up_stored_and_compressible_data_compressed(
    proxy: LossyProxy, mode_mounts: MountFactory, tenant: Tenant
) -> None:
    run = start_run(tenant)
    m = mode_mounts.mount(proxy.url, scope="task", token_file=token_file(mode_mounts, run))
    files = {
        "small.txt": text(20_000),
        "small.bin": os.urandom(20_000),
        "big.txt": text(CHUNK_MAX + 300_000),
        "big.bin": os.urandom(CHUNK_MAX + 300_000),
    }
    for name, data in files.items():
        (m.mountpoint / name).write_bytes(data)
    proxy.record_bodies("PUT", UPLOADS)
    reply = flush(m)
    assert reply["ok"] is True, reply

    sent = objects_sent(proxy.bodies)
    by_name = {name: sent[hashlib.sha256(data).hexdigest()] for name, data in files.items()}
    assert {name: how for name, (how, _) in by_name.items()} == {
        "small.txt": "batch",
        "small.bin": "batch",
        "big.txt": "single",
        "big.bin": "single",
    }
    for name, data in files.items():
        frames = by_name[name][1]
        assert [n for n, _ in frames] == [
            len(data[i : i + CHUNK_MAX]) for i in range(0, len(data), CHUNK_MAX)
        ]
        offset = 0
        for rlen, payload in frames:
            raw = data[offset : offset + rlen]
            offset += rlen
            if name.endswith(".bin"):
                # Raw blocks only: the bytes themselves, 13 bytes of frame
                # header and 3 per 128 KiB block.
                assert payload == stored_zstd(raw), name
                assert payload[:5] == b"\x28\xb5\x2f\xfd\xe0" and payload[16:4096] == raw[:4080]
                assert len(payload) == 13 + 3 * -(-rlen // (128 << 10)) + rlen
            else:
                assert len(payload) < rlen // 10, (name, len(payload), rlen)
                assert zstandard.ZstdDecompressor().decompress(payload) == raw
    # The controller keeps the bytes, whichever way they travelled.
    folder = tenant.folder("task", run["task"])
    with tenant.client() as c:
        for name, data in files.items():
            got = c.get(folder + "/content", params={"path": name})
            assert got.status_code == 200 and got.content == data, name
