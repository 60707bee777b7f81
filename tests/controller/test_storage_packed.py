"""Objects compressed at rest (``controller/storage/packed.py``), on both
providers: what compresses by an eighth or more is stored packed, the rest
raw; every read (whole, ranged, by span) gives the logical bytes; ``size`` is
the logical size; an object stored raw before packing existed still reads."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import pytest

from common.errors import StorageUnavailable
from controller.storage import LocalDiskProvider, S3Provider, StorageProvider, object_key, packed
from controller.storage.base import SourceMismatch, Span
from controller.storage.packed import FRAME_BYTES, HEADER_LEN, MAGIC
from tests.support.s3server import S3Server
from tests.support.storage import (
    COMPANY,
    TEST_MULTIPART_THRESHOLD,
    MiB,
    make_s3_provider,
    random_bytes,
    read_all,
    s3_client,
    sha256,
    store,
)


def text(size: int, seed: int = 0) -> bytes:
    """Compressible, but not trivially: lines of numbered words."""
    out = bytearray()
    i = seed
    while len(out) < size:
        out += f"line {i}: the quick brown fox {i % 97} jumps over the lazy dog\n".encode()
        i += 1
    return bytes(out[:size])


def stored_size(provider: StorageProvider, key: str) -> int:
    """Bytes the backend holds for ``key``: the file, or the S3 object."""
    if isinstance(provider, LocalDiskProvider):
        return (provider.root / key).stat().st_size
    assert isinstance(provider, S3Provider)
    return int(provider._client.head_object(Bucket=provider.bucket, Key=key)["ContentLength"])


def stored_bytes(provider: StorageProvider, key: str) -> bytes:
    if isinstance(provider, LocalDiskProvider):
        return (provider.root / key).read_bytes()
    assert isinstance(provider, S3Provider)
    return bytes(provider._client.get_object(Bucket=provider.bucket, Key=key)["Body"].read())


def ranges(size: int) -> list[tuple[int, int | None]]:
    f = FRAME_BYTES
    return [
        (0, None),
        (0, 1),
        (0, 100),
        (1, 7),
        (f - 3, f + 3),  # across a frame boundary
        (f, 2 * f),  # exactly one frame
        (f + 1, None),
        (size - 10, None),
        (size - 10, size + 100),  # past the end: cut there
        (size, None),
        (size + 5, None),
        (7, 7),
        (0, size),
    ]


def test_compressible_objects_are_stored_packed_and_read_back(
    provider: StorageProvider, tmp_path: Path
) -> None:
    data = text(3 * FRAME_BYTES + 12345) + bytes(2 * MiB)
    key, created = store(provider, tmp_path, data)
    assert created is True
    assert stored_size(provider, key) < len(data) // 8
    assert stored_bytes(provider, key).startswith(MAGIC)
    assert provider.size(key) == len(data)
    assert provider.exists(key)
    for start, end in ranges(len(data)):
        assert read_all(provider, key, start, end) == data[start:end], (start, end)
    chunks = list(provider.read_chunks(key, 5, None, chunk_size=100_000))
    assert max(map(len, chunks)) <= 100_000 and b"".join(chunks) == data[5:]
    assert store(provider, tmp_path, data) == (key, False)


def test_incompressible_objects_are_stored_raw(provider: StorageProvider, tmp_path: Path) -> None:
    data = random_bytes(2 * FRAME_BYTES + 5, seed=31)
    key, _ = store(provider, tmp_path, data)
    assert stored_bytes(provider, key) == data
    assert provider.size(key) == len(data)
    for start, end in ranges(len(data)):
        assert read_all(provider, key, start, end) == data[start:end], (start, end)


def test_an_object_saving_less_than_an_eighth_is_stored_raw(
    provider: StorageProvider, tmp_path: Path
) -> None:
    """Nine parts random to one part zeros compresses by about a tenth: not
    worth a second form; half and half is."""
    tenth = random_bytes(9 * MiB, seed=32) + bytes(MiB)
    key, _ = store(provider, tmp_path, tenth)
    assert stored_size(provider, key) == len(tenth)
    half = bytes(MiB) + random_bytes(MiB, seed=33)  # the random part last
    key, _ = store(provider, tmp_path, half)
    assert MiB < stored_size(provider, key) < 1.2 * MiB
    assert read_all(provider, key) == half


def test_small_and_empty_objects(provider: StorageProvider, tmp_path: Path) -> None:
    for data in (b"", b"x", b"a" * 511, b"a" * 512, text(4096)):
        key, _ = store(provider, tmp_path, data)
        assert read_all(provider, key) == data
        assert read_all(provider, key, 1, 3) == data[1:3]
        assert provider.size(key) == len(data)
    assert stored_size(provider, object_key(COMPANY, sha256(text(4096)))) < 4096 // 2


def test_a_raw_object_that_looks_packed_is_read_raw(
    provider: StorageProvider, tmp_path: Path
) -> None:
    """An object stored raw (before packing, or incompressible) whose bytes
    begin with the magic is still raw: the header names its own digest,
    which no raw object can contain."""
    data = MAGIC + random_bytes(HEADER_LEN + 3 * MiB, seed=34)
    key, _ = store(provider, tmp_path, data)
    assert stored_bytes(provider, key) == data
    assert read_all(provider, key) == data
    assert read_all(provider, key, 2, 40) == data[2:40]
    assert provider.size(key) == len(data)


def test_batch_members_are_packed(provider: StorageProvider, tmp_path: Path) -> None:
    members = [text(700, seed=1), random_bytes(5000, seed=35), text(3 * MiB, seed=2), b""]
    members.append(text(10 * MiB, seed=3))  # past the S3 provider's in-memory span size
    spool = tmp_path / "batch"
    spool.write_bytes(b"".join(members))
    spans, offset = [], 0
    for data in members:
        spans.append(Span(object_key(COMPANY, sha256(data)), offset, len(data), sha256(data)))
        offset += len(data)
    assert provider.put_spans(spool, spans) == [True] * len(members)
    for span, data in zip(spans, members, strict=True):
        assert read_all(provider, span.key) == data
        assert read_all(provider, span.key, 3, 600) == data[3:600]
    assert stored_size(provider, spans[2].key) < 3 * MiB // 8
    assert stored_size(provider, spans[1].key) == 5000


def test_s3_packed_multipart_object(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """A packed form at or above the multipart threshold goes up in parts."""
    provider = make_s3_provider(s3_server, s3_bucket, temp_dir=tmp_path / "packing")
    provider.check()
    data = random_bytes(TEST_MULTIPART_THRESHOLD + MiB, seed=36) + bytes(16 * MiB)
    key, created = store(provider, tmp_path, data)
    assert created is True
    head = s3_client(s3_server).head_object(Bucket=s3_bucket, Key=key, PartNumber=1)
    assert head["PartsCount"] == 2
    assert TEST_MULTIPART_THRESHOLD < stored_size(provider, key) < len(data) // 2
    for start, end in ranges(len(data)):
        assert read_all(provider, key, start, end) == data[start:end], (start, end)
    assert os.listdir(tmp_path / "packing") == []


def test_a_short_read_of_a_packed_object_is_an_error(
    local_provider: LocalDiskProvider, tmp_path: Path
) -> None:
    data = text(3 * MiB)
    key, _ = store(local_provider, tmp_path, data)
    path = local_provider.root / key
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(Exception, match="ended early"):
        read_all(local_provider, key)


OTHER_COMPANY = "7a9f0c62-1d7b-4a8e-9a41-3c5b2e6d8f10"
THIRD_COMPANY = "3e1d9b57-8c2a-4f60-b7d3-9a0e5c4f2b18"
SPAN_KINDS = {
    "small text": text(700, seed=4),
    "small random": random_bytes(5000, seed=36),
    "one frame of text": text(FRAME_BYTES, seed=5),
    "one frame of random": random_bytes(FRAME_BYTES, seed=37),
    "past one frame": text(FRAME_BYTES + 1, seed=6),
}


def test_a_span_is_stored_as_put_file_stores_it(provider: StorageProvider, tmp_path: Path) -> None:
    """A batch member's stored form (made in memory up to one frame,
    streamed past it) is byte for byte what a single put stores."""
    members = list(SPAN_KINDS.values())
    spool = tmp_path / "batch"
    spool.write_bytes(b"".join(members))
    spans, offset = [], 0
    for data in members:
        spans.append(Span(object_key(COMPANY, sha256(data)), offset, len(data), sha256(data)))
        offset += len(data)
    assert provider.put_spans(spool, spans) == [True] * len(members)
    by_spans = {span.key: stored_bytes(provider, span.key) for span in spans}
    for span, data in zip(spans, members, strict=True):
        key, _ = store(provider, tmp_path, data, company=OTHER_COMPANY)
        assert stored_bytes(provider, key) == by_spans[span.key]
        assert read_all(provider, span.key) == data


@pytest.mark.parametrize("kind", sorted(SPAN_KINDS))
def test_a_span_that_does_not_hash_to_its_digest_is_refused(
    provider: StorageProvider, tmp_path: Path, kind: str
) -> None:
    """Whether its bytes would be packed or stored raw, in memory or streamed."""
    data = SPAN_KINDS[kind]
    spool = tmp_path / "batch"
    spool.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit off
    span = Span(object_key(COMPANY, sha256(data)), 0, len(data), sha256(data))
    with pytest.raises((SourceMismatch, StorageUnavailable)):
        provider.put_spans(spool, [span])
    assert not provider.exists(span.key)
    short = Span(span.key, 1, len(data), span.sha256_hex)  # runs past the spool's end
    with pytest.raises((SourceMismatch, StorageUnavailable)):
        provider.put_spans(spool, [short])
    assert not provider.exists(span.key)


@pytest.mark.parametrize("data", [text(4000, seed=7), random_bytes(4000, seed=38), b"x"])
def test_stored_form_refuses_bytes_that_do_not_hash_to_the_digest(data: bytes) -> None:
    assert packed.stored_form(data, sha256(data)) is not None
    with pytest.raises(SourceMismatch):
        packed.stored_form(data, sha256(data + b"!"))


def test_local_adopt_file_packs_the_spool_as_put_file_would(
    local_provider: LocalDiskProvider, tmp_path: Path
) -> None:
    """A compressible spool is packed without hashing it again (its writer
    hashed it); the packed form is put_file's, and a size that is not the
    spool's is still refused."""
    data = text(3 * FRAME_BYTES + 77, seed=8)
    spool = tmp_path / "spool"
    spool.write_bytes(data)
    key = object_key(COMPANY, sha256(data))
    with pytest.raises(SourceMismatch):
        local_provider.adopt_file(key, spool, len(data) + 1, sha256(data))
    assert local_provider.adopt_file(key, spool, len(data), sha256(data)) is True
    adopted = stored_bytes(local_provider, key)
    assert adopted.startswith(MAGIC) and len(adopted) < len(data) // 8
    other, _ = store(local_provider, tmp_path, data, company=OTHER_COMPANY)
    assert stored_bytes(local_provider, other) == adopted
    assert read_all(local_provider, key) == data


def test_pack_checks_the_size_even_of_bytes_already_hashed() -> None:
    data = text(2 * FRAME_BYTES, seed=9)
    for source in (data[:-5], data + b"more"):
        view = io.BytesIO(source)
        with pytest.raises(SourceMismatch):
            packed.pack(view.read, len(data), sha256(data), io.BytesIO(), hashed=True)


# --- screening: large objects that cannot pay are not packed at all --------

SCREEN = packed.SCREEN_FROM


def old_stored_form(data: bytes) -> bytes:
    """What a put stored before screening: ``pack`` over all the bytes, or
    the bytes themselves when it gave up (``pack`` itself is unchanged)."""
    return packed.pack_bytes(data, sha256(data), hashed=True) or data


def almost_an_eighth(seed: int) -> bytes:
    """One frame that saves a little less than an eighth on its own."""
    return random_bytes(FRAME_BYTES - FRAME_BYTES // 10, seed=seed) + bytes(FRAME_BYTES // 10)


def frames_of(*parts: bytes) -> bytes:
    assert all(len(part) == FRAME_BYTES for part in parts)
    return b"".join(parts)


def count_packing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes ``packed.pack`` is called for, from now on."""
    calls: list[int] = []
    real = packed.pack

    def spy(*args: object, **kwargs: object) -> int | None:
        calls.append(args[1])  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(packed, "pack", spy)
    return calls


def test_a_large_incompressible_object_is_stored_raw_without_packing(
    provider: StorageProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By put_file, by a span and (local disk) by adopting a spool: no packed
    form is written and thrown away, the object is its bytes, and it reads
    back whole and by range under its digest."""
    calls = count_packing(monkeypatch)
    data = random_bytes(SCREEN + 12345, seed=40)
    key, created = store(provider, tmp_path, data)
    assert created is True and key == object_key(COMPANY, sha256(data))
    assert stored_bytes(provider, key) == data
    assert provider.size(key) == len(data)
    assert read_all(provider, key) == data
    for start, end in ranges(len(data)):
        assert read_all(provider, key, start, end) == data[start:end], (start, end)
    spool = tmp_path / "batch"
    spool.write_bytes(b"x" * 7 + data)
    span = Span(object_key(OTHER_COMPANY, sha256(data)), 7, len(data), sha256(data))
    assert provider.put_spans(spool, [span]) == [True]
    assert stored_bytes(provider, span.key) == data
    if isinstance(provider, LocalDiskProvider):
        adopted = object_key(THIRD_COMPANY, sha256(data))
        spool = tmp_path / "spool"
        spool.write_bytes(data)
        assert provider.adopt_file(adopted, spool, len(data), sha256(data)) is True
        assert stored_bytes(provider, adopted) == data
        assert os.listdir(provider.root / "tmp") == []
    assert calls == []


def test_a_large_incompressible_object_is_still_checked(
    provider: StorageProvider, tmp_path: Path
) -> None:
    """Screened out of packing, the bytes are still hashed and sized."""
    data = random_bytes(SCREEN + 5, seed=41)
    liar = data[:-1] + bytes([data[-1] ^ 1])
    key = object_key(COMPANY, sha256(data))
    src = tmp_path / "liar"
    src.write_bytes(liar)
    with pytest.raises((SourceMismatch, StorageUnavailable)):
        provider.put_file(key, src, len(data), sha256(data))
    src.write_bytes(data[:-5])
    with pytest.raises((SourceMismatch, StorageUnavailable)):
        provider.put_file(key, src, len(data), sha256(data))
    assert not provider.exists(key)


def test_a_large_compressible_object_is_stored_as_before(
    provider: StorageProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Byte for byte the packed form packing all of it gives, packed once."""
    calls = count_packing(monkeypatch)
    data = text(SCREEN + 3 * MiB + 77, seed=10)
    expected = old_stored_form(data)
    calls.clear()
    key, _ = store(provider, tmp_path, data)
    assert calls == [len(data)]
    assert expected.startswith(MAGIC) and stored_bytes(provider, key) == expected
    assert read_all(provider, key) == data
    if isinstance(provider, LocalDiskProvider):
        adopted = key.replace(COMPANY, OTHER_COMPANY)
        spool = tmp_path / "spool"
        spool.write_bytes(data)
        assert provider.adopt_file(adopted, spool, len(data), sha256(data)) is True
        assert stored_bytes(provider, adopted) == expected


MIXED = {
    # Incompressible but for the end, which pays for all: packed, whatever
    # the order (the screen looks at every frame, not a sample).
    "random, then zeros": lambda: random_bytes(SCREEN, seed=42) + bytes(SCREEN),
    # No frame saves an eighth on its own, but one more does: packed.
    "almost an eighth, then one of zeros": lambda: frames_of(
        *(almost_an_eighth(seed) for seed in range(16)), bytes(FRAME_BYTES)
    ),
    # One frame pays, the whole does not: packing tries and gives up, raw.
    "random with one frame of zeros": lambda: (
        random_bytes(SCREEN, seed=43) + bytes(FRAME_BYTES) + random_bytes(SCREEN, seed=44)
    ),
    # Not one frame saves an eighth: raw, without packing.
    "almost an eighth in every frame": lambda: frames_of(
        *(almost_an_eighth(seed) for seed in range(17))
    ),
}


@pytest.mark.parametrize("kind", sorted(MIXED))
def test_a_mixed_object_is_stored_as_before(
    provider: StorageProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The rule for mixed data: the object is packed exactly when it was
    before (packing all of it saves an eighth), byte for byte; it is stored
    raw without packing only when not one frame saves an eighth, which
    means packing all of it could not have either."""
    data = MIXED[kind]()
    calls = count_packing(monkeypatch)
    expected = old_stored_form(data)
    calls.clear()
    key, _ = store(provider, tmp_path, data)
    assert stored_bytes(provider, key) == expected
    assert read_all(provider, key) == data
    source = tmp_path / "source"
    source.write_bytes(data)
    with source.open("rb") as f:
        screened_out = not packed.may_pay(f.fileno(), len(data))
    assert calls == ([] if screened_out else [len(data)])
    assert screened_out == (kind == "almost an eighth in every frame")


def test_the_screen_rules_out_only_what_packing_would_give_up() -> None:
    """``may_pay`` is False only when ``pack`` gives up, at the edges too:
    a frame saving just under an eighth, the last frame short, an offset
    into the file, and below the screening size it never rules out."""
    cases = {
        "just under an eighth": frames_of(*(almost_an_eighth(s) for s in range(16))),
        "short last frame": random_bytes(SCREEN + 1, seed=45),
        "exactly the screening size": random_bytes(SCREEN, seed=46),
        "just below it": random_bytes(SCREEN - 1, seed=47),
        "zeros": bytes(SCREEN + 9),
    }
    answers = {}
    with tempfile.TemporaryFile() as f:
        for name, data in cases.items():
            f.seek(0)
            f.truncate()
            f.write(b"prefix" + data)
            f.flush()
            pays = packed.may_pay(f.fileno(), len(data), offset=6)
            gives_up = packed.pack_bytes(data, sha256(data), hashed=True) is None
            assert pays or gives_up, name
            answers[name] = pays
        f.seek(0)
        f.truncate()
        f.write(cases["short last frame"][:-1])
        f.flush()
        # A short source is not the screen's to refuse: the put's checks do.
        assert packed.may_pay(f.fileno(), SCREEN + 1) is True
    assert answers == {
        "just under an eighth": False,
        "short last frame": False,
        "exactly the screening size": False,
        "just below it": True,
        "zeros": True,
    }
