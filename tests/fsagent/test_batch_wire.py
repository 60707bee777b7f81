"""fsagent's batch fetch reader (:func:`fsagent.bridge.http.read_batch`) over the one
wire reader, :mod:`common.wire`: what it writes for a good answer, and that
every bad one is a ``BadBatch`` refused before it costs memory. The memory
test runs in a subprocess of its own, whose peak RSS is the measure."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import zstandard

from common.bridge import END_FRAME, batch_header, encode_batch, frame_header, member_header
from fsagent.bridge.base import BadBatch
from fsagent.bridge.http import read_batch

DECLARED = 512 << 20
"""What the hostile frame claims to decompress to."""

RAW_LEN = 4096
"""What its frame header and member header say it holds."""


def lying_frame() -> bytes:
    """A zstd frame of a few KiB declaring (and holding) DECLARED zero bytes,
    made in bounded memory."""
    cctx = zstandard.ZstdCompressor(level=3)
    chunker = cctx.chunker(size=DECLARED, chunk_size=1 << 20)
    out = bytearray()
    zeros = bytes(1 << 20)
    for _ in range(DECLARED >> 20):
        for piece in chunker.compress(zeros):
            out += piece
    for piece in chunker.finish():
        out += piece
    assert zstandard.frame_content_size(bytes(out)) == DECLARED
    return bytes(out)


def lying_batch() -> bytes:
    payload = lying_frame()
    return b"".join(
        [
            batch_header(1),
            member_header(RAW_LEN, hashlib.sha256(bytes(RAW_LEN)).digest()),
            frame_header(len(payload), RAW_LEN, 0),
            payload,
            END_FRAME,
        ]
    )


PROBE = """
import json, resource, sys
from pathlib import Path
import trio
from fsagent.bridge.base import BadBatch
from fsagent.bridge.http import read_batch

body = Path(sys.argv[1]).read_bytes()
dest = Path(sys.argv[2])

async def chunks():
    for i in range(0, len(body), 65536):
        yield body[i : i + 65536]

async def main():
    try:
        await read_batch(chunks(), 1, lambda i: dest)
    except BadBatch as exc:
        return str(exc)
    return None

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
refused = trio.run(main)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"refused": refused, "growth_kib": after - before}))
"""


def test_a_frame_declaring_512_mib_is_refused_without_allocating_it(tmp_path: Path) -> None:
    body = lying_batch()
    assert len(body) < 64 << 10
    (tmp_path / "body").write_bytes(body)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "body"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    got = json.loads(proc.stdout)
    assert got["refused"] is not None, "the lying frame was accepted"
    assert "declares" in got["refused"], got["refused"]
    assert got["growth_kib"] < 64 << 10, f"RSS grew by {got['growth_kib']} KiB"


async def _chunks(body: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


def _read(body: bytes, count: int, dest: Path) -> list[tuple[str, int]]:
    async def main() -> list[tuple[str, int]]:
        return await read_batch(_chunks(body), count, lambda i: dest / str(i))

    return trio.run(main)


def test_a_good_answer_is_written_member_by_member(tmp_path: Path) -> None:
    members = [b"", b"small", os.urandom(5 << 20), b"z" * 100_000]
    got = _read(encode_batch(members), len(members), tmp_path)
    assert got == [(hashlib.sha256(m).hexdigest(), len(m)) for m in members]
    for i, m in enumerate(members):
        assert (tmp_path / str(i)).read_bytes() == m


def test_a_short_member_names_its_object(tmp_path: Path) -> None:
    raw = b"x" * 100
    sha = hashlib.sha256(raw).digest()
    body = encode_batch([raw])
    # The member header claims one byte more than its frames carry.
    body = body.replace(member_header(100, sha), member_header(101, sha))
    with pytest.raises(BadBatch) as caught:
        _read(body, 1, tmp_path)
    assert caught.value.digest == sha.hex()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(encode_batch([b"a", b"b"]), id="more-members-than-asked"),
        pytest.param(encode_batch([b"a"])[:-5], id="cut-off"),
        pytest.param(encode_batch([b"a"]) + b"\0", id="trailing-data"),
        pytest.param(b"NOPE" + encode_batch([b"a"])[4:], id="bad-magic"),
    ],
)
def test_a_bad_answer_is_a_bad_batch(tmp_path: Path, body: bytes) -> None:
    with pytest.raises(BadBatch):
        _read(body, 1, tmp_path)


def test_a_corrupt_frame_is_a_bad_batch(tmp_path: Path) -> None:
    raw = b"hello world" * 10
    good = encode_batch([raw])
    header = batch_header(1) + member_header(len(raw), hashlib.sha256(raw).digest())
    frame = good[len(header) : -len(END_FRAME)]
    # Same lengths, a wrong xxh64.
    bad = frame[:8] + (int.from_bytes(frame[8:16], "big") ^ 1).to_bytes(8, "big") + frame[16:]
    with pytest.raises(BadBatch, match="batch frame"):
        _read(header + bad + END_FRAME, 1, tmp_path)
