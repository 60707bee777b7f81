"""The suite's plugins: the real services as fixtures, and the session-wide checks.

Fixtures live in the shared test-support package (also used by ``bench/``);
registering them here makes them available to every test module without
importing them.
"""

pytest_plugins = [
    "pytester",  # tests/meta/test_support.py runs inner sessions to prove the session checks
    "tests.support.session",
    "tests.support.watchdog",
    "tests.support.fixtures",
    "tests.support.browser",
]
