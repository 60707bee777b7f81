"""A checkpoint's ``localRefusals`` (the paths dir mode's scan refused in the
sandbox): untrusted input checked before anything applies, and the save
receipt's ``refusedEntries`` with ``"by": "sandbox"``.

The dir-mode daemon sending them is tested in tests/fsagent/test_fsagent_dirmode.py.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from common.bridge import MAX_LOCAL_REFUSAL_PATH, MAX_LOCAL_REFUSALS
from common.errors import ValidationError
from controller.checkpoint import parse_checkpoint
from fsagent.dirmode.scan import DirScan, local_refusals, shown_name
from tests.support.agentfiles import run_receipts
from tests.support.bridge import start_run
from tests.support.controller import Tenant
from tests.system.test_checkpoints import server_files

BASE: dict[str, Any] = {"operationId": "op-1", "leaseEpoch": 1, "entries": []}

HOSTILE: list[tuple[dict[str, Any], str, str]] = [
    ({"localRefusals": {"path": "a", "code": "symlink"}}, "localRefusals", "invalid"),
    ({"localRefusals": "symlink"}, "localRefusals", "invalid"),
    (
        {"localRefusals": [{"path": "a", "code": "symlink"}] * (MAX_LOCAL_REFUSALS + 1)},
        "localRefusals",
        "too_many",
    ),
    (
        {"localRefusals": [{"path": "a", "code": "SYMLINK"}]},
        "localRefusals[0].code",
        "invalid_code",
    ),
    ({"localRefusals": [{"path": "a", "code": "gone"}]}, "localRefusals[0].code", "invalid_code"),
    ({"localRefusals": [{"path": "a", "code": 7}]}, "localRefusals[0].code", "invalid_code"),
    ({"localRefusals": [{"path": "a"}]}, "localRefusals[0]", "invalid_fields"),
    (
        {"localRefusals": [{"path": "a", "code": "symlink", "message": "x"}]},
        "localRefusals[0]",
        "invalid_fields",
    ),
    ({"localRefusals": ["a"]}, "localRefusals[0]", "invalid_fields"),
    (
        {"localRefusals": [{"path": "../etc/passwd", "code": "symlink"}]},
        "localRefusals[0].path",
        "",
    ),
    ({"localRefusals": [{"path": "/etc/passwd", "code": "symlink"}]}, "localRefusals[0].path", ""),
    ({"localRefusals": [{"path": 5, "code": "special_file"}]}, "localRefusals[0].path", ""),
    ({"localRefusals": [{"path": "a\tb", "code": "symlink"}]}, "localRefusals[0].path", ""),
    ({"localRefusals": [{"path": "", "code": "invalid_name"}]}, "localRefusals[0].path", "invalid"),
    (
        {"localRefusals": [{"path": "a\x00", "code": "invalid_name"}]},
        "localRefusals[0].path",
        "invalid",
    ),
    (
        {"localRefusals": [{"path": "\udcff", "code": "invalid_name"}]},
        "localRefusals[0].path",
        "invalid",
    ),
    (
        {"localRefusals": [{"path": "x" * (MAX_LOCAL_REFUSAL_PATH + 1), "code": "invalid_name"}]},
        "localRefusals[0].path",
        "invalid",
    ),
    (
        {"localRefusals": [{"path": ["a"], "code": "invalid_name"}]},
        "localRefusals[0].path",
        "invalid",
    ),
    ({"localRefusedMore": -1}, "localRefusedMore", "invalid"),
    ({"localRefusedMore": True}, "localRefusedMore", "invalid"),
    ({"localRefusedMore": "3"}, "localRefusedMore", "invalid"),
    ({"localRefusedMore": 1 << 40}, "localRefusedMore", "invalid"),
]


@pytest.mark.parametrize(("extra", "field", "code"), HOSTILE)
def test_parse_refuses_a_bad_local_refusal_list(
    extra: dict[str, Any], field: str, code: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        parse_checkpoint({**BASE, **extra})
    details = caught.value.details or []
    assert any(d["field"] == field and (not code or d["code"] == code) for d in details), details


def test_parse_takes_local_refusals_into_the_fingerprint() -> None:
    refusals = [
        {"path": "dir/link", "code": "symlink"},
        {"path": "tab\\tname", "code": "invalid_name"},
    ]
    cp = parse_checkpoint({**BASE, "localRefusals": refusals, "localRefusedMore": 3})
    assert cp.local_refusals == refusals and cp.local_refused_more == 3
    assert [(r["path"], r["code"], r["by"]) for r in cp.sandbox_refused()] == [
        ("dir/link", "symlink", "sandbox"),
        ("tab\\tname", "invalid_name", "sandbox"),
    ]
    plain = parse_checkpoint(BASE)
    assert plain.fingerprint() != cp.fingerprint()
    # A body without them keeps the fingerprint it always had.
    assert plain.fingerprint() == parse_checkpoint({**BASE, "localRefusals": []}).fingerprint()


def test_the_scan_lists_its_refusals_escaped_and_bounded() -> None:
    problems = {f"f{i:05}": "symlink" for i in range(MAX_LOCAL_REFUSALS + 5)}
    problems["bad\x01name"] = "invalid_name: path contains forbidden character U+0001"
    problems["latin\udce9"] = "invalid_name: not UTF-8"
    scan = DirScan(entries={}, problems=problems, unstable=set(), stable=True)
    body = local_refusals(scan)
    listed = body["localRefusals"]
    assert isinstance(listed, list) and len(listed) == MAX_LOCAL_REFUSALS
    assert listed[:2] == [
        {"path": "bad\\x01name", "code": "invalid_name"},
        {"path": "f00000", "code": "symlink"},
    ]
    assert body["localRefusedMore"] == 7
    assert shown_name("latin\udce9") == "latin\\xe9"
    # Whatever the scan sends, the controller takes.
    parse_checkpoint({**BASE, **body})


def test_receipt_names_the_sandbox_refusals_and_hostile_lists_apply_nothing(
    tenant: Tenant,
) -> None:
    run = start_run(tenant)
    assert run.task is not None
    refusals = [{"path": "fifo", "code": "special_file"}, {"path": "link", "code": "symlink"}]
    r = run.save("task", {"kept.txt": b"kept"}, localRefusals=refusals, localRefusedMore=2)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "refusedEntries" not in answer  # fsagent keeps only the controller's refusals dirty
    [receipt] = run_receipts(tenant, run.run_id)
    assert receipt["outcome"] == "saved" and receipt["filesChanged"] == 1
    assert [(e["path"], e["code"], e["by"]) for e in receipt["refusedEntries"]] == [
        ("fifo", "special_file", "sandbox"),
        ("link", "symlink", "sandbox"),
    ]
    [warning] = receipt["warnings"]
    assert warning["code"] == "SANDBOX_REFUSED" and warning["count"] == 4
    # A replay of the operation answers the same receipt and records no other.
    with run.client() as c:
        body = {
            "operationId": answer["operationId"],
            "leaseEpoch": run.lease_epoch,
            "final": False,
            "entries": [
                {
                    "op": "put",
                    "path": "kept.txt",
                    "digest": hashlib.sha256(b"kept").hexdigest(),
                    "executable": False,
                }
            ],
            "localRefusals": refusals,
            "localRefusedMore": 2,
        }
        again = c.post("/folders/task/checkpoints", json=body)
        assert again.status_code == 200, again.text
        assert again.json() == {**answer, "replayed": True}
        # The same id with other refusals is another body.
        other = c.post("/folders/task/checkpoints", json={**body, "localRefusedMore": 3})
        assert other.status_code == 409, other.text
        assert other.json()["code"] == "idempotency_conflict"
    assert len(run_receipts(tenant, run.run_id)) == 2  # the 409 is a refused receipt
    up = run.upload("task", b"never saved")
    assert up.status_code == 200, up.text
    put = {"op": "put", "path": "hostile.txt", "digest": up.json()["digest"], "executable": False}
    with run.client() as c:
        for extra, field, _ in HOSTILE:
            hostile = {
                **body,
                "operationId": f"hostile-{field}-{len(str(extra))}",
                "entries": [put],
            }
            # Escaped JSON: a lone surrogate travels as \udcff, as a hostile sandbox may send it.
            raw = json.dumps({**hostile, **extra})
            r = c.post(
                "/folders/task/checkpoints",
                content=raw,
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 400, (extra, r.text)
            # The JSON reader refuses a lone surrogate before the checkpoint is parsed.
            expect = "body" if "\\udcff" in raw else field
            assert any(d["field"] == expect for d in r.json()["details"]), r.text
    assert server_files(tenant, "task", run.task) == {"kept.txt": b"kept"}
    outcomes = [x["outcome"] for x in run_receipts(tenant, run.run_id)]
    # The 409 and each hostile body but the one that is not even JSON the
    # controller reads (no operation to name) left a refused receipt.
    assert outcomes == ["saved"] + ["refused"] * len(HOSTILE)


JSON_VALUES: list[Any] = [None, True, 0, -1, 1.5, "", "x", [], [1], [{"op": "put"}], {}, {"a": 1}]


def _every_field_swapped() -> list[dict[str, Any]]:
    put = {"op": "put", "path": "a.txt", "digest": "ab" * 32, "executable": False}
    bodies: list[dict[str, Any]] = []
    for value in JSON_VALUES:
        for field in ("operationId", "leaseEpoch", "final", "entries", "localRefusals"):
            bodies.append({**BASE, field: value})
        for field in put:
            bodies.append({**BASE, "entries": [{**put, field: value}]})
        bodies.append({**BASE, "entries": [value]})
        bodies.append({**BASE, "localRefusals": [{"path": "a", "code": value}]})
        bodies.append({**BASE, "localRefusals": [value]})
    return bodies


def test_parse_answers_every_json_type_in_every_field_with_a_validation_error() -> None:
    # A hostile checkpoint is refused with details, never a TypeError (a list
    # where a string belongs once raised "unhashable type" and answered 500).
    valid = 0
    for body in _every_field_swapped():
        try:
            cp = parse_checkpoint(body)
        except ValidationError as exc:
            assert exc.details, body
            continue
        valid += 1
        assert isinstance(cp.operation_id, str) and isinstance(cp.lease_epoch, int), body
    # Only a few swaps keep the body valid (executable/final booleans, a
    # different printable operation id, an empty list).
    assert valid < len(_every_field_swapped()) // 4
