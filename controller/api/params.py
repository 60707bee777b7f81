"""Strict parsing of request input: query parameters, integers, cursors, Range.

Every malformed value is a 400 with a stable code, never a 500. Integers are
ASCII digits only (``str.isdigit`` also accepts ``²`` and other Unicode digits,
which ``int`` then refuses) with at most 19 of them, so no value can reach
Python's long-integer conversion limit or overflow a PostgreSQL ``bigint``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request

from common.errors import InvalidPath, RangeNotSatisfiable, ValidationError
from common.limits import MAX_IDEMPOTENCY_KEY_CHARS
from common.paths import validate_path

MAX_INT_DIGITS = 19
BIGINT_MAX = 2**63 - 1
MAX_CURSOR_CHARS = 4096

_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")
_DIGITS = re.compile(f"[0-9]{{1,{MAX_INT_DIGITS}}}")
_RANGE = re.compile(f"bytes=([0-9]{{0,{MAX_INT_DIGITS}}})-([0-9]{{0,{MAX_INT_DIGITS}}})")


class BadCursor(ValidationError):
    """A list cursor that this controller did not hand out."""

    code = "bad_cursor"

    def __init__(self) -> None:
        super().__init__(
            [{"field": "cursor", "code": "bad_cursor", "message": "cursor is not valid"}]
        )


def parse_int(
    raw: str, field: str, *, minimum: int = 0, maximum: int = BIGINT_MAX, code: str
) -> int:
    """``raw`` as an integer in [minimum, maximum], else ValidationError(code)."""
    if _DIGITS.fullmatch(raw) is None or not minimum <= int(raw) <= maximum:
        raise ValidationError.single(
            field, code, f"{field} must be an integer {minimum}-{maximum} in ASCII digits"
        )
    return int(raw)


def query_int(
    request: Request, name: str, default: int, *, minimum: int, maximum: int, code: str
) -> int:
    values = strict_query(request, name)
    if not values:
        return default
    if len(values) != 1:
        raise ValidationError.single(name, code, f"at most one {name} query parameter")
    return parse_int(values[0], name, minimum=minimum, maximum=maximum, code=code)


def strict_query(request: Request, name: str) -> list[str]:
    """Query values decoded strictly: invalid UTF-8 is an error, not U+FFFD."""
    raw = request.scope.get("query_string", b"").decode("latin-1")
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidPath("invalid_utf8", "query string is not valid UTF-8", name) from None
    return [v for k, v in pairs if k == name]


def query_bool(request: Request, name: str) -> bool:
    values = strict_query(request, name)
    if len(values) > 1 or (values and values[0] not in ("true", "false")):
        raise ValidationError.single(name, "invalid_boolean", f"{name} must be true or false")
    return bool(values) and values[0] == "true"


# --- list cursors ------------------------------------------------------------


def encode_cursor(data: dict[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def _cursor_fields(raw: str, keys: set[str]) -> dict[str, str]:
    if len(raw) > MAX_CURSOR_CHARS:
        raise BadCursor()
    try:
        data = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise BadCursor() from None
    if (
        not isinstance(data, dict)
        or set(data) != keys
        or not all(isinstance(v, str) for v in data.values())
    ):
        raise BadCursor()
    try:
        if "p" in data:
            validate_path(data["p"])
    except InvalidPath:
        raise BadCursor() from None
    return data


def decode_list_cursor(raw: str) -> str:
    """The last path of the previous page of active files."""
    return _cursor_fields(raw, {"p"})["p"]


def decode_trash_cursor(raw: str) -> tuple[datetime, str]:
    """The ``deletedAt`` (timezone-aware) and path of the previous trash page's end."""
    data = _cursor_fields(raw, {"d", "p"})
    try:
        deleted_at = datetime.fromisoformat(data["d"])
    except ValueError:
        raise BadCursor() from None
    if deleted_at.tzinfo is None:
        raise BadCursor()
    return deleted_at, data["p"]


def decode_run_cursor(raw: str) -> tuple[datetime, str]:
    """The ``startedAt`` (timezone-aware) and id of the previous run page's end."""
    data = _cursor_fields(raw, {"s", "i"})
    try:
        started_at = datetime.fromisoformat(data["s"])
        run_id = str(uuid.UUID(data["i"]))
    except ValueError:
        raise BadCursor() from None
    if started_at.tzinfo is None:
        raise BadCursor()
    return started_at, run_id


# --- JSON bodies -----------------------------------------------------------------


def string_fields(
    body: dict[str, Any], *, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, str | None]:
    """The body's fields, every one a string (an optional one may be absent or
    null, read as None); a missing, unknown or non-string field is a 400 that
    names it."""
    unknown = sorted(set(body) - set(required) - set(optional))
    if unknown:
        raise ValidationError.single(unknown[0], "unknown_field", f"unknown field {unknown[0]!r}")
    out: dict[str, str | None] = {}
    for name in (*required, *optional):
        value = body.get(name)
        if value is None and name in optional:
            out[name] = None
        elif not isinstance(value, str):
            raise ValidationError.single(
                name,
                "required" if value is None else "invalid_type",
                f"{name} must be a string",
            )
        else:
            out[name] = value
    return out


# --- Range -------------------------------------------------------------------


def parse_range(header: str, size: int) -> tuple[int, int]:
    """One ``bytes=`` range → [start, end) within ``size``; 416 when unsatisfiable."""
    m = _RANGE.fullmatch(header.strip())
    if m is None or (m.group(1) == "" and m.group(2) == ""):
        raise RangeNotSatisfiable("Only a single bytes=start-end range is supported")
    first, last = m.group(1), m.group(2)
    if first == "":
        suffix = int(last)
        if suffix == 0:
            raise RangeNotSatisfiable()
        return max(0, size - suffix), size
    start = int(first)
    end = size if last == "" else min(size, int(last) + 1)
    if start >= size or start >= end:
        raise RangeNotSatisfiable()
    return start, end


def declared_length(request: Request) -> int | None:
    """``Content-Length`` when it is plain ASCII digits within bounds (the server
    refuses a malformed one before the app sees it)."""
    raw = request.headers.get("content-length")
    if raw is None or _DIGITS.fullmatch(raw) is None:
        return None
    return int(raw)


def idempotency_key(request: Request) -> str | None:
    """The request's operation id; None without ``Idempotency-Key`` (the write
    then keeps no receipt: nobody could replay it). The same header for every
    route that takes one (folder writes, attachments)."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS or not _PRINTABLE_ASCII.fullmatch(key):
        raise ValidationError.single(
            "Idempotency-Key",
            "invalid_idempotency_key",
            f"Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters",
        )
    return key
