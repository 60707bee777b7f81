"""Per-folder counters: each folder counts its own writes and its live entries.

A version orders the writes of one folder (``since=``, ``highWater``, manifest
paging) and nothing else. It is drawn from a counter on the folder row, not
from one global sequence, so the numbers a tenant sees say nothing about how
much other tenants write.

The folder row also counts its live entries (``live_entries``) and their
bytes (``live_bytes``), so the entry limit and the agent folder's storage
limits (:mod:`controller.agentfiles`) are checked without counting rows.

Both counters are read once, right after the folder's advisory lock is taken,
and advanced in memory by every write of the transaction; ``store`` writes
them back before commit. Updating the folder row once per transaction rather
than once per row keeps a 100,000-entry checkpoint from piling up row
versions.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from psycopg import AsyncConnection, AsyncCursor

from common.errors import AgentFilesLimitExceeded, FolderEntryLimit


class FolderCounters:
    """The folder's counters inside one write transaction (under the folder lock)."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.stored: int | None = None
        self.entries = 0
        """Live entries when the counters were loaded."""
        self.entries_delta = 0
        """Live entries this transaction added (negative: removed)."""
        self.bytes = 0
        """Bytes of the live files when the counters were loaded."""
        self.bytes_delta = 0
        """Live file bytes this transaction added (negative: removed)."""
        self.largest_written: tuple[int, str] | None = None
        """The largest file this transaction wrote or brought back: (size, path)."""
        self.now: datetime | None = None
        """The transaction's ``now()``: what a row it writes gets as ``updated_at``."""

    async def load(self, conn: AsyncConnection[Any], folder_id: int) -> None:
        await self.read(await self.request(conn, folder_id))

    @staticmethod
    async def request(conn: AsyncConnection[Any], folder_id: int) -> AsyncCursor[Any]:
        """Send the read of the counters; :meth:`read` takes its answer (in
        pipeline mode it comes with the next round trip, not one of its own)."""
        return await conn.execute(
            "SELECT version_counter, live_entries, live_bytes, now() AS now FROM folders"
            " WHERE id = %s",
            (folder_id,),
        )

    async def read(self, cur: AsyncCursor[Any]) -> None:
        """Load the counters from the answer of :meth:`request`."""
        row = await cur.fetchone()
        assert row is not None
        self.current = self.stored = int(row["version_counter"])
        self.entries, self.entries_delta = int(row["live_entries"]), 0
        self.bytes, self.bytes_delta = int(row["live_bytes"]), 0
        self.largest_written = None
        self.now = row["now"]

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

    def count(self, delta: int, nbytes: int = 0) -> None:
        """Record ``delta`` live entries and ``nbytes`` live file bytes added
        (or removed, when negative)."""
        self.entries_delta += delta
        self.bytes_delta += nbytes

    def wrote(self, path: str, size: int) -> None:
        """A file of ``size`` bytes was written (or restored) at ``path``."""
        if self.largest_written is None or size > self.largest_written[0]:
            self.largest_written = (size, path)

    def check_agent_limits(self, max_entries: int, max_file_bytes: int, max_total: int) -> None:
        """The agent folder's storage limits: no file
        written over ``max_file_bytes``; entries and bytes may not grow past
        their limits. A save that shrinks an over-limit folder (or leaves a
        measure unchanged) passes, so an agent can clean up step by step."""
        written = self.largest_written
        if written is not None and written[0] > max_file_bytes:
            raise AgentFilesLimitExceeded(
                f"{written[1]} is {written[0]} bytes; an agent folder's files are limited"
                f" to {max_file_bytes} bytes",
                details=[
                    {"limit": "fileBytes", "max": max_file_bytes, "value": written[0],
                     "path": written[1]}
                ],
            )  # fmt: skip
        entries = self.entries + self.entries_delta
        if self.entries_delta > 0 and entries > max_entries:
            raise AgentFilesLimitExceeded(
                f"An agent folder holds at most {max_entries} files and folders",
                details=[{"limit": "entries", "max": max_entries, "value": entries}],
            )
        total = self.bytes + self.bytes_delta
        if self.bytes_delta > 0 and total > max_total:
            raise AgentFilesLimitExceeded(
                f"An agent folder holds at most {max_total} bytes",
                details=[{"limit": "totalBytes", "max": max_total, "value": total}],
            )

    def check_entries(self, limit: int) -> None:
        """A write that adds entries may not take the folder past ``limit``;
        one that removes or keeps them is allowed even in an over-limit folder."""
        after = self.entries + self.entries_delta
        if self.entries_delta > 0 and after > limit:
            raise FolderEntryLimit(
                f"A folder holds at most {limit} entries", details=[{"limit": limit}]
            )

    async def store(self, conn: AsyncConnection[Any], folder_id: int, *, touch: bool) -> None:
        """Write the counters back, with the folder's last operation time
        (``touch``) in the same statement."""
        if (
            (self.current is not None and self.current != self.stored)
            or self.entries_delta
            or self.bytes_delta
            or touch
        ):
            await conn.execute(
                "UPDATE folders SET version_counter = %s, live_entries = live_entries + %s,"
                " live_bytes = live_bytes + %s,"
                " last_operation_at = CASE WHEN %s THEN now() ELSE last_operation_at END"
                " WHERE id = %s",
                (self.current, self.entries_delta, self.bytes_delta, touch, folder_id),
            )
            self.stored = self.current
            self.entries += self.entries_delta
            self.bytes += self.bytes_delta
            self.entries_delta = self.bytes_delta = 0


async def folder_high_water(conn: AsyncConnection[Any], folder_id: int | None) -> int:
    """Every committed change of the folder has a version at or below this
    (read outside the folder lock: listings and "changes since" polls)."""
    if folder_id is None:
        return 0
    cur = await conn.execute("SELECT version_counter FROM folders WHERE id = %s", (folder_id,))
    row = await cur.fetchone()
    return 0 if row is None else int(row["version_counter"])
