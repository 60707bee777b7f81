"""The test-support package's own contracts: the session checks and the helpers' error paths."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time

import pytest

from tests.support.browser import BROWSER_TESTS
from tests.support.controller import ControllerProcess, parse_api_time
from tests.support.tmp import world_searchable_tmpdir

PLUGIN = ["-p", "tests.support.session"]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _repo_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytester's subprocess runs in its own temp dir: put the repository on its path."""
    parts = [REPO_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(parts))


def fsa_session_roots() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("fsa-s-")}


def test_api_times_order_by_value_not_by_string() -> None:
    # isoformat() leaves out the fraction when the microseconds are 0.
    whole, later = "2026-12-02T21:00:05Z", "2026-12-02T21:00:05.000100Z"
    assert not later > whole  # the string comparison the old assertion made gets this wrong
    assert parse_api_time(later) > parse_api_time(whole)
    assert parse_api_time("2026-12-02T21:00:05+00:00") == parse_api_time(whole)
    with pytest.raises(ValueError, match="without a time zone"):
        parse_api_time("2026-12-02T21:00:05")


def test_session_fails_when_a_test_leaves_temp_files(pytester: pytest.Pytester) -> None:
    before = fsa_session_roots()
    pytester.makepyfile(
        """
        import tempfile

        def test_leaks():
            tempfile.mkdtemp(prefix="leaked-")
            tempfile.mkstemp(prefix="leaked-file-")
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*temp files left behind*", "*2 entries in*", "  leaked-*"])
    assert result.parseoutcomes() == {"passed": 1}
    assert fsa_session_roots() == before  # the leaked files went with the session's root


def test_session_passes_when_tests_clean_up(pytester: pytest.Pytester) -> None:
    before = fsa_session_roots()
    pytester.makepyfile(
        """
        import os, shutil, tempfile

        def test_cleans_up(tmp_path):
            d = tempfile.mkdtemp()
            assert os.path.dirname(d) == os.environ["TMPDIR"]  # the session's root
            shutil.rmtree(d)
            (tmp_path / "kept-by-pytest").write_text("x")
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "temp files left behind" not in result.stdout.str()
    assert fsa_session_roots() == before


def test_unexpected_warning_logs_fail_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import logging
        import pytest

        log = logging.getLogger("some.module")

        def test_logs_a_warning():
            log.warning("disk %s is nearly full", "sda")

        def test_inspects_its_warning(caplog):
            log.warning("expected")
            assert caplog.records[0].getMessage() == "expected"

        @pytest.mark.allow_warning_logs
        def test_marked():
            log.error("tolerated")

        def test_info_is_fine():
            log.info("routine")
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "--strict-markers")
    assert result.parseoutcomes() == {"failed": 1, "passed": 3}
    result.stdout.fnmatch_lines(
        ["*unexpected WARNING log records*", "WARNING some.module: disk sda is nearly full"]
    )


def test_controller_helper_fails_fast_with_the_log() -> None:
    data = world_searchable_tmpdir("fsa-bad-ctl-")
    bad = ControllerProcess("postgresql://controller@/nodb?host=/nonexistent", data)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not become healthy") as info:
        bad.start(timeout=60)
    assert time.monotonic() - started < 30, "the helper waited out its deadline"
    assert "exited" in str(info.value)
    assert bad.log_path is not None and bad.log_path.parent == data
    shutil.rmtree(data)


WEDGED_DAEMON = r'''
import errno, stat, sys
import pyfuse3, trio

class Wedged(pyfuse3.Operations):
    """Answers lookups; takes every read and never answers it."""

    async def getattr(self, inode, ctx=None):
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        is_root = inode == pyfuse3.ROOT_INODE
        attr.st_mode = (stat.S_IFDIR | 0o755) if is_root else (stat.S_IFREG | 0o644)
        attr.st_size = 0 if is_root else 10
        return attr

    async def lookup(self, parent, name, ctx=None):
        if name != b"stuck":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(2)

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode, direct_io=True)

    async def read(self, fh, off, size):
        await trio.sleep_forever()

pyfuse3.init(Wedged(), sys.argv[1], set())
trio.run(pyfuse3.main)
'''


def test_watchdog_unwedges_a_test_stuck_on_a_fuse_mount(pytester: pytest.Pytester) -> None:
    """A read the daemon never answers is an uninterruptible wait: pytest-timeout
    alone could not end that worker. The watchdog prints the stacks and the
    processes, aborts the mount's FUSE connection, and the read fails."""
    pytester.makepyfile(
        daemon=WEDGED_DAEMON,
        test_wedged=f"""
        import os, subprocess, sys, tempfile, time
        import pytest

        @pytest.mark.timeout(30)
        def test_reads_from_a_wedged_mount():
            mnt = tempfile.mkdtemp(prefix="wedged-")
            proc = subprocess.Popen([sys.executable, {str(pytester.path / "daemon.py")!r}, mnt])
            try:
                deadline = time.monotonic() + 60
                while not os.path.ismount(mnt):
                    assert proc.poll() is None and time.monotonic() < deadline
                    time.sleep(0.05)
                with open(os.path.join(mnt, "stuck"), "rb") as fh:
                    fh.read()
            finally:
                proc.kill()
                proc.wait()
                subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
                os.rmdir(mnt)
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "tests.support.watchdog")
    result.assert_outcomes(failed=1)
    # The aborted connection ends the wait: ECONNABORTED for a request the
    # kernel still held (the kernel's choice varies by version), else ENOTCONN.
    result.stdout.re_match_lines([r".*\[Errno (103|107)\].*"])
    err = result.stderr.str()
    assert "watchdog: test_wedged.py::test_reads_from_a_wedged_mount has run" in err
    assert "in test_reads_from_a_wedged_mount" in err  # the stuck thread's stack
    assert "daemon.py" in err  # the processes below the worker
    assert "watchdog: aborting the FUSE connection of" in err


@pytest.mark.browser
@BROWSER_TESTS[1]  # skipped without Chromium, as the Files page tests are
def test_watchdog_ends_a_browser_call_that_waits_forever(pytester: pytest.Pytester) -> None:
    """``evaluate`` has no timeout of its own: a promise that never settles
    held a worker until pytest-timeout ended it (and with it the run, under
    xdist). The watchdog ends the browser and the call fails."""
    pytester.makepyfile(
        test_forever="""
        import pytest

        @pytest.mark.timeout(40)
        def test_waits_on_a_promise_forever(page):
            page.set_content("<p>hi</p>")
            page.evaluate("() => new Promise(() => {})")
        """,
    )
    result = pytester.runpytest_subprocess(
        *PLUGIN, "-p", "tests.support.watchdog", "-p", "tests.support.browser"
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1 and "passed" not in outcomes, outcomes
    result.stdout.fnmatch_lines(["*closed*"])  # Playwright: target or browser closed
    err = result.stderr.str()
    assert "watchdog: test_forever.py::test_waits_on_a_promise_forever has run" in err
    assert "watchdog: ending the browser process" in err
    # The test's own stack, parked in a greenlet while Playwright waits.
    assert 'in test_waits_on_a_promise_forever\n    page.evaluate("() => new Promise' in err


def make_test_xdist_args() -> list[str]:
    """The xdist options ``make test`` passes (the Makefile's PYTEST_XDIST)."""
    with open(os.path.join(REPO_ROOT, "Makefile")) as fh:
        for line in fh:
            if line.startswith("PYTEST_XDIST ="):
                return line.split("=", 1)[1].split()
    raise AssertionError("the Makefile names no PYTEST_XDIST")


def test_a_worker_that_dies_ends_the_run_naming_its_test(pytester: pytest.Pytester) -> None:
    """With --dist loadfile, xdist ran a crashed worker's test again on the
    other worker, and once both had died the run waited forever (the last CI
    run hung that way until its deadline). ``make test``'s options end the
    run instead, naming the test."""
    for name in "abd":
        pytester.makepyfile(**{f"test_{name}": "def test_one():\n    pass\n"})
    pytester.makepyfile(
        test_c="import os\n\ndef test_first():\n    pass\n\ndef test_dies():\n    os._exit(1)\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", *make_test_xdist_args(), timeout=120
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*worker 'gw*' crashed while running 'test_c.py::test_dies'*"])
    assert result.parseoutcomes()["failed"] == 1


def test_watchdog_acts_before_the_timeout_in_force_and_never_without_one(
    pytester: pytest.Pytester,
) -> None:
    """``--timeout 0`` (the long kill -9 loops) means no timeout: the watchdog
    once took the ini file's 600 s instead and ended a 30-minute loop."""
    pytester.makepyfile(
        test_limits="""
        import pytest
        from tests.support.watchdog import _limit

        def test_given(request):
            print("LIMIT", _limit(request.node))

        @pytest.mark.timeout(100)
        def test_marked(request):
            print("LIMIT", _limit(request.node))
        """,
    )
    limits = {}
    for args in ([], ["--timeout", "0"], ["--timeout", "200"]):
        result = pytester.runpytest_subprocess(
            *PLUGIN, "-p", "tests.support.watchdog", "-s", "-o", "timeout=600", *args
        )
        result.assert_outcomes(passed=2)
        limits[" ".join(args)] = [float(v) for v in re.findall(r"LIMIT (\S+)", result.stdout.str())]
    assert limits == {"": [540.0, 50.0], "--timeout 0": [0.0, 50.0], "--timeout 200": [140.0, 50.0]}


@BROWSER_TESTS[1]  # skipped without Chromium, as the Files page tests are
def test_a_browser_past_its_age_or_closed_is_launched_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from playwright.sync_api import sync_playwright

    from tests.support import browser as support

    with sync_playwright() as pw:
        held = support.Browsers(pw)
        try:
            first = held.young()
            assert held.young() is first and first.is_connected()
            first.close()
            second = held.young()
            assert second is not first and second.is_connected()
            monkeypatch.setattr(support, "BROWSER_MAX_AGE_S", 0.0)
            third = held.young()
            assert third is not second and third.is_connected()
            assert not second.is_connected()  # the old one was closed
        finally:
            held.close()
