"""Which mode serves a collection: FUSE where it works, a plain directory elsewhere.

``--mode auto`` (the default of ``fsagent mount`` and ``fsagent up``, or
``$FSAGENT_MODE``) uses FUSE when ``/dev/fuse`` opens and a test mount
succeeds, and falls back to ``dir`` mode otherwise. The test mount is the
real thing: ``python -m fsagent.fuse.probe DIR`` mounts an empty pyfuse3
filesystem on a private temporary directory and unmounts it, in a process of
its own, so a runtime that hangs on mount (or libfuse missing) cannot hang
or break the daemon, and the daemon's own pyfuse3 session starts fresh.

A state dir keeps the mode it was first served in (fsagent.state.statedir,
``claim_mode``): ``auto`` follows it, so a collection is never served in the
other mode by accident. ``fsagent up`` and ``doctor`` decide for the four
collections of a state root at once (``decide_all``): when the state dirs
that record a mode all record ``dir``, all four stay plain directories, even
where FUSE works now (an unbound collection, or an agent folder whose local
copy ended with its run, records nothing), and the line that says so names
the recorded state, not a missing FUSE.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Final

from fsagent.errors import FsagentError, MountFailed

MODES: Final = ("auto", "fuse", "dir")
MODE_ENV: Final = "FSAGENT_MODE"
PROBE_TIMEOUT: Final = 30.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The mode that serves a collection and why (shown by ``status`` and ``doctor``)."""

    mode: str
    reason: str
    recorded: bool = False
    """Chosen by the mode a state dir records, under ``auto``; FUSE was not tried."""


def default_mode() -> str:
    """``$FSAGENT_MODE`` when it names a mode (a systemd drop-in can set it), else auto."""
    value = os.environ.get(MODE_ENV, "auto")
    return value if value in MODES else "auto"


def probe_fuse(timeout: float = PROBE_TIMEOUT) -> Decision:
    """``fuse`` if ``/dev/fuse`` opens and a test mount works, else ``dir``;
    the reason names what was found."""
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return Decision("dir", f"/dev/fuse cannot be opened ({exc.strerror})")
    os.close(fd)
    where = Path(tempfile.mkdtemp(prefix="fsagent-probe-"))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "fsagent.fuse.probe", str(where)],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        subprocess.run(["fusermount3", "-u", "-z", str(where)], capture_output=True, check=False)
        return Decision("dir", f"a test FUSE mount did not finish within {timeout:.0f}s")
    finally:
        try:
            where.rmdir()
        except OSError:
            shutil.rmtree(where, ignore_errors=True)
    if out.returncode == 0:
        return Decision("fuse", "/dev/fuse opens and a test mount works")
    # libfuse says why on stderr ("fuse: mount failed: ..."), then our own line.
    lines = [line.strip() for line in (out.stderr or out.stdout).splitlines() if line.strip()]
    why = "; ".join(lines[-2:]) if lines else f"exit status {out.returncode}"
    return Decision("dir", f"a test FUSE mount failed ({why})")


def recorded_mode(state_dir: Path) -> str | None:
    """The mode the state dir was served in, or None (no state yet, or unreadable:
    the daemon's own open reports that)."""
    from fsagent.state.journal import Journal
    from fsagent.state.statedir import MARKER, StateDir

    if not (state_dir / MARKER).exists():
        return None
    try:
        state = StateDir.open(state_dir, readonly=True)
    except (FsagentError, OSError):
        return None
    try:
        record = state.mode_record()
        if record is not None:
            return str(record["mode"])
        # Written before dir mode existed: a hydrated one is a FUSE collection.
        return "fuse" if Journal(state).baseline().hydrated else None
    finally:
        state.close()


def decide(
    requested: str,
    state_dir: Path | None,
    reason: str | None = None,
    probe: Callable[[], Decision] = probe_fuse,
) -> Decision:
    """The mode for ``--mode requested``; ``reason`` is the caller's, when it
    already decided (``fsagent up`` decides once for all four collections)."""
    if requested != "auto":
        return Decision(requested, reason or f"--mode {requested}")
    recorded = recorded_mode(state_dir) if state_dir is not None else None
    if recorded == "dir":
        return Decision("dir", DIR_STATE, recorded=True)
    found = probe()
    if found.mode == "dir" and recorded == "fuse":
        raise MountFailed(
            f"FUSE is not available here ({found.reason}), and the state dir {state_dir} "
            "holds a FUSE collection whose unsaved changes only a FUSE mount can serve"
        )
    return found if recorded is None else Decision("fuse", f"{found.reason}; {FUSE_STATE}")


def decide_all(
    requested: str, state_dirs: Mapping[str, Path], reason: str | None = None
) -> dict[str, Decision]:
    """The mode of each collection of a sandbox (scope -> its state dir), with
    FUSE probed at most once. Under ``auto``, when every state dir that records
    a mode records ``dir``, all of them are plain directories: one sandbox, one
    mode, the one its saved state was made in. Otherwise each follows its own
    record (a FUSE record where FUSE is gone is refused, as by ``decide``), and
    the ones without a record follow the probe."""
    if requested == "auto":
        records = {scope: recorded_mode(where) for scope, where in state_dirs.items()}
        named = [scope for scope, mode in records.items() if mode is not None]
        if named and all(records[scope] == "dir" for scope in named):
            if len(named) == 1:
                because = DIR_STATE.replace("the state dir", f"the state dir of {named[0]}")
            else:
                because = (
                    f"the state dirs of {', '.join(named)} record dir mode (they hold "
                    "plain-directory collections); FUSE not tried"
                )
            return {scope: Decision("dir", because, recorded=True) for scope in state_dirs}
    probe = cache(probe_fuse)
    return {scope: decide(requested, where, reason, probe) for scope, where in state_dirs.items()}


def dir_mode_line(subject: str, decision: Decision, plural: bool = False) -> str:
    """The one line ``auto`` says when it serves plain directories: FUSE is not
    available, or the recorded state chose them (then FUSE was not tried)."""
    if decision.recorded:
        verb = "stay plain directories" if plural else "stays a plain directory"
        return f"{subject} {verb} (dir mode): {decision.reason}"
    verb = "are plain directories" if plural else "is a plain directory"
    return f"FUSE is not available ({decision.reason}); {subject} {verb} (dir mode)"


DIR_STATE: Final = (
    "the state dir records dir mode (it holds a plain-directory collection); FUSE not tried"
)
FUSE_STATE: Final = "the state dir holds a FUSE collection"


def test_mount(where: Path) -> int:
    """Mount an empty filesystem at ``where`` and unmount it (``python -m
    fsagent.fuse.probe``); one line on stderr when it fails."""
    try:
        import pyfuse3
    except ImportError as exc:  # libfuse3 itself may be missing
        print(f"pyfuse3 cannot be loaded: {exc}", file=sys.stderr)
        return 1
    try:
        pyfuse3.init(pyfuse3.Operations(), str(where), {"fsname=fsagent-probe", "subtype=fsagent"})
    except RuntimeError as exc:
        print(f"pyfuse3.init: {exc}", file=sys.stderr)
        return 1
    pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(test_mount(Path(sys.argv[1])))
