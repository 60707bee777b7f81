"""Checks only the ``s3`` provider can have, on a moto server reached over
HTTP: single and multipart puts, conditional creates, unreachable endpoints and
missing buckets, and the test server helper itself.

The behaviour every provider shares is in ``test_storage.py``.
"""

from __future__ import annotations

import hashlib
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from common.errors import StorageUnavailable
from controller.storage import S3Provider, object_key
from controller.storage.base import SourceMismatch, Span
from tests.support.s3server import S3Server, S3ServerError, free_port
from tests.support.storage import (
    COMPANY,
    TEST_MULTIPART_THRESHOLD,
    MiB,
    leftovers,
    make_s3_provider,
    random_bytes,
    read_all,
    s3_client,
    sha256,
    store,
    write_source,
)


def test_s3_small_objects_use_a_single_put(
    s3_server: S3Server, s3_provider: S3Provider, tmp_path: Path
) -> None:
    data = random_bytes(TEST_MULTIPART_THRESHOLD - 1, seed=8)
    key, created = store(s3_provider, tmp_path, data)
    assert created is True
    head = s3_client(s3_server).head_object(Bucket=s3_provider.bucket, Key=key)
    assert head["ETag"].strip('"') == hashlib.md5(data).hexdigest()


@pytest.mark.parametrize("size", [1000, 9 * MiB], ids=["single", "multipart"])
def test_s3_conditional_create_settles_races(
    s3_server: S3Server,
    s3_provider: S3Provider,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    size: int,
) -> None:
    data = random_bytes(size, seed=9)
    key, _ = store(s3_provider, tmp_path, data)
    # Another writer finished between our HEAD and our write: only the
    # If-None-Match condition can notice now.
    monkeypatch.setattr(s3_provider, "exists", lambda key: False)
    assert s3_provider.put_file(key, write_source(tmp_path, data), size, sha256(data)) is False
    monkeypatch.undo()
    assert read_all(s3_provider, key) == data
    assert leftovers(s3_provider, s3_server) == []


def test_s3_falls_back_when_conditional_writes_are_unsupported(
    s3_provider: S3Provider,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real_put = s3_provider._client.put_object
    conditional_attempts: list[str] = []

    def put_object_without_conditions(**kwargs: Any) -> Any:
        if "IfNoneMatch" in kwargs:
            conditional_attempts.append(kwargs["Key"])
            raise ClientError(
                {
                    "Error": {"Code": "NotImplemented", "Message": "If-None-Match"},
                    "ResponseMetadata": {"HTTPStatusCode": 501},
                },
                "PutObject",
            )
        return real_put(**kwargs)

    monkeypatch.setattr(s3_provider._client, "put_object", put_object_without_conditions)
    first, created = store(s3_provider, tmp_path, b"first")
    second, created_too = store(s3_provider, tmp_path, b"second")
    assert (created, created_too) == (True, True)
    assert conditional_attempts == [first]  # asked once, then remembered
    fallback_warnings = [r for r in caplog.records if "conditional writes" in r.getMessage()]
    assert [r.levelname for r in fallback_warnings] == ["WARNING"]
    assert read_all(s3_provider, first) == b"first"
    assert read_all(s3_provider, second) == b"second"
    assert store(s3_provider, tmp_path, b"first") == (first, False)


def test_s3_failed_part_aborts_the_upload(
    s3_server: S3Server, s3_provider: S3Provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(20 * MiB, seed=10)
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    real_upload_part = s3_provider._client.upload_part
    calls: list[int] = []

    def flaky_upload_part(**kwargs: Any) -> Any:
        calls.append(kwargs["PartNumber"])
        if kwargs["PartNumber"] == 2:
            raise EndpointConnectionError(endpoint_url=s3_server.endpoint_url)
        return real_upload_part(**kwargs)

    monkeypatch.setattr(s3_provider._client, "upload_part", flaky_upload_part)
    with pytest.raises(StorageUnavailable):
        s3_provider.put_file(key, write_source(tmp_path, data), len(data), digest)
    assert calls == [1, 2]
    assert s3_provider.exists(key) is False
    assert leftovers(s3_provider, s3_server) == []


def test_s3_unreachable_endpoint(tmp_path: Path) -> None:
    provider = S3Provider(
        "anything",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        region="us-east-1",
        access_key="testing",
        secret_key="testing",
        max_attempts=2,
        connect_timeout=2.0,
    )
    with pytest.raises(StorageUnavailable) as caught:
        provider.check()
    assert caught.value.code == "storage_unavailable"
    assert caught.value.status == 503
    key = object_key(COMPANY, sha256(b"x"))
    with pytest.raises(StorageUnavailable):
        provider.put_file(key, write_source(tmp_path, b"x"), 1, sha256(b"x"))
    with pytest.raises(StorageUnavailable):
        provider.read_chunks(key)
    with pytest.raises(StorageUnavailable):
        provider.size(key)
    with pytest.raises(StorageUnavailable):
        list(provider.iter_keys())


def test_s3_missing_bucket(s3_server: S3Server, s3_bucket: str) -> None:
    without = make_s3_provider(s3_server, s3_bucket, create_bucket=False)
    with pytest.raises(StorageUnavailable):
        without.check()
    make_s3_provider(s3_server, s3_bucket, create_bucket=True).check()
    s3_client(s3_server).head_bucket(Bucket=s3_bucket)
    without.check()  # now it exists
    # A second creator (another replica) is not an error.
    make_s3_provider(s3_server, s3_bucket, create_bucket=True).check()


def test_s3_iter_keys_skips_foreign_objects(
    s3_server: S3Server, s3_provider: S3Provider, tmp_path: Path
) -> None:
    key, _ = store(s3_provider, tmp_path, b"ours")
    client = s3_client(s3_server)
    client.put_object(Bucket=s3_provider.bucket, Key="backups/dump.sql", Body=b"x")
    client.put_object(Bucket=s3_provider.bucket, Key=key + ".bak", Body=b"x")
    assert list(s3_provider.iter_keys()) == [key]


def test_s3_provider_validates_settings() -> None:
    with pytest.raises(ValueError):
        S3Provider("")
    with pytest.raises(ValueError):
        S3Provider("bucket", part_size=4 * MiB)
    with pytest.raises(ValueError):
        S3Provider("bucket", multipart_threshold=0)


# -- the test server helper itself -------------------------------------------------


def test_s3_server_helper_fails_fast_when_the_port_is_taken() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        server = S3Server(port=port, startup_timeout=60)
        # The port answers nothing HTTP, and the server process dies: the helper
        # must notice the death rather than wait out its deadline.
        with pytest.raises(S3ServerError, match="exited"):
            server.start()
        assert time.monotonic() - started < 30
        assert server.running is False


class Requests:
    """Every request the provider's client sends, by operation (boto3's
    ``before-send`` event: each attempt on the wire, retries included)."""

    def __init__(self, provider: S3Provider) -> None:
        self.sent: list[str] = []
        self._operation: dict[int, str] = {}
        events = provider._client.meta.events
        events.register("before-call.s3", self._call)
        events.register("before-send.s3", self._send)

    def _call(self, model: Any, context: Any, **_: Any) -> None:
        self._operation[id(context)] = model.name

    def _send(self, request: Any, **_: Any) -> None:
        self.sent.append(self._operation.get(id(request.context), request.method))

    def take(self) -> list[str]:
        sent, self.sent = sorted(self.sent), []
        return sent


def test_s3_requests_per_file(s3_provider: S3Provider, tmp_path: Path) -> None:
    """A small object costs one conditional PUT, new or not (412: there
    already); a multipart one a HEAD, the create, its parts and the
    completion, and only the HEAD when the bucket holds it."""
    requests = Requests(s3_provider)
    small = random_bytes(4096, seed=21)
    large = random_bytes(TEST_MULTIPART_THRESHOLD + MiB, seed=22)  # two parts
    assert store(s3_provider, tmp_path, small)[1] is True
    assert requests.take() == ["PutObject"]
    assert store(s3_provider, tmp_path, small)[1] is False
    assert requests.take() == ["PutObject"]
    assert store(s3_provider, tmp_path, large)[1] is True
    assert requests.take() == [
        "CompleteMultipartUpload",
        "CreateMultipartUpload",
        "HeadObject",
        "UploadPart",
        "UploadPart",
    ]
    assert store(s3_provider, tmp_path, large)[1] is False
    assert requests.take() == ["HeadObject"]
    assert read_all(s3_provider, object_key(COMPANY, sha256(small))) == small
    assert read_all(s3_provider, object_key(COMPANY, sha256(large))) == large


def test_s3_batch_members_cost_one_put_each(s3_provider: S3Provider, tmp_path: Path) -> None:
    members = [random_bytes(n, seed=n) for n in (0, 1, 700, 64 * 1024)]
    members.append(members[2])  # a twin: its own conditional PUT, answered 412
    spool = tmp_path / "batch"
    spool.write_bytes(b"".join(members))
    spans, offset = [], 0
    for data in members:
        spans.append(Span(object_key(COMPANY, sha256(data)), offset, len(data), sha256(data)))
        offset += len(data)
    existing = random_bytes(3000, seed=23)
    store(s3_provider, tmp_path, existing)
    spool.write_bytes(spool.read_bytes() + existing)
    spans.append(Span(object_key(COMPANY, sha256(existing)), offset, 3000, sha256(existing)))
    requests = Requests(s3_provider)
    created = s3_provider.put_spans(spool, spans)
    assert requests.take() == ["PutObject"] * 6
    assert created.count(True) == 4 and created[-1] is False
    for data in members:
        assert read_all(s3_provider, object_key(COMPANY, sha256(data))) == data


def test_s3_batch_member_whose_bytes_differ_is_not_stored(
    s3_provider: S3Provider, tmp_path: Path
) -> None:
    spool = tmp_path / "batch"
    spool.write_bytes(b"right bytes")
    wrong = sha256(b"other bytes")
    requests = Requests(s3_provider)
    with pytest.raises(SourceMismatch):
        s3_provider.put_spans(spool, [Span(object_key(COMPANY, wrong), 0, 11, wrong)])
    assert requests.take() == []
    assert s3_provider.exists(object_key(COMPANY, wrong)) is False
