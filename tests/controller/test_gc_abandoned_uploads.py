"""Puts that never finish: an S3 multipart upload is aborted on every failure
the put sees, and GC removes what a killed process left (an incomplete
multipart upload, a local temp file) once it is older than the grace period,
keeping young ones (a live put of another replica) and anything not its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from common.errors import StorageUnavailable
from controller import gc
from controller.storage import LocalDiskProvider, S3Provider, object_key
from tests.support.s3server import S3Server
from tests.support.storage import (
    COMPANY,
    TEST_MULTIPART_THRESHOLD,
    TEST_PART_SIZE,
    MiB,
    leftovers,
    random_bytes,
    s3_client,
    sha256,
    write_source,
)

REPO = Path(__file__).resolve().parents[2]
GRACE = timedelta(seconds=3)
YOUNGER_BY = timedelta(seconds=10)
"""How much younger the upload a sweep must keep is than the one it must abort."""

# A put of a three-part object whose second part never finishes: the process
# is killed (SIGKILL) while it waits, so nothing in it can abort the upload.
UPLOADER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from controller.storage import object_key
    from tests.support.s3server import S3Server
    from tests.support.storage import make_s3_provider, sha256

    endpoint, bucket, src = sys.argv[1:4]
    server = S3Server.__new__(S3Server)
    server.endpoint_url = endpoint
    provider = make_s3_provider(server, bucket)
    real = provider._upload_part

    def stall(key, upload_id, number, data):
        if number > 1:
            time.sleep(3600)
        return real(key, upload_id, number, data)

    provider._upload_part = stall
    data = Path(src).read_bytes()
    provider.put_file(object_key("{company}", sha256(data)), Path(src), len(data), sha256(data))
    """
).replace("{company}", COMPANY)


def uploads(server: S3Server, bucket: str) -> list[dict[str, Any]]:
    return list(s3_client(server).list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def between(older: datetime, younger: datetime) -> timedelta:
    """A grace that sweeps what began at ``older`` and keeps what began at
    ``younger``: the age of their midpoint now. A sweep that starts up to
    half their gap later (a busy machine) still decides the same."""
    return datetime.now(UTC) - (older + (younger - older) / 2)


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_gc_aborts_the_upload_of_a_killed_put_and_keeps_young_and_foreign_ones(
    s3_server: S3Server, s3_provider: S3Provider, s3_bucket: str, tmp_path: Path
) -> None:
    data = random_bytes(2 * TEST_PART_SIZE + MiB, seed=71)
    assert len(data) >= TEST_MULTIPART_THRESHOLD
    src = write_source(tmp_path, data)
    key = object_key(COMPANY, sha256(data))
    proc = subprocess.Popen(
        [sys.executable, "-c", UPLOADER, s3_server.endpoint_url, s3_bucket, str(src)],
        cwd=REPO,
        stderr=subprocess.PIPE,
    )
    client = s3_client(s3_server)
    try:

        def first_part_sent() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return any(
                client.list_parts(Bucket=s3_bucket, Key=u["Key"], UploadId=u["UploadId"]).get(
                    "Parts"
                )
                for u in uploads(s3_server, s3_bucket)
            )

        wait_for(first_part_sent, "the first part of the killed put")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
    # Not the controller's: another tool's upload in a shared bucket.
    client.create_multipart_upload(Bucket=s3_bucket, Key="elsewhere/backup.tar")
    (killed,) = [u for u in uploads(s3_server, s3_bucket) if u["Key"] == key]
    wait_for(
        lambda: datetime.now(UTC) - killed["Initiated"] > YOUNGER_BY,
        "the killed put's upload to age",
    )
    young_key = object_key(COMPANY, "ab" * 32)
    client.create_multipart_upload(Bucket=s3_bucket, Key=young_key)
    (young,) = [u for u in uploads(s3_server, s3_bucket) if u["Key"] == young_key]

    def grace() -> timedelta:
        return between(killed["Initiated"], young["Initiated"])

    assert asyncio.run(gc.sweep_abandoned_writes(s3_provider, grace())) == 1
    assert sorted(u["Key"] for u in uploads(s3_server, s3_bucket)) == [
        "elsewhere/backup.tar",
        young_key,
    ]
    with pytest.raises(ClientError):
        client.list_parts(Bucket=s3_bucket, Key=key, UploadId=killed["UploadId"])
    assert s3_provider.exists(key) is False
    # A sweep finds nothing more; the young one stays until it is old.
    assert asyncio.run(gc.sweep_abandoned_writes(s3_provider, grace())) == 0


def test_gc_removes_stale_local_temp_files_only(tmp_path: Path) -> None:
    provider = LocalDiskProvider(tmp_path / "store")
    stale, fresh = provider.root / "tmp" / "put-stale", provider.root / "tmp" / "put-fresh"
    stale.write_bytes(b"from a put that died")
    fresh.write_bytes(b"from a put still running elsewhere")
    old = time.time() - 3 * GRACE.total_seconds()
    os.utime(stale, (old, old))
    assert asyncio.run(gc.sweep_abandoned_writes(provider, GRACE)) == 1
    assert sorted(os.listdir(provider.root / "tmp")) == ["put-fresh"]


def test_a_failed_completion_aborts_the_upload(
    s3_server: S3Server, s3_provider: S3Provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(TEST_MULTIPART_THRESHOLD + MiB, seed=72)
    key = object_key(COMPANY, sha256(data))

    def failing_complete(**kwargs: Any) -> Any:
        raise ClientError(
            {"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}},
            "CompleteMultipartUpload",
        )

    monkeypatch.setattr(s3_provider._client, "complete_multipart_upload", failing_complete)
    with pytest.raises(StorageUnavailable):
        s3_provider.put_file(key, write_source(tmp_path, data), len(data), sha256(data))
    assert leftovers(s3_provider, s3_server) == []


def test_an_interrupted_put_aborts_the_upload(
    s3_server: S3Server, s3_provider: S3Provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only errors: an interrupt (KeyboardInterrupt, SystemExit) while
    parts are sent aborts the upload too."""
    data = random_bytes(2 * TEST_PART_SIZE + MiB, seed=73)
    key = object_key(COMPANY, sha256(data))
    real = s3_provider._upload_part

    def interrupted(key: str, upload_id: str, number: int, part: bytes) -> str:
        if number == 2:
            raise KeyboardInterrupt
        return real(key, upload_id, number, part)

    monkeypatch.setattr(s3_provider, "_upload_part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s3_provider.put_file(key, write_source(tmp_path, data), len(data), sha256(data))
    assert leftovers(s3_provider, s3_server) == []
