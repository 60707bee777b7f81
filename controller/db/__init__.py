"""PostgreSQL access: connection pool and ordered, idempotent migrations."""

from __future__ import annotations

import logging
import re
from importlib import resources
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

# One fixed key so concurrent `migrate` runs (several replicas starting at
# once) serialize instead of racing on CREATE TABLE.
_MIGRATION_LOCK_KEY = 0x66736167656E74


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) in ascending version order."""
    found = []
    for entry in resources.files("controller.db").joinpath("migrations").iterdir():
        m = _MIGRATION_NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry.name, entry.read_text("utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions: {versions}")
    return found


def migrate(url: str) -> list[str]:
    """Apply every migration not yet applied, each in its own transaction."""
    applied_now: list[str] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK_KEY,))
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r[0] for r in conn.execute("SELECT version FROM schema_migrations")}
            for version, name, sql in migrations():
                if version in done:
                    continue
                with conn.transaction():
                    conn.execute(sql.encode())
                    conn.execute(
                        "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                        (version, name),
                    )
                log.info("applied migration %s", name)
                applied_now.append(name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK_KEY,))
    return applied_now


def make_pool(url: str, *, min_size: int = 2, max_size: int = 20) -> AsyncConnectionPool:
    return AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        open=False,
        # A connection that died with the server is replaced, not handed out.
        check=AsyncConnectionPool.check_connection,
        kwargs={"autocommit": False, "row_factory": dict_row},
    )


async def ping(conn: AsyncConnection[Any]) -> None:
    """A round trip to the database (the health check)."""
    await conn.execute("SELECT 1")
