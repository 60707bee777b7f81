"""A small request must not make the host store gigabytes: 255
upload frames of 4 MiB of zeros and one of random bytes, about 41 KB on the
wire, are 1,020 MiB of content. Stored packed, they cost the object store a
small multiple of what was sent, on local disk and on S3, and read back
byte for byte, whole and by range."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard

from common.bridge import CHUNK_MAX, END_FRAME, encode_frame
from tests.controller.test_controller_s3 import s3_controller  # noqa: F401 -- a fixture
from tests.support.bridge import Run, start_run
from tests.support.controller import ControllerProcess, Tenant, bootstrap_tenant
from tests.support.s3server import FAKE_CREDENTIALS, S3Server
from tests.support.storage import s3_client

ZERO_FRAMES = 255
TAIL = os.urandom(3000)
SIZE = ZERO_FRAMES * CHUNK_MAX + len(TAIL)


def attack_body() -> bytes:
    cctx = zstandard.ZstdCompressor()
    zeros = encode_frame(bytes(CHUNK_MAX), cctx)
    return zeros * ZERO_FRAMES + encode_frame(TAIL, None) + END_FRAME


@functools.cache
def expected_digest() -> str:
    """SHA-256 of the 1,020 MiB of content (seconds of CPU: once per module)."""
    h = hashlib.sha256()
    zeros = bytes(CHUNK_MAX)
    for _ in range(ZERO_FRAMES):
        h.update(zeros)
    h.update(TAIL)
    return h.hexdigest()


def logical(start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the uploaded content, without building it."""
    zeros_end = ZERO_FRAMES * CHUNK_MAX
    zeros = bytes(max(0, min(end, zeros_end) - start))
    return zeros + TAIL[max(start - zeros_end, 0) : max(end - zeros_end, 0)]


def disk_usage(root: Path) -> int:
    """Bytes of disk the files under ``root`` take (allocated blocks)."""
    total = 0
    for path in root.rglob("*"):
        st = path.lstat()
        if path.is_file():
            total += st.st_blocks * 512
    return total


def upload_and_read_back(run: Run, body: bytes, digest: str) -> None:
    """The attack's upload, committed so the run may read it; then the whole
    object (hashed as it streams) and ranges across the zeros and the tail."""
    with run.client() as c:
        r = c.put("/folders/task/uploads", content=body, headers={"X-Content-SHA256": digest})
        assert r.status_code == 200, r.text
        assert r.json() == {"digest": digest, "byteSize": SIZE}
    r = run.commit(
        "task", [{"op": "put", "path": "zeros.bin", "digest": digest, "executable": False}]
    )
    assert r.status_code == 200, r.text
    url = f"/folders/task/objects/{digest}"
    with run.client() as c:
        h, got = hashlib.sha256(), 0
        with c.stream("GET", url) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_bytes():
                h.update(chunk)
                got += len(chunk)
        assert (got, h.hexdigest()) == (SIZE, digest)
        tail_start = ZERO_FRAMES * CHUNK_MAX
        for start, end in [(tail_start - 100, tail_start + 100), (SIZE - 10, SIZE), (5, 70)]:
            resp = c.get(url, headers={"Range": f"bytes={start}-{end - 1}"})
            assert resp.status_code == 206
            assert resp.content == logical(start, end), (start, end)


def test_a_41_kb_upload_stores_kilobytes_on_local_disk(
    controller: ControllerProcess, tenant: Tenant
) -> None:
    body, digest = attack_body(), expected_digest()
    assert len(body) < 48_000
    objects = controller.data_dir / "objects"
    before = disk_usage(objects)
    upload_and_read_back(start_run(tenant), body, digest)
    stored = disk_usage(objects) - before
    assert stored <= 4 * len(body) + 8192, f"{stored} bytes stored for a {len(body)}-byte request"
    key = objects / "objects" / tenant.company_id / digest[:2] / digest
    assert key.stat().st_size <= 4 * len(body)


@pytest.fixture
def s3_tenant(
    s3_controller: tuple[ControllerProcess, S3Server, str],  # noqa: F811 -- the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Tenant, S3Server, str]]:
    ctl, server, bucket = s3_controller
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    yield bootstrap_tenant(ctl), server, bucket


def test_a_41_kb_upload_stores_kilobytes_on_s3(
    s3_tenant: tuple[Tenant, S3Server, str],
) -> None:
    tenant, server, bucket = s3_tenant
    body, digest = attack_body(), expected_digest()
    upload_and_read_back(start_run(tenant), body, digest)
    key = f"objects/{tenant.company_id}/{digest[:2]}/{digest}"
    listed = s3_client(server).list_objects_v2(
        Bucket=bucket, Prefix=f"objects/{tenant.company_id}/"
    )
    sizes = {o["Key"]: o["Size"] for o in listed.get("Contents", [])}
    assert sizes[key] <= 4 * len(body), sizes
    assert sum(sizes.values()) <= 4 * len(body) + 8192, sizes
