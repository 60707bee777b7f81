"""The text rule (common/text.py) at every entry point: operation ids and the
free text a sandbox or a person sends answer 400 with a stable code, never
500, and nothing of them is stored."""

from __future__ import annotations

import uuid

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from common.text import MAX_ERROR_CHARS, check_text, clean_text
from fsagent.bridge.http import HttpBridgeClient
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


def test_nul_in_a_field_name_is_400_and_its_receipt_is_kept_escaped(tenant: Tenant) -> None:
    """A refusal's details quote the unexpected field's name; a NUL in it could
    not be stored in the receipt's jsonb (500)."""
    run = start_run(tenant)
    r = run.commit("task", [{"op": "mkdir", "path": "d"}], **{"a\u0000\u202eb": 1})
    assert r.status_code == 400, r.text
    assert r.json()["details"][0]["field"] == "a\u0000\u202eb"
    with tenant.controller.db() as db:
        row = db.execute(
            "SELECT details FROM save_receipts WHERE run_id = %s", (run.run_id,)
        ).fetchone()
    assert row is not None and row[0][0]["field"] == "a\\x00\\u202eb"
    # The same through the API bridge, where sandbox code writes its agent folder.
    agent_folder = tenant.folder("agent", run.agent)
    with run.api_client() as c:
        r = c.post(
            agent_folder + "/operations", json={"action": "mkdir", "path": "x", "b\u0000": 1}
        )
    assert r.status_code == 400, r.text
    assert receipts_of(tenant, run.run_id)[-1] == (None, "VALIDATION_ERROR")


def test_nul_in_a_reported_operation_id_is_400(tenant: Tenant) -> None:
    run = start_run(tenant)
    with run.client() as c:
        r = c.post(
            "/run/report",
            json={"state": "failed", "error": "x", "scope": "task", "operationId": "a\u0000b"},
        )
    assert text_refusal(r, "operationId") == "control_character"
    assert receipts_of(tenant, run.run_id) == []


# --- errors a sandbox reports ---------------------------------------------------

HOSTILE = {
    "ansi": "save failed \x1b[2J\x1b[31mall good\x1b[0m",
    "bidi": "error in \u202etxt.exe",
    "isolate": "error \u2067hidden\u2069",
    "nul": "a\x00b",
    "carriage return": "line\rover",
    "invisible": "zero\u200bwidth",
}


def run_row(tenant: Tenant, run_id: str) -> tuple[str, str | None]:
    with tenant.controller.db() as db:
        row = db.execute("SELECT state, error FROM runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return row[0], row[1]


def test_hostile_text_in_a_run_report_is_400_and_stores_nothing(tenant: Tenant) -> None:
    run = start_run(tenant)
    with run.client() as c:
        for name, error in HOSTILE.items():
            for body in (
                {"state": "failed", "error": error},
                {"state": "failed", "error": error, "scope": "task", "operationId": "op-1"},
            ):
                r = c.post("/run/report", json=body)
                assert text_refusal(r, "error") in (
                    "control_character",
                    "bidi_control",
                    "invisible_character",
                ), name
        r = c.post("/run/report", json={"state": "failed", "error": "x" * 4097})
        assert text_refusal(r, "error") == "too_long"
        assert run_row(tenant, run.run_id) == ("starting", None)
        assert receipts_of(tenant, run.run_id) == []
        # Lines and tabs are what an error may hold, and they are kept as sent.
        multi = "final save given up:\n\tHTTP 503 storage_unavailable"
        r = c.post("/run/report", json={"state": "failed", "error": multi, "scope": "task"})
        assert r.status_code == 200, r.text
    assert run_row(tenant, run.run_id) == ("failed", multi)


def test_hostile_text_in_a_repository_report_is_400(tenant: Tenant) -> None:
    from tests.support.repos import repo_run

    run = repo_run(tenant)
    ws = run.ws()
    url = f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos"
    with run.client() as c:
        for name, error in HOSTILE.items():
            r = c.post(f"/repos/{ws}/report", json={"state": "failed", "error": error})
            assert text_refusal(r, "error") != "too_long", name
        ok = c.post(f"/repos/{ws}/report", json={"state": "failed", "error": "index.lock\nheld"})
        assert ok.status_code == 200, ok.text
    with tenant.client() as c:
        (repo,) = c.get(url).json()["repos"]
    assert (repo["state"], repo["error"]) == ("failed", "index.lock\nheld")


# --- names and titles people give ---------------------------------------------------


def count(tenant: Tenant, table: str) -> int:
    with tenant.controller.db() as db:
        row = db.execute(
            f"SELECT count(*) FROM {table} WHERE company_id = %s", (tenant.company_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_bidi_controls_in_names_and_titles_are_400(tenant: Tenant) -> None:
    b = f"/api/companies/{tenant.company_id}"
    with tenant.client() as c:
        project = c.post(b + "/projects", json={"name": "p"}).json()["id"]
        agents, tasks = count(tenant, "agents"), count(tenant, "tasks")
        for bad, code in (
            ("helper\u202egnp.exe", "bidi_control"),
            ("a\u2067b\u2069", "bidi_control"),
            ("a\u200fb", "bidi_control"),
            ("a\u061cb", "bidi_control"),
            ("\x1b[31mred", "control_character"),
            ("a\u0085b", "control_character"),
            ("a\u2028b", "invisible_character"),
            ("tag\U000e0041", "invisible_character"),
        ):
            assert text_refusal(c.post(b + "/agents", json={"name": bad}), "name") == code
            r = c.post(b + "/tasks", json={"projectId": project, "title": bad})
            assert text_refusal(r, "title") == code
            assert text_refusal(c.post(b + "/projects", json={"name": bad}), "name") == code
            r = c.post(b + "/operator-tokens", json={"name": bad})
            assert text_refusal(r, "name") == code
        assert (count(tenant, "agents"), count(tenant, "tasks")) == (agents, tasks)
        # Joiners, accents and other scripts are names like any other.
        for good in ("Zoë 👩\u200d💻", "مساعد\u200cبرنامه", "日本語\u3000エージェント"):
            r = c.post(b + "/agents", json={"name": good})
            assert r.status_code == 201 and r.json()["name"] == good, r.text


def test_the_command_line_refuses_the_same_names(tenant: Tenant) -> None:
    ctl = tenant.controller
    code, _, err = ctl.cli("admin", "create-agent", tenant.company_id, "x\u202ey", "--json")
    assert code != 0 and "bidirectional" in err, err
    code, _, err = ctl.cli(
        "admin", "bootstrap", "--company-name", "co\u2067", "--email", "e@example.com", "--json"
    )
    assert code != 0 and "bidirectional" in err, err
    project = ctl.admin("create-project", tenant.company_id, "p")["id"]
    code, _, err = ctl.cli("admin", "create-task", tenant.company_id, project, "t\u202e", "--json")
    assert code != 0 and "bidirectional" in err, err
    assert count(tenant, "tasks") == 0


def test_run_and_workspace_text_follows_the_rule(tenant: Tenant) -> None:
    b = f"/api/companies/{tenant.company_id}"
    with tenant.client() as c:
        agent = c.post(b + "/agents", json={"name": "a"}).json()["id"]
        project = c.post(b + "/projects", json={"name": "p"}).json()["id"]
        task = c.post(b + "/tasks", json={"projectId": project, "title": "t"}).json()["id"]
        for field, value in (("sandbox", "box\u202e"), ("home", "/home/\u2066agent")):
            r = c.post(b + "/runs", json={"agentId": agent, field: value})
            assert text_refusal(r, field) == "bidi_control"
        ws = f"{b}/projects/{project}/workspaces"
        r = c.post(ws, json={"repoUrl": "https://h/\u202ea.git"})
        assert text_refusal(r, "repoUrl") == "bidi_control"
        r = c.post(ws, json={"repoUrl": "https://h/a.git", "setupCommand": "make\n# \u202e x"})
        assert text_refusal(r, "setupCommand") == "bidi_control"
        r = c.post(ws, json={"repoUrl": "https://h/a.git", "setupCommand": "make\n\tmake test"})
        assert r.status_code == 201, r.text
        r = c.put(f"{b}/tasks/{task}/branch", json={"branch": "fix\u202e"})
        assert r.status_code == 400 and r.json()["details"][0]["field"] == "branch", r.text
        # A pattern's "$" also matches before a final newline: names are matched whole.
        r = c.post(ws, json={"repoUrl": "https://h/b.git", "name": "app\n"})
        assert r.status_code == 400 and r.json()["details"][0]["field"] == "name", r.text


def test_a_digest_with_a_final_newline_is_no_digest(tenant: Tenant) -> None:
    run = start_run(tenant)
    entry = {"op": "put", "path": "f", "digest": "a" * 64 + "\n", "executable": False}
    r = run.commit("task", [entry])
    assert r.status_code == 400 and r.json()["details"][0]["code"] == "invalid_digest", r.text


# --- the sender's side: fsagent reports any error it has ----------------------------


@given(st.text(max_size=5000))
def test_cleaned_text_always_follows_the_rule(text: str) -> None:
    cleaned = clean_text(text)
    check_text(cleaned, "error", MAX_ERROR_CHARS, multiline=True)
    if len(text) <= 1000 and all(ch.isprintable() or ch in "\n\t" for ch in text) and text.strip():
        assert cleaned == text  # nothing to clean: sent as it is


@pytest.mark.trio
async def test_fsagent_reports_an_error_with_escapes_and_overrides(tenant: Tenant) -> None:
    run = start_run(tenant)
    client = HttpBridgeClient(tenant.controller.url, run.token, retry_deadline=5)
    try:
        await client.report_state("failed", "git: \x1b[31mfatal\x1b[0m in \u202etxt.exe\x00")
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()
    assert run_row(tenant, run.run_id) == (
        "failed",
        "git: \\x1b[31mfatal\\x1b[0m in \\u202etxt.exe\\x00",
    )
