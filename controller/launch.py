"""The ``controller`` command's entry point.

The package installs both commands, but only the ``controller`` extra brings
the controller's dependencies (PostgreSQL's driver, the web framework, the
S3 client): the sandbox installs fsagent without them. There ``controller``
says so in one line, naming what to install, instead of ending in an import
traceback.
"""

from __future__ import annotations

import sys

DISTRIBUTION = "fsagent-workfolders"
EXIT_NOT_INSTALLED = 2
"""argparse's usage error: the command cannot run as installed."""

_OWN = frozenset({"controller", "common", "fsagent"})


def main(argv: list[str] | None = None) -> int:
    try:
        from controller.cli import main as cli_main
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if not missing or missing in _OWN:
            raise  # a broken install of this package itself: the traceback says where
        print(
            f"controller: the controller's dependencies are not installed (no module"
            f" {missing!r}); install the package with its controller extra:"
            f" pip install '{DISTRIBUTION}[controller]'",
            file=sys.stderr,
        )
        return EXIT_NOT_INSTALLED
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
