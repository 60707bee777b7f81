"""The bridge: the HTTP contract between fsagent (untrusted) and the controller.

All routes live under ``/bridge/v1`` and authenticate with the run token
(``Authorization: Bearer <run token>``). A run can reach only the folders it
is bound to; ``{scope}`` is one of task/agent/user/project and the owner is
taken from the run's binding, never from the client.

``GET /bridge/v1/run``
    ``{"runId", "companyId", "agentId", "leaseEpoch", "active",
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

from typing import Final

PREFIX: Final = "/bridge/v1"
MANIFEST_PAGE_MAX: Final = 5000
