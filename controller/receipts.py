"""Save receipts and a run's current warnings: the run history people read.

Every save attempt of a run leaves one ``save_receipts`` row: a checkpoint
the controller applied (``saved``, in the checkpoint's own transaction),
refused (``refused`` with the error's code in upper case, e.g.
``AGENT_FILES_LIMIT_EXCEEDED``) or failed on its side (``failed``), and the
failure fsagent reports after its last attempt at the stop boundary. Rows
are only ever added: a later success never erases an earlier failure.

A run's *current* warnings (``runs.warnings``, one array per folder scope)
are replaced by each receipt of that folder, and set for the agent folder
when the run first asks who it is (``GET /bridge/v1/run``): a folder at or
over a limit warns on each run until it is back under. They are diagnostics
of the run, never errors on the current files.

A run's *save state of a folder* (:func:`folder_saves`) is read from its
receipts of that folder: a refusal or failure stands until a later receipt
of the same folder says ``saved``, whatever the run's other folders did.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from psycopg import AsyncConnection

from common.errors import (
    MembershipRevoked,
    NotFound,
    StaleLease,
    UnknownContent,
    WorkFolderError,
    WriteNotAllowed,
)
from common.text import escape_text
from controller.auth import Principal, membership_role
from controller.grants import ALL_AGENTS_ROLES, may_configure_agent
from controller.rowjson import iso

MAX_ERROR_CHARS = 2000
RECEIPTS_PAGE_MAX = 1000

LIMIT_REFUSED: Final = "AGENT_FILES_LIMIT_EXCEEDED"
"""A refusal over an agent folder's storage limit: that save did not happen,
but it is a warning of the run, which goes on."""
FAILS_THE_RUN: Final[tuple[type[WorkFolderError], ...]] = (
    MembershipRevoked,
    NotFound,
    StaleLease,
    UnknownContent,
    WriteNotAllowed,
)
"""Refusals of a checkpoint that leave the run failed (the run's authority or
its uploads are gone, so its next saves would be refused as well); other
refusals fail that folder's save only."""
RUN_FAILURE_CODES: Final = frozenset({cls.code.upper() for cls in FAILS_THE_RUN} | {"SAVE_FAILED"})
"""Receipt codes of :data:`FAILS_THE_RUN`, and fsagent's own explicit failure."""

_RECEIPT_COLUMNS = (
    "id, run_id, scope, owner_id, operation_id, outcome, code, error, details, warnings,"
    " refused_entries, files_changed, final, at"
)


def _storable(value: Any) -> Any:
    """A refusal's details may quote what the client sent (an unexpected
    field's name): escaped under the text rule, so that PostgreSQL can store
    them (jsonb holds no NUL: the receipt, and the answer, would fail with a
    500) and a person reads them as sent."""
    if isinstance(value, str):
        return escape_text(value)
    if isinstance(value, list):
        return [_storable(v) for v in value]
    if isinstance(value, dict):
        return {escape_text(str(k)): _storable(v) for k, v in value.items()}
    return value


async def record(
    conn: AsyncConnection[Any],
    *,
    run_id: str,
    company_id: str,
    scope: str,
    owner_id: str,
    operation_id: str | None,
    outcome: str,
    code: str | None = None,
    error: str | None = None,
    details: list[Any] | None = None,
    warnings: list[dict[str, Any]] | None = None,
    refused_entries: list[dict[str, Any]] | None = None,
    files_changed: int = 0,
    final: bool = False,
) -> int:
    """Add one receipt; the folder's current warnings of the run become its warnings."""
    cur = await conn.execute(
        "INSERT INTO save_receipts (run_id, company_id, scope, owner_id, operation_id, outcome,"
        " code, error, details, warnings, refused_entries, files_changed, final)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
        (
            run_id,
            company_id,
            scope,
            owner_id,
            operation_id,
            outcome,
            code,
            escape_text(error[:MAX_ERROR_CHARS]) if error else None,
            None if details is None else json.dumps(_storable(details)),
            json.dumps(warnings or []),
            json.dumps(refused_entries or []),
            files_changed,
            final,
        ),
    )
    row = await cur.fetchone()
    assert row is not None
    await set_warnings(conn, run_id, scope, warnings or [])
    return int(row["id"])


async def set_warnings(
    conn: AsyncConnection[Any], run_id: str, scope: str, warnings: list[dict[str, Any]]
) -> None:
    await conn.execute(
        "UPDATE runs SET warnings = warnings || jsonb_build_object(%s::text, %s::jsonb)"
        " WHERE id = %s",
        (scope, json.dumps(warnings), run_id),
    )


async def warnings_known(conn: AsyncConnection[Any], run_id: str, scope: str) -> bool:
    cur = await conn.execute(
        "SELECT warnings ? %s AS known FROM runs WHERE id = %s", (scope, run_id)
    )
    row = await cur.fetchone()
    return bool(row and row["known"])


def receipt_json(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": int(row["id"]),
        "runId": str(row["run_id"]),
        "scope": row["scope"],
        "ownerId": row["owner_id"],
        "operationId": row["operation_id"],
        "outcome": row["outcome"],
        "code": row["code"],
        "error": row["error"],
        "details": row["details"],
        "warnings": row["warnings"],
        "refusedEntries": row["refused_entries"],
        "filesChanged": int(row["files_changed"]),
        "final": bool(row["final"]),
        "at": iso(row["at"]),
    }


async def list_for_run(
    conn: AsyncConnection[Any], run_id: str, after: int, limit: int
) -> list[dict[str, Any]]:
    """The run's receipts, oldest first, after the receipt id ``after``."""
    cur = await conn.execute(
        f"SELECT {_RECEIPT_COLUMNS} FROM save_receipts WHERE run_id = %s AND id > %s"
        " ORDER BY id LIMIT %s",
        (run_id, after, limit),
    )
    return [receipt_json(r) for r in await cur.fetchall()]


async def run_row(
    conn: AsyncConnection[Any], company_id: str, run_id: str
) -> dict[str, Any] | None:
    cur = await conn.execute(
        "SELECT * FROM runs WHERE company_id = %s AND id = %s", (company_id, run_id)
    )
    row: dict[str, Any] | None = await cur.fetchone()
    return row


async def receipt_counts(conn: AsyncConnection[Any], run_id: str) -> dict[str, int]:
    cur = await conn.execute(
        "SELECT outcome, count(*) AS n FROM save_receipts WHERE run_id = %s GROUP BY outcome",
        (run_id,),
    )
    counts = {"saved": 0, "refused": 0, "failed": 0}
    counts.update({r["outcome"]: int(r["n"]) for r in await cur.fetchall()})
    return counts


async def may_read_run(
    conn: AsyncConnection[Any], principal: Principal, company_id: str, run: dict[str, Any]
) -> bool:
    """A run's history is for the company's owners and admins, the run's
    responsible user and the members who may configure its agent; runs read
    no run history."""
    if principal.kind != "user" or principal.user_id is None:
        return False
    role = await membership_role(conn, company_id, principal.user_id)
    if role is None:
        return False
    if role in ALL_AGENTS_ROLES or str(run["user_id"]) == principal.user_id:
        return True
    return await may_configure_agent(
        conn, company_id, principal.user_id, str(run["agent_id"]), role
    )


@dataclass(frozen=True)
class FolderSave:
    """A run's saves of one folder, as its receipts tell them."""

    scope: str
    owner_id: str
    saved_at: datetime | None
    """The newest receipt that says ``saved`` (a checkpoint, or an API write of
    the agent folder)."""
    failure: dict[str, Any] | None
    """The newest receipt when it is a refusal or a failure (``outcome``,
    ``code``, ``error``, ``at``): it stands until a later save of the folder
    succeeds. None when the newest attempt saved."""
    stopped_at: datetime | None = None
    """When the sandbox stopped with this folder: the newest receipt is its
    final save's (saved, refused, or the failure fsagent reports when it
    gives up at the stop boundary). None while a later save may come."""

    @property
    def failed(self) -> bool:
        """A save of the folder failed and none succeeded since."""
        return self.failure is not None

    @property
    def over_limit(self) -> bool:
        """The standing failure is a storage limit's refusal: a warning of the run."""
        return self.failure is not None and self.failure["code"] == LIMIT_REFUSED

    @property
    def fails_the_run(self) -> bool:
        """The standing failure makes the run a failed one (:data:`RUN_FAILURE_CODES`)."""
        return self.failure is not None and self.failure["code"] in RUN_FAILURE_CODES


async def folder_saves(
    conn: AsyncConnection[Any], run_ids: Sequence[str]
) -> dict[str, list[FolderSave]]:
    """Each run's folders that have receipts, by run id: the newest receipt of
    each folder and the time of its newest successful one."""
    if not run_ids:
        return {}
    # One pass over the runs' receipts (index save_receipts_run), then each
    # folder's newest receipt by its id.
    cur = await conn.execute(
        "WITH g AS (SELECT run_id, scope, owner_id, max(id) AS last_id,"
        "  max(at) FILTER (WHERE outcome = 'saved') AS saved_at"
        "  FROM save_receipts WHERE run_id = ANY(%s::uuid[]) GROUP BY run_id, scope, owner_id)"
        " SELECT g.run_id, g.scope, g.owner_id, g.saved_at, s.outcome, s.code, s.error, s.at,"
        " s.final"
        " FROM g JOIN save_receipts s ON s.id = g.last_id",
        (list(run_ids),),
    )
    out: dict[str, list[FolderSave]] = {}
    for r in await cur.fetchall():
        failure = None
        if r["outcome"] != "saved":
            failure = {k: r[k] for k in ("outcome", "code", "error", "at")}
        stopped_at = r["at"] if r["final"] else None
        save = FolderSave(r["scope"], r["owner_id"], r["saved_at"], failure, stopped_at)
        out.setdefault(str(r["run_id"]), []).append(save)
    return out
