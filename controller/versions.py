"""Per-folder versions: each folder counts its own writes.

A version orders the writes of one folder (``since=``, ``highWater``, manifest
paging) and nothing else. It is drawn from a counter on the folder row, not
from one global sequence, so the numbers a tenant sees say nothing about how
much other tenants write.

The counter is read once, right after the folder's advisory lock is taken, and
advanced in memory by every write of the transaction; ``store`` writes it back
before commit. Updating the folder row once per transaction rather than once
per row keeps a 100,000-entry checkpoint from piling up row versions.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection


class VersionClock:
    """The folder's counter inside one write transaction (under the folder lock)."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.stored: int | None = None

    async def load(self, conn: AsyncConnection[Any], folder_id: int) -> None:
        cur = await conn.execute("SELECT version_counter FROM folders WHERE id = %s", (folder_id,))
        row = await cur.fetchone()
        assert row is not None
        self.current = self.stored = int(row["version_counter"])

    def base(self) -> int:
        """The last version handed out; the next write gets ``base() + 1``."""
        if self.current is None:
            raise RuntimeError("a folder version is drawn only under the folder lock")
        return self.current

    def take(self, count: int = 1) -> int:
        """Reserve ``count`` versions; returns the first."""
        first = self.base() + 1
        self.current = self.base() + count
        return first

    async def store(self, conn: AsyncConnection[Any], folder_id: int) -> None:
        if self.current is not None and self.current != self.stored:
            await conn.execute(
                "UPDATE folders SET version_counter = %s WHERE id = %s", (self.current, folder_id)
            )
            self.stored = self.current


async def folder_high_water(conn: AsyncConnection[Any], folder_id: int | None) -> int:
    """Every committed change of the folder has a version at or below this."""
    if folder_id is None:
        return 0
    cur = await conn.execute("SELECT version_counter FROM folders WHERE id = %s", (folder_id,))
    row = await cur.fetchone()
    return 0 if row is None else int(row["version_counter"])
