"""pyfuse3 with fsagent's patch (packaging/pyfuse3), for tests whatever the venv has.

fsagent runs in the kernel's "no open" mode only with the patched pyfuse3, and
with handles otherwise. Tests exercise both whichever pyfuse3 the venv holds:
:func:`patched_pyfuse3_env` gives the environment for a subprocess that must
import the patched build (the venv's own when it is that build, else a copy
installed under ``.test-cache/`` from the wheel ``packaging/pyfuse3/build.sh``
builds, which ``make deps`` has already left in ``build/pyfuse3-wheels``), and
:func:`handles_env` one that makes fsagent keep OPEN/RELEASE handles.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.constants import REPO

PACKAGING = REPO / "packaging" / "pyfuse3"
BUILD = PACKAGING / "build.sh"


def patched_version() -> str:
    """The version the patched build carries (``3.5.0+fsagent.N``), from build.sh."""
    text = BUILD.read_text()
    version = re.search(r"^version=(\S+)$", text, re.M)
    label = re.search(r"^label=(\S+)$", text, re.M)
    assert version and label, "build.sh names no version or label"
    return f"{version[1]}+{label[1]}"


def venv_has_patched() -> bool:
    try:
        return importlib.metadata.version("pyfuse3") == patched_version()
    except importlib.metadata.PackageNotFoundError:
        return False


@functools.cache
def patched_site() -> Path | None:
    """A directory holding the patched pyfuse3 to put first on PYTHONPATH, or
    None when this interpreter's pyfuse3 is already the patched build."""
    if venv_has_patched():
        return None
    digest = hashlib.sha256()
    for f in sorted(PACKAGING.iterdir()):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    site = REPO / ".test-cache" / f"pyfuse3-{digest.hexdigest()[:16]}"
    if (site / "pyfuse3").is_dir():
        return site
    site.parent.mkdir(parents=True, exist_ok=True)
    # `make test`'s xdist workers may both get here: one builds and installs
    # while the other waits, then finds the site in place.
    with open(site.parent / "pyfuse3.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (site / "pyfuse3").is_dir():
            _install_patched(site)
    return site


def _install_patched(site: Path) -> None:
    """Build the patched wheel and install it into ``site`` (under the lock)."""
    out = subprocess.run([str(BUILD), "--python", sys.executable], capture_output=True,
                         text=True, check=False, timeout=1800)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"packaging/pyfuse3/build.sh failed:\n{out.stdout}\n{out.stderr}")
    wheel = out.stdout.strip().splitlines()[-1]
    staging = Path(tempfile.mkdtemp(prefix=site.name + ".", dir=site.parent))
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(staging), wheel], check=True, timeout=600)  # fmt: skip
        staging.rename(site)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def patched_pyfuse3_env() -> dict[str, str]:
    """The environment of a subprocess that imports the patched pyfuse3."""
    env = dict(os.environ)
    site = patched_site()
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env.pop("FSAGENT_FUSE_HANDLES", None)
    return env


def handles_env() -> dict[str, str]:
    """The environment of an fsagent that keeps OPEN/RELEASE handles (the mode
    it runs in with a stock pyfuse3), with the venv's pyfuse3."""
    return {**os.environ, "FSAGENT_FUSE_HANDLES": "1"}
