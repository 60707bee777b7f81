"""The agent's env file: one quoting that every reader takes the same way.

Four readers read it: systemd's ``EnvironmentFile=`` (a unit that runs the
agent), POSIX sh (``set -a; . FILE; set +a``), :func:`read_env_file`
(``fsagent launch`` and ``doctor``) and ``/etc/profile.d/fsagent.sh`` in the
sandbox image (which decodes it without running it: a root login shell
reads that file too, and the agent can write it).

Every value is written as ``KEY="..."`` with a backslash before each
backslash, double quote, dollar sign and backquote. Inside double quotes
these four are exactly what POSIX sh
unescapes (nothing else is special there once ``$`` and the backquote are
escaped), and exactly what systemd.exec(5) unescapes in a double-quoted
``EnvironmentFile=`` value; both keep a backslash before any other
character, which is never written. So spaces, quotes, ``#``, ``;`` and
``'`` in a home path are plain data to all four. A newline has no escape
the four share, and systemd refuses a value that is not UTF-8 or holds NUL:
such a value is refused when the file is written (:class:`UnwritableEnv`).

:func:`parse_env` implements systemd's documented rules (systemd.exec(5),
"EnvironmentFile="; the state machine of systemd's ``env-file.c``): unquoted
values with backslash escapes and trailing blanks dropped, single and double
quotes, ``#``/``;`` comment lines. So a file written by hand, or by an older
fsagent (plain ``KEY=VALUE``), reads here as systemd reads it.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from fsagent.errors import FULL_DISK, FsagentError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NEED_ESCAPE = '"\\`$'
"""Unescaped inside double quotes by sh and systemd alike."""
_NEWLINE = "\n\r"
_BLANK = " \t\n\r"
_COMMENT = "#;"


class UnwritableEnv(FsagentError):
    """A variable no env file can carry to every reader (a newline, NUL or
    non-UTF-8 byte in its value, or an invalid name): a usage error."""

    exit_code = 2


def quote_value(name: str, value: str) -> str:
    """``value`` double-quoted for the env file; UnwritableEnv when it cannot be."""
    if "\n" in value or "\0" in value:
        raise UnwritableEnv(f"{name} cannot go into an env file: its value has a newline or NUL")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UnwritableEnv(f"{name} cannot go into an env file: it is not UTF-8") from None
    escaped = "".join("\\" + c if c in _NEED_ESCAPE else c for c in value)
    return f'"{escaped}"'


def format_env(env: dict[str, str]) -> str:
    """The file's text: one ``KEY="value"`` line per variable, in order."""
    lines = []
    for name, value in env.items():
        if not _NAME.fullmatch(name):
            raise UnwritableEnv(f"{name!r} is not a variable name")
        lines.append(f"{name}={quote_value(name, value)}\n")
    return "".join(lines)


def parse_env(text: str) -> dict[str, str]:
    """The variables of an env file's text, as systemd reads ``EnvironmentFile=``
    (a later assignment wins; an invalid name is skipped)."""
    env: dict[str, str] = {}
    state = "pre_key"
    key: list[str] = []
    value: list[str] = []
    key_blank = value_blank = -1  # where trailing blanks start, or -1

    def push() -> None:
        name = "".join(key[:key_blank] if key_blank >= 0 else key)
        if _NAME.fullmatch(name):
            env[name] = "".join(value)

    for c in text:
        if state == "pre_key":
            if c in _COMMENT:
                state = "comment"
            elif c not in _BLANK:
                state, key, value, key_blank = "key", [c], [], -1
        elif state == "key":
            if c in _NEWLINE:
                state = "pre_key"
            elif c == "=":
                state, value_blank = "pre_value", -1
            else:
                if c not in _BLANK:
                    key_blank = -1
                elif key_blank < 0:
                    key_blank = len(key)
                key.append(c)
        elif state == "pre_value":
            if c in _NEWLINE:
                push()
                state = "pre_key"
            elif c == "'":
                state = "single"
            elif c == '"':
                state = "double"
            elif c == "\\":
                state = "escape"
            elif c not in _BLANK:
                state = "value"
                value.append(c)
        elif state == "value":
            if c in _NEWLINE:
                if value_blank >= 0:
                    del value[value_blank:]
                push()
                state = "pre_key"
            elif c == "\\":
                state, value_blank = "escape", -1
            else:
                if c not in _BLANK:
                    value_blank = -1
                elif value_blank < 0:
                    value_blank = len(value)
                value.append(c)
        elif state == "escape":
            state = "value"
            if c not in _NEWLINE:  # an escaped newline continues the line
                value.append(c)
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
        elif state == "double_escape":
            state = "double"
            if c in _NEED_ESCAPE:
                value.append(c)
            elif c != "\n":  # like sh: the backslash stays before anything else
                value += ["\\", c]
        elif state == "comment":
            if c == "\\":
                state = "comment_escape"
            elif c in _NEWLINE:
                state = "pre_key"
        elif state == "comment_escape":
            state = "pre_key" if c in _NEWLINE else "comment"
    if state in ("pre_value", "value", "escape", "single", "double", "double_escape"):
        if state == "value" and value_blank >= 0:
            del value[value_blank:]
        push()
    return env


def read_env_file(path: Path) -> dict[str, str]:
    """The variables of an env file (:func:`parse_env`)."""
    return parse_env(path.read_bytes().decode("utf-8", "surrogateescape"))


def write_env_file(path: Path, env: dict[str, str]) -> None:
    """Replace the env file atomically (a reader sees the old or the new one).

    On a full disk the new file cannot be made. An env file already there (a
    sandbox started again after its agent filled the disk) is then rewritten
    in place, in the blocks it already has, so the start does not fail for
    want of one block: a reader might see it half written, as nobody reads it
    before ``fsagent up`` says it is ready. The full disk's error is raised
    when there is no such file or the new text would need more room."""
    data = format_env(env).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno not in FULL_DISK or not _rewrite_in_place(path, data):
            raise


def _rewrite_in_place(path: Path, data: bytes) -> bool:
    """Write ``data`` over the regular file ``path`` where its allocated
    blocks hold it; False (the file untouched) where they do not or it is
    not there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or len(data) > st.st_blocks * 512:
            return False
        view = memoryview(data)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], done)
        os.ftruncate(fd, len(data))
        return True
    finally:
        os.close(fd)


def update_env_file(path: Path, updates: dict[str, str]) -> None:
    """Set ``updates`` in the env file, keeping its other variables."""
    env = read_env_file(path) if path.exists() else {}
    write_env_file(path, {**env, **updates})
