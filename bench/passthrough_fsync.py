"""pyfuse3's example passthrough file system, with the fsync it leaves out.

    python bench/passthrough_fsync.py EXAMPLE_SCRIPT SOURCE MOUNTPOINT [options]

``examples/passthroughfs.py`` has no ``fsync`` or ``fsyncdir`` handler, so
pyfuse3 answers the kernel's first FSYNC with ``ENOSYS``; the kernel then
treats every later ``fsync(2)`` on the mount as done and never sends another.
Its write + fsync and SQLite figures would measure a file system that syncs
nothing. This runs the example unchanged except for those two handlers, which
sync the backing file (or directory) as any passthrough that keeps the
promise must, on the loop like the example's other handlers.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def load_example(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("passthroughfs", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_fsync(example: ModuleType) -> type:
    base = example.Operations

    class Syncing(base):  # type: ignore[misc,valid-type]
        async def fsync(self, fh: int, datasync: bool) -> None:
            (os.fdatasync if datasync else os.fsync)(fh)

        async def fsyncdir(self, fh: int, datasync: bool) -> None:
            # the example's opendir hands out the inode as the handle
            fd = os.open(self._inode_to_path(fh), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    return Syncing


def main() -> None:
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    example = load_example(sys.argv[1])
    example.Operations = with_fsync(example)
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    example.main()


if __name__ == "__main__":
    main()
