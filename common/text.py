"""The text rule: what a free-text field from a sandbox or a person may hold.

Paths and names of files have their own, stricter rule (:mod:`common.paths`);
this one is for everything else a client sends as text and a person later
reads: operation ids, errors a sandbox reports, and the names and titles
people give (companies, agents, projects, tasks, operator tokens, sandbox
keys). Such text is refused, never silently rewritten, when it holds:

- a control character (C0, DEL, C1): NUL cannot be stored in PostgreSQL at
  all (a 500 otherwise), ESC starts the ANSI sequences that rewrite a
  terminal when a listing is printed, and CR/LF split log and CLI lines. Only
  fields that are multi-line by nature (a reported error, a setup command)
  take ``\\n`` and ``\\t``;
- a bidirectional control (U+202A-U+202E, U+2066-U+2069, U+200E, U+200F,
  U+061C): ``invoice\\u202etxt.exe`` displays as ``invoiceexe.txt``, so an
  agent named with an override shows another agent's name;
- any other invisible format character (Unicode category Cf, such as U+200B
  ZERO WIDTH SPACE, U+FEFF, the U+E0000 tag characters that smuggle text past
  a reader), a lone surrogate or a line/paragraph separator (U+2028, U+2029).
  U+200C and U+200D (ZWNJ, ZWJ) are allowed: Persian and Indic scripts and
  emoji sequences need them, and they move nothing;
- more characters than the field allows, or none (or only spaces, for a name).

The sender's side of the rule is :func:`clean_text`: fsagent reports errors
built from exceptions and tool output, which may hold anything, so it passes
them through it before sending and an honest report is never refused.

No I/O here: both sides import it.
"""

from __future__ import annotations

import unicodedata
from typing import Final

from common.errors import InvalidText

MAX_NAME_CHARS: Final = 256
"""Names of companies, agents, projects and operator tokens, task titles."""
MAX_OPERATION_ID_CHARS: Final = 256
MAX_ERROR_CHARS: Final = 4096
"""A save error a sandbox reports (the run's and a repository's)."""

BIDI_CONTROLS: Final = frozenset(
    [chr(c) for c in range(0x202A, 0x202F)]
    + [chr(c) for c in range(0x2066, 0x206A)]
    + ["\u200e", "\u200f", "\u061c"]
)
_JOINERS: Final = frozenset("\u200c\u200d")
_MULTILINE: Final = frozenset("\n\t")
_WHAT: Final = {
    "control_character": "control characters",
    "bidi_control": "bidirectional controls",
    "invisible_character": "invisible characters",
}


def char_problem(ch: str, multiline: bool = False) -> str | None:
    """The detail code for a character the rule refuses, or None."""
    if ch in BIDI_CONTROLS:
        return "bidi_control"
    cat = unicodedata.category(ch)
    if cat == "Cc":
        return None if multiline and ch in _MULTILINE else "control_character"
    if (cat == "Cf" and ch not in _JOINERS) or cat in ("Cs", "Zl", "Zp"):
        return "invisible_character"
    return None


def text_problem(
    value: object, max_chars: int, *, multiline: bool = False, blank_ok: bool = False
) -> tuple[str, str] | None:
    """Why ``value`` breaks the text rule, as (detail code, message), or None."""
    if not isinstance(value, str):
        return "not_a_string", "must be a string"
    if not blank_ok and not value.strip():
        return "empty", "must not be empty"
    if len(value) > max_chars:
        return "too_long", f"must be at most {max_chars} characters"
    if value.isascii() and value.isprintable():
        return None  # the common case, in C: printable ASCII holds no refused character
    for ch in value:
        code = char_problem(ch, multiline)
        if code is not None:
            return code, f"must not contain {_WHAT[code]} (U+{ord(ch):04X} found)"
    return None


def check_text(
    value: object,
    field: str,
    max_chars: int = MAX_NAME_CHARS,
    *,
    multiline: bool = False,
    blank_ok: bool = False,
    label: str | None = None,
) -> str:
    """``value`` unchanged when it follows the rule, else :class:`InvalidText`
    (400 ``invalid_text``) naming ``field`` (``label``: how the message names
    it, for the command line)."""
    problem = text_problem(value, max_chars, multiline=multiline, blank_ok=blank_ok)
    if problem is not None:
        code, message = problem
        raise InvalidText(field, code, f"{label or field} {message}")
    assert isinstance(value, str)
    return value


def operation_id_problem(value: object) -> tuple[str, str] | None:
    """An operation id: 1-256 printable characters (``str.isprintable``: no
    separator but the space, no control or format character)."""
    if value == "":
        return "empty", "must not be empty"
    problem = text_problem(value, MAX_OPERATION_ID_CHARS, blank_ok=True)
    if problem is None and isinstance(value, str) and not value.isprintable():
        return "invisible_character", "must be printable"
    return problem


def is_operation_id(value: object) -> bool:
    return operation_id_problem(value) is None


def check_operation_id(value: object, field: str = "operationId") -> str:
    """``value`` when it is an operation id, else :class:`InvalidText`."""
    problem = operation_id_problem(value)
    if problem is not None:
        code, message = problem
        raise InvalidText(field, code, f"{field} {message}")
    assert isinstance(value, str)
    return value


def escape_text(value: str, *, multiline: bool = True) -> str:
    """``value`` with each character the rule refuses replaced by its
    ``\\xNN``/``\\uNNNN`` escape (readable, and unlike U+FFFD it says what was
    there)."""
    if value.isascii() and value.isprintable():
        return value
    out = []
    for ch in value:
        if char_problem(ch, multiline) is None:
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii"))
    return "".join(out)


def clean_text(value: str, max_chars: int = MAX_ERROR_CHARS, *, multiline: bool = True) -> str:
    """``value`` made to follow the rule: escaped (:func:`escape_text`), then
    cut to ``max_chars`` with a marker. For text the sender did not choose
    (an exception, a tool's output)."""
    text = escape_text(value, multiline=multiline)
    if not text.strip():
        return "(no message)"
    marker = " ...(truncated)"
    return text if len(text) <= max_chars else text[: max_chars - len(marker)] + marker
