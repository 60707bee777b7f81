"""Batch uploads (``PUT /bridge/v1/folders/{scope}/uploads/batch``): many small
objects in one request, all or nothing, each stored under its own digest."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random

import httpx
import pytest
import zstandard

from common.bridge import (
    BATCH_HEADER,
    BATCH_MAGIC,
    BATCH_MAX_MEMBERS,
    BATCH_MEMBER_ENV,
    BATCH_MEMBER_MAX,
    END_FRAME,
    MEMBER_HEADER,
    batch_member_max,
    encode_batch,
    encode_frame,
    encode_member,
)
from common.errors import WorkFolderError
from common.wire import BatchSplitter, Frame, Member, decode_frame
from controller.storage.base import object_key
from tests.support.bridge import Run, start_run
from tests.support.controller import Tenant

BATCH = "/folders/task/uploads/batch"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put_batch(run: Run, body: bytes) -> httpx.Response:
    with run.client() as c:
        return c.put(BATCH, content=body)


def registered(run: Run) -> set[str]:
    with run.tenant.controller.db() as db:
        rows = db.execute(
            "SELECT digest FROM run_uploads WHERE run_id = %s", (run.run_id,)
        ).fetchall()
    return {r[0] for r in rows}


def stored(run: Run, digest: str) -> bool:
    path = run.tenant.controller.data_dir / "objects" / object_key(run.tenant.company_id, digest)
    return path.is_file()


def put_entries(digests: dict[str, str]) -> list[dict[str, object]]:
    return [{"op": "put", "path": p, "digest": d, "executable": False} for p, d in digests.items()]


def test_a_batch_stores_each_member_under_its_digest_and_a_checkpoint_uses_them(
    tenant: Tenant,
) -> None:
    run = start_run(tenant)
    files = {f"d/f{i}.txt": os.urandom(i * 37) for i in range(40)}  # f0 is empty
    files["text.md"] = b"compressible " * 1000
    files["twin.md"] = files["text.md"]  # the same bytes twice: one object
    r = put_batch(run, encode_batch(list(files.values())))
    assert r.status_code == 200, r.text
    objects = r.json()["objects"]
    assert [(o["digest"], o["byteSize"]) for o in objects] == [
        (sha(d), len(d)) for d in files.values()
    ]
    assert registered(run) == {sha(d) for d in files.values()}
    assert all(stored(run, sha(d)) for d in files.values())
    digests = {p: o["digest"] for p, o in zip(files, objects, strict=True)}
    c = run.commit("task", put_entries(digests))
    assert c.status_code == 200, c.text
    with run.client() as client:
        for path, data in files.items():
            got = client.get(f"/folders/task/objects/{sha(data)}")
            assert got.status_code == 200 and got.content == data, path


def test_a_batch_with_one_corrupt_member_fails_whole_and_a_retry_succeeds(
    tenant: Tenant,
) -> None:
    run = start_run(tenant)
    members = [os.urandom(1000 + i) for i in range(5)]
    good = encode_batch(members)
    # Flip one byte inside the third member's frame payload.
    offset = BATCH_HEADER.size + sum(len(encode_member(m, None)) for m in members[:2])
    at = offset + MEMBER_HEADER.size + 16 + 20
    corrupt = good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1 :]
    r = put_batch(run, corrupt)
    assert r.status_code == 400 and r.json()["code"] == "bad_frame", r.text
    assert registered(run) == set()
    assert not any(stored(run, sha(m)) for m in members)
    c = run.commit("task", put_entries({"a": sha(members[0])}))
    assert c.status_code == 422 and c.json()["code"] == "unknown_content", c.text
    r = put_batch(run, good)
    assert r.status_code == 200, r.text
    assert registered(run) == {sha(m) for m in members}
    c = run.commit("task", put_entries({f"f{i}": sha(m) for i, m in enumerate(members)}))
    assert c.status_code == 200, c.text


def test_a_member_whose_bytes_differ_from_its_declared_digest_is_refused(
    tenant: Tenant,
) -> None:
    run = start_run(tenant)
    honest, liar, claimed = b"honest bytes", b"what was sent", b"what was claimed"
    cctx = zstandard.ZstdCompressor()
    body = (
        BATCH_HEADER.pack(BATCH_MAGIC, 2)
        + encode_member(honest, cctx)
        + MEMBER_HEADER.pack(len(liar), hashlib.sha256(claimed).digest())
        + encode_frame(liar, cctx)
        + END_FRAME
    )
    r = put_batch(run, body)
    assert r.status_code == 422 and r.json()["code"] == "digest_mismatch", r.text
    assert registered(run) == set()
    assert not stored(run, sha(honest)) and not stored(run, sha(liar))
    # A declared size that the frames do not add up to is refused the same way.
    short = BATCH_HEADER.pack(BATCH_MAGIC, 1) + MEMBER_HEADER.pack(99, sha(liar).encode()[:32])
    r = put_batch(run, short + encode_frame(liar, cctx) + END_FRAME)
    assert r.status_code == 422 and r.json()["code"] == "digest_mismatch", r.text
    assert registered(run) == set()


def test_batch_bounds_and_malformed_bodies_are_clear_errors(tenant: Tenant) -> None:
    run = start_run(tenant)
    cctx = zstandard.ZstdCompressor()
    too_big = os.urandom(BATCH_MEMBER_MAX + 1)
    cases = {
        "too many members": (BATCH_HEADER.pack(BATCH_MAGIC, BATCH_MAX_MEMBERS + 1), 413),
        "no members": (BATCH_HEADER.pack(BATCH_MAGIC, 0), 413),
        "member too large": (
            BATCH_HEADER.pack(BATCH_MAGIC, 1) + encode_member(too_big, cctx),
            413,
        ),
        "wrong magic": (BATCH_HEADER.pack(b"NOPE", 1) + encode_member(b"x", cctx), 400),
        "truncated": (encode_batch([b"a", b"b"])[:-3], 400),
        "trailing bytes": (encode_batch([b"a"]) + b"\x00", 400),
        "empty body": (b"", 400),
    }
    for name, (body, status) in cases.items():
        r = put_batch(run, body)
        assert r.status_code == status, (name, r.status_code, r.text)
        assert r.json()["code"] in ("bad_frame", "payload_too_large"), (name, r.text)
    assert registered(run) == set()


def test_the_batch_threshold_is_64_kib_unless_the_benchmark_names_another() -> None:
    assert BATCH_MEMBER_MAX == batch_member_max({}) == 64 << 10
    assert batch_member_max({BATCH_MEMBER_ENV: "16"}) == 16 << 10
    assert batch_member_max({BATCH_MEMBER_ENV: "256"}) == 256 << 10
    for bad in ("100", "", "64k", "-1"):
        with pytest.raises(ValueError, match="must be one of 16, 64, 256"):
            batch_member_max({BATCH_MEMBER_ENV: bad})


def test_the_batch_reader_gives_the_same_items_whatever_the_body_is_cut_into() -> None:
    members = [os.urandom(5000), b"", b"text " * 3000, os.urandom(BATCH_MEMBER_MAX)]
    body = encode_batch(members)

    def read(step: int) -> list[bytes]:
        splitter = BatchSplitter()
        out: list[bytes] = []
        current = bytearray()
        for i in range(0, len(body), step):
            for item in splitter.feed(body[i : i + step]):
                if isinstance(item, Member):
                    current = bytearray()
                elif isinstance(item, Frame):
                    current += decode_frame(item)
                else:
                    out.append(bytes(current))
        splitter.finish()
        return out

    for step in (1, 7, 4096, len(body)):
        assert read(step) == members, step


def test_encoding_batches_in_many_threads_at_once_gives_valid_bodies() -> None:
    members = [os.urandom(3000) for _ in range(64)] + [b"text " * 800 for _ in range(64)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(lambda _: encode_batch(members), range(200)))
    assert all(b == bodies[0] for b in bodies)


def test_the_batch_reader_refuses_any_mangled_body_with_a_project_error() -> None:
    rng = random.Random(15)
    body = encode_batch([os.urandom(rng.randrange(0, 3000)) for _ in range(12)])
    for _ in range(400):
        mangled = bytearray(body)
        for _ in range(rng.randrange(1, 4)):
            mangled[rng.randrange(len(mangled))] = rng.randrange(256)
        cut = rng.choice([len(mangled), rng.randrange(len(mangled))])
        splitter = BatchSplitter()
        try:
            for item in splitter.feed(bytes(mangled[:cut])):
                if isinstance(item, Frame):
                    decode_frame(item)
            splitter.finish()
        except WorkFolderError as exc:
            assert exc.status in (400, 413, 422), exc
