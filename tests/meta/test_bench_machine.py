"""The machine line of benchmark results names the filesystem the work ran on."""

from __future__ import annotations

from pathlib import Path

from bench.machine import filesystem_line, machine_line
from tests.support.smallfs import small_tmpfs


def test_the_filesystem_is_the_innermost_mount_holding_the_path() -> None:
    with small_tmpfs(size="1m", inodes=64) as root:
        inner = root / "a" / "b"
        inner.mkdir(parents=True)
        assert filesystem_line(inner) == f"`{inner}` on tmpfs"
        assert machine_line(inner).endswith(f"; `{inner}` on tmpfs")
    assert filesystem_line(Path("/proc/self")) == "`/proc/self` on proc"


def test_ext4_says_whether_it_has_a_journal() -> None:
    line = filesystem_line(Path("/var/tmp"))
    fstype = line.split(" on ", 1)[1].split()[0]
    if fstype != "ext4":
        assert "journal" not in line, line
        return
    device = None
    for row in Path("/proc/self/mounts").read_text().splitlines():
        source, point, kind = row.split()[:3]
        if kind == "ext4" and point in ("/", "/var", "/var/tmp"):
            device = Path(source).name  # mounts are listed outer first
    assert device is not None
    journaled = any(Path("/proc/fs/jbd2").glob(f"{device}-*"))
    assert ("no journal" in line) is not journaled, line
