"""An embedded PostgreSQL cluster under the controller's data dir.

`controller serve` without ``--database-url`` runs its own cluster with the
machine's PostgreSQL binaries: ``initdb`` once, ``pg_ctl start`` on every
start, ``pg_ctl stop -m fast`` on shutdown. It listens only on a unix socket
in a private directory (no TCP), and trusts local connections because nothing
but this process's user and the postgres user can reach that directory.

PostgreSQL refuses to run as root, so as root the cluster runs as the
``postgres`` user through ``runuser`` and the cluster directories belong to it.

After a crash (the postmaster killed with the controller, the OOM killer) the
next start waits, bounded by ``$CONTROLLER_PG_RECOVERY_WAIT`` seconds (default
60), until the old cluster's processes are gone -- orphaned backends linger a
moment and hold its shared memory -- then removes the stale ``postmaster.pid``
and lets PostgreSQL run its crash recovery.
"""

from __future__ import annotations

import glob
import logging
import os
import pwd
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from common.errors import AppError

log = logging.getLogger(__name__)

DB_NAME = "controller"
DB_USER = "controller"
RECOVERY_WAIT_SECONDS = 60.0


class EmbeddedPostgresError(AppError):
    """The embedded cluster could not be set up, started or recovered."""


def _live_postgres(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) PostgreSQL server process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return False
    comm, _, rest = stat.partition("(")[2].rpartition(")")
    return comm == "postgres" and rest.split()[0] not in ("Z", "X")


def _recovery_wait() -> float:
    raw = os.environ.get("CONTROLLER_PG_RECOVERY_WAIT", "")
    try:
        return float(raw) if raw else RECOVERY_WAIT_SECONDS
    except ValueError:
        raise EmbeddedPostgresError(
            f"CONTROLLER_PG_RECOVERY_WAIT must be a number of seconds, got {raw!r}"
        ) from None


def find_bindir() -> Path:
    """Locate initdb/pg_ctl: $CONTROLLER_PG_BINDIR, then PATH, then Debian's layout."""
    env = os.environ.get("CONTROLLER_PG_BINDIR")
    candidates = [Path(env)] if env else []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates.extend(Path(v) for v in versions)
    for c in candidates:
        if (c / "initdb").exists() and (c / "pg_ctl").exists():
            return c
    raise EmbeddedPostgresError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found; install the Debian "
        "package 'postgresql' or set CONTROLLER_PG_BINDIR"
    )


class EmbeddedPostgres:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir.resolve()
        self.pgdata = self.root / "pg" / "data"
        self.sockdir = self.root / "pg" / "run"
        self.logfile = self.root / "pg" / "postgres.log"
        self.bindir = find_bindir()
        self._run_as: str | None = "postgres" if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        return f"postgresql://{DB_USER}@/{DB_NAME}?host={quote(str(self.sockdir), safe='/')}"

    def _cmd(self, *args: str) -> list[str]:
        if self._run_as is None:
            return list(args)
        return ["runuser", "-u", self._run_as, "--", *args]

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self._cmd(*args), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise EmbeddedPostgresError(
                f"{Path(args[0]).name} failed ({proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        return proc

    def _prepare_dirs(self) -> None:
        base = self.root / "pg"
        base.mkdir(parents=True, exist_ok=True)
        self.sockdir.mkdir(exist_ok=True)
        if self._run_as is None:
            os.chmod(self.sockdir, 0o700)
            return
        pw = pwd.getpwnam(self._run_as)
        # The postgres user must be able to reach its directories: every
        # ancestor needs search permission for it.
        for parent in [self.root, *self.root.parents]:
            st = parent.stat()
            if not st.st_mode & 0o001 and st.st_uid != pw.pw_uid:
                if parent == self.root:
                    os.chmod(parent, st.st_mode | 0o001)
                else:
                    raise EmbeddedPostgresError(
                        f"{parent} is not searchable by the postgres user; choose a data "
                        f"dir whose parents are world-searchable (chmod o+x {parent})"
                    )
        for d in (base, self.sockdir):
            os.chown(d, pw.pw_uid, pw.pw_gid)
        os.chmod(base, 0o700)
        os.chmod(self.sockdir, 0o700)
        if self.pgdata.exists():
            os.chown(self.pgdata, pw.pw_uid, pw.pw_gid)

    def initialized(self) -> bool:
        return (self.pgdata / "PG_VERSION").exists()

    def init(self) -> None:
        self._prepare_dirs()
        if self.initialized():
            return
        log.info("initializing embedded PostgreSQL cluster in %s", self.pgdata)
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.pgdata),
            "-U",
            DB_USER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        )

    def _postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        """Whether this cluster's postmaster runs. ``pg_ctl status`` is not asked:
        it takes a killed postmaster that is still a zombie, or an unrelated
        process that reused its PID, for a running server."""
        pid = self._postmaster_pid()
        return pid is not None and self._works_here(pid) and _live_postgres(pid)

    def _works_here(self, pid: int) -> bool:
        """Whether ``pid`` runs in this cluster's data directory (as its server
        processes do; another cluster's postmaster may have reused the PID)."""
        try:
            return Path(os.readlink(f"/proc/{pid}/cwd")) == self.pgdata
        except OSError:
            return False

    def leftover_processes(self) -> list[int]:
        """PostgreSQL processes still working in this cluster's data directory
        (every server process runs with it as its working directory)."""
        pids = (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
        return [pid for pid in pids if self._works_here(pid) and _live_postgres(pid)]

    def _clear_crashed_cluster(self) -> None:
        """Wait for a crashed cluster's processes to go, then remove its locks."""
        wait = _recovery_wait()
        deadline = time.monotonic() + wait
        while leftover := self.leftover_processes():
            if time.monotonic() >= deadline:
                raise EmbeddedPostgresError(
                    f"processes of a previous PostgreSQL server are still running in "
                    f"{self.pgdata} after {wait:g}s (pids {' '.join(map(str, leftover))}); "
                    "stop them and start again"
                )
            time.sleep(0.1)
        if (self.pgdata / "postmaster.pid").exists():
            log.warning("embedded PostgreSQL was not shut down cleanly; it recovers now")
            (self.pgdata / "postmaster.pid").unlink(missing_ok=True)
        # A stale socket lock after a kill -9 would make postgres refuse to start.
        for stale in self.sockdir.glob(".s.PGSQL.*"):
            stale.unlink(missing_ok=True)

    def start(self) -> None:
        """Initialize if needed, start if not running, create the database.

        A server that was just killed can still look alive (its postmaster
        not yet gone), and one that lost a child resets every process and
        closes or refuses connections until its crash recovery ends: the
        database is asked again, with backoff, and the server started once
        it is gone, for as long as a recovery is given (:func:`_recovery_wait`)."""
        import psycopg  # local: keeps `controller --help` fast

        self.init()
        deadline = time.monotonic() + _recovery_wait()
        delay = 0.05
        while True:
            if not self.running():
                self._start_server()
            try:
                self._ensure_database()
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.info("embedded PostgreSQL not ready yet (%s); trying again", exc)
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _start_server(self) -> None:
        self._clear_crashed_cluster()
        opts = (
            # pg_ctl runs postgres through a shell: a data dir may hold spaces.
            f"-k {shlex.quote(str(self.sockdir))} -c listen_addresses='' -c fsync=on "
            "-c max_connections=200 -c shared_buffers=128MB"
        )
        try:
            self._run(
                str(self.bindir / "pg_ctl"),
                "start",
                "-D",
                str(self.pgdata),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.logfile),
                "-o",
                opts,
            )
        except EmbeddedPostgresError as exc:
            # pg_ctl only says "examine the log output": quote the log's end.
            raise EmbeddedPostgresError(f"{exc}\n{self._log_tail()}") from None

    def _log_tail(self, lines: int = 12) -> str:
        try:
            tail = self.logfile.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f"(cannot read {self.logfile}: {exc.strerror})"
        return f"the end of {self.logfile}:\n" + "\n".join(tail)

    def _ensure_database(self) -> None:
        """Create the database if it is missing."""
        import psycopg  # local: keeps `controller --help` fast

        admin_url = f"postgresql://{DB_USER}@/postgres?host={quote(str(self.sockdir), safe='/')}"
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=30) as conn:
            row = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)
            ).fetchone()
            if row is None:
                conn.execute(f"CREATE DATABASE {DB_NAME}")

    def stop(self) -> None:
        if self.initialized() and self.running():
            self._run(
                str(self.bindir / "pg_ctl"), "stop", "-D", str(self.pgdata), "-m", "fast", "-w"
            )
