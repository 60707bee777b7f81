"""Limits shared by both sides. The controller enforces them; fsagent mirrors
them so an agent learns about a refusal at write time, not at save time."""

from typing import Final

KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB

MAX_FILE_BYTES: Final = 1 * GiB
"""Largest work file. Uploads abort with 413 as soon as they cross it."""

MAX_ENTRIES: Final = 100_000
"""Largest scan or listing of one folder."""

MAX_PREVIEW_BYTES: Final = 8 * MiB
"""Largest body served by GET /content?preview=true."""

MAX_PATH_CHARS: Final = 1024
MAX_COMPONENT_BYTES: Final = 255
MAX_OWNER_ID_CHARS: Final = 256
MAX_CONTENT_TYPE_CHARS: Final = 256
MAX_IDEMPOTENCY_KEY_CHARS: Final = 256

DEFAULT_PAGE_LIMIT: Final = 200
MAX_PAGE_LIMIT: Final = 1000

CHECKPOINT_INTERVAL_SECONDS: Final = 180
GC_DELAY_SECONDS: Final = 24 * 3600
GC_SWEEP_INTERVAL_SECONDS: Final = 180

RESERVED_SEGMENT: Final = ".fsagent"
"""Runtime segment reserved for fsagent's own use; never a user path segment."""

SCOPES: Final = ("task", "agent", "user", "project")
