"""The bridge: the HTTP contract between fsagent (untrusted) and the controller.

All routes live under ``/bridge/v1`` and authenticate with the run token
(``Authorization: Bearer <run token>``). A run can reach only the folders it
is bound to; ``{scope}`` is one of task/agent/user/project and the owner is
taken from the run's binding, never from the client.

``GET /bridge/v1/run``
    ``{"runId", "companyId", "agentId", "leaseEpoch", "active", "refreshRequested",
    "bindings": {"task": ownerId|null, "agent": ownerId, "user": ownerId|null,
    "project": ownerId|null}}``

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

import struct
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
#     ended by :data:`END_FRAME` (nothing after it); controller/frames.py. Headers ``X-Content-SHA256`` and
#     ``X-Content-Length`` are hints: the controller computes both itself and
#     answers 422 ``digest_mismatch`` when they differ (a torn read), 413 past
#     1 GiB, 400 ``bad_frame`` for a corrupt frame. Answer:
#     ``{"digest", "byteSize"}``. The object may then be referenced by this
#     run's checkpoints.
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
#
# ``POST /bridge/v1/run/report``  ``{"state": "saving"|"failed", "error"?}``
#     fsagent reports that a save started or that it gave up, so /sync shows it.
#
# ``POST /bridge/v1/run/refresh-applied``
#     After a successful final save fsagent took the server's changes because
#     ``GET /run`` said ``refreshRequested``; this clears the request.


CHUNK_MAX: Final = 4 << 20
"""Largest uncompressed chunk in one upload frame."""

MAX_CHECKPOINT_ENTRIES: Final = 100_000
MAX_CHECKPOINT_BODY: Final = 64 << 20

FRAME_HEADER: Final = struct.Struct(">IIQ")
"""(compressed length, raw length, xxh64 of the raw bytes)."""

END_FRAME: Final = FRAME_HEADER.pack(0, 0, 0)


def frame_header(compressed_len: int, raw_len: int, xxh64: int) -> bytes:
    return FRAME_HEADER.pack(compressed_len, raw_len, xxh64)


def encode_frame(raw: bytes, compressor: zstandard.ZstdCompressor) -> bytes:
    """One upload frame for ``raw`` (at most :data:`CHUNK_MAX` bytes)."""
    if not 0 < len(raw) <= CHUNK_MAX:
        raise ValueError(f"a frame carries 1-{CHUNK_MAX} bytes, got {len(raw)}")
    compressed = compressor.compress(raw)
    return frame_header(len(compressed), len(raw), xxhash.xxh64_intdigest(raw)) + compressed
