"""Controller settings, resolved once from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from common.limits import GC_DELAY_SECONDS, GC_SWEEP_INTERVAL_SECONDS, MAX_FILE_BYTES, KiB


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


# flag, field, type, help: one table so `controller serve --help` and the
# dataclass cannot drift apart.
_LIMIT_FLAGS: list[tuple[str, str, type, str]] = [
    ("--header-timeout", "header_timeout", float, "seconds to receive the request headers"),
    ("--keep-alive-timeout", "keep_alive_timeout", int, "seconds an idle connection stays open"),
    (
        "--body-idle-timeout",
        "body_idle_timeout",
        float,
        "seconds to wait for the next piece of a request body",
    ),
    ("--body-min-rate", "body_min_rate", int, "bytes/s a request body must average"),
    ("--body-deadline", "body_deadline", float, "seconds to receive a whole request body"),
    ("--max-connections", "max_connections", int, "open connections accepted at once"),
    (
        "--max-requests-per-token",
        "max_requests_per_token",
        int,
        "requests in flight per token (429 beyond)",
    ),
    ("--max-request-head", "max_head_bytes", int, "bytes of request line and headers"),
]


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerLimits()
    for flag, name, kind, text in _LIMIT_FLAGS:
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            default=None,
            help=f"{text} (default {getattr(defaults, name)})",
        )


def limits_from(args: argparse.Namespace) -> ServerLimits:
    """The limits given on the command line; refuses values that disable a limit."""
    limits = ServerLimits()
    for flag, name, _, _ in _LIMIT_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
        setattr(limits, name, value)
    return limits


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
    max_file_bytes: int = MAX_FILE_BYTES
    limits: ServerLimits = field(default_factory=ServerLimits)

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"
