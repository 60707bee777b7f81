"""Run a write transaction again when PostgreSQL rolled it back for a
serialization failure or a deadlock.

Both errors mean the transaction was undone whole and running it again is safe
and may well succeed; every other error (a lock timeout, a constraint, a lost
connection) is final for this request. The pause before each new attempt is
random (full jitter) so that writers that collided do not collide again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection

from common.errors import DatabaseUnavailable
from controller.db import SharedPool, end_autocommit

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)
ATTEMPTS = 8
"""Tries in all, the first included."""
BASE_DELAY = 0.02
"""Seconds; the pause before try n is random in [0, BASE_DELAY * 2**(n-1))."""


async def retrying(
    pool: SharedPool,
    work: Callable[[AsyncConnection[Any]], Awaitable[T]],
    *,
    share: str | None = None,
    pipeline: bool = False,
) -> T:
    """``work(conn)`` in a transaction of its own, tried up to ``ATTEMPTS`` times.

    ``share`` is the caller's credential key: each attempt's connection comes
    from that caller's share of the pool (:class:`controller.db.SharedPool`).

    ``pipeline``: ``work`` runs in psycopg's pipeline mode. A statement
    whose answer it does not read at once (a lock, an ``UPDATE``, a read it
    needs later) then costs no round trip of its own: it goes to the server
    with the next statement whose answer is read, or with the ``COMMIT``
    and the sync at the end, and the server still runs them one after the
    other, each with its own snapshot; ``BEGIN`` and ``COMMIT`` cost no
    round trip of their own either (:func:`_pipelined`).
    Its error is raised where that next answer is read (the same error: a
    deadlock is retried alike), and ``cursor.rowcount`` is only known once
    its answer is read: ``work`` must not rely on either at the statement.

    ``work`` must do everything inside that transaction (it runs again from the
    start). Conflicts every time, or an unreachable database, raise
    :class:`DatabaseUnavailable` (503, the client may retry).
    """
    attempt = 1
    while True:
        try:
            async with pool.connection(share=share) as conn:
                if pipeline:
                    return await _pipelined(conn, work)
                async with conn.transaction():
                    return await work(conn)
        except RETRYABLE as exc:
            if attempt >= ATTEMPTS:
                raise DatabaseUnavailable(
                    f"the write kept conflicting with others ({attempt} tries); retry"
                ) from exc
            log.info("transaction rolled back (%s); trying again", exc.sqlstate)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable() from exc
        await asyncio.sleep(random.uniform(0, BASE_DELAY * 2**attempt))
        attempt += 1


async def _pipelined(
    conn: AsyncConnection[Any], work: Callable[[AsyncConnection[Any]], Awaitable[T]]
) -> T:
    """``work(conn)`` in a transaction of its own, all of it in pipeline mode:
    ``BEGIN`` goes to the server with ``work``'s first statements and
    ``COMMIT`` with its last ones, neither costs a round trip of its own.
    The pipeline's sync at the end reads every answer, the ``COMMIT``'s
    last: this returns once the transaction is committed, and raises the
    first statement's error if one failed (the ``COMMIT`` is then skipped).

    The connection is in autocommit mode meanwhile, the transaction an
    explicit ``BEGIN``: psycopg waits for the answer of the ``BEGIN`` it
    sends itself. The pool's connections set no isolation level or access
    mode of their own, so the ``BEGIN`` is the one psycopg would send.

    After a statement's error the server skips the rest until the
    pipeline's sync. The error is read wherever its answer arrives: in
    ``work``, or while the ``COMMIT`` is sent when ``work`` read nothing
    after it. Either way that sync is made here, its "pipeline aborted" for
    the skipped statements dropped, and the statement's own error raised
    (a deadlock is retried), after the transaction is rolled back. The
    connection goes back to the pool out of autocommit mode, or closed when
    that cannot be done."""
    assert conn.isolation_level is None and conn.read_only is None and conn.deferrable is None
    await conn.set_autocommit(True)
    try:
        async with conn.pipeline() as pipe:
            await conn.execute(b"BEGIN", prepare=False)
            try:
                result = await work(conn)
                # A statement's error may first be read here, with the COMMIT
                # sent: it is drained alike.
                await conn.execute(b"COMMIT", prepare=False)
            except psycopg.Error:
                await _drain(pipe)
                raise
        return result
    except BaseException:
        if conn.pgconn.transaction_status in _IN_TRANSACTION:
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
        raise
    finally:
        await end_autocommit(conn)


DRAIN_SYNCS = 50
"""Syncs :func:`_drain` makes at most (the connection is broken, say)."""


async def _drain(pipe: psycopg.AsyncPipeline) -> None:
    """After a statement's error, sync until a sync reads every answer left.

    A sync raises at the first "pipeline aborted" among the answers it has
    read so far, without waiting for the rest (its own among them); any
    left would surface at the pipeline's exit, which logs them as an error
    it ignored. A sync that raises has read at least one answer, so a few
    more read them all."""
    for _ in range(DRAIN_SYNCS):
        try:
            await pipe.sync()
            return
        except psycopg.Error:
            continue


_IN_TRANSACTION = (psycopg.pq.TransactionStatus.INTRANS, psycopg.pq.TransactionStatus.INERROR)
