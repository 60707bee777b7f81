"""Operator commands (`controller admin ...`), run against the database directly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from common.errors import AppError, NotFound, ValidationError
from common.paths import validate_uuid
from controller import workspaces
from controller.auth import RUN_TOKEN_PREFIX, USER_TOKEN_PREFIX, new_token, token_hash

T = TypeVar("T")

ROLES = ("owner", "admin", "member", "viewer")


LEASE_LOCK_CLASS = 0x6C6561
"""First key of the two-key advisory lock that serializes a sandbox's leases
(``apply.OBJECT_LOCK_CLASS`` is another class; folders use one-key locks)."""


class AdminError(AppError):
    """A refusal an operator can act on; printed as one line."""


def _conn(url: str) -> psycopg.Connection[dict[str, Any]]:
    return psycopg.connect(url, row_factory=dict_row)


def in_transaction(url: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
    """Run an async domain function (``work(conn)``) in one transaction of its
    own: how a command shares its logic with the REST API. A validation
    refusal becomes the one-line AdminError."""

    async def run() -> T:
        async with await psycopg.AsyncConnection.connect(url, row_factory=dict_row) as conn:
            return await work(conn)

    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(run())
        # Called from inside an event loop (a program embedding the CLI, such
        # as a test driving a browser): a loop of its own, on a thread.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, run()).result()
    except ValidationError as exc:
        raise AdminError("; ".join(d.get("message", str(d)) for d in exc.details or [])) from None
    except NotFound as exc:
        raise AdminError(exc.text) from None


def _require(
    conn: psycopg.Connection[dict[str, Any]], table: str, id_: str, company: str | None = None
) -> None:
    sql = f"SELECT 1 FROM {table} WHERE id = %s" + (" AND company_id = %s" if company else "")
    params: tuple[str, ...] = (id_, company) if company else (id_,)
    if conn.execute(sql, params).fetchone() is None:
        raise AdminError(f"no such {table[:-1]}: {id_}")


def _uuid(value: str, field: str) -> str:
    try:
        return validate_uuid(value, field)
    except ValidationError:
        raise AdminError(f"{field} must be a UUID, got {value!r}") from None


def create_user(url: str, email: str) -> dict[str, Any]:
    with _conn(url) as conn:
        return _create_user(conn, email)


def _create_user(conn: psycopg.Connection[dict[str, Any]], email: str) -> dict[str, Any]:
    if "@" not in email or len(email) > 320 or any(c.isspace() for c in email):
        raise AdminError(f"not an email address: {email!r}")
    user_id = str(uuid.uuid4())
    token = new_token(USER_TOKEN_PREFIX)
    if conn.execute("SELECT 1 FROM users WHERE email = %s", (email,)).fetchone():
        raise AdminError(f"a user with email {email} already exists")
    conn.execute("INSERT INTO users (id, email) VALUES (%s, %s)", (user_id, email))
    row = conn.execute(
        "INSERT INTO api_tokens (token_hash, user_id) VALUES (%s, %s) RETURNING id",
        (token_hash(token), user_id),
    ).fetchone()
    assert row is not None
    return {"user_id": user_id, "token": token, "token_id": str(row["id"])}


def bootstrap(url: str, company_name: str, email: str) -> dict[str, Any]:
    """The company, its owner and the membership, all or nothing (one transaction)."""
    company_id = str(uuid.uuid4())
    with _conn(url) as conn:
        conn.execute("INSERT INTO companies (id, name) VALUES (%s, %s)", (company_id, company_name))
        user = _create_user(conn, email)
        _add_member(conn, company_id, user["user_id"], "owner")
    return {"company_id": company_id, **user}


def add_member(url: str, company: str, user: str, role: str) -> dict[str, Any]:
    with _conn(url) as conn:
        return _add_member(conn, company, user, role)


def _add_member(
    conn: psycopg.Connection[dict[str, Any]], company: str, user: str, role: str
) -> dict[str, Any]:
    company, user = _uuid(company, "company"), _uuid(user, "user")
    if role not in ROLES:
        raise AdminError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    _require(conn, "companies", company)
    _require(conn, "users", user)
    conn.execute(
        "INSERT INTO memberships (company_id, user_id, role) VALUES (%s, %s, %s)"
        " ON CONFLICT (company_id, user_id) DO UPDATE SET role = EXCLUDED.role",
        (company, user, role),
    )
    return {"company_id": company, "user_id": user, "role": role}


def remove_member(url: str, company: str, user: str) -> dict[str, Any]:
    company, user = _uuid(company, "company"), _uuid(user, "user")
    with _conn(url) as conn:
        cur = conn.execute(
            "DELETE FROM memberships WHERE company_id = %s AND user_id = %s", (company, user)
        )
        if cur.rowcount == 0:
            raise AdminError(f"user {user} is not a member of company {company}")
        # Signed-in pages of a removed member lose access at once as well.
    return {"company_id": company, "user_id": user, "removed": True}


def create_owner(
    url: str, table: str, company: str, name: str, project: str | None = None
) -> dict[str, Any]:
    company = _uuid(company, "company")
    if not name.strip():
        raise AdminError("name must not be empty")
    new_id = str(uuid.uuid4())
    with _conn(url) as conn:
        _require(conn, "companies", company)
        if table == "tasks":
            assert project is not None
            project = _uuid(project, "project")
            _require(conn, "projects", project, company)
            conn.execute(
                "INSERT INTO tasks (id, company_id, project_id, title) VALUES (%s, %s, %s, %s)",
                (new_id, company, project, name),
            )
        else:
            conn.execute(
                f"INSERT INTO {table} (id, company_id, name) VALUES (%s, %s, %s)",
                (new_id, company, name),
            )
    return {"id": new_id}


def start_run(
    url: str,
    company: str,
    *,
    agent: str,
    task: str | None,
    project: str | None,
    user: str | None,
    sandbox: str | None,
    home: str,
) -> dict[str, Any]:
    """Bind a run and take a new lease for its sandbox (fencing older leases)."""
    company, agent = _uuid(company, "company"), _uuid(agent, "agent")
    task = _uuid(task, "task") if task else None
    project = _uuid(project, "project") if project else None
    user = _uuid(user, "user") if user else None
    sandbox_key = sandbox or f"sandbox-{uuid.uuid4()}"
    if not 1 <= len(sandbox_key) <= 256:
        raise AdminError("sandbox key must be 1-256 characters")
    run_id = str(uuid.uuid4())
    token = new_token(RUN_TOKEN_PREFIX)
    # The task's repositories are bound first, in their own transaction: a
    # binding is the task's, whether or not this run then starts.
    bindings: list[workspaces.Binding] = []
    if task:
        bound_task = task
        bindings = in_transaction(url, lambda c: workspaces.bind_task(c, company, bound_task))
    with _conn(url) as conn:
        _require(conn, "agents", agent, company)
        if task:
            _require(conn, "tasks", task, company)
            row = conn.execute("SELECT project_id FROM tasks WHERE id = %s", (task,)).fetchone()
            assert row is not None
            if project is None:
                project = str(row["project_id"])
            elif project != str(row["project_id"]):
                raise AdminError(
                    f"task {task} belongs to project {row['project_id']}, not {project}"
                )
        if project:
            _require(conn, "projects", project, company)
        if (
            user
            and conn.execute(
                "SELECT 1 FROM memberships WHERE company_id = %s AND user_id = %s", (company, user)
            ).fetchone()
            is None
        ):
            raise AdminError(f"user {user} is not a member of company {company}")
        # Serialize lease changes per sandbox; the new epoch fences every older one.
        # Two keys: never the same lock as a folder's one-key lock (its id).
        conn.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            (LEASE_LOCK_CLASS, f"{company}:{sandbox_key}"),
        )
        row = conn.execute(
            "SELECT coalesce(max(lease_epoch), 0) AS e FROM runs"
            " WHERE company_id = %s AND sandbox_key = %s",
            (company, sandbox_key),
        ).fetchone()
        epoch = int(row["e"] if row else 0) + 1
        _end_runs(
            conn,
            "company_id = %s AND sandbox_key = %s AND active",
            (company, sandbox_key),
            reason=f"superseded by run {run_id}",
        )
        conn.execute(
            "INSERT INTO runs (id, company_id, agent_id, task_id, project_id, user_id,"
            " sandbox_key, lease_epoch, token_hash) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)",
            (run_id, company, agent, task, project, user, sandbox_key, epoch, token_hash(token)),
        )
    home_dir = Path(home)
    env = {
        "AGENT_HOME": str(home_dir / "agent"),
        "PAPERCLIP_AGENT_DIR": str(home_dir / "agent"),
        "PAPERCLIP_REPOS_DIR": str(home_dir / "repos"),
    }
    if task:
        env["PAPERCLIP_TASK_DIR"] = str(home_dir / "task")
    if user:
        env["PAPERCLIP_USER_DIR"] = str(home_dir / "user")
    if project:
        env["PAPERCLIP_PROJECT_DIR"] = str(home_dir / "project")
    env.update(workspaces.run_env(bindings, PurePosixPath(home)))
    return {
        "run_id": run_id,
        "token": token,
        "lease_epoch": epoch,
        "sandbox": sandbox_key,
        "bindings": {"task": task, "agent": agent, "user": user, "project": project},
        "env": env,
        "repos": [
            {"workspace_id": b.workspace_id, "name": b.name, "primary": b.primary} for b in bindings
        ],
    }


def _end_runs(
    conn: psycopg.Connection[dict[str, Any]], where: str, params: tuple[Any, ...], *, reason: str
) -> int:
    # A run that ends while a save is in flight did not save: say so.
    cur = conn.execute(
        "UPDATE runs SET active = false, ended_at = now(),"
        " state = CASE WHEN state = 'saving' THEN 'failed' ELSE state END,"
        " error = CASE WHEN state = 'saving' THEN %s ELSE error END"
        f" WHERE {where}",
        (f"run ended while a save was in progress ({reason})", *params),
    )
    return cur.rowcount


def end_run(url: str, run: str) -> dict[str, Any]:
    run = _uuid(run, "run")
    with _conn(url) as conn:
        row = conn.execute("SELECT active FROM runs WHERE id = %s", (run,)).fetchone()
        if row is None:
            raise AdminError(f"no such run: {run}")
        _end_runs(conn, "id = %s AND active", (run,), reason="ended by operator")
        state = conn.execute("SELECT state, error FROM runs WHERE id = %s", (run,)).fetchone()
    assert state is not None
    return {"run_id": run, "active": False, "state": state["state"], "error": state["error"]}


def _iso(value: Any) -> str | None:
    return None if value is None else str(value.isoformat())


def list_tokens(url: str, company: str | None, user: str | None) -> dict[str, Any]:
    """API tokens (never the tokens themselves), oldest first."""
    where, params = [], []
    if company is not None:
        where.append("t.user_id IN (SELECT user_id FROM memberships WHERE company_id = %s)")
        params.append(_uuid(company, "company"))
    if user is not None:
        where.append("t.user_id = %s")
        params.append(_uuid(user, "user"))
    sql = (
        "SELECT t.id, t.user_id, u.email, t.created_at, t.revoked_at"
        " FROM api_tokens t JOIN users u ON u.id = t.user_id"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY t.created_at, t.id"
    )
    with _conn(url) as conn:
        rows = conn.execute(sql, params).fetchall()
    return {
        "tokens": [
            {
                "token_id": str(r["id"]),
                "user_id": str(r["user_id"]),
                "email": r["email"],
                "created_at": _iso(r["created_at"]),
                "revoked_at": _iso(r["revoked_at"]),
            }
            for r in rows
        ]
    }


def revoke_token(url: str, token_id: str) -> dict[str, Any]:
    """Revoke an API token; requests presenting it answer 401 from now on."""
    token_id = _uuid(token_id, "token")
    with _conn(url) as conn:
        row = conn.execute(
            "UPDATE api_tokens SET revoked_at = coalesce(revoked_at, now())"
            " WHERE id = %s RETURNING user_id, revoked_at",
            (token_id,),
        ).fetchone()
    if row is None:
        raise AdminError(f"no such token: {token_id}")
    return {
        "token_id": token_id,
        "user_id": str(row["user_id"]),
        "revoked": True,
        "revoked_at": _iso(row["revoked_at"]),
    }


def end_sessions(url: str, user: str) -> dict[str, Any]:
    """End every Files page session of ``user``; their next request is 401."""
    user = _uuid(user, "user")
    with _conn(url) as conn:
        _require(conn, "users", user)
        cur = conn.execute("DELETE FROM web_sessions WHERE user_id = %s", (user,))
    return {"user_id": user, "ended": cur.rowcount}


def audit(url: str, run: str, after: int, limit: int) -> dict[str, Any]:
    """The API bridge's audit rows of one run, oldest first (``after`` an id)."""
    from controller.bridgeaudit import AUDIT_PAGE_MAX, LIST_SQL, row_json

    run = _uuid(run, "run")
    if not 1 <= limit <= AUDIT_PAGE_MAX or after < 0:
        raise AdminError(f"--limit must be 1-{AUDIT_PAGE_MAX} and --after at least 0")
    with _conn(url) as conn:
        _require(conn, "runs", run)
        rows = conn.execute(LIST_SQL, (run, after, limit)).fetchall()
    return {"run_id": run, "entries": [row_json(r) for r in rows]}


def add_workspace(
    url: str,
    project: str,
    *,
    repo_url: str,
    name: str | None,
    ref: str | None,
    primary: bool,
    setup_command: str | None,
) -> dict[str, Any]:
    return in_transaction(
        url,
        lambda c: workspaces.add_workspace(
            c,
            _uuid(project, "project"),
            repo_url=repo_url,
            name=name,
            ref=ref,
            primary=primary,
            setup_command=setup_command,
        ),
    )


def remove_workspace(url: str, workspace: str) -> dict[str, Any]:
    return in_transaction(
        url, lambda c: workspaces.remove_workspace(c, _uuid(workspace, "workspace"))
    )


def set_task_branch(url: str, task: str, branch: str) -> dict[str, Any]:
    return in_transaction(url, lambda c: workspaces.set_task_branch(c, _uuid(task, "task"), branch))
