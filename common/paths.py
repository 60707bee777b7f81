"""Path rules for scoped work files, shared by fsagent and the controller.

A work path is relative, '/'-separated and already canonical. Anything that is
not is rejected, never normalized: silently turning ``a/./b`` into ``a/b`` or an
NFD name into NFC would let two spellings name one file on one side and two on
the other, and is how traversal bugs start.
"""

from __future__ import annotations

import unicodedata
import uuid
from collections.abc import Iterator

from common.errors import InvalidPath, ValidationError
from common.limits import (
    MAX_COMPONENT_BYTES,
    MAX_OWNER_ID_CHARS,
    MAX_PATH_CHARS,
    RESERVED_SEGMENT,
    SCOPES,
)

MAX_PATH_SEGMENTS = 64
"""Deepest path accepted: each segment of a new path may create a parent row."""

# C0 and C1 controls, DEL, backslash, and the bidirectional embeddings,
# overrides and isolates that make a name display as another
# (``invoice\u202etxt.exe`` shows as ``invoiceexe.txt``).
_FORBIDDEN_CHARS = frozenset(
    [chr(c) for c in range(0x20)]
    + ["\x7f", "\\"]
    + [chr(c) for c in range(0x80, 0xA0)]
    + [chr(c) for c in range(0x202A, 0x202F)]
    + [chr(c) for c in range(0x2066, 0x206A)]
)


def check_segment(segment: str) -> None:
    """Validate one path component (also used by fsagent for a single name)."""
    if segment in ("", ".", ".."):
        raise InvalidPath("invalid_segment", f"path segment {segment!r} is empty, '.' or '..'")
    if segment == RESERVED_SEGMENT:
        raise InvalidPath("reserved_segment", f"path segment {segment!r} is reserved")
    if "/" in segment:
        raise InvalidPath("invalid_segment", "path segment contains '/'")
    if segment.isascii() and segment.isprintable() and "\\" not in segment:
        # The common case, in C: printable ASCII holds none of the forbidden
        # characters but the backslash, is its own UTF-8 and is always NFC.
        if len(segment) > MAX_COMPONENT_BYTES:
            raise InvalidPath(
                "segment_too_long",
                f"path segment is {len(segment)} bytes; at most {MAX_COMPONENT_BYTES} allowed",
            )
        return
    bad = next((ch for ch in segment if ch in _FORBIDDEN_CHARS), None)
    if bad is not None:
        raise InvalidPath(
            "forbidden_character",
            f"path contains forbidden character U+{ord(bad):04X}",
        )
    try:
        raw = segment.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates (e.g. from os.fsdecode of invalid bytes) are not UTF-8.
        raise InvalidPath("invalid_utf8", "path is not valid UTF-8") from None
    if len(raw) > MAX_COMPONENT_BYTES:
        raise InvalidPath(
            "segment_too_long",
            f"path segment is {len(raw)} bytes; at most {MAX_COMPONENT_BYTES} allowed",
        )
    if not unicodedata.is_normalized("NFC", segment):
        raise InvalidPath("not_nfc", "path must be NFC-normalized Unicode")


def validate_path(path: object, field: str = "path") -> str:
    """Return ``path`` unchanged if it is a valid work path, else raise InvalidPath."""
    if not isinstance(path, str):
        raise InvalidPath("not_a_string", "path must be a string", field)
    if path == "":
        raise InvalidPath("empty", "path must not be empty", field)
    if len(path) > MAX_PATH_CHARS:
        raise InvalidPath("too_long", f"path is longer than {MAX_PATH_CHARS} characters", field)
    if path.startswith("/"):
        raise InvalidPath("absolute", "path must be relative", field)
    segments = path.split("/")
    if len(segments) > MAX_PATH_SEGMENTS:
        raise InvalidPath("too_deep", f"path has more than {MAX_PATH_SEGMENTS} segments", field)
    for segment in segments:
        try:
            check_segment(segment)
        except InvalidPath as exc:
            raise InvalidPath(
                exc.reason, exc.details[0]["message"] if exc.details else "", field
            ) from None
    return path


def decode_fs_name(name: bytes) -> str:
    """Decode a name from the kernel (fsagent) under the same rules."""
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidPath("invalid_utf8", "name is not valid UTF-8") from None
    check_segment(text)
    return text


def parent_of(path: str) -> str | None:
    """``a/b/c`` → ``a/b``; a top-level path has no parent (None)."""
    head, sep, _ = path.rpartition("/")
    return head if sep else None


def ancestors(path: str) -> Iterator[str]:
    """Proper ancestors from the top down: ``a/b/c`` → ``a``, ``a/b``."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


def basename(path: str) -> str:
    return path.rpartition("/")[2]


def is_within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` or lies below it."""
    return path == root or path.startswith(root + "/")


def validate_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise ValidationError.single(
            "scope", "invalid_scope", f"scope must be one of {', '.join(SCOPES)}"
        )
    return scope


def validate_uuid(value: str, field: str) -> str:
    """Return the canonical lower-case form, or raise a validation error."""
    try:
        parsed = uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise ValidationError.single(field, "invalid_uuid", f"{field} must be a UUID") from None
    if str(parsed) != value.lower() or len(value) != 36:
        raise ValidationError.single(field, "invalid_uuid", f"{field} must be a UUID")
    return str(parsed)


def validate_owner_id(scope: str, owner_id: str) -> str:
    if not 1 <= len(owner_id) <= MAX_OWNER_ID_CHARS:
        raise ValidationError.single(
            "ownerId", "invalid_owner_id", f"ownerId must be 1-{MAX_OWNER_ID_CHARS} characters"
        )
    if scope != "user":
        return validate_uuid(owner_id, "ownerId")
    if any(ch in _FORBIDDEN_CHARS or ch == "/" for ch in owner_id):
        raise ValidationError.single(
            "ownerId", "invalid_owner_id", "ownerId has forbidden characters"
        )
    return owner_id
