"""Path rules (common/paths.py) and hostile paths sent to a real controller."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import InvalidPath
from common.limits import RESERVED_SEGMENT
from common.paths import check_segment, decode_fs_name, validate_path
from tests.support.controller import Tenant

GOOD = [
    "a",
    "a/b/c.txt",
    "名前/ファイル.md",
    "x" * 255,
    "/".join(["d" * 15] * 64),  # 1023 characters in the most segments allowed
    "a b/c%_d",
    "é",
    ".hidden",
    "..dots",
    "a..b",
]
BAD = {
    "": "empty",
    "/abs": "absolute",
    "a//b": "invalid_segment",
    "a/": "invalid_segment",
    "./a": "invalid_segment",
    "a/../b": "invalid_segment",
    "..": "invalid_segment",
    "a\\b": "forbidden_character",
    "a\x00b": "forbidden_character",
    "a\nb": "forbidden_character",
    "a\x7fb": "forbidden_character",
    "a\x1f": "forbidden_character",
    f"x/{RESERVED_SEGMENT}/y": "reserved_segment",
    "é" * 128: "segment_too_long",  # 256 bytes in UTF-8
    "a" * 1025: "too_long",
    "e\u0301": "not_nfc",
    "bad\udcff": "invalid_utf8",
    "a\x80b": "forbidden_character",  # C1 controls
    "a\x9fb": "forbidden_character",
    "invoice\u202etxt.exe": "forbidden_character",  # bidi override
    "a\u202ab": "forbidden_character",
    "a\u2066b": "forbidden_character",  # bidi isolates
    "a\u2069b": "forbidden_character",
    "/".join(["d"] * 65): "too_deep",
}


@pytest.mark.parametrize("path", GOOD)
def test_valid_paths_pass_unchanged(path: str) -> None:
    assert validate_path(path) == path


@pytest.mark.parametrize(("path", "reason"), list(BAD.items()))
def test_invalid_paths_are_rejected_with_a_reason(path: str, reason: str) -> None:
    with pytest.raises(InvalidPath) as info:
        validate_path(path)
    assert info.value.reason == reason
    assert info.value.status == 400


def test_fs_names() -> None:
    assert decode_fs_name(b"ok.txt") == "ok.txt"
    for raw in (b"\xff\xfe", b"..", RESERVED_SEGMENT.encode(), "e\u0301".encode()):
        with pytest.raises(InvalidPath):
            decode_fs_name(raw)


def hostile_paths() -> st.SearchStrategy[str]:
    segment = st.one_of(
        st.sampled_from(["..", ".", "", RESERVED_SEGMENT, "/", "\\", "~", "C:", "%2e%2e"]),
        st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=6),
        st.text(alphabet=st.sampled_from("\x00\x01\x1f\x7f\n\r\t/\\."), min_size=1, max_size=4),
        st.text(min_size=256, max_size=300),
        st.just("e\u0301"),
    )
    joined = st.lists(segment, min_size=1, max_size=5).map("/".join)
    return st.one_of(
        joined,
        joined.map(lambda p: "/" + p),
        joined.map(lambda p: p + "/../.."),
        st.text(min_size=1025, max_size=1100),
        st.text(
            alphabet=st.characters(min_codepoint=0x300, max_codepoint=0x36F), min_size=1, max_size=3
        ).map(lambda marks: "a" + marks),
    )


def _is_valid(path: str) -> bool:
    try:
        validate_path(path)
    except InvalidPath:
        return False
    return True


def names_beside(data_dir: Path, path: str) -> set[str]:
    found = set()
    for seg in path.split("/"):
        if seg and "\x00" not in seg and seg not in (".", ".."):
            try:
                if (data_dir.parent / seg).exists() or (data_dir / seg).exists():
                    found.add(seg)
            except (OSError, ValueError):
                pass
    return found


def snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=hostile_paths())
def test_hostile_paths_are_rejected_by_the_controller(tenant: Tenant, path: str) -> None:
    """Whatever the path, the controller answers 400 or writes inside its own folder."""
    ctl = tenant.controller
    before_beside = names_beside(ctl.data_dir, path)
    before_data = snapshot(ctl.data_dir)
    with tenant.client() as c:
        r = c.put(
            f"{tenant.my_folder}/content",
            params={"path": path},
            content=b"payload",
            headers={"Content-Type": "application/octet-stream"},
        )
        expected_valid = _is_valid(path) and unicodedata.is_normalized("NFC", path)
        if not expected_valid:
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert r.json()["error"] == "Validation error"
            assert snapshot(ctl.data_dir) - before_data <= {
                p for p in snapshot(ctl.data_dir) if p.startswith("controller-")
            }
        else:
            assert r.status_code in (200, 201, 409), (path, r.text)
        m = c.post(f"{tenant.my_folder}/operations", json={"action": "mkdir", "path": path})
        assert (m.status_code == 400) == (not expected_valid)
    # Objects are content-addressed: every new file under the data dir is an
    # object key, a spool file or the server log, never a client path.
    for rel in snapshot(ctl.data_dir) - before_data:
        assert rel.startswith(("objects", "spool", "controller-")), rel
    # Nothing named after a piece of the path appeared beside the data dir
    # (where a traversal out of the storage root would land first).
    assert {n for n in names_beside(ctl.data_dir, path)} == before_beside


def test_hostile_path_query_strings(tenant: Tenant) -> None:
    """Raw query strings with encoded traversal and duplicates are refused."""
    base = tenant.controller.url + tenant.my_folder + "/content"
    headers = {"Authorization": f"Bearer {tenant.token}"}
    for qs in (
        "path=%2e%2e%2fetc",
        "path=%2Fetc%2Fpasswd",
        "path=a%00b",
        "path=a&path=b",
        "",
        "path=a%5Cb",
        "path=%C3%28",
    ):
        r = httpx.get(f"{base}?{qs}", headers=headers)
        assert r.status_code == 400, qs


def test_segment_checks_match_validate_path() -> None:
    for seg in ("ok", "..", "", RESERVED_SEGMENT, "a\x00"):
        seg_ok = True
        try:
            check_segment(seg)
        except InvalidPath:
            seg_ok = False
        assert seg_ok == _is_valid(seg)


def _full_rules(segment: str) -> str | None:
    """check_segment's rules spelled out one by one (no shortcut): the reason, or None."""
    if segment in ("", ".", "..") or "/" in segment:
        return "invalid_segment"
    if segment == RESERVED_SEGMENT:
        return "reserved_segment"
    for ch in segment:
        c = ord(ch)
        if c < 0x20 or ch in "\x7f\\" or 0x80 <= c < 0xA0 or 0x202A <= c < 0x202F:
            return "forbidden_character"
        if 0x2066 <= c < 0x206A:
            return "forbidden_character"
    try:
        raw = segment.encode("utf-8")
    except UnicodeEncodeError:
        return "invalid_utf8"
    if len(raw) > 255:
        return "segment_too_long"
    if not unicodedata.is_normalized("NFC", segment):
        return "not_nfc"
    return None


def _verdict(segment: str) -> str | None:
    try:
        check_segment(segment)
    except InvalidPath as exc:
        return exc.reason
    return None


@settings(max_examples=3000, deadline=None)
@given(
    st.one_of(
        st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=260),
        st.text(max_size=140),
        st.sampled_from(["x" * 255, "x" * 256, "a\\b", "\x7f", "e\u0301", "ok\u2067", "é" * 128]),
    )
)
def test_check_segment_agrees_with_the_rules_spelled_out(segment: str) -> None:
    """The printable-ASCII shortcut gives every segment the verdict the full rules give."""
    assert _verdict(segment) == _full_rules(segment), repr(segment)
