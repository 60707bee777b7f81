"""Session-wide checks: the suite removes what it creates, and logs no surprises.

Temp root: at configure time the session makes its own directory under the
system temp dir and points ``TMPDIR`` (and :mod:`tempfile`) at it, so every
helper, every subprocess it starts and pytest's own ``tmp_path`` create their
files there. When the session ends, anything still in it besides pytest's
``tmp_path`` tree is a leak: the leftovers are listed and the run fails. The
root is then removed in any case (set ``FSA_KEEP_TMP=1`` to keep it for a
post-mortem). Other developers run tests on the same machine at the same
time, so the check looks only at this session's root, never at /tmp itself.

WARNING logs: a test whose call phase logs a record at WARNING or above fails,
unless it asks for ``caplog`` (it then inspects the records itself) or carries
``@pytest.mark.allow_warning_logs``. A warning nobody expected is a bug report
nobody reads.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Generator
from pathlib import Path

import pytest

KEEP_ENV = "FSA_KEEP_TMP"
_root_key = pytest.StashKey[Path]()
_old_tmpdir_key = pytest.StashKey[str | None]()
_leftovers_key = pytest.StashKey[list[str]]()


def session_temp_root(config: pytest.Config) -> Path:
    return config.stash[_root_key]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_warning_logs: the test may log WARNING records it does not inspect"
    )
    root = Path(tempfile.mkdtemp(prefix="fsa-s-"))
    # Like /tmp: the embedded PostgreSQL and daemons run as other users and
    # make their own temp files here too.
    os.chmod(root, 0o1777)
    config.stash[_root_key] = root
    config.stash[_old_tmpdir_key] = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = None  # recomputed from TMPDIR on next use


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                found.append(point)
    return found


def leftovers(root: Path) -> list[str]:
    """What the session left in its temp root: live mounts, then files and dirs
    (pytest's own ``tmp_path`` tree aside, pytest manages that)."""
    found = [f"mount {p}" for p in _mounts_under(root)]
    found += sorted(
        str(p.relative_to(root)) for p in root.iterdir() if not p.name.startswith("pytest-of-")
    )
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Runs after the session fixtures are torn down (trylast: after the runner's own hook)."""
    root = session.config.stash.get(_root_key, None)
    if root is None or not root.exists():
        return
    left = leftovers(root)
    session.config.stash[_leftovers_key] = left
    if left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.config.stash.get(_leftovers_key, [])
    if left:
        root = terminalreporter.config.stash[_root_key]
        terminalreporter.section("temp files left behind", red=True)
        terminalreporter.line(f"the session left {len(left)} entries in {root}:")
        for entry in left[:50]:
            terminalreporter.line(f"  {entry}")


def pytest_unconfigure(config: pytest.Config) -> None:
    root = config.stash.get(_root_key, None)
    if root is None:
        return
    old = config.stash[_old_tmpdir_key]
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None
    if os.environ.get(KEEP_ENV):
        print(f"{KEEP_ENV} is set: the session's temp root stays at {root}")
        return
    for point in _mounts_under(root):  # never recurse into a live mount
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True, check=False)
    shutil.rmtree(root, ignore_errors=True)


class _WarningRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _expects_warnings(item: pytest.Item) -> bool:
    fixtures = getattr(item, "fixturenames", ())
    return "caplog" in fixtures or item.get_closest_marker("allow_warning_logs") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    handler = _WarningRecords()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        result = yield
    finally:
        root.removeHandler(handler)
    if handler.records and not _expects_warnings(item):
        lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in handler.records[:20]]
        pytest.fail(
            "unexpected WARNING log records (use caplog, or mark the test "
            "allow_warning_logs):\n" + "\n".join(lines),
            pytrace=False,
        )
    return result
