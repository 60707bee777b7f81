"""A small in-memory pyfuse3 file system that logs every request it gets.

    python -m tests.support.pyfuse3_probe MOUNTPOINT LOG [--with-open] [--awaiting]

Run with the pyfuse3 under test (tests/support/pyfuse3_patch.py). Each request
is one JSON line in LOG: ``[op, handle or inode, detail]``. A lookup of a name
starting with ``MARK`` answers ENOENT and is logged, so a test can cut the log
into the requests each of its steps caused. Without ``--with-open`` the file
system has no open or opendir handler (the kernel's "no open" mode with the
patched pyfuse3); ``--awaiting`` makes getattr and lookup wait on the event loop once
(the path of a handler that cannot finish at once). A background task counts
its wake-ups (one a millisecond while it gets to run) in ``ticks``, logged by
a lookup of ``TICKS``.
"""

from __future__ import annotations

import errno
import json
import stat
import sys
from typing import Any

import pyfuse3
import trio
import trio.lowlevel

ROOT = pyfuse3.ROOT_INODE
TIME_NS = 1_700_000_000_000_000_000


class Probe(pyfuse3.Operations):
    enable_writeback_cache = True

    def __init__(self, log: Any, awaiting: bool) -> None:
        super().__init__()
        self.log_file = log
        self.awaiting = awaiting
        self.names: dict[bytes, int] = {}
        self.data: dict[int, bytes] = {}
        self.next_ino = ROOT + 1
        self.ticks = 0

    def log(self, *entry: Any) -> None:
        self.log_file.write(json.dumps(entry) + "\n")
        self.log_file.flush()

    def attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = (stat.S_IFDIR | 0o755) if ino == ROOT else (stat.S_IFREG | 0o644)
        a.st_nlink = 1
        a.st_size = len(self.data.get(ino, b""))
        a.attr_timeout = a.entry_timeout = 3600
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = TIME_NS
        return a

    async def ticker(self) -> None:
        while True:
            await trio.sleep(0.001)
            self.ticks += 1

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if self.awaiting:
            await trio.lowlevel.checkpoint()
        self.log("getattr", inode, None)
        return self.attrs(inode)

    async def lookup(
        self, parent: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if self.awaiting:
            await trio.lowlevel.checkpoint()
        self.log("lookup", parent, name.decode())
        if name == b"TICKS":
            self.log("ticks", self.ticks, None)
        if name.startswith((b"MARK", b"TICKS")) or name not in self.names:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs(self.names[name])

    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        ino = self.next_ino
        self.next_ino += 1
        self.names[name] = ino
        self.data[ino] = b""
        self.log("create", ino, name.decode())
        return pyfuse3.FileInfo(fh=1000 + ino), self.attrs(ino)

    def ino_of(self, fh: int) -> int:
        return fh - 1000 if fh > 1000 else fh

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.log("read", fh, off)
        return self.data[self.ino_of(fh)][off : off + size]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.log("write", fh, off)
        ino = self.ino_of(fh)
        data = bytearray(self.data[ino])
        data[len(data) :] = bytes(max(0, off - len(data)))
        data[off : off + len(buf)] = buf
        self.data[ino] = bytes(data)
        return len(buf)

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        self.log("setattr", inode, attr.st_size if fields.update_size else None)
        if fields.update_size:
            self.data[inode] = self.data[inode][: attr.st_size].ljust(attr.st_size, b"\0")
        return self.attrs(inode)

    async def flush(self, fh: int) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        self.log("release", fh, None)

    async def fsync(self, fh: int, datasync: bool) -> None:
        self.log("fsync", fh, None)

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        self.log("readdir", fh, start_id)
        entries = sorted(self.names.items())
        for i in range(start_id, len(entries)):
            name, ino = entries[i]
            if not pyfuse3.readdir_reply(token, name, self.attrs(ino), i + 1):
                return

    async def releasedir(self, fh: int) -> None:
        self.log("releasedir", fh, None)

    async def forget(self, inode_list: Any) -> None:
        pass


class ProbeWithOpen(Probe):
    """The same with open and opendir handlers: handles as pyfuse3 always had them."""

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self.log("open", inode, flags)
        return pyfuse3.FileInfo(fh=1000 + inode, keep_cache=True)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self.log("opendir", inode, None)
        return 5000 + inode


async def serve(fs: Probe) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.ticker)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main() -> None:
    mountpoint, log_path = sys.argv[1], sys.argv[2]
    cls = ProbeWithOpen if "--with-open" in sys.argv else Probe
    with open(log_path, "a") as log:
        fs = cls(log, "--awaiting" in sys.argv)
        options = set(pyfuse3.default_options) - {"default_permissions"}
        pyfuse3.init(fs, mountpoint, options | {"fsname=pyfuse3-probe", "noatime"})
        try:
            trio.run(serve, fs)
        finally:
            pyfuse3.close()


if __name__ == "__main__":
    main()
