"""``controller admin ...``: the operator's commands, each one call of a domain
function (:mod:`controller.orgs`, :mod:`controller.runs`,
:mod:`controller.tokens`, :mod:`controller.workspaces`,
:mod:`controller.bridgeaudit`, :mod:`controller.agentfiles`,
:mod:`controller.grants`) in one transaction (``start-run`` and
``import-agent-files``: several, see :func:`controller.runs.start_bound_run`
and :func:`controller.agentimport.import_files`).

The admin REST API (``controller/api/orgs.py``, ``controller/api/runs.py``)
calls the same functions, so the two cannot drift. What stays here is the
command line's side: a synchronous entry per command, the stable JSON shapes
(snake_case, see README "Admin commands") and one-line refusals.

Adding a command: write the domain function as
``async def f(conn: psycopg.AsyncConnection, ...)``, call it here through
:func:`in_transaction` (and from a route through ``api/common.py``'s
``company_write`` / ``company_read``), and give it a parser entry in
``controller/cli.py``. This module is the only way the command line runs a
domain function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from common.errors import AppError, ValidationError, WorkFolderError
from common.limits import MAX_ENTRIES
from controller import agentfiles, agentimport, bridgeaudit, grants, orgs, runs, tokens, workspaces
from controller.config import AgentLimits
from controller.foldercore import Row
from controller.orgs import ROLES as ROLES
from controller.storage.base import StorageProvider

T = TypeVar("T")


class AdminError(AppError):
    """A refusal an operator can act on; printed as one line."""


def refusal_text(exc: WorkFolderError) -> str:
    """A domain refusal as the command line words it (a validation error by
    the messages of its details)."""
    if isinstance(exc, ValidationError) and exc.details:
        return "; ".join(str(d.get("message", d)) for d in exc.details)
    return exc.text


def coded_refusal_text(exc: WorkFolderError) -> str:
    """``code: reason``: how the agent folder commands (and any error no
    command words itself) name a refusal, with its stable code first."""
    detail = exc.details[0] if exc.details and isinstance(exc.details[0], dict) else {}
    return f"{exc.code}: {detail.get('message') or exc.text}"


def transactions(url: str) -> runs.Transact:
    """Each ``work(conn)`` in one transaction on a connection of its own."""

    async def transact(work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
        conn = await psycopg.AsyncConnection.connect(url, row_factory=dict_row)
        async with conn, conn.transaction():
            return await work(conn)

    return transact


def run_command(main: Callable[[], Awaitable[T]], *, coded: bool = False) -> T:
    """``main()`` to completion; a domain refusal (a 4xx error over HTTP)
    becomes an :class:`AdminError` worded by :func:`refusal_text`, or with
    ``coded`` by :func:`coded_refusal_text`."""
    try:
        return _run_to_completion(main)
    except WorkFolderError as exc:
        if exc.status >= 500:
            raise
        raise AdminError(coded_refusal_text(exc) if coded else refusal_text(exc)) from None


def in_transaction(
    url: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], *, coded: bool = False
) -> T:
    """``work(conn)`` in one transaction on a connection of its own; a domain
    refusal (a 4xx error over HTTP) becomes an :class:`AdminError` (see
    :func:`run_command`)."""
    return run_command(lambda: transactions(url)(work), coded=coded)


def _run_to_completion(main: Callable[[], Awaitable[T]]) -> T:
    """``main()`` on an event loop of its own; on a thread of its own when the
    caller's thread already runs a loop (a program embedding these commands,
    or a test driving a browser), where ``asyncio.run`` refuses to start."""

    async def as_coroutine() -> T:
        return await main()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(as_coroutine())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, as_coroutine()).result()


def _iso(value: Any) -> str | None:
    return None if value is None else str(value.isoformat())


def _uuid(value: str, field: str) -> str:
    try:
        return orgs.check_uuid(value, field)
    except ValidationError as exc:
        raise AdminError(refusal_text(exc)) from None


# --- companies, users, members --------------------------------------------------


def _new_user_json(user: orgs.NewUser) -> dict[str, Any]:
    return {"user_id": user.user_id, "token": user.token, "token_id": user.token_id}


def create_user(url: str, email: str) -> dict[str, Any]:
    return _new_user_json(in_transaction(url, lambda c: orgs.create_user(c, email)))


def bootstrap(url: str, company_name: str, email: str) -> dict[str, Any]:
    """The company, its owner and the membership, all or nothing (one transaction)."""
    company_id, user = in_transaction(url, lambda c: orgs.bootstrap(c, company_name, email))
    return {"company_id": company_id, **_new_user_json(user)}


def add_member(url: str, company: str, user: str, role: str) -> dict[str, Any]:
    m = in_transaction(url, lambda c: orgs.set_member_role(c, company, user, role))
    return {"company_id": m.company_id, "user_id": m.user_id, "role": m.role}


def remove_member(url: str, company: str, user: str) -> dict[str, Any]:
    company, user = _uuid(company, "company"), _uuid(user, "user")
    in_transaction(url, lambda c: orgs.remove_member(c, company, user))
    return {"company_id": company, "user_id": user, "removed": True}


def create_owner(
    url: str, table: str, company: str, name: str, project: str | None = None
) -> dict[str, Any]:
    """An agent, project or task (``table``); its id."""

    async def work(conn: psycopg.AsyncConnection[Any]) -> Row:
        if table == "tasks":
            assert project is not None
            return await orgs.create_task(conn, company, project, name)
        if table == "agents":
            return await orgs.create_agent(conn, company, name)
        assert table == "projects"
        return await orgs.create_project(conn, company, name)

    row = in_transaction(url, work)
    out = {"id": str(row["id"])}
    if table == "agents":
        out["entry_path"] = row["entry_path"]
    return out


# --- agents: the instruction entry, grants, the one-time import -----------------------
# Their refusals name the stable code (``entry_too_large: ...``), as they always have.


def set_agent_entry(url: str, agent: str, path: str) -> dict[str, Any]:
    agent = _uuid(agent, "agent")
    return in_transaction(url, lambda c: agentfiles.set_entry(c, agent, path), coded=True)


def change_grant(
    url: str, action: str, company: str, user: str, agent: str, *, configure: bool
) -> dict[str, Any]:
    """``grant`` or ``revoke`` (``action``) of the configure permission, the one
    a command must name (``--configure``)."""
    if not configure:
        raise AdminError(f"{action}: name the permission (--configure)")
    company, user, agent = _uuid(company, "company"), _uuid(user, "user"), _uuid(agent, "agent")
    change = grants.grant_configure if action == "grant" else grants.revoke_configure
    return in_transaction(url, lambda c: change(c, company, user, agent), coded=True)


def import_agent_files(
    url: str,
    storage: StorageProvider,
    agent: str,
    source: str,
    *,
    dry_run: bool,
    gc_delay: timedelta,
) -> dict[str, Any]:
    """Scan ``source`` and (unless ``dry_run``) import it into the agent's
    folder, once: the summary."""
    agent = _uuid(agent, "agent")
    try:
        return run_command(
            lambda: agentimport.import_files(
                transactions(url),
                storage,
                agent,
                Path(source).resolve(),
                dry_run=dry_run,
                # The defaults `serve` checks saves against, as no option says otherwise.
                limits=AgentLimits(),
                max_folder_entries=MAX_ENTRIES,
                gc_delay=gc_delay,
            ),
            coded=True,
        )
    except agentimport.ImportRefused as exc:
        raise AdminError(str(exc)) from None


# --- runs ------------------------------------------------------------------------


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
    """Bind the task's repositories, then a run and a new lease for its sandbox
    (fencing older leases)."""
    run = run_command(
        lambda: runs.start_bound_run(
            transactions(url),
            company,
            agent=agent,
            task=task,
            project=project,
            user=user,
            sandbox=sandbox,
            home=home,
        )
    )
    return {
        "run_id": run.run_id,
        "token": run.token,
        "lease_epoch": run.lease_epoch,
        "sandbox": run.sandbox,
        "bindings": run.bindings,
        "env": run.env,
        "repos": [
            {"workspace_id": b.workspace_id, "name": b.name, "primary": b.primary}
            for b in run.repos
        ],
    }


def end_run(url: str, run: str) -> dict[str, Any]:
    row = in_transaction(url, lambda c: runs.end_run(c, run))
    return {
        "run_id": str(row["id"]),
        "active": bool(row["active"]),
        "state": row["state"],
        "error": row["error"],
    }


# --- tokens and sessions ---------------------------------------------------------


def _token_json(r: Row) -> dict[str, Any]:
    out = {
        "token_id": str(r["id"]),
        "kind": r["kind"],
        "user_id": None if r["user_id"] is None else str(r["user_id"]),
        "email": r["email"],
        "created_at": _iso(r["created_at"]),
        "revoked_at": _iso(r["revoked_at"]),
    }
    if r["kind"] == "operator":
        out.update(company_id=str(r["company_id"]), name=r["name"])
    return out


def list_tokens(url: str, company: str | None, user: str | None) -> dict[str, Any]:
    """API and operator tokens (never the tokens themselves), oldest first."""
    rows = in_transaction(url, lambda c: tokens.list_tokens(c, company=company, user=user))
    return {"tokens": [_token_json(r) for r in rows]}


def revoke_token(url: str, token_id: str) -> dict[str, Any]:
    """Revoke an API or operator token; requests presenting it answer 401 from now on."""
    row = in_transaction(url, lambda c: tokens.revoke_token(c, token_id))
    return {**_token_json(row), "revoked": True}


def create_operator_token(url: str, company: str, name: str) -> dict[str, Any]:
    made = in_transaction(url, lambda c: tokens.create_operator_token(c, company, name))
    return {
        "token_id": made.token_id,
        "company_id": made.company_id,
        "name": made.name,
        "token": made.token,
        "created_at": _iso(made.created_at),
    }


def end_sessions(url: str, user: str) -> dict[str, Any]:
    """End every Files page session of ``user``; their next request is 401."""
    user = _uuid(user, "user")
    ended = in_transaction(url, lambda c: tokens.end_sessions(c, user))
    return {"user_id": user, "ended": ended}


def audit(url: str, run: str, after: int, limit: int) -> dict[str, Any]:
    """The API bridge's audit rows of one run, oldest first (``after`` an id)."""
    run = _uuid(run, "run")
    if not 1 <= limit <= bridgeaudit.AUDIT_PAGE_MAX or after < 0:
        raise AdminError(f"--limit must be 1-{bridgeaudit.AUDIT_PAGE_MAX} and --after at least 0")

    async def work(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
        await runs.get_run(conn, run)
        return await bridgeaudit.list_for_run(conn, run, after, limit)

    return {"run_id": run, "entries": in_transaction(url, work)}


# --- repositories (controller/workspaces.py) ---------------------------------------


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
    project = _uuid(project, "project")
    return in_transaction(
        url,
        lambda c: workspaces.add_workspace(
            c,
            project,
            repo_url=repo_url,
            name=name,
            ref=ref,
            primary=primary,
            setup_command=setup_command,
        ),
    )


def remove_workspace(url: str, workspace: str) -> dict[str, Any]:
    workspace = _uuid(workspace, "workspace")
    return in_transaction(url, lambda c: workspaces.remove_workspace(c, workspace))


def set_task_branch(url: str, task: str, branch: str) -> dict[str, Any]:
    task = _uuid(task, "task")
    return in_transaction(url, lambda c: workspaces.set_task_branch(c, task, branch))
