"""The API bridge's audit trail: one row per request sandbox code made through
``/bridge/v1/api/...`` (written by ``controller/api/apibridge.py``), read by
``controller admin audit`` and ``GET /api/companies/{companyId}/runs/{runId}/audit``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

AUDIT_PAGE_MAX = 1000
"""Most rows one read returns; page on with ``after``."""

_COLUMNS = (
    "id, at, run_id, agent_id, lease_epoch, method, route, status,"
    " request_bytes, response_bytes, duration_ms"
)
LIST_SQL = f"SELECT {_COLUMNS} FROM bridge_audit WHERE run_id = %s AND id > %s ORDER BY id LIMIT %s"
"""The run's rows after one id, oldest first (shared with the admin command)."""


@dataclass(frozen=True)
class AuditRecord:
    run_id: str
    company_id: str
    agent_id: str
    lease_epoch: int
    method: str
    route: str | None
    status: int
    request_bytes: int
    response_bytes: int
    duration_ms: int


async def record(conn: AsyncConnection[Any], rec: AuditRecord) -> None:
    await conn.execute(
        "INSERT INTO bridge_audit (run_id, company_id, agent_id, lease_epoch, method, route,"
        " status, request_bytes, response_bytes, duration_ms)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            rec.run_id,
            rec.company_id,
            rec.agent_id,
            rec.lease_epoch,
            rec.method,
            rec.route,
            rec.status,
            rec.request_bytes,
            rec.response_bytes,
            rec.duration_ms,
        ),
    )


async def run_company(conn: AsyncConnection[Any], run_id: str) -> str | None:
    cur = await conn.execute("SELECT company_id FROM runs WHERE id = %s", (run_id,))
    row = await cur.fetchone()
    return None if row is None else str(row["company_id"])


async def list_for_run(
    conn: AsyncConnection[Any], run_id: str, after: int, limit: int
) -> list[dict[str, Any]]:
    cur = await conn.execute(LIST_SQL, (run_id, after, limit))
    return [row_json(r) for r in await cur.fetchall()]


def row_json(row: dict[str, Any]) -> dict[str, Any]:
    """The stable JSON shape of one audit row (API and admin command alike)."""
    return {
        "id": int(row["id"]),
        "at": row["at"].isoformat().replace("+00:00", "Z"),
        "runId": str(row["run_id"]),
        "agentId": str(row["agent_id"]),
        "leaseEpoch": int(row["lease_epoch"]),
        "method": row["method"],
        "route": row["route"],
        "status": int(row["status"]),
        "requestBytes": int(row["request_bytes"]),
        "responseBytes": int(row["response_bytes"]),
        "durationMs": int(row["duration_ms"]),
    }
