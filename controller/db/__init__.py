"""PostgreSQL access: connection pool and ordered, idempotent migrations."""

from __future__ import annotations

import asyncio
import logging
import re
import select
import socket
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

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


HEADROOM_SHARE = 0.8
"""Share of PostgreSQL's usable connections the controllers' pools may take
before the check at start warns: the rest is for ``controller admin``,
migrations, backups, monitoring and the pool's replacements of dead
connections."""


def headroom_warning(
    max_connections: int, reserved: int, pool_size: int, replicas: int
) -> str | None:
    """The warning :func:`connection_headroom` logs, or None when ``replicas``
    pools of ``pool_size`` fit the server's ``max_connections`` less its
    ``reserved`` (superuser and other reserved) slots with room to spare."""
    usable = max_connections - reserved
    need = pool_size * replicas
    if need <= HEADROOM_SHARE * usable:
        return None
    verdict = "more than" if need > usable else "close to"
    return (
        f"database connections: {replicas} replica(s) x --pool-size {pool_size} = {need},"
        f" {verdict} the {usable} PostgreSQL accepts from ordinary users"
        f" (max_connections {max_connections} less {reserved} reserved);"
        f" requests will wait for connections and fail with 503 database_unavailable once"
        f" they run out. Raise max_connections, or lower --pool-size so that --replicas x"
        f" --pool-size stays under {int(HEADROOM_SHARE * 100)}% of it"
        f" (README: Sizing for N replicas)"
    )


def connection_headroom(url: str, pool_size: int, replicas: int) -> str | None:
    """Ask the server for its connection limit (``SHOW max_connections`` and
    the reserved slots, ``reserved_connections`` from PostgreSQL 16) and
    return :func:`headroom_warning`'s verdict for this deployment."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('max_connections')::int,"
            " current_setting('superuser_reserved_connections')::int"
            " + coalesce(nullif(current_setting('reserved_connections', true), ''), '0')::int"
        ).fetchone()
    assert row is not None
    return headroom_warning(int(row[0]), int(row[1]), pool_size, replicas)


DOWN_WAIT_SECONDS = 2.0
"""How long a request waits for a connection while PostgreSQL refuses new
ones (the pool's last attempt to connect failed): long enough to take one a
reconnection makes meanwhile, short enough that a client hears 503
``database_unavailable`` and retries on its own schedule instead of being
held for the pool's whole 30 s wait."""

RECONNECT_SECONDS = 10.0
"""How long one of the pool's reconnection attempts backs off (1 s, 2 s,
4 s...) before it gives up and the next request starts a new one at once.
psycopg_pool's default of 300 s lets the delay grow past a minute in a long
outage, and requests wait that long after the server is back."""


@dataclass
class _Share:
    slots: asyncio.Semaphore
    users: int = 0


class SharedPool(AsyncConnectionPool[AsyncConnection[Any]]):
    """A connection pool in which one holder (a token) gets at most
    ``share_size`` connections at once.

    Without a share, one sandbox firing slow requests in parallel holds every
    connection and other companies get 503. With it, that sandbox's extra
    requests wait on its own share, in front of the pool, and the rest of the
    pool stays free for everyone else.
    """

    def __init__(self, *args: Any, share_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.share_size = share_size
        self._shares: dict[str, _Share] = {}
        self.down_since: float | None = None
        """When the pool's attempts to connect began to fail (loop time), or None."""
        self._waits: set[asyncio.Timeout] = set()
        self.connection_class = _watched(self.connection_class, weakref.ref(self))

    def _connect_failed(self, exc: BaseException) -> None:
        """A connection attempt failed: the database is down. Waiting requests
        get :data:`DOWN_WAIT_SECONDS` more, not the rest of the pool's timeout."""
        loop = asyncio.get_running_loop()
        if self.down_since is None:
            self.down_since = loop.time()
            log.warning(
                "database unreachable (%s): requests answer 503 after %gs until it accepts"
                " connections again",
                " ".join(str(exc).split()) or type(exc).__name__,
                DOWN_WAIT_SECONDS,
            )
        cut = loop.time() + DOWN_WAIT_SECONDS
        for wait in self._waits:
            when = wait.when()
            if when is None or when > cut:
                wait.reschedule(cut)

    def _connected(self) -> None:
        if self.down_since is not None:
            outage = asyncio.get_running_loop().time() - self.down_since
            self.down_since = None
            log.warning("database reachable again after %.1fs", outage)

    async def getconn(self, timeout: float | None = None) -> AsyncConnection[Any]:  # noqa: ASYNC109
        """The pool's ``getconn``, cut to :data:`DOWN_WAIT_SECONDS` while the database is down."""
        limit = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        if self.down_since is not None:
            deadline = min(deadline, loop.time() + DOWN_WAIT_SECONDS)
        try:
            async with asyncio.timeout_at(deadline) as wait:
                self._waits.add(wait)
                try:
                    conn = await super().getconn(limit)
                finally:
                    self._waits.discard(wait)
        except TimeoutError:
            raise PoolTimeout(
                "no database connection: the database is not accepting connections"
            ) from None
        # A checked connection is proof enough that the server answers (a
        # failed attempt may have been one too many for its connection limit).
        self._connected()
        return conn

    @asynccontextmanager
    async def connection(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 -- the overridden method's signature
        *,
        share: str | None = None,
    ) -> AsyncIterator[AsyncConnection[Any]]:
        if share is None:
            async with super().connection(timeout) as conn:
                yield conn
            return
        entry = self._shares.setdefault(share, _Share(asyncio.Semaphore(self.share_size)))
        entry.users += 1
        try:
            try:
                async with asyncio.timeout(self.timeout if timeout is None else timeout):
                    await entry.slots.acquire()
            except TimeoutError:
                raise PoolTimeout("this token's share of database connections is busy") from None
            try:
                async with super().connection(timeout) as conn:
                    yield conn
            finally:
                entry.slots.release()
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._shares[share]


def _watched(
    base: type[AsyncConnection[Any]], pool: weakref.ref[SharedPool]
) -> type[AsyncConnection[Any]]:
    """``base`` whose ``connect`` tells ``pool`` how each attempt went (the
    pool's own attempts, in the background, are the ones that learn first
    that the server is gone or back)."""

    class Watched(base):  # type: ignore[valid-type,misc]
        @classmethod
        async def connect(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                conn = await super().connect(*args, **kwargs)
            except Exception as exc:
                if (owner := pool()) is not None:
                    owner._connect_failed(exc)
                raise
            if (owner := pool()) is not None:
                owner._connected()
            return conn

    return Watched


def make_pool(
    url: str,
    *,
    min_size: int = 2,
    max_size: int = 20,
    share_size: int | None = None,
    statement_timeout: float | None = None,
) -> SharedPool:
    """The pool; ``statement_timeout`` (seconds) bounds every statement of every
    transaction, lock waits included, so no request holds a connection forever."""
    return SharedPool(
        url,
        min_size=min_size,
        max_size=max_size,
        share_size=max_size if share_size is None else share_size,
        open=False,
        # A connection that died with the server is replaced, not handed out.
        check=check_without_round_trip,
        reconnect_timeout=RECONNECT_SECONDS,
        kwargs={
            "autocommit": False,
            "row_factory": dict_row,
            "options": connection_options(statement_timeout),
        },
    )


async def check_without_round_trip(conn: AsyncConnection[Any]) -> None:
    """The pool's check of a connection before it is handed out, without a
    round trip to the server when none is needed.

    An idle session hears nothing from its server unprompted, so its socket
    has nothing to read. A server that ended the session (a restart, a kill,
    ``pg_terminate_backend``) closed its end, or sent a last error before it
    did: the socket reads as end of file, or has bytes waiting. Only then is
    the server asked (psycopg_pool's own check, which raises for a dead
    connection and reads whatever a live one was sent); a connection whose
    socket has nothing to read is handed out as it is. That is one round
    trip less for every request: each one checks a connection out. One
    ``poll`` tells a socket with nothing to read (the usual case) apart;
    only the others are looked at further.
    """
    if conn.closed or conn.pgconn.status != psycopg.pq.ConnStatus.OK:
        raise psycopg.OperationalError("the connection is closed")
    fd = conn.pgconn.socket
    idle = select.poll()
    idle.register(fd, select.POLLIN)
    if not idle.poll(0):
        return  # nothing to read, no end of file: the session is as it was left
    sock = socket.socket(fileno=fd)
    try:
        waiting = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return  # nothing to read: the session is as it was left
    except OSError:
        waiting = b""
    finally:
        sock.detach()  # the descriptor stays libpq's
    if not waiting:
        # Closed, so that the pool discards it rather than taking it back as idle.
        await conn.close()
        raise psycopg.OperationalError("the server closed the connection")
    await AsyncConnectionPool.check_connection(conn)


def connection_options(statement_timeout: float | None = None) -> str:
    """The settings of every pooled connection (libpq ``options``).

    ``jit=off``: the controller runs short statements, and PostgreSQL decides
    to JIT-compile by estimated cost alone. A plan with a step the planner was
    told to avoid (``enable_sort`` off in :func:`controller.folders.manifest_page`)
    is costed at 10^10, so each 5,000-entry manifest page was compiled with
    inlining and optimisation: 250 ms of compilation for 5 ms of execution.
    """
    options = "-c jit=off"
    if statement_timeout is not None:
        options += f" -c statement_timeout={int(statement_timeout * 1000)}"
    return options


async def end_autocommit(conn: AsyncConnection[Any]) -> None:
    """Take a pooled connection out of autocommit mode again (the pool's
    connections are not in it: the other callers' statements run in their
    transactions). One that cannot be set back (closed, or a statement was
    cut short) is closed: the pool discards it."""
    if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        try:
            await conn.set_autocommit(False)
            return
        except psycopg.Error:
            pass
    await conn.close()


async def ping(conn: AsyncConnection[Any]) -> None:
    """A round trip to the database (the health check)."""
    await conn.execute("SELECT 1")
