"""Start real controllers and a private PostgreSQL cluster for tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from controller.cli import main as controller_main
from controller.pgembed import EmbeddedPostgres

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world_searchable_tmpdir(prefix: str) -> Path:
    """A temp dir the postgres user can reach when tests run as root."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(d, 0o711)
    return d


class PgCluster:
    """One embedded cluster per test session; each controller gets its own database."""

    def __init__(self) -> None:
        self.dir = world_searchable_tmpdir("fsa-pg-")
        self.pg = EmbeddedPostgres(self.dir)
        self.pg.start()

    def admin_url(self) -> str:
        return f"postgresql://controller@/postgres?host={self.pg.sockdir}"

    def create_database(self) -> str:
        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://controller@/{name}?host={self.pg.sockdir}"

    def stop(self) -> None:
        self.pg.stop()


@dataclass
class ControllerProcess:
    """`controller serve` in a subprocess against a given database."""

    database_url: str
    data_dir: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
                "--database-url",
                self.database_url,
                "--data-dir",
                str(self.data_dir),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--gc-delay",
                "0",
                "--gc-interval",
                "0",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **self.env},
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"controller did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cli(self, *args: str) -> tuple[int, str, str]:
        """Run a `controller` subcommand in-process against this database."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = controller_main(
                [*args, "--database-url", self.database_url, "--data-dir", str(self.data_dir)]
            )
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
        return psycopg.connect(self.database_url, autocommit=True)


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


@contextlib.contextmanager
def running_controller(cluster: PgCluster, tmp: Path, *extra: str) -> Iterator[ControllerProcess]:
    ctl = ControllerProcess(cluster.create_database(), tmp, list(extra)).start()
    try:
        yield ctl
    finally:
        ctl.stop()
