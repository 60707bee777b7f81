"""Hydration progress on a terminal: how far the filling of plain directories got.

A dir-mode daemon fills its directory before the agent starts
(fsagent.dirmode.serve), which can take minutes. In the foreground on a terminal it
rewrites one line in place. Started by another process, it has no terminal
of its own worth writing to: under ``fsagent up`` four daemons share one, and
``\\r`` lines from four processes overwrite each other; a detaching ``fsagent
mount`` sends its daemon's stderr to a log. So the process that started it,
when its own stderr is a terminal, passes ``--progress-file`` (the daemon then
writes its figures there as JSON instead of printing them) and shows them
itself with :class:`ProgressView`: ``up`` as one combined line for all its
collections, ``mount`` as the daemon would have.

No trio here: ``up`` and ``mount``'s detaching parent are plain loops.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

MIB = 1 << 20


def describe(figures: Mapping[str, Any]) -> str:
    """``task: 120/500 files, 1.2/10.0 MiB``."""
    return (
        f"{figures['scope']}: {figures['done']}/{figures['files']} files, "
        f"{figures['doneBytes'] / MIB:.1f}/{figures['bytes'] / MIB:.1f} MiB"
    )


def write_figures(path: Path, figures: Mapping[str, Any]) -> None:
    """Replace ``path`` with the figures (best effort: progress is never worth
    failing a hydration for)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(dict(figures)))
        os.replace(tmp, path)
    except OSError:
        pass


def read_figures(path: Path) -> dict[str, Any] | None:
    try:
        figures: dict[str, Any] = json.loads(path.read_text())
        describe(figures)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return figures


class ProgressView:
    """The progress files of the daemons a process started, shown on its stderr
    as one line rewritten in place, only when that is a terminal."""

    def __init__(self, prefix: str, files: Mapping[str, Path], stream: TextIO | None = None):
        self.prefix = prefix
        self.files = dict(files)
        self.stream = stream or sys.stderr
        self.active = bool(self.files) and self.stream.isatty()
        self.shown = ""

    def refresh(self) -> None:
        if not self.active:
            return
        found = [read_figures(path) for path in self.files.values()]
        line = "; ".join(describe(f) for f in found if f is not None)
        if not line or line == self.shown:
            return
        # Clear to the end of the line: a shorter line must not leave the tail
        # of the longer one before it.
        self.stream.write(f"\r{self.prefix}{line}\x1b[K")
        self.stream.flush()
        self.shown = line

    def finish(self) -> None:
        """The last figures, and the line ended, so what follows starts afresh."""
        self.refresh()
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""
        self.active = False
