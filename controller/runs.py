"""Runs as the controller records them: starting one (a new lease for its
sandbox) and ending it, which runs use a folder, their save state, refresh
requests and the objects they uploaded.

Save state. ``runs.state`` and ``runs.error`` are the run's last reported
state; what people are shown is derived from it with the save receipts
(:func:`controller.receipts.folder_saves`), so that each folder shows its
own state (:func:`folder_state`) and a failure stands until a later save of
the same thing succeeds (:func:`run_state`):

- a folder's refusal or failure (its receipt) is that folder's, never
  another's, and keeps the run failed while it stands (a storage limit is a
  warning and does not);
- a repository's failure is recorded on the run as ``repository <name>:
  <error>`` (:func:`record_repository_failure`), cleared by a later save of
  that repository, and is never a folder's;
- a failure the run reported without naming its folder is shown on each of
  its folders, unless a standing folder failure or a repository explains it;
- a run of a sandbox that a newer run took over (``superseded``) that never
  saved a folder shows that folder ``failed`` with ``STALE_LEASE``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import PurePosixPath
from typing import Any, Final, Protocol, TypeVar

from psycopg import AsyncConnection

from common.errors import MemberNotFound, RunNotActive, RunNotFound, ValidationError
from common.text import check_text
from controller import foldercore, folders, receipts, runprep, workspaces
from controller.auth import RUN_TOKEN_PREFIX, new_token, token_hash
from controller.foldercore import EnsureObject, Folder, Row, StoreMark
from controller.orgs import check_uuid, require_agent, require_project, task_project
from controller.receipts import FolderSave
from controller.storage.base import object_key

T = TypeVar("T")

MAX_ERROR_CHARS = 2000

SUPERSEDED_CODE: Final = "STALE_LEASE"
"""The code a superseded run's folders show: its saves are refused from the
moment a newer run of its sandbox started (409 ``stale_lease``, or 401 for
its token)."""
SUPERSEDED_ERROR: Final = (
    "superseded by a newer run of its sandbox; its saves are refused from then on"
)
_REPOSITORY_PREFIX: Final = "repository "
_CODE_PREFIX: Final = re.compile(r"([a-z][a-z0-9_]*): ")

LEASE_LOCK_CLASS = 0x6C6561
"""First key of the two-key advisory lock that serializes a sandbox's leases
(``foldercore.OBJECT_LOCK_CLASS`` is another class; folders use one-key locks)."""


def superseded(row: Row) -> bool:
    """A newer run of the same sandbox holds the lease (``newest_epoch`` read with the row)."""
    newest = row.get("newest_epoch")
    return newest is not None and int(newest) > int(row["lease_epoch"])


MAX_SANDBOX_KEY_CHARS = 256
DEFAULT_HOME = "/home/agent"
MAX_HOME_CHARS = 1024

_OWNER_COLUMN = {"task": "task_id", "agent": "agent_id", "project": "project_id", "user": "user_id"}


@dataclass(frozen=True)
class SyncStatus:
    runs: list[Row]
    """Runs bound to the folder's owner, newest first."""
    last_operation_at: datetime | None
    saves: dict[str, list[FolderSave]]
    """Each run's folders with save receipts, by run id."""


async def bound_runs(
    conn: AsyncConnection[Any], company_id: str, scope: str, owner_id: str
) -> list[Row]:
    """The runs bound to the folder's owner, newest first, each with its agent's
    name (``agent_name``: the agent exists as long as its runs do) and the
    newest lease of its sandbox (``newest_epoch``). The owner is
    compared as a uuid, so the owner column's index (migration 0012) serves
    it; a user folder's owner that is not a uuid's canonical text has no runs."""
    try:
        owner = uuid.UUID(owner_id)
    except ValueError:
        return []
    if str(owner) != owner_id:
        return []
    cur = await conn.execute(
        "SELECT r.*, a.name AS agent_name, (SELECT max(lease_epoch) FROM runs o"
        "  WHERE o.company_id = r.company_id AND o.sandbox_key = r.sandbox_key) AS newest_epoch"
        " FROM runs r JOIN agents a ON a.id = r.agent_id"
        f" WHERE r.company_id = %s AND r.{_OWNER_COLUMN[scope]} = %s"
        " ORDER BY r.started_at DESC, r.id",
        (company_id, owner),
    )
    return list(await cur.fetchall())


async def sync_status(
    conn: AsyncConnection[Any],
    folder: Folder | None,
    company_id: str,
    scope: str,
    owner_id: str,
) -> SyncStatus:
    runs = await bound_runs(conn, company_id, scope, owner_id)
    saves = await receipts.folder_saves(conn, [str(r["id"]) for r in runs])
    return SyncStatus(runs, await folders.last_operation_at(conn, folder), saves)


async def request_refresh(
    conn: AsyncConnection[Any], company_id: str, scope: str, owner_id: str, run_id: str
) -> None:
    """Ask a run bound to this owner to take the server's changes."""
    runs = {str(r["id"]): r for r in await bound_runs(conn, company_id, scope, owner_id)}
    run = runs.get(run_id)
    if run is None:
        raise RunNotFound()
    if not run["active"]:
        raise RunNotActive()
    await conn.execute("UPDATE runs SET refresh_requested = true WHERE id = %s", (run_id,))


async def refresh_requested(conn: AsyncConnection[Any], run_id: str) -> bool:
    cur = await conn.execute("SELECT refresh_requested FROM runs WHERE id = %s", (run_id,))
    row = await cur.fetchone()
    return bool(row and row["refresh_requested"])


async def clear_refresh(conn: AsyncConnection[Any], run_id: str) -> None:
    await conn.execute("UPDATE runs SET refresh_requested = false WHERE id = %s", (run_id,))


async def set_state(conn: AsyncConnection[Any], run_id: str, state: str, error: str | None) -> None:
    """Record the run's save state; an empty error is stored as none."""
    await conn.execute(
        "UPDATE runs SET state = %s, error = %s WHERE id = %s",
        (state, error[:MAX_ERROR_CHARS] if error else None, run_id),
    )


async def settle_saving(conn: AsyncConnection[Any], run_id: str) -> None:
    """A save that was refused without failing the run (a storage limit, which
    is a warning): the run's state goes back to what it was before the save."""
    await conn.execute(
        "UPDATE runs SET state = CASE WHEN last_saved_at IS NULL THEN 'starting' ELSE 'saved' END"
        " WHERE id = %s AND state = 'saving'",
        (run_id,),
    )


async def mark_saving(conn: AsyncConnection[Any], run_id: str) -> None:
    await conn.execute(
        "UPDATE runs SET state = 'saving' WHERE id = %s AND state <> 'saving'", (run_id,)
    )


async def record_repository_failure(
    conn: AsyncConnection[Any], run_id: str, name: str, error: str
) -> None:
    """A failed save of the run's repository ``name``: the run is failed with
    ``repository <name>: <error>`` until a later save of that repository
    (:func:`clear_repository_failure`); no folder shows it as its own."""
    await set_state(conn, run_id, "failed", f"{_REPOSITORY_PREFIX}{name}: {error}")


async def clear_repository_failure(conn: AsyncConnection[Any], run_id: str, name: str) -> None:
    """The run saved its repository ``name``: a failure of that repository's
    no longer stands (another failure of the run is left as it is)."""
    prefix = f"{_REPOSITORY_PREFIX}{name}: "
    await conn.execute(
        "UPDATE runs SET error = NULL,"
        " state = CASE WHEN last_saved_at IS NULL THEN 'starting' ELSE 'saved' END"
        " WHERE id = %s AND state = 'failed' AND left(error, %s) = %s",
        (run_id, len(prefix), prefix),
    )


def repository_failure(row: Row, name: str) -> str | None:
    """The run's failed save of its repository ``name`` while it stands."""
    prefix = f"{_REPOSITORY_PREFIX}{name}: "
    error = row["error"]
    if row["state"] == "failed" and isinstance(error, str) and error.startswith(prefix):
        return error[len(prefix) :]
    return None


def error_code(error: str | None) -> str | None:
    """The stable code an error recorded as ``<code>: <message>`` starts with
    (the controller's refusals are recorded so); None for other text."""
    found = _CODE_PREFIX.match(error or "")
    return found.group(1) if found else None


@dataclass(frozen=True)
class SaveState:
    """One folder's save state as a run shows it."""

    state: str
    """``starting``, ``saving``, ``saved`` or ``failed``."""
    code: str | None = None
    """The failure's stable code (a receipt's, e.g. ``STALE_LEASE``)."""
    error: str | None = None
    failed_at: datetime | None = None
    stopped_at: datetime | None = None
    """When the run's sandbox stopped with the folder (its final save's
    receipt, :attr:`controller.receipts.FolderSave.stopped_at`), before the
    orchestrator ends the run; None while the run may save it again."""


def run_state(row: Row, saves: Sequence[FolderSave]) -> tuple[str, str | None]:
    """The run's save state and error: as recorded, but failed while a
    folder's failure that fails the run stands
    (:data:`controller.receipts.FAILS_THE_RUN`): a later save of another
    folder records ``saved`` on the run, which does not save the first."""
    if row["state"] == "failed":
        return "failed", row["error"]
    for save in saves:
        if save.fails_the_run and save.failure is not None:
            failure = save.failure
            return "failed", f"{save.scope} folder: {failure['code']}: {failure['error']}"
    return row["state"], row["error"]


def folder_state(
    row: Row,
    scope: str,
    owner_id: str,
    saves: Sequence[FolderSave],
    baseline_at: datetime | None = None,
) -> SaveState:
    """The run's save state of one folder (see the module doc): its own
    receipts first; ``baseline_at`` is its last checkpoint of the folder."""
    own = next((s for s in saves if (s.scope, s.owner_id) == (scope, owner_id)), None)
    st = _folder_save_state(row, own, saves, baseline_at)
    return st if own is None else replace(st, stopped_at=own.stopped_at)


def stopped_at(folders: Sequence[SaveState]) -> datetime | None:
    """When the run's sandbox stopped: every folder it binds had its final
    save (the last of them), else None."""
    times = [f.stopped_at for f in folders]
    if not times or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


def _folder_save_state(
    row: Row, own: FolderSave | None, saves: Sequence[FolderSave], baseline_at: datetime | None
) -> SaveState:
    if own is not None and own.failure is not None:
        f = own.failure
        return SaveState("failed", f["code"], f["error"], f["at"])
    if row["state"] == "failed" and not _explained(row, saves):
        return SaveState("failed", None, row["error"])
    saved = baseline_at is not None or (own is not None and own.saved_at is not None)
    if row["active"]:
        if row["state"] == "saving":
            return SaveState("saving")
        return SaveState("saved" if saved else "starting")
    if saved:
        return SaveState("saved")
    if superseded(row):
        return SaveState("failed", SUPERSEDED_CODE, SUPERSEDED_ERROR)
    return SaveState("failed")  # ended before it saved this folder


def _explained(row: Row, saves: Sequence[FolderSave]) -> bool:
    """Whether the run's recorded failure is another folder's or a repository's."""
    error = row["error"]
    if isinstance(error, str) and error.startswith(_REPOSITORY_PREFIX):
        return True
    # A storage limit's refusal is never reported as a failure by fsagent.
    return any(s.failed and not s.over_limit for s in saves)


async def run_folder_baselines(
    conn: AsyncConnection[Any], run_id: str
) -> dict[tuple[str, str], datetime]:
    """When the run last saved a checkpoint of each folder, by (scope, owner)."""
    cur = await conn.execute(
        "SELECT f.scope, f.owner_id, b.updated_at FROM sync_baselines b"
        " JOIN folders f ON f.id = b.folder_id WHERE b.run_id = %s",
        (run_id,),
    )
    return {(r["scope"], r["owner_id"]): r["updated_at"] for r in await cur.fetchall()}


async def run_repo_saves(conn: AsyncConnection[Any], run_id: str) -> dict[str, Row]:
    """The run's newest checkpoint of each repository, by workspace id."""
    cur = await conn.execute(
        "SELECT DISTINCT ON (workspace_id) workspace_id, id, created_at FROM repo_checkpoints"
        " WHERE run_id = %s ORDER BY workspace_id, created_at DESC",
        (run_id,),
    )
    return {str(r["workspace_id"]): r for r in await cur.fetchall()}


async def record_uploads(
    conn: AsyncConnection[Any],
    run_id: str,
    company_id: str,
    sizes: dict[str, int],
    ensure_objects: Callable[[list[str]], Awaitable[None]],
    gc_delay: timedelta,
    ttl: float,
    stored_after: StoreMark | None = None,
) -> None:
    """Register objects a run uploaded, with a few multi-row statements: the
    objects' locks in digest order (the order every writer takes them), their
    rows, the bytes re-checked (``ensure_objects`` with the keys a sweep may
    have deleted since ``stored_after``, see :func:`foldercore.upsert_objects`; every
    key without a mark), the run's uploads and the GC journal.

    Each upload row pins its object for ``ttl`` seconds or, once a checkpoint
    commits it, while the run is running (the pin rule is in
    :mod:`controller.gc`); after that the object is collected unless a file
    references it."""
    digests = sorted(sizes)
    sizes_list = [sizes[d] for d in digests]
    await conn.execute(
        "SELECT pg_advisory_xact_lock(%s, hashtext(%s || ':' || d)) FROM"
        ' (SELECT d FROM unnest(%s::text[]) AS d ORDER BY d COLLATE "C") AS ordered',
        (foldercore.OBJECT_LOCK_CLASS, company_id, digests),
    )
    swept = await foldercore.upsert_objects(conn, company_id, sizes, stored_after)
    if swept:
        await ensure_objects([object_key(company_id, d) for d in swept])
    await conn.execute(
        "INSERT INTO run_uploads (run_id, company_id, digest, byte_size, expires_at)"
        " SELECT %s, %s, d, s, now() + make_interval(secs => %s)"
        " FROM unnest(%s::text[], %s::bigint[]) AS u(d, s)"
        " ON CONFLICT (run_id, digest) DO UPDATE"
        # Uploading an expired upload again makes it usable again.
        " SET created_at = now(), expires_at = EXCLUDED.expires_at"
        " WHERE run_uploads.committed_at IS NULL",
        (run_id, company_id, ttl, digests, sizes_list),
    )
    await foldercore.journal_deletion(conn, company_id, digests, "bridge upload", gc_delay)


async def record_upload(
    conn: AsyncConnection[Any],
    run_id: str,
    company_id: str,
    digest: str,
    byte_size: int,
    ensure_object: EnsureObject,
    gc_delay: timedelta,
    ttl: float,
    stored_after: StoreMark | None = None,
) -> None:
    """:func:`record_uploads` for one object."""

    async def ensure(keys: list[str]) -> None:
        for key in keys:
            await ensure_object(key)

    await record_uploads(
        conn, run_id, company_id, {digest: byte_size}, ensure, gc_delay, ttl, stored_after
    )


# --- starting and ending runs ----------------------------------------------------


@dataclass(frozen=True)
class StartedRun:
    run_id: str
    token: str
    """The run token, shown once: only its hash is stored."""
    lease_epoch: int
    sandbox: str
    bindings: dict[str, str | None]
    """``task``, ``agent``, ``user`` and ``project`` ids (None when unbound)."""
    env: dict[str, str]
    """The agent's environment variables naming its folders under ``home``."""
    repos: list[workspaces.Binding]
    """The task's repositories (its project's workspaces), oldest first."""


class Transact(Protocol):
    """Runs ``work(conn)`` in a transaction of its own and returns its result
    (the command line: a connection of its own; the API: the caller's
    authority checked again in each transaction)."""

    def __call__(self, work: Callable[[AsyncConnection[Any]], Awaitable[T]], /) -> Awaitable[T]: ...


async def start_bound_run(
    transact: Transact,
    company: str,
    *,
    agent: str,
    task: str | None = None,
    project: str | None = None,
    user: str | None = None,
    sandbox: str | None = None,
    home: str = DEFAULT_HOME,
) -> StartedRun:
    """``start-run`` and ``POST …/runs``: the task's repositories are bound in
    a transaction of their own (a binding is the task's, whether or not this
    run then starts, and no task or binding row stays locked while the start
    waits for an older run's save), then :func:`start_run` in another."""
    # Bad input is refused before anything is bound.
    company, agent = check_uuid(company, "company"), check_uuid(agent, "agent")
    task = check_uuid(task, "task") if task else None
    project = check_uuid(project, "project") if project else None
    user = check_uuid(user, "user") if user else None
    if sandbox is not None:
        check_sandbox_key(sandbox)
    check_home(home)
    repos: list[workspaces.Binding] = []
    if task is not None:
        task_id = task

        async def bind(conn: AsyncConnection[Any]) -> list[workspaces.Binding]:
            await task_project(conn, company, task_id)  # TaskNotFound, as the start says
            return await workspaces.bind_task(conn, company, task_id)

        repos = await transact(bind)

    async def start(conn: AsyncConnection[Any]) -> StartedRun:
        return await start_run(
            conn, company, agent=agent, task=task, project=project, user=user,
            sandbox=sandbox, home=home, repos=repos,
        )  # fmt: skip

    started = await transact(start)
    # Then the run is prepared (the agent's entry exists, the task's
    # attachments have their working copies), before any sandbox uses it. A
    # run that cannot be prepared is ended again: no sandbox starts half bound.
    try:
        await transact(lambda conn: runprep.prepare_run(conn, started.run_id))
    except Exception:
        await transact(lambda conn: end_run(conn, started.run_id))
        raise
    return started


def run_env(home: str, bindings: dict[str, str | None]) -> dict[str, str]:
    """The folder variables of the agent's environment: each bound folder's
    mount point under the sandbox's ``$HOME`` (the repositories' variables
    come from :func:`workspaces.run_env`, only when the task binds some, as
    the env file fsagent writes has them)."""
    home_dir = PurePosixPath(home)
    env = {
        "AGENT_HOME": str(home_dir / "agent"),
        "PAPERCLIP_AGENT_DIR": str(home_dir / "agent"),
    }
    if bindings["task"]:
        env["PAPERCLIP_TASK_DIR"] = str(home_dir / "task")
    if bindings["user"]:
        env["PAPERCLIP_USER_DIR"] = str(home_dir / "user")
    if bindings["project"]:
        env["PAPERCLIP_PROJECT_DIR"] = str(home_dir / "project")
    return env


def check_home(value: str) -> str:
    """The sandbox's ``$HOME``: an absolute path, one line under the text rule."""
    if not value.startswith("/") or len(value) > MAX_HOME_CHARS:
        raise ValidationError.single(
            "home",
            "invalid_home",
            f"home must be an absolute path of at most {MAX_HOME_CHARS} characters",
        )
    return check_text(value, "home", MAX_HOME_CHARS)


def check_sandbox_key(key: str) -> str:
    if not 1 <= len(key) <= MAX_SANDBOX_KEY_CHARS:
        raise ValidationError.single(
            "sandbox", "invalid_sandbox", "sandbox key must be 1-256 characters"
        )
    return check_text(key, "sandbox", MAX_SANDBOX_KEY_CHARS)


async def start_run(
    conn: AsyncConnection[Any],
    company: str,
    *,
    agent: str,
    task: str | None = None,
    project: str | None = None,
    user: str | None = None,
    sandbox: str | None = None,
    home: str = DEFAULT_HOME,
    repos: list[workspaces.Binding] | None = None,
) -> StartedRun:
    """Bind a run to its folders and take a new lease for its sandbox, in the
    caller's transaction (``repos``: the task's repository bindings, made by
    :func:`start_bound_run`).

    The new lease epoch is one above every earlier run of the same sandbox,
    and those runs end in the same transaction: their tokens answer 401 from
    the next request, and a checkpoint of theirs still in flight is refused
    at its commit (fencing). A task's project is bound with it.
    """
    company, agent = check_uuid(company, "company"), check_uuid(agent, "agent")
    task = check_uuid(task, "task") if task else None
    project = check_uuid(project, "project") if project else None
    user = check_uuid(user, "user") if user else None
    sandbox_key = check_sandbox_key(sandbox or f"sandbox-{uuid.uuid4()}")
    run_id = str(uuid.uuid4())
    token = new_token(RUN_TOKEN_PREFIX)
    await require_agent(conn, company, agent)
    if task:
        task_in = await task_project(conn, company, task)
        if project is None:
            project = task_in
        elif project != task_in:
            raise ValidationError.single(
                "projectId",
                "task_project_mismatch",
                f"task {task} belongs to project {task_in}, not {project}",
            )
    if project:
        await require_project(conn, company, project)
    if user:
        cur = await conn.execute(
            "SELECT 1 FROM memberships WHERE company_id = %s AND user_id = %s FOR SHARE",
            (company, user),
        )
        if await cur.fetchone() is None:
            raise MemberNotFound(f"user {user} is not a member of company {company}")
    # Serialize lease changes per sandbox; the new epoch fences every older one.
    # Two keys: never the same lock as a folder's one-key lock (its id).
    await conn.execute(
        "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
        (LEASE_LOCK_CLASS, f"{company}:{sandbox_key}"),
    )
    cur = await conn.execute(
        "SELECT coalesce(max(lease_epoch), 0) AS e FROM runs"
        " WHERE company_id = %s AND sandbox_key = %s",
        (company, sandbox_key),
    )
    row = await cur.fetchone()
    epoch = int(row["e"] if row else 0) + 1
    await _end_runs(
        conn,
        "company_id = %s AND sandbox_key = %s AND active",
        (company, sandbox_key),
        reason=f"superseded by run {run_id}",
    )
    await conn.execute(
        "INSERT INTO runs (id, company_id, agent_id, task_id, project_id, user_id,"
        " sandbox_key, lease_epoch, token_hash) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)",
        (run_id, company, agent, task, project, user, sandbox_key, epoch, token_hash(token)),
    )
    bindings = {"task": task, "agent": agent, "user": user, "project": project}
    repos = list(repos or [])
    env = run_env(home, bindings) | workspaces.run_env(repos, PurePosixPath(home))
    return StartedRun(run_id, token, epoch, sandbox_key, bindings, env, repos)


async def _end_runs(
    conn: AsyncConnection[Any], where: str, params: tuple[Any, ...], *, reason: str
) -> int:
    # A run that ends while a save is in flight did not save: say so.
    cur = await conn.execute(
        "UPDATE runs SET active = false, ended_at = now(),"
        " state = CASE WHEN state = 'saving' THEN 'failed' ELSE state END,"
        " error = CASE WHEN state = 'saving' THEN %s ELSE error END"
        f" WHERE {where}",
        (f"run ended while a save was in progress ({reason})", *params),
    )
    return cur.rowcount


async def end_run(conn: AsyncConnection[Any], run: str, *, company: str | None = None) -> Row:
    """End a run (its token answers 401 from the next request; a write in
    flight, which holds the run row, lands before this). Ending an ended run
    changes nothing. ``company`` limits this to that company's runs."""
    run = check_uuid(run, "run")
    found = await get_run(conn, run, company=company)
    if found["active"]:
        await _end_runs(conn, "id = %s AND active", (run,), reason="ended by operator")
        found = await get_run(conn, run, company=company)
    return found


async def get_run(conn: AsyncConnection[Any], run: str, *, company: str | None = None) -> Row:
    """The run's record (never its token), with ``newest_epoch``: the newest
    lease of its sandbox (a run below it was superseded)."""
    run = check_uuid(run, "run")
    cur = await conn.execute(
        "SELECT r.*, (SELECT max(lease_epoch) FROM runs o WHERE o.company_id = r.company_id"
        "  AND o.sandbox_key = r.sandbox_key) AS newest_epoch"
        " FROM runs r WHERE r.id = %s AND (%s::uuid IS NULL OR r.company_id = %s::uuid)",
        (run, company, company),
    )
    row: Row | None = await cur.fetchone()
    if row is None:
        raise RunNotFound(f"no such run: {run}")
    return row


@dataclass(frozen=True)
class RunFilter:
    active: bool | None = None
    agent: str | None = None
    task: str | None = None
    sandbox: str | None = None


async def list_runs(
    conn: AsyncConnection[Any],
    company: str,
    match: RunFilter,
    *,
    limit: int,
    before: tuple[datetime, str] | None = None,
) -> list[Row]:
    """The company's runs, newest first (``started_at``, then id, both
    descending), at most ``limit`` after the keyset ``before``."""
    started, last_id = before if before is not None else (None, None)
    cur = await conn.execute(
        "SELECT r.*, (SELECT max(lease_epoch) FROM runs o WHERE o.company_id = r.company_id"
        "  AND o.sandbox_key = r.sandbox_key) AS newest_epoch"
        " FROM runs r WHERE r.company_id = %(company)s"
        " AND (%(active)s::boolean IS NULL OR r.active = %(active)s::boolean)"
        " AND (%(agent)s::uuid IS NULL OR r.agent_id = %(agent)s::uuid)"
        " AND (%(task)s::uuid IS NULL OR r.task_id = %(task)s::uuid)"
        " AND (%(sandbox)s::text IS NULL OR r.sandbox_key = %(sandbox)s::text)"
        " AND (%(started)s::timestamptz IS NULL"
        "      OR (r.started_at, r.id) < (%(started)s::timestamptz, %(last_id)s::uuid))"
        " ORDER BY r.started_at DESC, r.id DESC LIMIT %(limit)s",
        {
            "company": company,
            "active": match.active,
            "agent": match.agent,
            "task": match.task,
            "sandbox": match.sandbox,
            "started": started,
            "last_id": last_id,
            "limit": limit,
        },
    )
    return list(await cur.fetchall())
