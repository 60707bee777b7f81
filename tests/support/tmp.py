"""Private temp dirs.

Under pytest, ``tempfile.gettempdir()`` is the session's own temp root (see
:mod:`tests.support.session`), so every dir made here is removed with it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def private_tmpdir(prefix: str) -> Path:
    """A fresh dir under the current temp root, short enough for unix socket paths."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def world_searchable_tmpdir(prefix: str) -> Path:
    """A temp dir the postgres user can reach when tests run as root."""
    d = private_tmpdir(prefix)
    os.chmod(d, 0o711)
    return d
