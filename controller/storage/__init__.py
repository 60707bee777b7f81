"""Object storage for file contents: one interface, a local-disk and an S3 provider."""

from __future__ import annotations

from pathlib import Path

from .base import ObjectMissing, SourceMismatch, StorageProvider, object_key, validate_key
from .local_disk import LocalDiskProvider
from .s3 import S3Provider

__all__ = [
    "LocalDiskProvider",
    "ObjectMissing",
    "S3Provider",
    "SourceMismatch",
    "StorageProvider",
    "make_provider",
    "object_key",
    "validate_key",
]

PROVIDER_KINDS = ("local_disk", "s3")


def make_provider(
    kind: str,
    *,
    data_dir: Path,
    s3_bucket: str | None = None,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
) -> StorageProvider:
    """The provider the controller's settings ask for.

    S3 credentials are not parameters: boto3 finds them in its usual places
    (environment, shared config, instance role), which keeps secrets out of
    command lines and settings files.
    """
    if kind == "local_disk":
        return LocalDiskProvider(data_dir / "objects")
    if kind == "s3":
        if not s3_bucket:
            raise ValueError("the s3 storage provider needs a bucket name")
        return S3Provider(
            s3_bucket, endpoint_url=s3_endpoint, region=s3_region, temp_dir=data_dir / "spool"
        )
    raise ValueError(f"unknown storage provider {kind!r}; expected one of {PROVIDER_KINDS}")
