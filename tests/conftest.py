"""The suite's plugins: the real services as fixtures, and the session-wide checks.

Fixtures live in the shared test-support package (also used by ``bench/``);
registering them here makes them available to every test module without
importing them.
"""

pytest_plugins = [
    "tests.support.session",
    "tests.support.fixtures",
]
