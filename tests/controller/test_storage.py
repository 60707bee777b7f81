"""One suite for every storage provider: the behaviour the controller relies on.

The shared tests run against ``local_disk`` on a temporary directory and
against ``s3`` on a moto server reached over HTTP; a behaviour the controller
relies on must hold for both, byte for byte. The checks only one provider can
have are in ``test_storage_local.py`` and ``test_storage_s3.py``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import StorageUnavailable
from controller.storage import (
    LocalDiskProvider,
    ObjectMissing,
    S3Provider,
    SourceMismatch,
    StorageProvider,
    make_provider,
    object_key,
    validate_key,
)
from tests.support.s3server import S3Server
from tests.support.storage import (
    COMPANY,
    OTHER_COMPANY,
    TEST_PART_SIZE,
    FailingSource,
    MiB,
    leftovers,
    random_bytes,
    read_all,
    s3_client,
    sha256,
    store,
    write_source,
)

# -- fixtures and helpers ---------------------------------------------------


def server_of(request: pytest.FixtureRequest, provider: StorageProvider) -> S3Server | None:
    if isinstance(provider, S3Provider):
        server: S3Server = request.getfixturevalue("s3_server")
        return server
    return None


# -- object_key ---------------------------------------------------------------


def test_object_key_format() -> None:
    digest = sha256(b"hello")
    assert object_key(COMPANY, digest) == f"objects/{COMPANY}/{digest[:2]}/{digest}"
    assert validate_key(object_key(COMPANY, digest)) == object_key(COMPANY, digest)


GOOD_DIGEST = sha256(b"x")


@pytest.mark.parametrize(
    ("company", "digest"),
    [
        (COMPANY, "../x"),
        (COMPANY, GOOD_DIGEST.upper()),
        (COMPANY, GOOD_DIGEST[:63]),
        (COMPANY, GOOD_DIGEST + "0"),
        (COMPANY, GOOD_DIGEST + "\n"),
        (COMPANY, GOOD_DIGEST[:62] + "/."),
        (COMPANY, "g" * 64),
        (COMPANY, ""),
        (COMPANY, GOOD_DIGEST[:32] + "\x00" + GOOD_DIGEST[33:]),
        ("not-a-uuid", GOOD_DIGEST),
        ("../../etc", GOOD_DIGEST),
        ("", GOOD_DIGEST),
        (COMPANY.upper(), GOOD_DIGEST),
        (COMPANY.replace("-", ""), GOOD_DIGEST),
        ("{" + COMPANY + "}", GOOD_DIGEST),
        ("urn:uuid:" + COMPANY, GOOD_DIGEST),
        (COMPANY + "/..", GOOD_DIGEST),
        (COMPANY + "\n", GOOD_DIGEST),
    ],
)
def test_object_key_rejects_hostile_input(company: str, digest: str) -> None:
    with pytest.raises(ValueError):
        object_key(company, digest)


HOSTILE_KEYS = [
    "../x",
    "/etc/passwd",
    f"objects/{COMPANY}/../../../etc/passwd",
    f"objects/{COMPANY}/{GOOD_DIGEST[:2]}/../{GOOD_DIGEST}",
    f"objects/{COMPANY}/{GOOD_DIGEST[:2]}/{GOOD_DIGEST.upper()}",
    f"objects/{COMPANY}/{'00' if GOOD_DIGEST[:2] != '00' else '01'}/{GOOD_DIGEST}",
    f"objects/{COMPANY.upper()}/{GOOD_DIGEST[:2]}/{GOOD_DIGEST}",
    f"objects/{COMPANY}/{GOOD_DIGEST[:2]}/{GOOD_DIGEST}\n",
    f"/objects/{COMPANY}/{GOOD_DIGEST[:2]}/{GOOD_DIGEST}",
    f"objects//{COMPANY}/{GOOD_DIGEST[:2]}/{GOOD_DIGEST}",
    f"tmp/{GOOD_DIGEST}",
    "",
]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_providers_refuse_malformed_keys(
    provider: StorageProvider, tmp_path: Path, key: str
) -> None:
    src = write_source(tmp_path, b"x")
    with pytest.raises(ValueError):
        provider.put_file(key, src, 1, GOOD_DIGEST)
    with pytest.raises(ValueError):
        provider.read_chunks(key)
    with pytest.raises(ValueError):
        provider.size(key)
    with pytest.raises(ValueError):
        provider.exists(key)
    with pytest.raises(ValueError):
        provider.delete(key)
    assert list(provider.iter_keys()) == []


def test_put_refuses_a_key_that_names_another_digest(
    provider: StorageProvider, tmp_path: Path
) -> None:
    data = b"the real content"
    wrong_key = object_key(COMPANY, sha256(b"something else"))
    with pytest.raises(ValueError, match="does not name"):
        provider.put_file(wrong_key, write_source(tmp_path, data), len(data), sha256(data))
    assert provider.exists(wrong_key) is False


# -- the shared behaviour -------------------------------------------------------


def test_round_trip(provider: StorageProvider, tmp_path: Path) -> None:
    data = random_bytes(300_000, seed=1)
    key, created = store(provider, tmp_path, data)
    assert created is True
    assert read_all(provider, key) == data
    assert provider.size(key) == len(data)
    assert provider.exists(key) is True


def test_empty_object(provider: StorageProvider, tmp_path: Path) -> None:
    key, created = store(provider, tmp_path, b"")
    assert created is True
    assert provider.size(key) == 0
    assert read_all(provider, key) == b""
    assert read_all(provider, key, 0, 10) == b""
    assert read_all(provider, key, 0, 0) == b""


def test_put_is_idempotent_and_leaves_source_alone(
    provider: StorageProvider, tmp_path: Path
) -> None:
    data = random_bytes(50_000, seed=2)
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    first, second = write_source(tmp_path, data), write_source(tmp_path, data)
    assert provider.put_file(key, first, len(data), digest) is True
    assert provider.put_file(key, second, len(data), digest) is False
    assert provider.put_file(key, first, len(data), digest) is False
    assert read_all(provider, key) == data
    assert first.read_bytes() == data
    assert second.read_bytes() == data
    assert list(provider.iter_keys()) == [key]


DATA_10K = random_bytes(10_000, seed=3)


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (0, None),
        (0, 1),
        (1, 2),
        (5, 17),
        (0, 999),
        (0, 1000),  # exactly one chunk
        (0, 1001),
        (999, 2001),  # straddles two chunk boundaries
        (4096, 8192),
        (9_999, None),
        (9_999, 10_000),
        (1234, None),
        (0, 10_000),
        (100, 50_000),  # end past the object: cut at its end
        (10_000, None),  # start at the end: nothing
        (12_000, None),  # start past the end: nothing
        (12_000, 13_000),
        (0, 0),
        (5000, 5000),
    ],
)
def test_ranged_reads(
    provider: StorageProvider, tmp_path: Path, start: int, end: int | None
) -> None:
    key, _ = store(provider, tmp_path, DATA_10K)
    chunks = list(provider.read_chunks(key, start, end, chunk_size=1000))
    assert b"".join(chunks) == DATA_10K[start:end]
    assert all(0 < len(chunk) <= 1000 for chunk in chunks)


@settings(
    max_examples=60,
    deadline=None,
    # The provider fixture is reused across examples on purpose: the object is
    # immutable, so examples cannot influence each other.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    start=st.integers(0, 3100),
    length=st.one_of(st.none(), st.integers(0, 3100)),
    chunk_size=st.integers(1, 4096),
)
def test_ranged_reads_match_slicing(
    provider: StorageProvider, tmp_path: Path, start: int, length: int | None, chunk_size: int
) -> None:
    data = DATA_10K[:3000]
    key, _ = store(provider, tmp_path, data)
    end = None if length is None else start + length
    chunks = list(provider.read_chunks(key, start, end, chunk_size=chunk_size))
    assert b"".join(chunks) == data[start:end]
    assert all(0 < len(chunk) <= chunk_size for chunk in chunks)


@pytest.mark.parametrize(("start", "end"), [(-1, None), (5, 4), (0, -1)])
def test_invalid_ranges_are_refused(
    provider: StorageProvider, tmp_path: Path, start: int, end: int | None
) -> None:
    key, _ = store(provider, tmp_path, b"0123456789")
    with pytest.raises(ValueError):
        provider.read_chunks(key, start, end)


def test_missing_object(provider: StorageProvider) -> None:
    key = object_key(COMPANY, sha256(b"never stored"))
    assert provider.size(key) is None
    assert provider.exists(key) is False
    # Raised by the call itself, before any iteration, so a handler can pick
    # its status code before it starts streaming a response.
    for start, end in [(0, None), (5, 10), (3, 3), (100, None)]:
        with pytest.raises(ObjectMissing) as caught:
            provider.read_chunks(key, start, end)
        assert caught.value.code == "object_missing"
        assert caught.value.status == 500


def test_abandoned_reads_release_the_object(provider: StorageProvider, tmp_path: Path) -> None:
    key, _ = store(provider, tmp_path, DATA_10K)
    open_fds = len(os.listdir("/proc/self/fd"))
    for _ in range(30):
        stream = provider.read_chunks(key, chunk_size=100)
        assert next(stream) == DATA_10K[:100]
        del stream  # never exhausted: its file or HTTP body must still be released
    never_iterated = provider.read_chunks(key)
    del never_iterated
    assert read_all(provider, key) == DATA_10K
    if isinstance(provider, LocalDiskProvider):
        assert len(os.listdir("/proc/self/fd")) == open_fds


def test_delete_is_idempotent(provider: StorageProvider, tmp_path: Path) -> None:
    doomed, _ = store(provider, tmp_path, b"doomed")
    kept, _ = store(provider, tmp_path, b"kept")
    provider.delete(doomed)
    assert provider.exists(doomed) is False
    assert provider.size(doomed) is None
    with pytest.raises(ObjectMissing):
        provider.read_chunks(doomed)
    provider.delete(doomed)
    provider.delete(object_key(OTHER_COMPANY, sha256(b"never stored")))
    assert read_all(provider, kept) == b"kept"
    assert list(provider.iter_keys()) == [kept]
    # A deleted object can be stored again.
    again, created = store(provider, tmp_path, b"doomed")
    assert (again, created) == (doomed, True)
    assert read_all(provider, again) == b"doomed"


def test_iter_keys_with_prefix(provider: StorageProvider, tmp_path: Path) -> None:
    ours = sorted(store(provider, tmp_path, f"ours {i}".encode())[0] for i in range(12))
    theirs = sorted(
        store(provider, tmp_path, f"theirs {i}".encode(), OTHER_COMPANY)[0] for i in range(5)
    )
    assert list(provider.iter_keys()) == sorted(ours + theirs)
    assert list(provider.iter_keys("objects/")) == sorted(ours + theirs)
    assert list(provider.iter_keys(f"objects/{COMPANY}/")) == ours
    assert list(provider.iter_keys(f"objects/{OTHER_COMPANY}/")) == theirs
    fanout = ours[0].split("/")[2]
    assert list(provider.iter_keys(f"objects/{COMPANY}/{fanout}/")) == [
        key for key in ours if key.split("/")[2] == fanout
    ]
    # Prefixes that end inside a path component work too.
    assert list(provider.iter_keys(ours[0][:-20])) == [ours[0]]
    assert list(provider.iter_keys(f"objects/{COMPANY[:8]}")) == ours
    assert list(provider.iter_keys(ours[0])) == [ours[0]]
    assert list(provider.iter_keys(f"objects/{uuid.uuid4()}/")) == []
    assert list(provider.iter_keys("nothing-here/")) == []


def test_large_object_round_trips(
    request: pytest.FixtureRequest, provider: StorageProvider, tmp_path: Path
) -> None:
    size = 80 * MiB + 12_345  # a short last part as well as full ones
    data = os.urandom(size)
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    src = write_source(tmp_path, data)
    del data
    assert provider.put_file(key, src, size, digest) is True
    assert provider.size(key) == size

    readback = hashlib.sha256()
    total = 0
    for chunk in provider.read_chunks(key):
        readback.update(chunk)
        total += len(chunk)
    assert (total, readback.hexdigest()) == (size, digest)

    # A range in the middle, across a part boundary.
    with src.open("rb") as source:
        source.seek(TEST_PART_SIZE - 1000)
        expected = source.read(5000)
    assert read_all(provider, key, TEST_PART_SIZE - 1000, TEST_PART_SIZE + 4000) == expected

    server = server_of(request, provider)
    if server is not None:
        # A multipart object's ETag ends in "-<number of parts>": proof the
        # multipart path ran, with the parts we asked for.
        assert isinstance(provider, S3Provider)
        head = s3_client(server).head_object(Bucket=provider.bucket, Key=key)
        assert head["ETag"].strip('"').endswith(f"-{-(-size // TEST_PART_SIZE)}")
    assert leftovers(provider, server) == []


def test_concurrent_puts_of_one_object(provider: StorageProvider, tmp_path: Path) -> None:
    data = random_bytes(2 * MiB, seed=4)
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    sources = [write_source(tmp_path, data) for _ in range(8)]
    results: list[bool] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(sources))

    def put(src: Path) -> None:
        barrier.wait()
        try:
            results.append(provider.put_file(key, src, len(data), digest))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(src,)) for src in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == len(sources)
    if isinstance(provider, LocalDiskProvider):
        # link() admits exactly one creator; moto does not make its
        # conditional check atomic across threads, so S3 is held to >= 1.
        assert results.count(True) == 1
    else:
        assert results.count(True) >= 1
    assert read_all(provider, key) == data


@pytest.mark.parametrize(
    "data",
    [b"", b"x", bytes(100_000), random_bytes(60_000, seed=7)],
    ids=["empty", "one-byte", "packs", "does-not-pack"],
)
def test_put_bytes_stores_what_put_file_would(
    request: pytest.FixtureRequest, provider: StorageProvider, tmp_path: Path, data: bytes
) -> None:
    """An upload's body kept in memory is stored as a spooled one would be:
    the same bytes back, once (a second put finds it), nothing left behind."""
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    assert provider.put_bytes(key, data, digest) is True
    assert read_all(provider, key) == data
    assert provider.size(key) == len(data)
    assert provider.put_bytes(key, data, digest) is False
    assert provider.put_file(key, write_source(tmp_path, data), len(data), digest) is False
    assert list(provider.iter_keys()) == [key]
    assert leftovers(provider, server_of(request, provider)) == []


@pytest.mark.parametrize("data", [bytes(100_000), random_bytes(60_000, seed=8)])
def test_put_bytes_refuses_bytes_that_do_not_hash_to_the_key(
    request: pytest.FixtureRequest, provider: StorageProvider, data: bytes
) -> None:
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    with pytest.raises(SourceMismatch):
        provider.put_bytes(key, data[:-1] + b"?", digest)
    assert provider.exists(key) is False
    assert leftovers(provider, server_of(request, provider)) == []
    assert provider.put_bytes(key, data, digest) is True


# -- failed puts leave nothing behind ------------------------------------------


@pytest.mark.parametrize("size", [100_000, 20 * MiB], ids=["single", "multipart"])
@pytest.mark.parametrize("lie", ["shorter", "longer", "digest"])
def test_source_mismatch_stores_nothing(
    request: pytest.FixtureRequest, provider: StorageProvider, tmp_path: Path, size: int, lie: str
) -> None:
    data = random_bytes(size, seed=5)
    digest, declared = sha256(data), size
    if lie == "shorter":
        src = write_source(tmp_path, data[:-1])
    elif lie == "longer":
        src = write_source(tmp_path, data + b"!")
    else:
        src = write_source(tmp_path, data[:-1] + b"?")
    key = object_key(COMPANY, digest)
    with pytest.raises(SourceMismatch):
        provider.put_file(key, src, declared, digest)
    assert provider.exists(key) is False
    assert list(provider.iter_keys()) == []
    assert leftovers(provider, server_of(request, provider)) == []
    # The failed attempt does not block a correct one.
    assert provider.put_file(key, write_source(tmp_path, data), size, digest) is True
    assert read_all(provider, key) == data


@pytest.mark.parametrize("form", ["raw", "packed"])
def test_failure_mid_copy_stores_nothing(
    request: pytest.FixtureRequest, provider: StorageProvider, tmp_path: Path, form: str
) -> None:
    """Whether the bytes are being copied as they are or packed."""
    data = random_bytes(20 * MiB, seed=6)
    if form == "packed":
        data = data[: 5 * MiB] + bytes(15 * MiB)
    digest = sha256(data)
    key = object_key(COMPANY, digest)
    src = FailingSource(write_source(tmp_path, data))
    with pytest.raises(StorageUnavailable) as caught:
        provider.put_file(key, src, len(data), digest)
    assert "injected" in str(caught.value)
    assert provider.exists(key) is False
    assert list(provider.iter_keys()) == []
    assert leftovers(provider, server_of(request, provider)) == []


# -- make_provider -------------------------------------------------------------------


def test_make_provider(tmp_path: Path) -> None:
    local = make_provider("local_disk", data_dir=tmp_path)
    assert isinstance(local, LocalDiskProvider)
    assert local.name == "local_disk"
    assert local.root == (tmp_path / "objects").resolve()

    s3 = make_provider(
        "s3",
        data_dir=tmp_path,
        s3_bucket="b",
        s3_endpoint="http://127.0.0.1:9",
        s3_region="eu-west-1",
    )
    assert isinstance(s3, S3Provider)
    assert (s3.name, s3.bucket) == ("s3", "b")

    with pytest.raises(ValueError):
        make_provider("s3", data_dir=tmp_path)
    with pytest.raises(ValueError):
        make_provider("ftp", data_dir=tmp_path)
