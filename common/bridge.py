"""The bridge: the HTTP contract between fsagent (untrusted) and the controller.

All routes live under ``/bridge/v1`` and authenticate with the run token
(``Authorization: Bearer <run token>``). A run can reach only the folders it
is bound to; ``{scope}`` is one of task/agent/user/project and the owner is
taken from the run's binding, never from the client.

``GET /bridge/v1/run``
    ``{"runId", "companyId", "agentId", "leaseEpoch", "active", "refreshRequested",
    "bindings": {"task": ownerId|null, "agent": ownerId, "user": ownerId|null,
    "project": ownerId|null}, "agentEntry": path, "warnings": [Warning...]}``

    ``agentEntry`` is the agent's instruction entry in its folder
    (``AGENTS.md`` by default): its presence says the agent folder contract
    applies, so fsagent refuses ``unlink`` and ``rename`` away of that path
    (``EPERM``), tries the agent folder's final save up to three times and
    discards its local copy at stop. ``warnings`` are the run's current
    warnings (``{"scope", "code", "message", "limit"?, "max"?, "value"?,
    "path"?}``, e.g. ``AGENT_FILES_AT_LIMIT``); the first call of a run
    records the agent folder's limit warnings for it.

``GET /bridge/v1/folders/{scope}/manifest?since=<version>&limit=<n>``
    Entries of the folder with ``version > since`` in ascending version order,
    at most ``limit`` (default and maximum :data:`MANIFEST_PAGE_MAX`).
    ``since=0`` (the default) lists only live entries: a full manifest.
    ``since>0`` also lists entries deleted after ``since`` with
    ``"deleted": true`` so a client can apply "changes since" in order.
    Body: ``{"entries": [ManifestEntry...], "nextSince": int|null,
    "highWater": int}``. ``nextSince`` is null on the last page; otherwise ask
    again with ``since=nextSince``. ``highWater`` is the folder's newest
    version when the first page was read: remember it as the baseline.
    If ``since`` is older than the folder's purge floor the answer is
    410 ``{"code": "resync_required"}``: list again from ``since=0``.
    404 when the scope is not bound to the run (or the user folder's
    responsible user is no longer an active member).

    ManifestEntry: ``{"path", "kind": "file"|"directory", "digest": hex|null,
    "byteSize", "executable", "version", "deleted"}``

``GET /bridge/v1/folders/{scope}/objects/{digest}``
    The bytes of an object that the folder references (a live or trashed
    file) or that this run uploaded. ``Range: bytes=a-b`` is honoured (206).
    404 otherwise: an object is never reachable by hash alone.
"""

import hashlib
import os
import struct
import threading
from collections.abc import Mapping
from typing import Final

import xxhash
import zstandard

PREFIX: Final = "/bridge/v1"
MANIFEST_PAGE_MAX: Final = 5000

# --- writes (checkpoints) ----------------------------------------------------
#
# ``PUT /bridge/v1/folders/{scope}/uploads``
#     Body: a sequence of frames (see :func:`frame_header`), each exactly one
#     zstd frame (no trailing bytes) of at most :data:`CHUNK_MAX` uncompressed
#     bytes that declares its content size, with the xxh64 of those bytes,
#     ended by :data:`END_FRAME` (nothing after it); common/wire.py. Headers ``X-Content-SHA256`` and
#     ``X-Content-Length`` are hints: the controller computes both itself and
#     answers 422 ``digest_mismatch`` when they differ (a torn read), 413 past
#     1 GiB, 400 ``bad_frame`` for a corrupt frame. Answer:
#     ``{"digest", "byteSize"}``. The object may then be referenced by this
#     run's checkpoints.
#
# ``PUT /bridge/v1/folders/{scope}/uploads/batch``
#     Many small objects in one body: :data:`BATCH_HEADER` (magic
#     :data:`BATCH_MAGIC`, member count, 1 to :data:`BATCH_MAX_MEMBERS`), then
#     per member :data:`MEMBER_HEADER` (raw byte size, declared SHA-256) and
#     its upload frames ended by :data:`END_FRAME`, exactly as in a single
#     upload; nothing after the last member. A member carries at most
#     :data:`BATCH_MEMBER_MAX` bytes, the batch at most :data:`BATCH_MAX_BYTES`.
#     The controller decodes and hashes every member itself; a member whose
#     bytes are not its declared size and digest is 422 ``digest_mismatch``,
#     a corrupt frame 400 ``bad_frame``, too many members or bytes 413. The
#     batch is all or nothing: on any refusal no member is registered. Objects
#     stay one per digest (the batch is only a transport), stored with one
#     sync for the batch and registered in one transaction. Answer:
#     ``{"objects": [{"digest", "byteSize"}...]}`` in member order.
#
# ``POST /bridge/v1/folders/{scope}/checkpoints``
#     ``{"operationId", "leaseEpoch", "final": bool, "entries": [Entry...]}``
#     where Entry is ``{"op": "put", "path", "digest", "executable"}``,
#     ``{"op": "mkdir", "path"}`` or ``{"op": "delete", "path"}``, applied in
#     order, all or nothing. A put may reference only content visible to the
#     folder (its live files or trash) or uploaded by this run. Answer: the
#     receipt ``{"operationId", "applied": true, "entries", "byteSize" (content
#     bytes the puts reference), "highWater", "savedAt"}``; a retry with the same operation id and body returns the
#     same receipt with ``"replayed": true``; the same id with another body is
#     409 ``idempotency_conflict``; an old lease epoch is 409 ``stale_lease``;
#     a user folder whose user left the company is 403 ``membership_revoked``.
#     In the agent folder: a save over one of its storage limits is 422
#     ``agent_files_limit_exceeded`` (``details: [{"limit", "max", "value",
#     "path"?}]``; nothing applied, so the body may be dropped and the changes
#     listed afresh); a run whose responsible user may not configure the agent
#     gets 404; entries that break the instruction entry's rules (deleting it,
#     a directory at or above it, content over 1 MiB or not UTF-8) are left
#     out and the receipt lists them as ``"refusedEntries": [{"path", "code",
#     "message"}]``: fsagent keeps those paths unsaved. Every commit the
#     controller answers is also a save receipt of the run (controller.receipts).
#     Optional ``"localRefusals": [{"path", "code"}]`` and
#     ``"localRefusedMore": n``: the paths the sandbox itself refused (dir mode's
#     scan: a code of :data:`LOCAL_REFUSAL_CODES`), at most
#     :data:`MAX_LOCAL_REFUSALS` listed and the count of the rest. A path is a
#     valid work path, except under ``invalid_name``, where it is the name as
#     the sandbox shows it (non-printable characters escaped, at most
#     :data:`MAX_LOCAL_REFUSAL_PATH` characters). They are part of the body
#     (its idempotency fingerprint) and change no file: the save receipt lists
#     them in its ``refusedEntries`` with ``"by": "sandbox"`` and warns with
#     code ``SANDBOX_REFUSED`` and their total ``count``. A bad list is 400
#     ``validation_error`` and nothing of the checkpoint applies.
#     Optional ``"finalSave": true`` on every part of a final save (``final``
#     marks only its last part): a refused part's receipt is then final, the
#     final save's own; it is not part of the fingerprint.
#
# ``POST /bridge/v1/run/report``
#     ``{"state": "saving"|"failed", "error"?, "scope"?, "operationId"?, "final"?}``
#     fsagent reports that a save started or that it gave up, so /sync shows it.
#     With ``scope`` (state failed): fsagent gave up on that folder's save after
#     its last attempt; the controller records an explicit ``failed`` receipt
#     (code ``SAVE_FAILED``) with the operation id, final with ``"final": true``
#     (a final save given up).
#
# ``POST /bridge/v1/run/refresh-applied``
#     After a successful final save fsagent took the server's changes because
#     ``GET /run`` said ``refreshRequested``; this clears the request.


CHUNK_MAX: Final = 4 << 20
"""Largest uncompressed chunk in one upload frame."""

BATCH_MAGIC: Final = b"FSB1"
BATCH_HEADER: Final = struct.Struct(">4sI")
"""(magic, member count) at the start of a batch upload."""

MEMBER_HEADER: Final = struct.Struct(">Q32s")
"""(raw byte size, SHA-256) before each member's frames."""

BATCH_MEMBER_SIZES_KIB: Final = ("16", "64", "256")
BATCH_MEMBER_ENV: Final = "BENCH_BATCH_MEMBER_KIB"


def batch_member_max(env: Mapping[str, str] = os.environ) -> int:
    """64 KiB, or the size :data:`BATCH_MEMBER_ENV` names in KiB (16, 64 or
    256): ``bench.save --batch-sweep`` sets it for the controller and fsagent
    alike to measure the threshold. (A sender whose members a receiver's
    smaller bound refuses gets 413 and keeps its files unsaved.)"""
    raw = env.get(BATCH_MEMBER_ENV)
    if raw is None:
        return 64 << 10
    if raw not in BATCH_MEMBER_SIZES_KIB:
        raise ValueError(
            f"{BATCH_MEMBER_ENV} must be one of {', '.join(BATCH_MEMBER_SIZES_KIB)}, not {raw!r}"
        )
    return int(raw) << 10


BATCH_MEMBER_MAX: Final = batch_member_max()
"""Largest file sent in a batch; bigger files go up one per request."""

BATCH_MAX_MEMBERS: Final = 1024
BATCH_MAX_BYTES: Final = 16 << 20
"""Raw bytes of all members of one batch."""

MAX_CHECKPOINT_ENTRIES: Final = 100_000
"""Entries one checkpoint may name (the controller's ``--max-checkpoint-entries``
default; the run info announces the value in force as ``maxCheckpointEntries``)."""

MAX_CHECKPOINT_ROWS: Final = 200_000
"""Rows one checkpoint may create, each named path and each of its ancestors
once (the controller's ``--max-checkpoint-rows`` default; announced as
``maxCheckpointRows``). fsagent plans the parts of a large change set within
both bounds (fsagent.checkpoint.ship), so no size of change set is refused for its size."""

LOCAL_REFUSAL_CODES: Final = frozenset(
    {
        "symlink",
        "hard_link",
        "special_file",
        "invalid_name",
        "file_too_large",
        "entry_limit",
        "unreadable",
    }
)
"""Why dir mode's scan refuses a path (fsagent.dirmode.scan), as a checkpoint's
``localRefusals`` may name them."""
MAX_LOCAL_REFUSALS: Final = 1000
"""Sandbox refusals listed in one checkpoint (and its receipt); the rest are counted."""
MAX_LOCAL_REFUSAL_PATH: Final = 4096
"""Characters of a refused name as the sandbox shows it (escapes take room)."""
MAX_CHECKPOINT_BODY: Final = 64 << 20

FRAME_HEADER: Final = struct.Struct(">IIQ")
"""(compressed length, raw length, xxh64 of the raw bytes)."""

END_FRAME: Final = FRAME_HEADER.pack(0, 0, 0)


def frame_header(compressed_len: int, raw_len: int, xxh64: int) -> bytes:
    return FRAME_HEADER.pack(compressed_len, raw_len, xxh64)


def encode_frame(raw: bytes, compressor: zstandard.ZstdCompressor | None) -> bytes:
    """One upload frame for ``raw`` (at most :data:`CHUNK_MAX` bytes).

    With ``compressor`` None the payload is a zstd frame of raw (stored)
    blocks: valid zstd that costs a copy to write and to read, for data that
    does not compress (:func:`compressible`).
    """
    if not 0 < len(raw) <= CHUNK_MAX:
        raise ValueError(f"a frame carries 1-{CHUNK_MAX} bytes, got {len(raw)}")
    payload = compressor.compress(raw) if compressor is not None else stored_zstd(raw)
    return frame_header(len(payload), len(raw), xxhash.xxh64_intdigest(raw)) + payload


_ZSTD_MAGIC = struct.pack("<I", 0xFD2FB528)
_STORED_BLOCK = 128 << 10
# Frame header descriptor: single segment (the window is the content size),
# 8-byte content size field, no checksum, no dictionary.
_SINGLE_SEGMENT_FCS8 = bytes([0b1110_0000])


def stored_zstd(raw: bytes) -> bytes:
    """``raw`` as one zstd frame of Raw_Blocks (RFC 8878 3.1.1), declaring its size."""
    parts: list[bytes | memoryview] = [
        _ZSTD_MAGIC,
        _SINGLE_SEGMENT_FCS8,
        struct.pack("<Q", len(raw)),
    ]
    view = memoryview(raw)
    for start in range(0, len(raw), _STORED_BLOCK):
        block = view[start : start + _STORED_BLOCK]
        last = 1 if start + _STORED_BLOCK >= len(raw) else 0
        parts.append((len(block) << 3 | last).to_bytes(3, "little"))  # block type 0: raw
        parts.append(block)
    return b"".join(parts)


COMPRESSIBLE_SAMPLE: Final = 64 << 10
COMPRESSIBLE_RATIO: Final = 0.9


def compressible(first_block: bytes) -> bool:
    """Whether a file is worth compressing, judged on its first block: a fast
    zstd pass over a sample must save at least a tenth of it."""
    sample = first_block[:COMPRESSIBLE_SAMPLE]
    if len(sample) < 512:
        return True  # too small to judge; compressing it costs next to nothing
    sampler = getattr(_local, "sampler", None)
    if sampler is None:
        # A compression context is not thread-safe: one per thread.
        sampler = _local.sampler = zstandard.ZstdCompressor(level=1)
    return len(sampler.compress(sample)) < COMPRESSIBLE_RATIO * len(sample)


_local = threading.local()


def batch_header(count: int) -> bytes:
    """The start of a batch body of ``count`` members."""
    return BATCH_HEADER.pack(BATCH_MAGIC, count)


def member_header(size: int, sha256: bytes) -> bytes:
    """A member's header; its frames and :data:`END_FRAME` follow. A sender
    that streams a member (the controller's repository object fetch) writes
    the header from the content address, then one frame per chunk."""
    return MEMBER_HEADER.pack(size, sha256)


def encode_member(raw: bytes, compressor: zstandard.ZstdCompressor | None) -> bytes:
    """One batch member: its header and frames (:data:`END_FRAME` included)."""
    out = [member_header(len(raw), hashlib.sha256(raw).digest())]
    for start in range(0, len(raw), CHUNK_MAX):
        out.append(encode_frame(raw[start : start + CHUNK_MAX], compressor))
    out.append(END_FRAME)
    return b"".join(out)


def encode_batch(members: list[bytes]) -> bytes:
    """A batch upload body; each member compressed unless it looks incompressible."""
    compressor = zstandard.ZstdCompressor(level=3)
    out = [batch_header(len(members))]
    for raw in members:
        out.append(encode_member(raw, compressor if compressible(raw) else None))
    return b"".join(out)
