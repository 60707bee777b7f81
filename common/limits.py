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
GC_UPLOAD_GRACE_SECONDS: Final = 6 * 3600
"""Age at which GC takes an unfinished write into storage (an S3 multipart
upload, a local temp file) for abandoned: far longer than any live put takes
(a body has at most ``--body-deadline``, 1 h by default, to arrive)."""

RESERVED_SEGMENT: Final = ".fsagent"
"""Runtime segment reserved for fsagent's own use; never a user path segment."""

SCOPES: Final = ("task", "agent", "user", "project")

# --- the agent folder (its contract: docs/internals/invariants.md) ------------

AGENT_MAX_ENTRIES: Final = 100_000
"""Files and directories of one agent folder (a sync-validation limit)."""

AGENT_LOCAL_MAX_ENTRIES: Final = 10 * AGENT_MAX_ENTRIES
"""fsagent's own bound on the entries of an agent folder under its contract.
The agent may write past :data:`AGENT_MAX_ENTRIES` while it runs (the save is
what is refused), so the :data:`MAX_ENTRIES` refusal that
every other collection gets at write time does not apply there; this bound
only keeps a runaway agent from growing the state dir without end."""

AGENT_MAX_FILE_BYTES: Final = 256 * MiB
"""Largest file of an agent folder (a sync-validation limit, not a live quota:
fsagent still lets the agent write up to :data:`MAX_FILE_BYTES`)."""

AGENT_MAX_TOTAL_BYTES: Final = 2 * GiB
"""Uncompressed bytes of one agent folder's live files."""

DEFAULT_AGENT_ENTRY: Final = "AGENTS.md"
"""The instruction entry of a new agent (``controller admin set-agent-entry`` changes it)."""

ENTRY_MAX_BYTES: Final = 1 * MiB
"""Largest instruction entry; it must also be valid UTF-8."""

EDITOR_MAX_BYTES: Final = 1 * MiB
"""Largest text file the Files page's editor opens (larger or binary: download)."""
