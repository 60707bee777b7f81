"""Every JSON type in every field of the controller's pure body and cursor
parsers answers a WorkFolderError (a 4xx with a code), never a TypeError."""

from __future__ import annotations

import base64
import json
from typing import Any

from common.errors import WorkFolderError
from controller.api import params
from controller.repomanifest import parse_request

VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**70,
    1.5,
    "",
    "x" * 5000,
    "\ud800",
    "a/b",
    [],
    [1],
    [[]],
    [{}],
    ["a", "b"],
    {},
    {"a": 1},
]

DIGEST = "ab" * 32
MEMBER = {"path": "a.txt", "kind": "file", "digest": DIGEST, "byteSize": 1, "executable": False}
BODY = {
    "operationId": "op-1",
    "leaseEpoch": 1,
    "base": None,
    "members": [MEMBER],
    "removed": [],
    "config": [],
}


def _refused_or_parsed(body: dict[str, Any]) -> bool:
    try:
        parse_request(body)
    except WorkFolderError as exc:
        assert 400 <= exc.status < 500, (body, exc)
        assert exc.code, body
        return False
    return True


def test_repo_checkpoint_body_every_json_type_in_every_field() -> None:
    assert _refused_or_parsed(BODY)
    parsed = 0
    cases = 0
    for name in BODY:
        for value in VALUES:
            cases += 1
            parsed += _refused_or_parsed({**BODY, name: value})
    for name in [*MEMBER, "target"]:
        for value in VALUES:
            cases += 1
            parsed += _refused_or_parsed({**BODY, "members": [{**MEMBER, name: value}]})
    for value in VALUES:
        cases += 3
        parsed += _refused_or_parsed({**BODY, "members": [value]})
        parsed += _refused_or_parsed({**BODY, "base": "0" * 36, "removed": [value]})
        parsed += _refused_or_parsed({**BODY, "config": [[value, "x"]]})
    assert parsed < cases // 4


def _cursor(data: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def test_list_cursors_every_json_type_in_every_key() -> None:
    decoders = {
        params.decode_list_cursor: {"p": "a.txt"},
        params.decode_trash_cursor: {"d": "2026-01-01T00:00:00+00:00", "p": "a.txt"},
        params.decode_run_cursor: {
            "s": "2026-01-01T00:00:00+00:00",
            "i": "00000000-0000-0000-0000-000000000001",
        },
    }
    for decode, good in decoders.items():
        decode(_cursor(good))
        raws = [_cursor(v) for v in VALUES] + ["", "!!", "\ud800", "e" * 10_000]
        raws += [_cursor({**good, k: v}) for k in good for v in VALUES if not isinstance(v, str)]
        for raw in raws:
            try:
                decode(raw)
            except params.BadCursor as exc:
                assert exc.status == 400 and exc.code, raw
                continue
            raise AssertionError(f"{decode.__name__} accepted {raw!r}")


def test_string_fields_every_json_type() -> None:
    for value in VALUES:
        try:
            out = params.string_fields({"name": value}, required=("name",))
        except WorkFolderError as exc:
            assert exc.status == 400 and exc.details, value
            assert exc.details[0]["code"] in ("required", "invalid_type"), value
            assert not isinstance(value, str)
        else:
            assert isinstance(value, str) and out == {"name": value}
