"""The pool's check of a connection before it is handed out
(``check_without_round_trip``): a live idle one passes as it is, one whose
server ended the session is refused (and closed), one with bytes waiting
from a live server passes after psycopg_pool's own check."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from controller.db import check_without_round_trip
from tests.support.controller import PgCluster


@pytest.fixture
def url(pg_cluster: PgCluster) -> str:
    return pg_cluster.create_database()


def checked(url: str, before: str | None) -> tuple[bool, bool]:
    """Whether the check passed a connection after ``before`` was done to
    its session from another one, and whether the connection is closed."""

    async def main() -> tuple[bool, bool]:
        conn = await psycopg.AsyncConnection.connect(url)
        try:
            pid = conn.info.backend_pid
            if before is not None:
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
                    await admin.execute(before, (pid,))
                await asyncio.sleep(0.3)  # the server's message reaches the socket
            try:
                await check_without_round_trip(conn)
            except psycopg.OperationalError:
                return False, conn.closed
            await conn.execute("SELECT 1")
            return True, conn.closed
        finally:
            await conn.close()

    return asyncio.run(main())


def test_a_live_idle_connection_passes(url: str) -> None:
    assert checked(url, None) == (True, False)


def test_a_connection_whose_session_ended_is_refused_and_closed(url: str) -> None:
    assert checked(url, "SELECT pg_terminate_backend(%s)") == (False, True)


def test_a_live_connection_with_a_message_waiting_passes(url: str) -> None:
    """A notification sent to the session: bytes to read, server alive."""

    async def main() -> tuple[bool, bool]:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            await conn.execute("LISTEN ping")
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as other:
                await other.execute("NOTIFY ping")
            await asyncio.sleep(0.3)
            await check_without_round_trip(conn)
            await conn.execute("SELECT 1")
            return True, conn.closed
        finally:
            await conn.close()

    assert asyncio.run(main()) == (True, False)
