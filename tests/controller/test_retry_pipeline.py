"""A write transaction in pipeline mode (``retrying(pipeline=True)``, the REST
PUT's): committed whole or not at all, retried after a conflict, and its
connection handed back to the pool as it was taken (out of autocommit mode,
no transaction open), whatever ended the work."""

from __future__ import annotations

import asyncio
import select
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection

from controller.db import make_pool, retry
from controller.db.retry import retrying
from tests.support.controller import PgCluster

IDLE = psycopg.pq.TransactionStatus.IDLE


class Failed(Exception):
    """Raised by the work itself, not by the database."""


@pytest.fixture
def url(pg_cluster: PgCluster) -> str:
    url = pg_cluster.create_database()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (k integer PRIMARY KEY)")
    return url


def keys(url: str) -> list[int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT k FROM t ORDER BY k")]


def with_one_connection(url: str, body: Callable[[Any], Awaitable[Any]]) -> Any:
    """``body(pool)`` with a pool of one connection, checked after: back in
    the pool out of autocommit mode, no transaction open, and usable."""

    async def main() -> Any:
        pool = make_pool(url, min_size=1, max_size=1)
        await pool.open(wait=True)
        try:
            result = await body(pool)
            async with pool.connection() as conn:
                assert not conn.autocommit
                assert conn.pgconn.transaction_status == IDLE
                assert await (await conn.execute("SELECT 1 AS one")).fetchone() == {"one": 1}
            return result
        finally:
            await pool.close()

    return asyncio.run(main())


def insert(conn: AsyncConnection[Any], k: int) -> Awaitable[Any]:
    return conn.execute("INSERT INTO t (k) VALUES (%s)", (k,))


def test_the_work_is_committed_once_its_answer_is_read(url: str) -> None:
    async def work(conn: AsyncConnection[Any]) -> int:
        await insert(conn, 1)
        await insert(conn, 2)  # neither answer read: both go with the COMMIT
        return 7

    async def body(pool: Any) -> int:
        result = await retrying(pool, work, pipeline=True)
        assert keys(url) == [1, 2]  # committed before retrying returned
        return result

    assert with_one_connection(url, body) == 7


def test_an_error_of_the_work_rolls_back_what_it_wrote(url: str) -> None:
    async def work(conn: AsyncConnection[Any]) -> None:
        await insert(conn, 1)
        await (await conn.execute("SELECT k FROM t")).fetchall()  # the insert ran
        await insert(conn, 2)
        raise Failed

    async def body(pool: Any) -> None:
        with pytest.raises(Failed):
            await retrying(pool, work, pipeline=True)

    with_one_connection(url, body)
    assert keys(url) == []


@pytest.mark.parametrize("read", [False, True])
def test_a_failed_statement_rolls_back_the_transaction(url: str, read: bool) -> None:
    """A duplicate key, its answer read in the work or only with the COMMIT:
    the error is raised, nothing is written, and only one try is made."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO t (k) VALUES (5)")
    tries = 0

    async def work(conn: AsyncConnection[Any]) -> None:
        nonlocal tries
        tries += 1
        await insert(conn, 1)
        cur = await conn.execute("INSERT INTO t (k) VALUES (5) RETURNING k")
        await insert(conn, 2)
        if read:
            await cur.fetchone()

    async def body(pool: Any) -> None:
        with pytest.raises(psycopg.errors.UniqueViolation):
            await retrying(pool, work, pipeline=True)

    with_one_connection(url, body)
    assert keys(url) == [5] and tries == 1


def conflict(conn: AsyncConnection[Any], sqlstate: str) -> Awaitable[Any]:
    """A statement that fails as a conflict (``sqlstate``) would."""
    return conn.execute(
        f"DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '{sqlstate}'; END $$"
    )


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])  # serialization failure, deadlock
def test_a_conflict_is_tried_again_and_committed_once(url: str, sqlstate: str) -> None:
    tries = 0

    async def work(conn: AsyncConnection[Any]) -> int:
        nonlocal tries
        tries += 1
        await insert(conn, 1)
        if tries < 3:
            await conflict(conn, sqlstate)
        await insert(conn, 2)
        return tries

    assert with_one_connection(url, lambda pool: retrying(pool, work, pipeline=True)) == 3
    assert keys(url) == [1, 2]


class Pipe:
    """A pipeline whose syncs raise ``failures`` times (each "pipeline
    aborted" read before the rest of the answers arrived), then succeed."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.syncs = 0

    async def sync(self) -> None:
        self.syncs += 1
        if self.syncs <= self.failures:
            raise psycopg.errors.PipelineAborted("pipeline aborted")


@pytest.mark.parametrize("failures", [0, 1, 3, retry.DRAIN_SYNCS + 5])
def test_an_aborted_pipeline_is_synced_until_its_answers_are_read(failures: int) -> None:
    """The error path syncs again while a sync raises (it may have read one
    "pipeline aborted" of several), and gives up quietly after DRAIN_SYNCS
    (a broken connection): the statement's own error is what is raised."""
    pipe = Pipe(failures)
    asyncio.run(retry._drain(pipe))  # type: ignore[arg-type]
    assert pipe.syncs == min(failures + 1, retry.DRAIN_SYNCS)


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
def test_a_conflict_first_read_with_the_commit_is_tried_again(url: str, sqlstate: str) -> None:
    """The conflict's answer is on the socket, unread, when the work returns:
    it is read while the ``COMMIT`` is sent. That error is retried as one
    read in the work, and the pipeline's answers left behind it are read
    before the pipeline ends (psycopg logs a warning for any it finds)."""
    tries = 0

    async def work(conn: AsyncConnection[Any]) -> int:
        nonlocal tries
        tries += 1
        await insert(conn, 1)
        if tries < 3:
            await conflict(conn, sqlstate)
            # Blocks the loop until the server answered: the next read is the COMMIT's.
            readable, _, _ = select.select([conn.pgconn.socket], [], [], 60)
            assert readable
        return tries

    assert with_one_connection(url, lambda pool: retrying(pool, work, pipeline=True)) == 3
    assert keys(url) == [1]
