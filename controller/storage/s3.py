"""Objects in an S3 bucket (AWS or any S3-protocol server), through boto3.

Visibility rules the provider relies on: a single PUT and a completed
multipart upload each make the whole object appear at once, and an
incomplete multipart upload is never visible under its key. So a put that
fails half way leaves nothing under the key; the provider aborts the upload so
its parts stop costing storage. An abort that itself fails, or a process
killed mid-upload, leaves parts behind: GC aborts such uploads once they are
old (``sweep_abandoned_writes``), and buckets should also carry an
``AbortIncompleteMultipartUpload`` lifecycle rule (README, "Operating it").

Creates are conditional (``If-None-Match: *``) so that of several controller
replicas storing the same object only one reports having created it. Servers
that answer ``501 NotImplemented`` to the condition get unconditional writes
from then on: keys are content addresses, so an overwrite stores identical
bytes and only the True/False answer can become imprecise.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tempfile
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from common.errors import StorageUnavailable

from . import packed
from .base import (
    DEFAULT_CHUNK_SIZE,
    ObjectMissing,
    SourceMismatch,
    Span,
    StorageProvider,
    check_put_arguments,
    check_range,
    is_object_key,
    open_stream,
    validate_key,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.literals import BucketLocationConstraintType
    from mypy_boto3_s3.type_defs import (
        CompletedPartTypeDef,
        CompleteMultipartUploadRequestTypeDef,
        PutObjectRequestTypeDef,
    )

log = logging.getLogger(__name__)

MiB = 1 << 20
# S3 limits: every part but the last must be at least 5 MiB, an upload has at
# most 10,000 parts, and a single PUT carries at most 5 GiB.
MIN_PART_SIZE = 5 * MiB
MAX_PARTS = 10_000
MAX_SINGLE_PUT = 5 * 1024 * MiB

_BOTO_ERRORS = (BotoCoreError, ClientError)
OBJECTS_PREFIX = "objects/"
"""Every object key starts with it (``base.object_key``)."""
_HASH_CHUNK = MiB
SPAN_IN_MEMORY = 8 * MiB
"""A batch member up to this size is read into memory for its PUT."""


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _is_missing(exc: ClientError) -> bool:
    # HEAD responses have no body, so botocore can only report the status code.
    return _error_code(exc) in {"NoSuchKey", "NotFound", "404"} or _http_status(exc) == 404


def _is_precondition_failed(exc: ClientError) -> bool:
    return _error_code(exc) == "PreconditionFailed" or _http_status(exc) == 412


def _is_concurrent_conflict(exc: ClientError) -> bool:
    # AWS answers 409 when another conditional write to the key is in flight.
    return _error_code(exc) == "ConditionalRequestConflict" or _http_status(exc) == 409


def _is_not_implemented(exc: ClientError) -> bool:
    return _error_code(exc) == "NotImplemented" or _http_status(exc) == 501


class S3Provider(StorageProvider):
    name = "s3"

    def __init__(
        self,
        bucket: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        create_bucket: bool = False,
        access_key: str | None = None,
        secret_key: str | None = None,
        *,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        part_concurrency: int = 4,
        temp_dir: Path | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("an S3 bucket name is required")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part size must be at least {MIN_PART_SIZE} bytes (S3 minimum)")
        if not 0 < multipart_threshold <= MAX_SINGLE_PUT:
            raise ValueError(f"multipart threshold must be in (0, {MAX_SINGLE_PUT}]")
        self.bucket = bucket
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.part_concurrency = max(1, part_concurrency)
        """Parts of one object in flight at once (memory: that many parts)."""
        self._create_bucket = create_bucket
        self.temp_dir = temp_dir
        """Where an object is packed before it is sent (None: the system's)."""
        self._conditional_writes = True
        options: dict[str, Any] = {
            "retries": {"mode": "standard", "max_attempts": max_attempts},
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            # Several uploads at once, each with its parts in parallel.
            "max_pool_connections": 8 * self.part_concurrency,
        }
        if endpoint_url is not None:
            # S3-compatible servers reliably support path-style addressing;
            # virtual-hosted style needs wildcard DNS that they rarely have.
            options["s3"] = {"addressing_style": "path"}
        # A private session: boto3's default session is not thread-safe to
        # create clients from, while the client itself is safe to share.
        session = boto3.session.Session(
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=region,
        )
        self._client: S3Client = session.client(
            "s3", endpoint_url=endpoint_url, config=Config(**options)
        )

    def __repr__(self) -> str:
        return f"S3Provider(bucket={self.bucket!r}, endpoint={self._client.meta.endpoint_url!r})"

    def _unavailable(self, action: str, key: str, exc: Exception) -> StorageUnavailable:
        return StorageUnavailable(f"S3: cannot {action} {key} in bucket {self.bucket!r}: {exc}")

    # -- writing ---------------------------------------------------------

    def put_file(self, key: str, src: Path, size: int, sha256_hex: str) -> bool:
        """One conditional PUT below the multipart threshold (412: the object
        was there); above it a HEAD first, then the multipart upload."""
        check_put_arguments(key, size, sha256_hex)
        try:
            if packed.worth_packing(size) and _may_pay(src, size):
                with self._temp_file() as tmp:
                    with src.open("rb") as source:
                        stored = packed.pack(source.read, size, sha256_hex, tmp)
                    if stored is not None:
                        tmp.flush()
                        return self._put_stored(key, Path(tmp.name), stored, None)
            return self._put_stored(key, src, size, sha256_hex)
        except (*_BOTO_ERRORS, OSError) as exc:
            # OSError: reading the local source failed; as much an
            # infrastructure fault as the bucket failing.
            raise self._unavailable("store", key, exc) from exc

    def put_bytes(self, key: str, data: bytes, sha256_hex: str) -> bool:
        """One conditional PUT of the bytes (packed when that pays) straight
        from memory; above the multipart threshold, ``put_file``'s way."""
        check_put_arguments(key, len(data), sha256_hex)
        body = packed.stored_form(data, sha256_hex)
        if len(body) >= self.multipart_threshold:
            return super().put_bytes(key, data, sha256_hex)
        try:
            return self._conditional_put(key, io.BytesIO(body), len(body))
        except _BOTO_ERRORS as exc:
            raise self._unavailable("store", key, exc) from exc

    def _temp_file(self) -> IO[bytes]:
        """A file for an object's packed form, gone when closed."""
        if self.temp_dir is not None:
            self.temp_dir.mkdir(parents=True, exist_ok=True)
        return tempfile.NamedTemporaryFile(dir=self.temp_dir, prefix="packed-")

    def _put_stored(self, key: str, src: Path, size: int, sha256_hex: str | None) -> bool:
        """Store the ``size`` bytes of ``src`` as they are: raw bytes verified
        against ``sha256_hex``, or a packed form this process wrote (None)."""
        if size < self.multipart_threshold:
            return self._put_single(key, src, size, sha256_hex)
        # One HEAD beside the create, the parts and the completion is a
        # small share of a large object's requests, and it spares sending
        # every part of a copy the bucket already holds only to have the
        # conditional completion refuse it. The condition settles races.
        if self.exists(key):
            return False
        return self._put_multipart(key, src, size, sha256_hex)

    def _put_single(self, key: str, src: Path, size: int, sha256_hex: str | None) -> bool:
        with src.open("rb") as source:
            # Hash first and stream the file as the body afterwards, rather than
            # holding up to multipart_threshold bytes in memory per worker thread.
            if sha256_hex is not None:
                _verify_source(source, src, size, sha256_hex)
            return self._conditional_put(key, source, size)

    def _conditional_put(self, key: str, body: IO[bytes], size: int) -> bool:
        """One PUT of verified bytes unless the key exists (412): no HEAD first.
        An endpoint without conditional writes gets a HEAD first instead, so
        the answer stays exact and a copy the bucket holds is not sent again."""
        while True:
            if not self._conditional_writes and self.exists(key):
                return False
            body.seek(0)
            request: PutObjectRequestTypeDef = {
                "Bucket": self.bucket,
                "Key": key,
                "Body": body,
                "ContentLength": size,
            }
            if self._conditional_writes:
                request["IfNoneMatch"] = "*"
            try:
                self._client.put_object(**request)
            except ClientError as exc:
                outcome = self._conditional_outcome(key, exc)
                if outcome is None:
                    continue  # condition unsupported: retry without it
                return outcome
            return True

    def put_spans(self, src: Path, spans: Sequence[Span]) -> list[bool]:
        """Each span its own conditional PUT, several in flight at once (a
        batch of small files costs one request per member, and their round
        trips overlap). Spans of up to :data:`SPAN_IN_MEMORY` bytes are read
        and verified in memory; larger ones go through :meth:`put_file`."""
        for span in spans:
            check_put_arguments(span.key, span.size, span.sha256_hex)
        small = [i for i, span in enumerate(spans) if span.size <= SPAN_IN_MEMORY]
        large = [i for i, span in enumerate(spans) if span.size > SPAN_IN_MEMORY]
        created: list[bool] = [False] * len(spans)
        for i, made in zip(large, super().put_spans(src, [spans[i] for i in large]), strict=True):
            created[i] = made
        if not small:
            return created
        with (
            src.open("rb") as source,
            ThreadPoolExecutor(2 * self.part_concurrency, thread_name_prefix="s3-span") as pool,
        ):
            futures = {i: pool.submit(self._put_span, source, spans[i]) for i in small}
            for i, future in futures.items():
                created[i] = future.result()
        return created

    def _put_span(self, source: IO[bytes], span: Span) -> bool:
        data = os.pread(source.fileno(), span.size, span.offset)
        if len(data) != span.size or hashlib.sha256(data).hexdigest() != span.sha256_hex:
            raise SourceMismatch(f"bytes at {span.offset} do not hash to {span.sha256_hex}")
        body = packed.pack_bytes(data, span.sha256_hex, hashed=True) or data
        try:
            return self._conditional_put(span.key, io.BytesIO(body), len(body))
        except _BOTO_ERRORS as exc:
            raise self._unavailable("store", span.key, exc) from exc

    def _put_multipart(self, key: str, src: Path, size: int, sha256_hex: str | None) -> bool:
        # Grow parts for huge objects so they fit in S3's part-count limit.
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        completed = False
        try:
            parts = self._send_parts(key, upload_id, src, size, sha256_hex, part_size)
            while True:
                request: CompleteMultipartUploadRequestTypeDef = {
                    "Bucket": self.bucket,
                    "Key": key,
                    "UploadId": upload_id,
                    "MultipartUpload": {"Parts": parts},
                }
                if self._conditional_writes:
                    request["IfNoneMatch"] = "*"
                try:
                    self._client.complete_multipart_upload(**request)
                except ClientError as exc:
                    outcome = self._conditional_outcome(key, exc)
                    if outcome is None:
                        continue
                    return outcome
                completed = True
                return True
        finally:
            if not completed:
                self._abort_upload(key, upload_id)

    def _send_parts(
        self,
        key: str,
        upload_id: str,
        src: Path,
        size: int,
        sha256_hex: str | None,
        part_size: int,
    ) -> list[CompletedPartTypeDef]:
        """Read the parts in order (hashing them), upload up to ``part_concurrency``
        at once: memory stays at that many parts."""
        digest = hashlib.sha256()
        sent = 0
        numbers: list[int] = []
        pending: list[Future[str]] = []
        etags: list[str] = []
        with (
            src.open("rb") as source,
            ThreadPoolExecutor(self.part_concurrency, thread_name_prefix="s3-part") as pool,
        ):
            try:
                while sent <= size:
                    data = source.read(part_size)
                    if not data:
                        break
                    sent += len(data)
                    digest.update(data)
                    numbers.append(len(numbers) + 1)
                    for f in pending:
                        if f.done():
                            f.result()  # a failed part stops the upload before the next
                    if len(pending) >= self.part_concurrency:
                        etags.append(pending.pop(0).result())
                    pending.append(
                        pool.submit(self._upload_part, key, upload_id, numbers[-1], data)
                    )
                etags += [f.result() for f in pending]
            finally:
                for f in pending:
                    f.cancel()
        # The bytes sent are the bytes hashed, so this check covers exactly
        # what would become visible on completion.
        if sent != size:
            raise SourceMismatch(f"{src} is not {size} bytes long (read {sent})")
        if sha256_hex is not None and digest.hexdigest() != sha256_hex:
            raise SourceMismatch(f"{src} does not hash to {sha256_hex}")
        return [{"ETag": e, "PartNumber": n} for n, e in zip(numbers, etags, strict=True)]

    def _upload_part(self, key: str, upload_id: str, number: int, data: bytes) -> str:
        response = self._client.upload_part(
            Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )
        return response["ETag"]

    def _conditional_outcome(self, key: str, exc: ClientError) -> bool | None:
        """Interpret a failed conditional create: False = already exists, None = retry.

        Re-raises anything that is not about the condition.
        """
        if self._conditional_writes and _is_not_implemented(exc):
            log.warning(
                "S3 endpoint for bucket %r does not support conditional writes; "
                "falling back to unconditional PUTs of content-addressed objects",
                self.bucket,
            )
            self._conditional_writes = False
            return None
        if _is_precondition_failed(exc):
            return False
        if _is_concurrent_conflict(exc) and self.exists(key):
            return False
        raise exc

    def _abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except _BOTO_ERRORS as exc:
            # The original failure is what the caller needs to see; the parts
            # left behind are invisible, and GC's sweep of abandoned uploads
            # (or the bucket's lifecycle rule) reclaims them.
            log.warning("could not abort multipart upload %s of %s: %s", upload_id, key, exc)

    # -- reading ---------------------------------------------------------

    def read_chunks(
        self, key: str, start: int = 0, end: int | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> Iterator[bytes]:
        """A whole object is one GET; a range one small GET of its head,
        then one of the bytes (or packed frames) the range needs."""
        validate_key(key)
        check_range(start, end, chunk_size)

        def open_raw(raw_start: int, raw_end: int | None) -> Iterator[bytes]:
            return open_stream(self._stream(key, raw_start, raw_end, chunk_size))

        return open_stream(packed.read_logical(open_raw, key, start, end, chunk_size))

    def _stream(
        self, key: str, start: int, end: int | None, chunk_size: int
    ) -> Generator[bytes, None, None]:
        if end == start:
            # HTTP ranges cannot express zero bytes; only existence is left to check.
            if not self.exists(key):
                raise ObjectMissing(f"object {key} is missing from bucket {self.bucket!r}")
            yield b""
            return
        try:
            if start == 0 and end is None:
                response = self._client.get_object(Bucket=self.bucket, Key=key)
            else:
                last = "" if end is None else str(end - 1)
                response = self._client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{last}"
                )
        except ClientError as exc:
            if _is_missing(exc):
                raise ObjectMissing(f"object {key} is missing from bucket {self.bucket!r}") from exc
            if _error_code(exc) == "InvalidRange" or _http_status(exc) == 416:
                # The range starts at or past the end; the local provider yields
                # nothing there too, as long as the object exists.
                if not self.exists(key):
                    raise ObjectMissing(
                        f"object {key} is missing from bucket {self.bucket!r}"
                    ) from exc
                yield b""
                return
            raise self._unavailable("read", key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("read", key, exc) from exc
        body = response["Body"]
        try:
            yield b""
            chunks = body.iter_chunks(chunk_size)
            while True:
                try:
                    chunk = next(chunks, None)
                except _BOTO_ERRORS as exc:
                    raise self._unavailable("read", key, exc) from exc
                if chunk is None:
                    return
                if chunk:
                    yield chunk
        finally:
            body.close()

    def size(self, key: str) -> int | None:
        """The logical size: one GET of the object's head (a packed object's
        header says it, the ``Content-Range`` the stored size)."""
        validate_key(key)
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes=0-{packed.HEADER_LEN - 1}"
            )
            try:
                head = response["Body"].read()
            finally:
                response["Body"].close()
        except ClientError as exc:
            if _is_missing(exc):
                return None
            if _error_code(exc) == "InvalidRange" or _http_status(exc) == 416:
                return self._stored_size(key)  # an empty object has no byte 0
            raise self._unavailable("inspect", key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("inspect", key, exc) from exc
        total = response.get("ContentRange", "").rpartition("/")[2]
        stored = int(total) if total.isdigit() else response["ContentLength"]
        return packed.logical_size(head, stored, key.rsplit("/", 1)[1])

    def exists(self, key: str) -> bool:
        return self._stored_size(key) is not None

    def _stored_size(self, key: str) -> int | None:
        validate_key(key)
        try:
            response = self._client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise self._unavailable("inspect", key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("inspect", key, exc) from exc
        return response["ContentLength"]

    # -- housekeeping ----------------------------------------------------

    def delete(self, key: str) -> None:
        validate_key(key)
        try:
            # S3 answers a delete of an absent key with success as well.
            self._client.delete_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return
            raise self._unavailable("delete", key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("delete", key, exc) from exc

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        page_iter = iter(pages)
        while True:
            try:
                page = next(page_iter, None)
            except _BOTO_ERRORS as exc:
                raise self._unavailable("list", f"prefix {prefix!r}", exc) from exc
            if page is None:
                return
            for entry in page.get("Contents", []):
                key = entry.get("Key", "")
                if is_object_key(key):
                    yield key

    def sweep_abandoned_writes(self, started_before: float) -> int:
        """Abort the multipart uploads of object keys initiated before
        ``started_before``: those of a put whose process died, or whose abort
        failed. Uploads of other keys (a bucket shared with other tools) are
        left alone; so is one that another replica aborted first."""
        pages = self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=OBJECTS_PREFIX
        )
        aborted = 0
        try:
            for page in pages:
                for upload in page.get("Uploads", []):
                    key, initiated = upload.get("Key", ""), upload.get("Initiated")
                    if (
                        not is_object_key(key)
                        or initiated is None
                        or initiated.timestamp() >= started_before
                    ):
                        continue
                    try:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=key, UploadId=upload["UploadId"]
                        )
                    except ClientError as exc:
                        if _error_code(exc) != "NoSuchUpload" and _http_status(exc) != 404:
                            raise
                        continue
                    aborted += 1
                    log.info(
                        "aborted abandoned multipart upload %s of %s (initiated %s)",
                        upload["UploadId"], key, initiated.isoformat(),
                    )  # fmt: skip
        except _BOTO_ERRORS as exc:
            raise self._unavailable("sweep multipart uploads under", OBJECTS_PREFIX, exc) from exc
        return aborted

    def check(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if self._create_bucket and _is_missing(exc):
                self._make_bucket()
                return
            raise StorageUnavailable(f"S3 bucket {self.bucket!r} is not usable: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageUnavailable(f"S3 bucket {self.bucket!r} is unreachable: {exc}") from exc

    def _make_bucket(self) -> None:
        region = self._client.meta.region_name
        try:
            # us-east-1 is the one region that rejects an explicit location.
            if region and region != "us-east-1":
                self._client.create_bucket(
                    Bucket=self.bucket,
                    CreateBucketConfiguration={
                        "LocationConstraint": cast("BucketLocationConstraintType", region)
                    },
                )
            else:
                self._client.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _error_code(exc) == "BucketAlreadyOwnedByYou":
                return  # another replica created it first
            raise StorageUnavailable(f"cannot create S3 bucket {self.bucket!r}: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageUnavailable(f"cannot create S3 bucket {self.bucket!r}: {exc}") from exc
        log.info("created S3 bucket %r", self.bucket)


def _may_pay(src: Path, size: int) -> bool:
    """``packed.may_pay`` for a file: False spares a large object that cannot
    pay its packing and the temp file it would be packed into."""
    with src.open("rb") as source:
        return packed.may_pay(source.fileno(), size)


def _verify_source(source: IO[bytes], src: Path, size: int, sha256_hex: str) -> None:
    digest = hashlib.sha256()
    seen = 0
    while seen <= size:
        chunk = source.read(_HASH_CHUNK)
        if not chunk:
            break
        seen += len(chunk)
        digest.update(chunk)
    if seen != size:
        raise SourceMismatch(f"{src} is not {size} bytes long (read {seen})")
    if digest.hexdigest() != sha256_hex:
        raise SourceMismatch(f"{src} does not hash to {sha256_hex}")
