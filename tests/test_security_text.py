"""The text rule (common/text.py) at every entry point: operation ids and the
free text a sandbox or a person sends answer 400 with a stable code, never
500, and nothing of them is stored."""

from __future__ import annotations

import uuid

import httpx

from tests.support.bridge import start_run
from tests.support.controller import Tenant


def text_refusal(r: httpx.Response, field: str) -> str:
    """The detail code of a 400 ``invalid_text`` naming ``field``."""
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == "invalid_text", body
    (detail,) = body["details"]
    assert detail["field"] == field, body
    return str(detail["code"])


def receipts_of(tenant: Tenant, run_id: str) -> list[tuple[str | None, str]]:
    with tenant.controller.db() as db:
        rows = db.execute(
            "SELECT operation_id, code FROM save_receipts WHERE run_id = %s ORDER BY id",
            (run_id,),
        ).fetchall()
    return [(r[0], r[1]) for r in rows]


# --- operation ids ------------------------------------------------------------


def test_nul_in_a_checkpoint_operation_id_is_400_not_500(tenant: Tenant) -> None:
    run = start_run(tenant)
    for bad in ("op\u0000id", "\u0000", "op\u202eid", "op\u001b[31mid"):
        r = run.commit("task", [{"op": "mkdir", "path": "d"}], operationId=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["code"] == "validation_error"
        assert [d["field"] for d in r.json()["details"]] == ["operationId"], r.text
    assert tenant.file_rows("d") == 0
    # Each refusal left its receipt, without the id that is no id.
    assert receipts_of(tenant, run.run_id) == [(None, "VALIDATION_ERROR")] * 4
    ok = run.commit("task", [{"op": "mkdir", "path": "d"}], operationId=f"op-{uuid.uuid4()}")
    assert ok.status_code == 200, ok.text


def test_nul_in_a_reported_operation_id_is_400(tenant: Tenant) -> None:
    run = start_run(tenant)
    with run.client() as c:
        r = c.post(
            "/run/report",
            json={"state": "failed", "error": "x", "scope": "task", "operationId": "a\u0000b"},
        )
    assert text_refusal(r, "operationId") == "control_character"
    assert receipts_of(tenant, run.run_id) == []
