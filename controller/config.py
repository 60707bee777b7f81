"""Controller settings, resolved once from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from common.limits import GC_DELAY_SECONDS, GC_SWEEP_INTERVAL_SECONDS, MAX_FILE_BYTES


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

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"
