"""Every malformed input answers 400 (or 416 for Range) with a stable code, never 500."""

from __future__ import annotations

import base64
import errno
import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.paths import MAX_PATH_SEGMENTS
from controller.api.common import MAX_JSON_DEPTH, json_too_deep
from tests.support.bridge import start_run
from tests.support.controller import Tenant
from tests.support.mount import FsagentMount

OCTET = {"Content-Type": "application/octet-stream"}
HUGE = "9" * 5000  # past Python's 4,300-digit int conversion limit
BAD_INTS = ["\u00b2", "\u0661", HUGE, "9" * 19, "-1", "+1", " 1", "1 ", "0x10", "1.0", ""]


def cursor(data: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def detail_code(r: httpx.Response) -> str:
    body = r.json()
    assert body["error"] == "Validation error", body
    return str(body["details"][0]["code"])


def put(c: httpx.Client, folder: str, path: str, data: bytes = b"x") -> httpx.Response:
    return c.put(f"{folder}/content", params={"path": path}, content=data, headers=OCTET)


# --- numbers ---------------------------------------------------------------


@pytest.mark.parametrize("raw", BAD_INTS)
def test_bad_list_limit_is_400(tenant: Tenant, raw: str) -> None:
    with tenant.client() as c:
        r = c.get(tenant.my_folder + "/", params={"limit": raw})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "validation_error"
    assert detail_code(r) == "invalid_limit"


def test_bridge_since_and_limit_refuse_non_ascii_and_huge_numbers(tenant: Tenant) -> None:
    run = start_run(tenant)
    with run.client() as c:
        for name in ("since", "limit"):
            for raw in BAD_INTS:
                r = c.get("/folders/task/manifest", params={name: raw})
                assert r.status_code == 400, (name, raw, r.text)
                assert detail_code(r) == "invalid_integer", (name, raw)
        # The largest bigint is still a number (and simply past every version).
        r = c.get("/folders/task/manifest", params={"since": str(2**63 - 1)})
        assert r.status_code == 200, r.text
        assert r.json()["entries"] == []


def test_range_with_huge_or_unicode_numbers_is_416(tenant: Tenant) -> None:
    with tenant.client() as c:
        assert put(c, tenant.my_folder, "r.bin", b"0123456789").status_code == 201
        url = tenant.my_folder + "/content"
        for header in (
            f"bytes={HUGE}-",
            f"bytes=-{HUGE}",
            f"bytes=0-{HUGE}",
            "bytes=\u00b2-",
            "bytes=-\u00b2",
            "bytes=99999999999999999999-",
        ):
            r = c.get(url, params={"path": "r.bin"}, headers={"Range": header.encode()})
            assert r.status_code == 416, (header, r.text)
            assert r.json()["code"] == "range_not_satisfiable"
            assert r.headers["content-range"] == "bytes */10"
        # A 19-digit end is clamped to the file, as before.
        r = c.get(url, params={"path": "r.bin"}, headers={"Range": "bytes=2-" + "9" * 19})
        assert r.status_code == 206 and r.content == b"23456789"


# --- cursors ---------------------------------------------------------------


def test_tampered_cursors_are_400_bad_cursor(tenant: Tenant) -> None:
    listing = tenant.my_folder + "/"
    with tenant.client() as c:
        for raw in (
            cursor({"p": "a\u0000b"}),
            cursor({"p": "/etc"}),
            cursor({"p": ""}),
            cursor({"p": 1}),
            cursor({"p": "a", "x": "b"}),
            cursor(["a"]),
            base64.urlsafe_b64encode(b"[" * 5000).decode(),
            "!!!not base64!!!",
            "A" * 5000,
        ):
            r = c.get(listing, params={"cursor": raw})
            assert r.status_code == 400, (raw[:40], r.text)
            assert r.json()["code"] == "bad_cursor"
        for raw in (
            cursor({"d": "not-a-date", "p": "a"}),
            cursor({"d": "2026-13-45T00:00:00+00:00", "p": "a"}),
            cursor({"d": "2026-01-01T00:00:00", "p": "a"}),  # no time zone
            cursor({"d": "2026-01-01T00:00:00+00:00", "p": "a\u0000"}),
            cursor({"p": "a"}),
        ):
            r = c.get(listing, params={"cursor": raw, "trash": "true"})
            assert r.status_code == 400, (raw, r.text)
            assert r.json()["code"] == "bad_cursor"


def test_handed_out_cursors_still_page_through(tenant: Tenant) -> None:
    with tenant.client() as c:
        for name in ("a", "b", "c"):
            assert put(c, tenant.my_folder, name).status_code == 201
            r = c.post(tenant.my_folder + "/operations", json={"action": "delete", "path": name})
            assert r.status_code == 200
            assert put(c, tenant.my_folder, name).status_code == 201
        for trash in ("false", "true"):
            seen, next_cursor = [], None
            while True:
                params = {"limit": "1", "trash": trash}
                if next_cursor:
                    params["cursor"] = next_cursor
                r = c.get(tenant.my_folder + "/", params=params)
                assert r.status_code == 200, r.text
                seen += [e["path"] for e in r.json()["entries"]]
                next_cursor = r.json()["nextCursor"]
                if next_cursor is None:
                    break
            assert sorted(seen) == ["a", "b", "c"], trash


# --- JSON bodies -----------------------------------------------------------


def nested(depth: int) -> bytes:
    return b'{"action": "mkdir", "path": "x", "n": ' + b"[" * depth + b"]" * depth + b"}"


def test_deep_json_is_400_everywhere(tenant: Tenant) -> None:
    headers = {"Content-Type": "application/json"}
    run = start_run(tenant)
    with tenant.client() as c:
        for depth in (65, 5000, 30_000):
            r = c.post(tenant.my_folder + "/operations", content=nested(depth), headers=headers)
            assert r.status_code == 400, (depth, r.text)
            assert detail_code(r) == "too_deep"
        # 64 levels (the object itself is one) are fine.
        r = c.post(tenant.my_folder + "/operations", content=nested(63), headers=headers)
        assert r.status_code == 400 and detail_code(r) == "unexpected_field", r.text
    # Unauthenticated sign-in reads its body before any token check.
    for depth in (65, 30_000):
        body = b'{"token": ' + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(tenant.controller.url + "/files/api/session", content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert detail_code(r) == "too_deep"
    with run.client() as c:
        body = b'{"operationId": ' + b"[" * 100 + b"]" * 100 + b"}"
        r = c.post("/folders/task/checkpoints", content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert detail_code(r) == "too_deep"


def _depth(raw: bytes) -> int:
    depth = deepest = 0
    for ch in raw:
        depth += 1 if ch in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.recursive(
        st.sampled_from([b"[]", b"{}"]),
        lambda inner: st.tuples(
            st.sampled_from([(b"[", b"]"), (b"{", b"}")]), st.lists(inner, min_size=1, max_size=3)
        ).map(lambda t: t[0][0] + b"".join(t[1]) + t[0][1]),
        max_leaves=200,
    ),
    st.integers(min_value=0, max_value=70),
)
def test_depth_check_matches_counting_every_bracket(shape: bytes, wrap: int) -> None:
    raw = b"[" * wrap + shape + b"]" * wrap
    assert json_too_deep(raw) == (_depth(raw) > MAX_JSON_DEPTH)


def _parsed_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_parsed_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_parsed_depth, value), default=0)
    return 0


_TRICKY_STRINGS = ["[", "}", '"', "\\", '\\"', '"[', "\\\\{", "]]}}", "a[b{c", ""]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.recursive(
        st.sampled_from(_TRICKY_STRINGS) | st.none() | st.integers(),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.sampled_from(_TRICKY_STRINGS), inner, max_size=3)
        ),
        max_leaves=40,
    ),
    st.integers(min_value=0, max_value=66),
)
def test_depth_check_ignores_brackets_quotes_and_escapes_inside_strings(
    value: Any, wrap: int
) -> None:
    for _ in range(wrap):
        value = [value, "]", {"[": '\\"{'}]
    raw = json.dumps(value).encode()
    assert json_too_deep(raw) == (_parsed_depth(value) > MAX_JSON_DEPTH)


def test_brackets_inside_strings_do_not_count_as_nesting(tenant: Tenant) -> None:
    body = json.dumps({"action": "mkdir", "path": "[[[{{{" + '\\"[' * 200})
    with tenant.client() as c:
        r = c.post(
            tenant.my_folder + "/operations",
            content=body.encode(),
            headers={"Content-Type": "application/json"},
        )
    # Refused for the backslash in the path, not for depth.
    assert r.status_code == 400
    assert r.json()["code"] == "invalid_path"


def test_lone_surrogate_escapes_are_400(tenant: Tenant) -> None:
    headers = {"Content-Type": "application/json"}
    with tenant.client() as c:
        for body in (
            b'{"action": "mkdir", "path": "a\\ud800"}',
            b'{"action": "mkdir", "path": "a\\udfff"}',
            b'{"action": "mkdir\\ud800", "path": "a"}',
            b'{"action": "mkdir", "path": "a", "\\udc00": 1}',
        ):
            r = c.post(tenant.my_folder + "/operations", content=body, headers=headers)
            assert r.status_code == 400, (body, r.text)
            assert detail_code(r) == "invalid_json"
        # A proper surrogate pair is one character, and an escaped backslash
        # followed by "ud800" is plain text.
        r = c.post(
            tenant.my_folder + "/operations",
            content=b'{"action": "mkdir", "path": "smile\\ud83d\\ude00"}',
            headers=headers,
        )
        assert r.status_code == 200, r.text
        assert r.json()["files"][0]["path"] == "smile\U0001f600"
    r = httpx.post(
        tenant.controller.url + "/files/api/session",
        content=b'{"token": "fsa_u_\\ud800"}',
        headers=headers,
    )
    assert r.status_code == 400 and detail_code(r) == "invalid_json"


def test_operation_action_of_the_wrong_type_is_400(tenant: Tenant) -> None:
    with tenant.client() as c:
        for action in ({"a": 1}, ["mkdir"], 1, None, True):
            r = c.post(tenant.my_folder + "/operations", json={"action": action, "path": "x"})
            assert r.status_code == 400, (action, r.text)
            assert detail_code(r) == "invalid_action"


# --- path rules ------------------------------------------------------------

REFUSED_NAMES = ["invoice\u202etxt.exe", "a\u202ab", "a\u2066b", "a\u2069b", "a\x85b", "a\x9bb"]


def test_c1_and_bidi_names_are_refused_by_the_controller(tenant: Tenant) -> None:
    run = start_run(tenant)
    with tenant.client() as c:
        for name in REFUSED_NAMES:
            for r in (
                put(c, tenant.my_folder, "dir/" + name),
                c.post(tenant.my_folder + "/operations", json={"action": "mkdir", "path": name}),
            ):
                assert r.status_code == 400, (name, r.text)
                assert r.json()["code"] == "invalid_path"
                assert detail_code(r) == "forbidden_character"
        listing = c.get(tenant.my_folder + "/").json()["entries"]
        assert listing == []
    digest = run.upload("task", b"x").json()["digest"]
    for name in REFUSED_NAMES:
        r = run.commit("task", [{"op": "put", "path": name, "digest": digest, "executable": False}])
        assert r.status_code == 400, (name, r.text)
        assert detail_code(r) == "forbidden_character"


def test_paths_deeper_than_64_segments_are_refused(tenant: Tenant) -> None:
    deep = "/".join(["d"] * 65)
    with tenant.client() as c:
        r = put(c, tenant.my_folder, deep)
        assert r.status_code == 400 and detail_code(r) == "too_deep", r.text
        r = c.post(tenant.my_folder + "/operations", json={"action": "mkdir", "path": deep})
        assert r.status_code == 400 and detail_code(r) == "too_deep", r.text
        assert c.get(tenant.my_folder + "/").json()["entries"] == []
        ok = "/".join(["d"] * 64)
        assert put(c, tenant.my_folder, ok).status_code == 201
    run = start_run(tenant)
    digest = run.upload("task", b"x").json()["digest"]
    r = run.commit("task", [{"op": "put", "path": deep, "digest": digest, "executable": False}])
    assert r.status_code == 400 and detail_code(r) == "too_deep", r.text


def test_c1_and_bidi_names_are_einval_on_the_mount(mnt: FsagentMount) -> None:
    for name in REFUSED_NAMES:
        with pytest.raises(OSError) as info:
            open(mnt.mountpoint / name, "wb").close()
        assert info.value.errno == errno.EINVAL, name
        with pytest.raises(OSError) as info:
            os.mkdir(mnt.mountpoint / name)
        assert info.value.errno == errno.EINVAL, name
    assert os.listdir(mnt.mountpoint) == []


def test_paths_deeper_than_64_segments_are_enametoolong_on_the_mount(mnt: FsagentMount) -> None:
    deepest = mnt.mountpoint.joinpath(*["d"] * (MAX_PATH_SEGMENTS - 1))
    os.makedirs(deepest)
    (deepest / "leaf").write_bytes(b"64 segments")  # exactly the limit
    assert (deepest / "leaf").read_bytes() == b"64 segments"
    os.mkdir(deepest / "sub")  # 64 segments
    for make in (os.mkdir, lambda p: open(p, "wb").close()):
        with pytest.raises(OSError) as info:
            make(deepest / "sub" / "too-deep")  # 65 segments
        assert info.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as info:
        os.rename(deepest / "leaf", deepest / "sub" / "leaf")
    assert info.value.errno == errno.ENAMETOOLONG
    assert (deepest / "leaf").read_bytes() == b"64 segments"
