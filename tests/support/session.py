"""Session-wide checks: the suite removes what it creates, and logs no surprises.

Temp root: at configure time the session makes its own directory under the
system temp dir and points ``TMPDIR`` (and :mod:`tempfile`) at it, so every
helper, every subprocess it starts and pytest's own ``tmp_path`` create their
files there. When the session ends, anything still in it besides pytest's
``tmp_path`` tree is a leak: the leftovers are listed and the run fails. The
root is then removed in any case (set ``FSA_KEEP_TMP=1`` to keep it for a
post-mortem). Other developers run tests on the same machine at the same
time, so the check looks only at this session's root, never at /tmp itself.

Helpers' temp dirs: :mod:`tests.support.tmp` hands each dir to the fixture
being set up or the test being run when it is made; it is removed after that
fixture's teardown, or after the test's.

WARNING logs: a test whose call phase logs a record at WARNING or above fails,
unless it asks for ``caplog`` (it then inspects the records itself) or carries
``@pytest.mark.allow_warning_logs``. A warning nobody expected is a bug report
nobody reads.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.support import tmp
from tests.support.tmp import mounts_under, remove_tree

KEEP_ENV = "FSA_KEEP_TMP"
_root_key = pytest.StashKey[Path]()
_old_tmpdir_key = pytest.StashKey[str | None]()
_leftovers_key = pytest.StashKey[list[str]]()
_test_dirs_key = pytest.StashKey[list[Path]]()
_fixture_dirs: dict[int, list[Path]] = {}


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


def leftovers(root: Path) -> list[str]:
    """What the session left in its temp root: live mounts, then files and dirs
    (pytest's own ``tmp_path`` tree aside, pytest manages that)."""
    found = [f"mount {p}" for p in mounts_under(root)]
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
    remove_tree(root)


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
    tmp.claim_begin()
    try:
        result = yield
    finally:
        item.stash[_test_dirs_key] = tmp.claim_end()
        root.removeHandler(handler)
    if handler.records and not _expects_warnings(item):
        lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in handler.records[:20]]
        pytest.fail(
            "unexpected WARNING log records (use caplog, or mark the test "
            "allow_warning_logs):\n" + "\n".join(lines),
            pytrace=False,
        )
    return result


# --- temp dirs the helpers made: removed by their owner's teardown ------------


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Generator[None, object, object]:
    tmp.claim_begin()
    try:
        return (yield)
    finally:
        _fixture_dirs.setdefault(id(fixturedef), []).extend(tmp.claim_end())


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any]) -> None:
    """After the fixture's own teardown (it stops what runs in its dirs)."""
    for d in _fixture_dirs.pop(id(fixturedef), []):
        remove_tree(d)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    """After the test's function-scoped fixtures are torn down."""
    try:
        return (yield)
    finally:
        for d in item.stash.get(_test_dirs_key, []):
            remove_tree(d)
