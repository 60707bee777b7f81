"""Storage-provider test helpers: S3 clients and providers on the moto server,
objects stored from plain bytes, a source file that fails mid-read, and what a
failed put could leave behind.

Shared by the provider contract tests and the local-disk-only and S3-only
ones; their fixtures are registered by :mod:`tests.support.fixtures`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import random
import uuid
from pathlib import Path
from typing import IO, Any

import boto3
from botocore.exceptions import ClientError

from controller.storage import LocalDiskProvider, S3Provider, StorageProvider, object_key
from tests.support.s3server import FAKE_CREDENTIALS, S3Server

MiB = 1 << 20
COMPANY = "0b6f3c1e-6a3e-4c59-9a53-2f8f1d0f7a11"
OTHER_COMPANY = "7d2c5a40-1f3b-4e8e-8a47-5b0c9e6d2f13"
# Lowered from the 64 MiB production default so the multipart path runs on
# test-sized objects; 8 MiB parts stay above S3's 5 MiB minimum.
TEST_MULTIPART_THRESHOLD = 8 * MiB
TEST_PART_SIZE = 8 * MiB


def s3_client(server: S3Server) -> Any:
    return boto3.session.Session(
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    ).client("s3", endpoint_url=server.endpoint_url)


def make_s3_provider(server: S3Server, bucket: str, **options: Any) -> S3Provider:
    settings: dict[str, Any] = {
        "multipart_threshold": TEST_MULTIPART_THRESHOLD,
        "part_size": TEST_PART_SIZE,
        "create_bucket": True,
        **options,
    }
    return S3Provider(
        bucket,
        endpoint_url=server.endpoint_url,
        region="us-east-1",
        access_key=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        **settings,
    )


@functools.cache
def _cleanup_client(endpoint_url: str) -> Any:
    """One S3 client per server for :func:`remove_bucket`: building a client
    loads botocore's service model (a quarter of test_storage's CPU when
    every test's teardown built its own)."""
    return boto3.session.Session(
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    ).client("s3", endpoint_url=endpoint_url)


def remove_bucket(server: S3Server, bucket: str) -> None:
    """Empty and drop a test bucket so the server does not hold every test's bytes."""
    client = _cleanup_client(server.endpoint_url)
    with contextlib.suppress(ClientError):
        for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for entry in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=entry["Key"])
        client.delete_bucket(Bucket=bucket)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_source(directory: Path, data: bytes) -> Path:
    path = directory / f"src-{uuid.uuid4().hex}"
    path.write_bytes(data)
    return path


def store(
    provider: StorageProvider, tmp_path: Path, data: bytes, company: str = COMPANY
) -> tuple[str, bool]:
    digest = sha256(data)
    key = object_key(company, digest)
    created = provider.put_file(key, write_source(tmp_path, data), len(data), digest)
    return key, created


def read_all(provider: StorageProvider, key: str, start: int = 0, end: int | None = None) -> bytes:
    return b"".join(provider.read_chunks(key, start, end))


def leftovers(provider: StorageProvider, server: S3Server | None) -> list[str]:
    """Anything a failed put could have left behind: temp files or pending multipart uploads."""
    if isinstance(provider, LocalDiskProvider):
        return sorted(os.listdir(provider.root / "tmp"))
    assert isinstance(provider, S3Provider) and server is not None
    uploads = s3_client(server).list_multipart_uploads(Bucket=provider.bucket)
    return sorted(upload["Key"] for upload in uploads.get("Uploads", []))


def random_bytes(size: int, seed: int) -> bytes:
    # Seeded so a failure reproduces; random so a mix-up of any two ranges
    # shows up as a byte difference.
    return random.Random(seed).randbytes(size)


class FailingSource(pathlib.PosixPath):
    """A source file whose reads fail with EIO once ``fail_after`` bytes were read."""

    fail_after = 10 * MiB

    def open(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return _FailingReader(super().open(*args, **kwargs), self.fail_after)


class _FailingReader:
    def __init__(self, inner: IO[bytes], fail_after: int) -> None:
        self._inner = inner
        self._left = fail_after

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            raise OSError(5, "Input/output error (injected)")
        chunk = self._inner.read(size if 0 <= size <= self._left else self._left)
        self._left -= len(chunk)
        return chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _FailingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


__all__ = [
    "COMPANY",
    "OTHER_COMPANY",
    "TEST_MULTIPART_THRESHOLD",
    "TEST_PART_SIZE",
    "FailingSource",
    "MiB",
    "leftovers",
    "make_s3_provider",
    "random_bytes",
    "read_all",
    "remove_bucket",
    "s3_client",
    "sha256",
    "store",
    "write_source",
]
