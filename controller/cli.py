"""`controller`: serve, migrate, admin and gc.

Exit codes: 0 success, 1 an operator error (one line on stderr), 2 bad usage,
3 a dependency (database, storage) unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import ssl
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import logs
from common.errors import WorkFolderError
from controller import admin
from controller.config import (
    Settings,
    add_bridge_arguments,
    add_limit_arguments,
    add_quota_arguments,
    bridge_from,
    limits_from,
    quotas_from,
)
from controller.pgembed import EmbeddedPostgres, EmbeddedPostgresError

log = logging.getLogger("controller")

EXIT_ERROR = 1
EXIT_UNAVAILABLE = 3


def default_data_dir() -> Path:
    return Path(os.environ.get("CONTROLLER_DATA_DIR", "controller-data"))


def add_upload_grace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gc-upload-grace",
        type=float,
        metavar="SECONDS",
        help="age at which GC removes an unfinished upload into storage (an S3 multipart "
        "upload, a local temp file) (default 21600)",
    )


def add_db_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="state directory (embedded PostgreSQL, local objects); "
        "default $CONTROLLER_DATA_DIR or ./controller-data",
    )
    p.add_argument(
        "--database-url",
        default=os.environ.get("CONTROLLER_DATABASE_URL"),
        help="PostgreSQL URL; without it an embedded cluster under the data dir is used",
    )


def settings_from(args: argparse.Namespace) -> Settings:
    data_dir = (args.data_dir or default_data_dir()).resolve()
    s = Settings(data_dir=data_dir, database_url=args.database_url)
    for name in ("storage", "s3_endpoint", "s3_bucket", "s3_region"):
        if getattr(args, name, None) is not None:
            setattr(s, name, getattr(args, name))
    if getattr(args, "gc_delay", None) is not None:
        s.gc_delay = timedelta(seconds=args.gc_delay)
    if getattr(args, "gc_interval", None) is not None:
        s.gc_interval_seconds = args.gc_interval
    if getattr(args, "gc_upload_grace", None) is not None:
        s.gc_upload_grace = timedelta(seconds=args.gc_upload_grace)
    return s


@contextlib.contextmanager
def database(
    settings: Settings, *, keep_running: bool = False, migrated: bool = True
) -> Iterator[str]:
    """Yield a database URL (migrated unless ``migrated`` is false), starting the
    embedded cluster if needed.

    A cluster this call started is stopped again on exit unless ``keep_running``.
    """
    from controller.db import migrate

    if settings.database_url:
        if migrated:
            migrate(settings.database_url)
        yield settings.database_url
        return
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    pg = EmbeddedPostgres(settings.data_dir)
    started = not pg.running()
    if started:
        pg.start()
    try:
        if migrated:
            migrate(pg.url)
        yield pg.url
    finally:
        if started and not keep_running:
            pg.stop()


def make_storage(settings: Settings) -> Any:
    from controller.storage import make_provider

    return make_provider(
        settings.storage,
        data_dir=settings.data_dir,
        s3_bucket=settings.s3_bucket,
        s3_endpoint=settings.s3_endpoint,
        s3_region=settings.s3_region,
    )


# --- serve -------------------------------------------------------------------


def warn_connection_headroom(url: str, settings: Settings) -> None:
    """Log a warning when the replicas' pools would use (nearly) every
    connection PostgreSQL allows: each pool is per process, so N replicas
    open up to N x --pool-size (at 5 replicas the defaults exhaust 100)."""
    import psycopg

    from controller.db import connection_headroom

    q = settings.quotas
    try:
        warning = connection_headroom(url, q.pool_size, q.replicas)
    except psycopg.Error as exc:
        log.warning("could not read PostgreSQL's max_connections: %s", exc)
        return
    if warning is not None:
        log.warning(warning)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from controller.api.app import app_routes, bridge_policy, create_app
    from controller.api.protocol import protocol_class

    settings = settings_from(args)
    try:
        settings.limits = limits_from(args)
        settings.quotas = quotas_from(args)
        settings.bridge = bridge_from(args)
        bridge_policy(settings, app_routes())
    except ValueError as exc:
        raise admin.AdminError(str(exc)) from None
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise admin.AdminError(f"--listen must be HOST:PORT, got {args.listen!r}")
    if settings.storage == "s3" and not settings.s3_bucket:
        raise admin.AdminError("--storage s3 needs --s3-bucket")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise admin.AdminError("--tls-cert and --tls-key go together")
    if args.tls_cert:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                args.tls_cert, args.tls_key
            )
        except (OSError, ssl.SSLError) as exc:
            raise admin.AdminError(f"cannot load --tls-cert/--tls-key: {exc}") from None
    scheme = "https" if args.tls_cert else "http"
    if args.metrics_listen:
        m_host, _, m_port = args.metrics_listen.rpartition(":")
        if not m_host or not m_port.isdigit():
            raise admin.AdminError(
                f"--metrics-listen must be HOST:PORT, got {args.metrics_listen!r}"
            )
        if args.metrics_listen == args.listen:
            raise admin.AdminError("--metrics-listen must differ from --listen")
    with database(settings) as url:
        settings.database_url = url
        warn_connection_headroom(url, settings)
        storage = make_storage(settings)
        storage.check()
        app = create_app(settings, storage)
        if args.metrics_listen:
            try:
                app.state.metrics.listen(args.metrics_listen)
            except OSError as exc:
                raise admin.AdminError(
                    f"cannot listen on --metrics-listen {args.metrics_listen}: {exc.strerror}"
                ) from None
        config = uvicorn.Config(
            app,
            host=host.strip("[]"),
            port=int(port),
            loop="asyncio",
            # httptools plus the header timeout, head size and connection cap.
            http=protocol_class(settings.limits),
            timeout_keep_alive=settings.limits.keep_alive_timeout,
            lifespan="on",
            log_level="info" if args.verbose else "warning",
            log_config=None,  # uvicorn's records go through our handler and format
            access_log=args.verbose,
            timeout_graceful_shutdown=10,
            ssl_certfile=args.tls_cert,
            ssl_keyfile=args.tls_key,
        )
        server = uvicorn.Server(config)
        print(
            f"controller listening on {scheme}://{args.listen} (storage: {settings.storage})",
            flush=True,
        )
        # uvicorn handles SIGTERM/SIGINT itself, shuts down gracefully and then
        # re-raises the signal; these handlers absorb that re-raise so the
        # embedded cluster is stopped by `database()` and we exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        try:
            asyncio.run(server.serve())
        finally:
            app.state.metrics.stop()
        if not server.started:  # uvicorn logged why (e.g. the metrics address is in use)
            raise admin.AdminError("the server did not start")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from controller.db import migrate

    # Report what this run applied: `database()` must not have applied it first.
    with database(settings_from(args), migrated=False) as url:
        applied = migrate(url)
    emit(args, {"applied": applied}, lambda d: f"applied {len(d['applied'])} migration(s)")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from controller import gc
    from controller.db import make_pool

    if not args.now:
        raise admin.AdminError(
            "gc runs inside `controller serve`; use `controller gc --now` for one sweep"
        )
    settings = settings_from(args)

    async def sweep(url: str) -> dict[str, int]:
        pool = make_pool(url, min_size=1, max_size=2)
        await pool.open(wait=True)
        try:
            storage = make_storage(settings)
            report = (await gc.sweep_once(pool, storage)).as_json()
        finally:
            await pool.close()
        report["abandoned"] = await gc.sweep_abandoned_writes(storage, settings.gc_upload_grace)
        return report

    with database(settings) as url:
        report = asyncio.run(sweep(url))
    emit(args, report, lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    from controller import backup

    settings = settings_from(args)
    if args.admin_cmd == "backup":
        with database(settings) as url:
            out = backup.backup(url, args.storage, settings.data_dir, args.to.resolve())
    else:
        # No migrations first: the dump brings the schema it was taken with.
        with database(settings, migrated=False) as url:
            out = backup.restore(url, settings.data_dir, args.source.resolve())
    emit(args, out)
    return 0


# --- admin -------------------------------------------------------------------


def emit(
    args: argparse.Namespace,
    data: dict[str, Any],
    text: Callable[[dict[str, Any]], str] | None = None,
) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data))
    elif text is not None:
        print(text(data))
    else:
        for k, v in data.items():
            print(f"{k}: {json.dumps(v) if isinstance(v, dict | list) else v}")


def audit_lines(data: dict[str, Any]) -> str:
    """``admin audit`` without ``--json``: one line per bridged call."""
    rows = [
        f"{e['id']} {e['at']} {e['method']} {e['route'] or '-'} {e['status']}"
        f" {e['requestBytes']}B/{e['responseBytes']}B {e['durationMs']}ms"
        for e in data["entries"]
    ]
    return "\n".join(rows) if rows else f"no API bridge calls recorded for run {data['run_id']}"


def import_lines(data: dict[str, Any]) -> str:
    """``admin import-agent-files`` without ``--json``: the summary, then a line per path."""
    verb = "would import" if data["dry_run"] else "imported"
    lines = [
        f"{verb} {len(data['imported'])} file(s), {data['bytes']} bytes, and"
        f" {len(data['directories'])} folder(s) from {data['source']};"
        f" excluded {len(data['excluded'])}, refused {len(data['refused'])}"
    ]
    lines += [f"  excluded  {e['path']}  ({e['reason']})" for e in data["excluded"]]
    lines += [f"  refused   {r['path']}  ({r['reason']})" for r in data["refused"]]
    return "\n".join(lines)


def workspace_line(data: dict[str, Any]) -> str:
    """``admin add-workspace`` without ``--json``; a primary takeover is said."""
    line = f"workspace {data['workspace_id']} added to project {data['project_id']}"
    if data["primary"]:
        line += "; it is the project's primary workspace"
        if data["replaced_primary"]:
            line += f" (workspace {data['replaced_primary']} no longer is)"
    return line


def cmd_admin(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    text: Callable[[dict[str, Any]], str] | None = None
    with database(settings) as url:
        a = args.admin_cmd
        if a == "bootstrap":
            out = admin.bootstrap(url, args.company_name, args.email)
        elif a == "create-user":
            out = admin.create_user(url, args.email)
        elif a == "add-member":
            out = admin.add_member(url, args.company, args.user, args.role)
        elif a == "remove-member":
            out = admin.remove_member(url, args.company, args.user)
        elif a == "create-agent":
            out = admin.create_owner(url, "agents", args.company, args.name)
        elif a == "create-project":
            out = admin.create_owner(url, "projects", args.company, args.name)
        elif a == "create-task":
            out = admin.create_owner(url, "tasks", args.company, args.title, project=args.project)
        elif a == "start-run":
            out = admin.start_run(
                url,
                args.company,
                agent=args.agent,
                task=args.task,
                project=args.project,
                user=args.user,
                sandbox=args.sandbox,
                home=args.home,
            )
        elif a == "set-agent-entry":
            out = admin.set_agent_entry(url, args.agent, args.path)
        elif a in ("grant", "revoke"):
            out = admin.change_grant(
                url, a, args.company, args.user, args.agent, configure=args.configure
            )
        elif a == "import-agent-files":
            out = admin.import_agent_files(
                url, make_storage(settings), args.agent, args.dir,
                dry_run=args.dry_run, gc_delay=settings.gc_delay,
            )  # fmt: skip
            text = import_lines
        elif a == "end-run":
            out = admin.end_run(url, args.run)
        elif a == "list-tokens":
            out = admin.list_tokens(url, args.company, args.user)
        elif a == "revoke-token":
            out = admin.revoke_token(url, args.token_id)
        elif a == "create-operator-token":
            out = admin.create_operator_token(url, args.company, args.name)
        elif a == "audit":
            out = admin.audit(url, args.run, args.after, args.limit)
            text = audit_lines
        elif a == "end-sessions":
            out = admin.end_sessions(url, args.user)
        elif a == "add-workspace":
            out = admin.add_workspace(
                url,
                args.project,
                repo_url=args.repo_url,
                name=args.name,
                ref=args.ref,
                primary=args.primary,
                setup_command=args.setup,
            )
            text = workspace_line
        elif a == "remove-workspace":
            out = admin.remove_workspace(url, args.workspace)
        elif a == "set-task-branch":
            out = admin.set_task_branch(url, args.task, args.branch)
        else:  # pragma: no cover - argparse restricts choices
            raise admin.AdminError(f"unknown admin command {a}")
    emit(args, out, text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="controller", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the HTTP API, the Files page and the GC sweeper")
    add_db_options(serve)
    serve.add_argument("--listen", default="127.0.0.1:8750", help="HOST:PORT (default %(default)s)")
    serve.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics (GET /metrics) on this separate, unauthenticated "
        "address; keep it off the public network (default: no metrics listener)",
    )
    logs.add_argument(serve)
    serve.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log at INFO, with an access log line per request",
    )
    serve.add_argument("--tls-cert", metavar="FILE", help="PEM certificate (chain): serve HTTPS")
    serve.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    serve.add_argument("--storage", choices=["local_disk", "s3"], default="local_disk")
    serve.add_argument("--s3-endpoint")
    serve.add_argument("--s3-bucket")
    serve.add_argument("--s3-region")
    serve.add_argument(
        "--gc-delay",
        type=float,
        metavar="SECONDS",
        help="delay before superseded/purged objects may be deleted (default 86400)",
    )
    serve.add_argument(
        "--gc-interval",
        type=float,
        metavar="SECONDS",
        help="seconds between GC sweeps, 0 disables (default 180)",
    )
    add_upload_grace_argument(serve)
    add_limit_arguments(serve)
    add_quota_arguments(serve)
    add_bridge_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    mig = sub.add_parser("migrate", help="apply database migrations")
    add_db_options(mig)
    mig.add_argument("--json", action="store_true")
    mig.set_defaults(func=cmd_migrate)

    gcp = sub.add_parser("gc", help="garbage-collect unreferenced objects")
    add_db_options(gcp)
    gcp.add_argument("--now", action="store_true", help="run one sweep now")
    gcp.add_argument("--storage", choices=["local_disk", "s3"], default="local_disk")
    gcp.add_argument("--s3-endpoint")
    gcp.add_argument("--s3-bucket")
    gcp.add_argument("--s3-region")
    add_upload_grace_argument(gcp)
    gcp.add_argument("--json", action="store_true")
    gcp.set_defaults(func=cmd_gc)

    adm = sub.add_parser("admin", help="operator commands")
    adm_sub = adm.add_subparsers(dest="admin_cmd", required=True)

    def admin_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        p = adm_sub.add_parser(name, help=help_)
        add_db_options(p)
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=cmd_admin)
        return p

    p = admin_cmd("bootstrap", "create a company and its owner with an API token")
    p.add_argument("--company-name", default="Default company")
    p.add_argument("--email", default="owner@example.com")
    p = admin_cmd("create-user", "create a user with an API token")
    p.add_argument("email")
    p = admin_cmd("add-member", "add a user to a company (or change the role)")
    p.add_argument("company")
    p.add_argument("user")
    p.add_argument("--role", required=True, choices=admin.ROLES)
    p = admin_cmd("remove-member", "remove a user from a company")
    p.add_argument("company")
    p.add_argument("user")
    p = admin_cmd("create-agent", "create an agent (its folder starts with an empty AGENTS.md)")
    p.add_argument("company")
    p.add_argument("name")
    p = admin_cmd("set-agent-entry", "make PATH the agent's instruction entry (created if absent)")
    p.add_argument("agent")
    p.add_argument("path")
    for name, help_ in (
        ("grant", "let a member configure one agent (its folder)"),
        ("revoke", "take a member's permission on one agent back"),
    ):
        p = admin_cmd(name, help_)
        p.add_argument("company")
        p.add_argument("user")
        p.add_argument("--agent", required=True)
        p.add_argument(
            "--configure", action="store_true", help="the permission: configure the agent"
        )
    p = admin_cmd("create-project", "create a project")
    p.add_argument("company")
    p.add_argument("name")
    p = admin_cmd("create-task", "create a task in a project")
    p.add_argument("company")
    p.add_argument("project")
    p.add_argument("title")
    p = admin_cmd("start-run", "bind a run to a sandbox and issue its run token")
    p.add_argument("company")
    p.add_argument("--agent", required=True)
    p.add_argument("--task")
    p.add_argument("--project")
    p.add_argument("--user")
    p.add_argument("--sandbox", help="sandbox identity (a new lease epoch fences older runs)")
    p.add_argument("--home", default="/home/agent", help="the sandbox's $HOME, for the env paths")
    p = admin_cmd(
        "import-agent-files",
        "import an existing workspace directory into the agent's folder, once",
    )
    p.add_argument("agent")
    p.add_argument("dir", help="the workspace directory on this host")
    p.add_argument("--dry-run", action="store_true", help="only report what would happen")
    p.add_argument("--storage", choices=["local_disk", "s3"], default="local_disk")
    p.add_argument("--s3-endpoint")
    p.add_argument("--s3-bucket")
    p.add_argument("--s3-region")
    p = admin_cmd("end-run", "end a run; its token stops working at once")
    p.add_argument("run")
    p = admin_cmd(
        "create-operator-token",
        "issue a token for machines (an orchestrator) that opens one company's admin routes",
    )
    p.add_argument("company")
    p.add_argument("--name", required=True, help="what the token is for, shown by list-tokens")
    p = admin_cmd(
        "list-tokens",
        "list API and operator tokens by id (the tokens themselves are not stored)",
    )
    p.add_argument(
        "--company", help="only tokens of this company's members and its operator tokens"
    )
    p.add_argument("--user", help="only this user's tokens")
    p = admin_cmd("revoke-token", "revoke an API or operator token by id; it answers 401 at once")
    p.add_argument("token_id")
    p = admin_cmd("end-sessions", "end every Files page session of a user")
    p.add_argument("user")
    p = admin_cmd("audit", "the API bridge's audit trail of a run, oldest first")
    p.add_argument("--run", required=True)
    p.add_argument("--after", type=int, default=0, help="only rows after this id")
    p.add_argument("--limit", type=int, default=1000, help="at most this many rows (1-1000)")
    p = admin_cmd("add-workspace", "add a repository workspace to a project")
    p.add_argument("project")
    p.add_argument("--repo-url", required=True, help="what `git clone` is given")
    p.add_argument("--name", help="checkout name under $HOME/repos (default: from the URL)")
    p.add_argument("--ref", help="starting branch or tag of a new clone")
    p.add_argument(
        "--primary",
        action="store_true",
        help="the project's primary repository (takes over from the current one)",
    )
    p.add_argument("--setup", help="shell command run once in a new or restored checkout")
    p = admin_cmd(
        "remove-workspace", "bind a workspace to no new task (bindings and saves are kept)"
    )
    p.add_argument("workspace")
    p = admin_cmd("set-task-branch", "the branch the task's primary checkout is cloned onto")
    p.add_argument("task")
    p.add_argument("branch")
    p = admin_cmd("backup", "pg_dump the database, then copy the local object directory")
    p.add_argument("--to", type=Path, required=True, help="new (or empty) directory")
    p.add_argument("--storage", choices=["local_disk", "s3"], default="local_disk")
    p.set_defaults(func=cmd_backup)
    p = admin_cmd("restore", "load a backup (the controller must be stopped)")
    p.add_argument("--from", dest="source", type=Path, required=True, help="a backup directory")
    p.set_defaults(func=cmd_backup)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import psycopg  # after parsing: keeps `controller --help` fast

    logs.configure(
        getattr(args, "log_format", None), logging.INFO if args.verbose else logging.WARNING
    )
    try:
        code: int = args.func(args)
        return code
    except admin.AdminError as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except EmbeddedPostgresError as exc:
        print(f"controller: embedded PostgreSQL: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except WorkFolderError as exc:
        print(f"controller: {admin.coded_refusal_text(exc)}", file=sys.stderr)
        return EXIT_UNAVAILABLE if exc.status >= 500 else EXIT_ERROR
    except psycopg.OperationalError as exc:
        # Unreachable, refused, timed out, shut down: a dependency, not a bug.
        reason = " ".join(str(exc).split()) or type(exc).__name__
        print(f"controller: database unavailable: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
