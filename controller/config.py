"""Controller settings, resolved once from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from common.bridge import MAX_CHECKPOINT_ENTRIES, MAX_CHECKPOINT_ROWS
from common.limits import (
    AGENT_MAX_ENTRIES,
    AGENT_MAX_FILE_BYTES,
    AGENT_MAX_TOTAL_BYTES,
    GC_DELAY_SECONDS,
    GC_SWEEP_INTERVAL_SECONDS,
    GC_UPLOAD_GRACE_SECONDS,
    MAX_ENTRIES,
    MAX_FILE_BYTES,
    GiB,
    KiB,
    MiB,
)
from common.repos import REPO_UPLOAD_TTL_SECONDS


@dataclass
class ServerLimits:
    """What one client may cost the server (enforced in ``controller/api/limits.py``
    and ``controller/api/protocol.py``). The sandbox is untrusted: a stalled or
    trickling body must not hold memory, a connection or a request slot forever."""

    header_timeout: float = 10.0
    """Seconds from connect (or the first byte of a keep-alive request) to the end of the headers."""
    keep_alive_timeout: int = 5
    """Seconds an idle keep-alive connection stays open."""
    body_idle_timeout: float = 30.0
    """Longest wait for the next piece of a request body; also the grace before the rate rule."""
    body_min_rate: int = 16 * KiB
    """Bytes per second a body must average over the time spent waiting for it."""
    body_deadline: float = 3600.0
    """Seconds to receive a whole request body, however fast it trickles."""
    max_connections: int = 512
    """Open connections; one more is answered 503 and closed at once."""
    max_requests_per_token: int = 32
    """Requests in flight per presented token or session; one more is 429 with Retry-After."""
    max_head_bytes: int = 32 * KiB
    """Request line plus headers; more is 431."""
    max_buffered_body_bytes: int = 256 * MiB
    """Bytes of request bodies read into memory at once by the process (JSON
    bodies, held until answered); a body that does not fit waits for room up
    to ``body_idle_timeout``, then is 503 ``server_busy`` with Retry-After."""


# flag, field, type, help: one table so `controller serve --help` and the
# dataclass cannot drift apart.
# flag, field, type, help, zero allowed.
_LIMIT_FLAGS: list[tuple[str, str, type, str, bool]] = [
    ("--header-timeout", "header_timeout", float, "seconds to receive the request headers", False),
    (
        "--keep-alive-timeout",
        "keep_alive_timeout",
        int,
        "seconds an idle connection stays open",
        False,
    ),
    (
        "--body-idle-timeout",
        "body_idle_timeout",
        float,
        "seconds to wait for the next piece of a request body",
        False,
    ),
    ("--body-min-rate", "body_min_rate", int, "bytes/s a request body must average", False),
    ("--body-deadline", "body_deadline", float, "seconds to receive a whole request body", False),
    ("--max-connections", "max_connections", int, "open connections accepted at once", False),
    (
        "--max-requests-per-token",
        "max_requests_per_token",
        int,
        "requests in flight per token (429 beyond)",
        False,
    ),
    ("--max-request-head", "max_head_bytes", int, "bytes of request line and headers", False),
    (
        "--max-buffered-body-bytes",
        "max_buffered_body_bytes",
        int,
        "bytes of request bodies held in memory at once by the process (503 beyond)",
        False,
    ),
]


def _add_flags(
    parser: argparse.ArgumentParser, flags: list[tuple[str, str, type, str, bool]], defaults: object
) -> None:
    for flag, name, kind, text, _ in flags:
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            default=None,
            help=f"{text} (default {getattr(defaults, name)})",
        )


def _apply_flags(
    args: argparse.Namespace, flags: list[tuple[str, str, type, str, bool]], target: object
) -> None:
    """Copy the given flags onto ``target``; refuses values that disable a limit."""
    for flag, name, _, _, zero_ok in flags:
        value = getattr(args, name, None)
        if value is None:
            continue
        if value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"{flag} must be positive, got {value}")
        setattr(target, name, value)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    _add_flags(parser, _LIMIT_FLAGS, ServerLimits())


def limits_from(args: argparse.Namespace) -> ServerLimits:
    """The limits given on the command line; refuses values that disable a limit."""
    limits = ServerLimits()
    _apply_flags(args, _LIMIT_FLAGS, limits)
    return limits


@dataclass(frozen=True)
class AgentLimits:
    """An agent folder's storage limits: checked when a
    save commits, never while the agent writes (``controller/agentfiles.py``)."""

    max_entries: int = AGENT_MAX_ENTRIES
    max_file_bytes: int = AGENT_MAX_FILE_BYTES
    max_total_bytes: int = AGENT_MAX_TOTAL_BYTES


@dataclass
class Quotas:
    """What one tenant or run may cost the database and storage, enforced by the
    controller at commit (``controller/quotas.py``), never trusted to fsagent."""

    max_folder_entries: int = MAX_ENTRIES
    """Live entries (files and directories) per folder; a write past it is 413."""
    max_checkpoint_rows: int = MAX_CHECKPOINT_ROWS
    """Rows one checkpoint may create or change, parent directories included."""
    max_checkpoint_entries: int = MAX_CHECKPOINT_ENTRIES
    """Entries one checkpoint may name, refused before any database work (an
    agent folder's checkpoint whose own entries would leave it past
    ``agent_max_entries``: as that limit, 422)."""
    max_pending_upload_bytes: int = 8 * GiB
    """Per run: uploaded bytes no checkpoint has committed yet (429 beyond)."""
    pending_upload_ttl: float = 86400.0
    """Seconds an uncommitted upload counts, may be committed and is kept from GC."""
    repo_upload_ttl: float = float(REPO_UPLOAD_TTL_SECONDS)
    """The same for an upload to a repository route: a repository save that
    takes longer than this is refused and must upload again."""
    company_storage_bytes: int = 0
    """Stored bytes per company; 0 turns the quota off (the default)."""
    statement_timeout: float = 30.0
    """Seconds one SQL statement may run inside a request (lock waits included)."""
    pool_size: int = 20
    """Database connections of one controller process."""
    pool_share: int = 4
    """Connections one token may hold at once; more requests wait on this share."""
    replicas: int = 1
    """Controller processes sharing the database, this one included: only
    for the check at start that ``replicas`` x ``pool_size`` connections fit
    PostgreSQL's ``max_connections`` (:func:`controller.db.connection_headroom`)."""
    agent_max_entries: int = AGENT_MAX_ENTRIES
    """Files and folders of an agent folder; a save growing past it is 422."""
    agent_max_file_bytes: int = AGENT_MAX_FILE_BYTES
    """Largest file a save may write into an agent folder (422 beyond)."""
    agent_max_total_bytes: int = AGENT_MAX_TOTAL_BYTES
    """Live file bytes of an agent folder; a save growing past it is 422."""

    @property
    def agent(self) -> AgentLimits:
        return AgentLimits(
            self.agent_max_entries, self.agent_max_file_bytes, self.agent_max_total_bytes
        )


# flag, field, type, help, zero allowed.
_QUOTA_FLAGS: list[tuple[str, str, type, str, bool]] = [
    ("--max-folder-entries", "max_folder_entries", int, "live entries per folder", False),
    ("--max-checkpoint-rows", "max_checkpoint_rows", int, "rows one checkpoint may write", False),
    (
        "--max-checkpoint-entries",
        "max_checkpoint_entries",
        int,
        "entries one checkpoint may name",
        False,
    ),
    (
        "--max-pending-upload-bytes",
        "max_pending_upload_bytes",
        int,
        "uncommitted upload bytes per run",
        False,
    ),
    (
        "--pending-upload-ttl",
        "pending_upload_ttl",
        float,
        "seconds an uncommitted upload lives",
        False,
    ),
    (
        "--repo-upload-ttl",
        "repo_upload_ttl",
        float,
        "seconds an uncommitted repository upload lives",
        False,
    ),
    (
        "--company-storage-bytes",
        "company_storage_bytes",
        int,
        "stored bytes per company, 0 = unlimited",
        True,
    ),
    ("--statement-timeout", "statement_timeout", float, "seconds per SQL statement", False),
    ("--pool-size", "pool_size", int, "database connections", False),
    ("--pool-share", "pool_share", int, "database connections one token may hold", False),
    (
        "--replicas",
        "replicas",
        int,
        "controller processes sharing the database (checked against max_connections at start)",
        False,
    ),
    ("--agent-max-entries", "agent_max_entries", int, "files and folders per agent folder", False),
    (
        "--agent-max-file-bytes",
        "agent_max_file_bytes",
        int,
        "largest file a save may write into an agent folder",
        False,
    ),
    (
        "--agent-max-total-bytes",
        "agent_max_total_bytes",
        int,
        "live file bytes per agent folder",
        False,
    ),
]


PER_PROCESS_FLAGS = frozenset(
    {
        "--max-connections",
        "--max-requests-per-token",
        "--max-buffered-body-bytes",
        "--pool-size",
        "--pool-share",
        "--bridge-max-concurrent",
    }
)
"""Limits each controller process keeps in its own memory: with N replicas
behind a load balancer the service allows N times each. docs/operators/sizing.md
("Sizing for N replicas") says how to set each (tests/controller/test_replica_sizing.py checks that it
names every one). Every other limit and quota is kept in PostgreSQL or is per
request, and holds across replicas."""


def add_quota_arguments(parser: argparse.ArgumentParser) -> None:
    _add_flags(parser, _QUOTA_FLAGS, Quotas())


def quotas_from(args: argparse.Namespace) -> Quotas:
    """The quotas given on the command line; refuses values that disable one."""
    quotas = Quotas()
    _apply_flags(args, _QUOTA_FLAGS, quotas)
    if quotas.pool_share > quotas.pool_size:
        raise ValueError("--pool-share cannot exceed --pool-size")
    return quotas


@dataclass
class BridgeLimits:
    """The API bridge (``/bridge/v1/api/...``, ``controller/api/apibridge.py``): which
    routes sandbox code may call and what one call may cost the host."""

    allow: list[tuple[str, str]] | None = None
    """``(METHOD, route template)`` pairs; None is the documented default list."""
    max_body_bytes: int = 64 * KiB
    """Request body of a forwarded call; content uploads keep the file limit instead."""
    max_response_bytes: int = 8 * 1024 * KiB
    """Response body of a forwarded call; content downloads keep the file limit instead."""
    request_timeout: float = 300.0
    """Seconds until a forwarded call's answer starts (its body included); then 504."""
    max_concurrent: int = 8
    """Forwarded calls in flight per run; one more is 429 with Retry-After."""


# flag, field, type, help, zero allowed.
_BRIDGE_FLAGS: list[tuple[str, str, type, str, bool]] = [
    ("--bridge-max-body", "max_body_bytes", int, "bytes of a bridged request body", False),
    (
        "--bridge-max-response",
        "max_response_bytes",
        int,
        "bytes of a bridged response body",
        False,
    ),
    (
        "--bridge-timeout",
        "request_timeout",
        float,
        "seconds until a bridged request's answer starts",
        False,
    ),
    (
        "--bridge-max-concurrent",
        "max_concurrent",
        int,
        "bridged requests in flight per run",
        False,
    ),
]


def add_bridge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bridge-allow",
        action="append",
        default=None,
        metavar="METHOD:TEMPLATE",
        help="allow one API route through the bridge (repeatable; replaces the default list; "
        "'default' adds the default list)",
    )
    parser.add_argument(
        "--bridge-allow-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="bridge allowlist file: one METHOD:TEMPLATE (or 'default') per line, # comments",
    )
    _add_flags(parser, _BRIDGE_FLAGS, BridgeLimits())


def parse_bridge_allow(entries: list[str]) -> list[tuple[str, str]]:
    """``METHOD:TEMPLATE`` entries as pairs. The word ``default`` stands for the
    default list; it is kept as ``("default", "")`` and expanded where the
    routes are known (``controller/api/apibridge.py``)."""
    pairs: list[tuple[str, str]] = []
    for raw in entries:
        entry = raw.strip()
        if entry == "default":
            pairs.append(("default", ""))
            continue
        method, sep, template = entry.partition(":")
        if not sep or not method.strip() or not template.strip().startswith("/"):
            raise ValueError(f"bridge allowlist entry must be METHOD:/TEMPLATE, got {raw!r}")
        pairs.append((method.strip().upper(), template.strip()))
    return pairs


def bridge_from(args: argparse.Namespace) -> BridgeLimits:
    """The bridge settings given on the command line (allowlist entries unchecked:
    ``controller.api.apibridge`` resolves them against the routes)."""
    bridge = BridgeLimits()
    _apply_flags(args, _BRIDGE_FLAGS, bridge)
    entries: list[str] = list(getattr(args, "bridge_allow", None) or [])
    allow_file: Path | None = getattr(args, "bridge_allow_file", None)
    if allow_file is not None:
        try:
            text = allow_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--bridge-allow-file {allow_file}: {exc}") from None
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                entries.append(line)
    if entries or allow_file is not None:
        bridge.allow = parse_bridge_allow(entries)
    return bridge


@dataclass
class Settings:
    data_dir: Path
    database_url: str | None = None
    storage: str = "local_disk"
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    s3_region: str | None = None
    gc_delay: timedelta = field(default_factory=lambda: timedelta(seconds=GC_DELAY_SECONDS))
    gc_interval_seconds: float = GC_SWEEP_INTERVAL_SECONDS
    gc_upload_grace: timedelta = field(
        default_factory=lambda: timedelta(seconds=GC_UPLOAD_GRACE_SECONDS)
    )
    max_file_bytes: int = MAX_FILE_BYTES
    limits: ServerLimits = field(default_factory=ServerLimits)
    quotas: Quotas = field(default_factory=Quotas)
    bridge: BridgeLimits = field(default_factory=BridgeLimits)

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"
