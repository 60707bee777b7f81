"""S3 multipart uploads with parts sent in parallel, against the test S3 server."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controller.storage.base import SourceMismatch, object_key
from tests.support.s3server import S3Server
from tests.support.storage import make_s3_provider, s3_client, sha256

COMPANY = "0b6f0f3e-8d4e-4d5c-9a59-3f1c1f2f7a10"
PART = 5 << 20


def test_multipart_round_trip_sends_parts_in_parallel(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    provider = make_s3_provider(
        s3_server, s3_bucket, multipart_threshold=PART, part_size=PART, part_concurrency=3
    )
    provider.check()  # creates the bucket
    data = os.urandom(4 * PART + 12345)  # five parts, the last one short
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    key = object_key(COMPANY, sha256(data))
    in_flight, most = 0, 0
    lock = threading.Lock()
    upload_part = provider._upload_part

    def counting(*args: Any) -> str:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        try:
            time.sleep(0.2)  # long enough for the next parts to start
            return upload_part(*args)
        finally:
            with lock:
                in_flight -= 1

    provider._upload_part = counting  # type: ignore[method-assign]
    assert provider.put_file(key, src, len(data), sha256(data)) is True
    assert b"".join(provider.read_chunks(key)) == data
    head = s3_client(s3_server).head_object(Bucket=s3_bucket, Key=key, PartNumber=1)
    assert head["PartsCount"] == 5
    assert 2 <= most <= 3, most
    assert provider.put_file(key, src, len(data), sha256(data)) is False  # already there


def test_multipart_of_bytes_that_do_not_match_stores_nothing(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    provider = make_s3_provider(s3_server, s3_bucket, multipart_threshold=PART, part_size=PART)
    provider.check()
    data = os.urandom(2 * PART + 1)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    key = object_key(COMPANY, sha256(b"other bytes"))
    with pytest.raises(SourceMismatch):
        provider.put_file(key, src, len(data), sha256(b"other bytes"))
    assert provider.size(key) is None
    uploads = s3_client(s3_server).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert uploads == []  # aborted
