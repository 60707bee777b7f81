"""Coverage-guided fuzzing of what a sandbox sends: upload frames, checkpoint and
repository checkpoint bodies.

    python tests/fuzz/fuzz_upload.py [libFuzzer flags] [CORPUS_DIR...]

The first input byte picks the target; the rest is the body. The documented
refusals (``BadFrame`` for frames, ``ValidationError`` for checkpoints,
``ValidationError`` or ``UnsafeRepoMember`` for repository checkpoints) are
expected; any other exception, or a decoded frame of the wrong length, is a
crash. Without a corpus directory the built-in seeds are used from a temp dir;
an empty corpus directory is seeded first. ``make fuzz`` runs it for longer.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

# Dependencies first, so that only our own parsing code is instrumented.
import psycopg  # noqa: F401
import starlette.requests  # noqa: F401
import xxhash
import zstandard

with atheris.instrument_imports(
    include=[
        "common.wire",
        "controller.checkpoint",
        "controller.repomanifest",
        "common.repos",
        "common.paths",
        "controller.api.common",
    ]
):
    from common.bridge import END_FRAME, encode_frame, frame_header
    from common.errors import BadFrame, UnsafeRepoMember, ValidationError
    from common.wire import FrameSplitter, decode_frame
    from controller.api.common import parse_json_object
    from controller.checkpoint import parse_checkpoint
    from controller.repomanifest import parse_request

FRAMES, CHECKPOINT, REPO_CHECKPOINT = 0, 1, 2


def fuzz_frames(body: bytes, cut: int) -> None:
    splitter = FrameSplitter()
    try:
        for i in range(0, len(body), cut):
            for frame in splitter.feed(body[i : i + cut]):
                raw = decode_frame(frame)
                if len(raw) != frame.raw_len:
                    raise AssertionError("decoded frame has the wrong length")
        splitter.finish()
    except BadFrame:
        pass


def fuzz_checkpoint(body: bytes) -> None:
    try:
        cp = parse_checkpoint(parse_json_object(body))
    except ValidationError:
        return
    if not isinstance(cp.operation_id, str) or not isinstance(cp.lease_epoch, int):
        raise AssertionError("parsed checkpoint has wrong field types")


def fuzz_repo_checkpoint(body: bytes) -> None:
    try:
        req = parse_request(parse_json_object(body))
    except (ValidationError, UnsafeRepoMember):
        return
    if not isinstance(req.operation_id, str) or not isinstance(req.lease_epoch, int):
        raise AssertionError("parsed repository checkpoint has wrong field types")


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    target = data[0] % 3
    if target == FRAMES:
        fuzz_frames(data[2:], data[1] % 97 + 1)
    elif target == CHECKPOINT:
        fuzz_checkpoint(data[1:])
    else:
        fuzz_repo_checkpoint(data[1:])


def seeds() -> list[bytes]:
    cctx = zstandard.ZstdCompressor()
    raw = b"hello, frames " * 50
    frame = encode_frame(raw, cctx)
    payload = cctx.compress(raw)
    streamed = cctx.compressobj()
    unknown = streamed.compress(raw) + streamed.flush()
    check = xxhash.xxh64_intdigest(raw)
    frames = [
        frame + END_FRAME,
        frame + encode_frame(b"x" * 1000, cctx) + END_FRAME,
        frame_header(len(payload) + 4, len(raw), check) + payload + b"junk" + END_FRAME,
        frame_header(len(unknown), len(raw), check) + unknown + END_FRAME,
        END_FRAME,
    ]
    digest = "ab" * 32
    checkpoints = [
        b'{"operationId": "op-1", "leaseEpoch": 1, "final": false, "entries": []}',
        (
            '{"operationId": "op-2", "leaseEpoch": 3, "final": true, "entries": ['
            '{"op": "mkdir", "path": "a"}, {"op": "delete", "path": "a/b.txt"}, '
            f'{{"op": "put", "path": "a/\\u00e9 c", "digest": "{digest}", "executable": true}}]}}'
        ).encode(),
        b'{"operationId": "", "leaseEpoch": true, "entries": [{"op": "link"}], "x": 1}',
        # Once a crash: an op that is not a string raised TypeError.
        b'{"entries": [{"op": [{"op": "nk"}], "x": true}]}',
    ]
    member = f'{{"path": "a.txt", "kind": "file", "digest": "{digest}", "byteSize": 3, "executable": false}}'
    repo_checkpoints = [
        f'{{"operationId": "r-1", "leaseEpoch": 1, "base": null, "members": [{member}]}}'.encode(),
        (
            b'{"operationId": "r-2", "leaseEpoch": 2, "base": "00000000-0000-0000-0000-000000000001", '
            b'"members": [{"path": "l", "kind": "symlink", "target": "a.txt"}], '
            b'"removed": ["b/c.txt"], "config": [["core.autocrlf", "false"]]}'
        ),
        b'{"operationId": "r-3", "leaseEpoch": 1, "members": [{"path": [1], "kind": {}}], "config": [[1]]}',
    ]
    return (
        [bytes([FRAMES, 13]) + f for f in frames]
        + [bytes([CHECKPOINT]) + c for c in checkpoints]
        + [bytes([REPO_CHECKPOINT]) + r for r in repo_checkpoints]
    )


def main() -> None:
    argv = list(sys.argv)
    corpora = [a for a in argv[1:] if not a.startswith("-")]
    if not corpora:
        corpus = Path(tempfile.mkdtemp(prefix="fuzz-upload-"))
        argv.append(str(corpus))
        corpora = [str(corpus)]
    first = Path(corpora[0])
    first.mkdir(parents=True, exist_ok=True)
    if not any(first.iterdir()):
        for i, seed in enumerate(seeds()):
            (first / f"seed-{i}").write_bytes(seed)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
