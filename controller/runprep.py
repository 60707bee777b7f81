"""A run's preparation on the controller, before its sandbox starts
(``controller admin start-run``): the agent's instruction entry exists, and
the task's attachments have their working copies in the task folder."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from common.errors import RunNotFound
from controller import agentfiles, attachments


async def prepare_run(conn: AsyncConnection[Any], run_id: str) -> dict[str, Any]:
    cur = await conn.execute(
        "SELECT company_id, agent_id, task_id FROM runs WHERE id = %s", (run_id,)
    )
    run = await cur.fetchone()
    if run is None:
        raise RunNotFound()
    company = str(run["company_id"])
    created = await agentfiles.ensure_entry(conn, company, str(run["agent_id"]))
    copies = []
    if run["task_id"] is not None:
        copies = await attachments.materialize(conn, company, str(run["task_id"]))
    return {"agentEntryCreated": created, "attachments": copies}
