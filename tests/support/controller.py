"""Real controllers for tests and benchmarks: a private PostgreSQL cluster and
``controller serve`` in a subprocess."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg

from controller.cli import main as controller_main
from controller.pgembed import EmbeddedPostgres
from tests.support.constants import REPO
from tests.support.procs import ProcessError, free_port, wait_until_healthy
from tests.support.tmp import world_searchable_tmpdir

GC_ON_DEMAND = ["--gc-delay", "0", "--gc-interval", "0"]
"""Tests sweep garbage only when they ask (``gc --now``), and then everything due."""


@functools.cache
def client_tls() -> ssl.SSLContext:
    """One TLS context for the suite's HTTP clients (pass it as ``verify=``).
    httpx builds a new one for every Client otherwise, loading the whole CA
    bundle: about 20 ms of CPU each on a quiet machine, several times that on
    a busy one, and tests make thousands of clients. It verifies as httpx's
    default does (the clients speak plain HTTP to local servers anyway)."""
    return httpx.create_ssl_context()


def parse_api_time(value: str) -> datetime:
    """An API timestamp (ISO 8601, ``Z``) as an aware datetime.

    Compare these, never the strings: ``isoformat`` drops the fraction when the
    microseconds are 0, and ``...:05Z`` sorts after ``...:05.000100Z``.
    """
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError(f"API timestamp without a time zone: {value!r}")
    return parsed


class PgCluster:
    """One embedded cluster per test session; each controller gets its own database."""

    def __init__(self) -> None:
        self.dir = world_searchable_tmpdir("fsa-pg-")
        self.pg = EmbeddedPostgres(self.dir)
        try:
            self.pg.start()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def admin_url(self) -> str:
        return f"postgresql://controller@/postgres?host={self.pg.sockdir}"

    def create_database(self) -> str:
        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://controller@/{name}?host={self.pg.sockdir}"

    def configure_database(self, url: str, settings: dict[str, str]) -> None:
        """``ALTER DATABASE ... SET`` each setting for the database of ``url``
        (from :meth:`create_database`): its new sessions take them."""
        name = url.split("?", 1)[0].rsplit("/", 1)[1]
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            for setting, value in settings.items():
                conn.execute(f"ALTER DATABASE {name} SET {setting} = '{value}'")

    def log_since(self, start: int) -> bytes:
        """The cluster's log from byte ``start`` on (``start``: the log's size
        at an earlier point, ``self.pg.logfile.stat().st_size``)."""
        with self.pg.logfile.open("rb") as fh:
            fh.seek(start)
            return fh.read()

    def kill(self, timeout: float = 60) -> None:
        """Every server process killed with -9, as a crashed host would, and
        gone when this returns (``pg.start()`` then recovers the cluster)."""
        for pid in self.pg.leftover_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.pg.leftover_processes():
            assert time.monotonic() < deadline, "PostgreSQL did not die"
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the cluster and remove its files."""
        try:
            self.pg.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class ControllerProcess:
    """`controller serve` in a subprocess.

    With a ``database_url`` it uses that database; with None, the controller's
    own embedded PostgreSQL under ``data_dir`` (as an operator runs it).
    """

    database_url: str | None
    data_dir: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    gc_args: list[str] = field(default_factory=lambda: list(GC_ON_DEMAND))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def db_url(self) -> str:
        """The database this controller uses, also in embedded mode."""
        return self.database_url or EmbeddedPostgres(self.data_dir).url

    def _db_args(self) -> list[str]:
        url = ["--database-url", self.database_url] if self.database_url else []
        return [*url, "--data-dir", str(self.data_dir)]

    def start(self, timeout: float = 30.0) -> ControllerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / f"controller-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "controller.cli",
                "serve",
                *self._db_args(),
                "--listen",
                f"127.0.0.1:{self.port}",
                *self.gc_args,
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **self.env},
        )
        log.close()
        try:
            wait_until_healthy(self.url + "/healthz", self.proc, timeout, self.log)
        except ProcessError as exc:
            self.stop()
            raise RuntimeError(f"controller did not become healthy: {exc}") from None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Signal the server, wait ``timeout`` seconds for it to stop its cluster and exit, kill."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cli(self, *args: str) -> tuple[int, str, str]:
        """Run a `controller` subcommand in-process against this database."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = controller_main([*args, *self._db_args()])
        return code, out.getvalue(), err.getvalue()

    def admin(self, *args: str) -> dict[str, Any]:
        code, out, err = self.cli("admin", *args, "--json")
        if code != 0:
            raise RuntimeError(f"controller admin {' '.join(args)} failed ({code}): {err}")
        result: dict[str, Any] = json.loads(out)
        return result

    def gc_now(self) -> dict[str, Any]:
        code, out, err = self.cli("gc", "--now", "--json")
        assert code == 0, err
        result: dict[str, Any] = json.loads(out)
        return result

    def db(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.db_url, autocommit=True)


@dataclass
class Tenant:
    """A fresh company with an owner, and an HTTP client signed in as that owner."""

    controller: ControllerProcess
    company_id: str
    user_id: str
    token: str

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.controller.url,
            headers={"Authorization": f"Bearer {token or self.token}"},
            timeout=60,
            verify=client_tls(),
        )

    def folder(self, scope: str, owner_id: str) -> str:
        return f"/api/companies/{self.company_id}/work-folders/{scope}/{owner_id}"

    @property
    def my_folder(self) -> str:
        return self.folder("user", self.user_id)

    def new_member(self, role: str = "member") -> tuple[str, str]:
        user = self.controller.admin("create-user", f"{uuid.uuid4().hex[:10]}@example.com")
        self.controller.admin("add-member", self.company_id, user["user_id"], "--role", role)
        return user["user_id"], user["token"]

    def file_rows(self, path: str, *, live: bool = True) -> int:
        """Rows of the company's folders at ``path``: live ones, or (``live=False``)
        trashed ones too -- what a refused write must not have published."""
        with self.controller.db() as db:
            row = db.execute(
                "SELECT count(*) FROM files f JOIN folders d ON d.id = f.folder_id"
                " WHERE d.company_id = %s AND f.path = %s"
                + (" AND f.deleted_at IS NULL" if live else ""),
                (self.company_id, path),
            ).fetchone()
        assert row is not None
        return int(row[0])

    def folder_lock_waiters(self, folder_id: int) -> int:
        """Transactions waiting on the folder's write lock (held by a test to
        make writes to the folder wait inside their transaction)."""
        with self.controller.db() as db:
            row = db.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND objsubid = 1 AND objid = %s",
                (folder_id,),
            ).fetchone()
        assert row is not None
        return int(row[0])


def bootstrap_tenant(ctl: ControllerProcess, **names: str) -> Tenant:
    """A fresh company and owner (``company_name``/``email`` optional)."""
    out = ctl.admin(
        "bootstrap",
        "--company-name",
        names.get("company_name", f"co-{uuid.uuid4().hex[:8]}"),
        "--email",
        names.get("email", f"owner-{uuid.uuid4().hex[:10]}@example.com"),
    )
    return Tenant(ctl, out["company_id"], out["user_id"], out["token"])


@contextlib.contextmanager
def running_controller(cluster: PgCluster, tmp: Path, *extra: str) -> Iterator[ControllerProcess]:
    ctl = ControllerProcess(cluster.create_database(), tmp, list(extra)).start()
    try:
        yield ctl
    finally:
        ctl.stop()


@contextlib.contextmanager
def private_controller(cluster: PgCluster, prefix: str, *extra: str) -> Iterator[ControllerProcess]:
    """:func:`running_controller` in a temp dir of its own, removed afterwards:
    a controller started with its own flags (small limits, say)."""
    tmp = world_searchable_tmpdir(prefix)
    try:
        with running_controller(cluster, tmp, *extra) as ctl:
            yield ctl
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "GC_ON_DEMAND",
    "REPO",
    "ControllerProcess",
    "PgCluster",
    "Tenant",
    "bootstrap_tenant",
    "client_tls",
    "free_port",
    "parse_api_time",
    "private_controller",
    "running_controller",
    "world_searchable_tmpdir",
]
