"""The open files of one mount: copy-on-write over saved contents, reads and
writes, with the store committing each change.

Durability point: each WRITE reaches the upper file (or the inline record)
and its size, generation and journal entry are committed before it is
answered, so a written file survives ``kill -9``; after a crash the size of
an upper file is recovered from the file itself, which is always exactly as
long as the logical file (fsagent.state.tree, ``recover``).  One exception
commits less: a WRITE to an upper file whose records are durable (an fsync
synced them, and its journal entry with them: ``StateDir.is_durable``) has
nothing to add that a crash could lose. Its journal entry is there, and its
size is the file's length; its new size and generation are kept in memory
and committed with the next batch (``on_behind``), or before a listing from
committed records (``Store.commit_behind``). A SQLite commit is then one
``pwrite`` and one ``fdatasync``, with no LMDB commit between them.  Where
contents live on the disk is :mod:`fsagent.state.content`'s.

Threading: reads and writes of one FUSE request (at most 128 KiB) on a local
file go straight to the page cache and are done inline on the trio thread,
because a thread hop would cost more than the copy.  Whole-file work (copy-up,
fsync, object fetches) runs in worker threads; an fd used by a worker is
pinned so that it is not closed underneath it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

import trio

from common.types import Digest
from fsagent.state.content import INLINE_MAX
from fsagent.state.hydrate import ContentFetcher
from fsagent.state.records import EMPTY_DIGEST, Inode, InodeNo, now_ns
from fsagent.state.store import Store

_R = TypeVar("_R")

WRITEBACK_EVERY: Final = 8 * 1024 * 1024
"""Bytes written to an upper file (since its last fsync or writeback start)
after which the mount starts writing its dirty pages to disk in the
background (:attr:`Content.writeback_due`, taken by
``WorkFolderFS._write_back_uppers`` in fsagent.fuse.fs). Without it, a large file's pages all stay dirty
until its fsync (the kernel's own writeback waits for about 10% of memory to
be dirty, or 30 s), and the fsync then writes all of it: 256 MiB then took
an fsync of about 100 ms after writes of about 150 ms."""


@dataclass(slots=True)
class OpenFile:
    """Per-inode backing fd shared by all handles of that inode (-1 while inline).

    ``opens``: open handles (when the kernel sends OPEN); ``pins``: uses in
    flight that may wait (a worker thread, a copy-up), during which the fd
    must not be closed."""

    fd: int
    upper: bool
    inline: bool = False
    opens: int = 0
    pins: int = 0
    retired: list[int] = field(default_factory=list)
    unsynced: int = 0
    """Bytes written to ``fd`` since its last fsync."""
    inline_fsyncs: int = 0
    """fsyncs of the file while inline (fsagent.fuse.fs, ``fsync``)."""
    unstarted: int = 0
    """Bytes written to ``fd`` since its last fsync or writeback start
    (:data:`WRITEBACK_EVERY`)."""


class Content:
    """The contents of the open files of one mount; used by the FUSE operations only.

    Every method that changes content commits through the store before it
    returns (see the durability point above).  Raises OSError (ENOSPC, EIO
    from a failed fetch); the FUSE layer maps errors to errno replies.
    """

    def __init__(self, store: Store, fetcher: ContentFetcher) -> None:
        self.store = store
        self.fetcher = fetcher
        self.upper = store.tree.upper
        self.files: dict[InodeNo, OpenFile] = {}
        self._copy_locks: dict[InodeNo, trio.Lock] = {}
        self.writeback_due: dict[InodeNo, OpenFile] = {}
        """Upper files with :data:`WRITEBACK_EVERY` bytes written since their
        last fsync or writeback start; taken by the mount's background task,
        which :attr:`writeback_wake` wakes."""
        self.writeback_wake = trio.Event()
        self.on_behind: Callable[[InodeNo], None] | None = None
        """Set by the mount: takes a durable upper file whose new size and
        generation a WRITE kept in memory, to commit them with its next batch
        (see the durability point above). None: every WRITE commits."""

    def release_fd(self, of: OpenFile, fd: int) -> None:
        if fd < 0:
            return
        if of.pins:
            of.retired.append(fd)
        else:
            os.close(fd)

    async def pinned(self, of: OpenFile, fn: Callable[[int], _R]) -> _R:
        """Run ``fn(fd)`` in a worker thread without the fd being closed meanwhile."""
        of.pins += 1
        try:
            return await trio.to_thread.run_sync(fn, of.fd)
        finally:
            self.unpin(of)

    @staticmethod
    def unpin(of: OpenFile) -> None:
        """End one use of ``of`` begun with ``of.pins += 1``; close the fds
        retired meanwhile once nobody uses them."""
        of.pins -= 1
        if not of.pins:
            for fd in of.retired:
                os.close(fd)
            of.retired.clear()

    async def make_upper(self, inode: Inode, *, copy: bool) -> None:
        """Give ``inode`` its own upper copy (copy-on-write), once.

        Up to ``INLINE_MAX`` bytes the copy goes into the store in the same
        commit that sets the upper flag.  A larger copy is complete (written
        to a temp name and renamed into place) before the inode record says
        ``upper``, so a crash in between leaves the saved content showing,
        never a half copy.  ``copy=False`` (a truncation to zero) copies nothing.
        """
        lock = self._copy_locks.setdefault(inode.ino, trio.Lock())
        async with lock:
            if inode.upper:
                return
            size = inode.size if copy and inode.digest and inode.digest != EMPTY_DIGEST else 0
            src = await self.fetcher.ensure(Digest(inode.digest or EMPTY_DIGEST)) if size else None
            if size <= INLINE_MAX:
                data = b"" if src is None else await trio.to_thread.run_sync(src.read_bytes)
                if not self.store.dir.has_room(len(data)):
                    raise OSError(errno.ENOSPC, "no room for inline contents")
                inode.size = len(data)
            else:
                assert src is not None
                await trio.to_thread.run_sync(
                    self.upper.write_complete, inode.ino, lambda tmp: shutil.copyfile(src, tmp)
                )
                data = None
            inode.upper = True
            inode.digest = None
            inode.generation += 1
            self.store.tree.persist(inode, touch="write", inline=data)
            of = self.files.get(inode.ino)
            if of is not None and not of.upper:
                old = of.fd
                of.fd = -1 if data is not None else self.upper.open_rw(inode.ino)
                of.upper, of.inline = True, data is not None
                self.release_fd(of, old)
        self._copy_locks.pop(inode.ino, None)

    def spill(self, inode: Inode) -> None:
        """Move an inline file to ``upper/<inode>`` now (see :meth:`_spill`)."""
        data = self.store.tree.inline_data(inode.ino)
        if data is not None:
            self._spill(inode, data)

    def _spill(self, inode: Inode, data: bytes) -> None:
        """Move an inline file that outgrows ``INLINE_MAX`` to ``upper/<inode>``.

        Synchronous on purpose: no other request may change the inline copy
        while it moves.  The file is complete before the inline copy is
        dropped; a crash in between leaves both and recovery keeps the inline one.
        A failure (the disk full, a commit past the reserve) leaves the file
        inline as it was, with no upper file taking the space; the backing is
        opened before the inline copy goes, so an open file never reads an
        inline copy that is gone.
        """
        self.upper.write_complete(inode.ino, lambda tmp: tmp.write_bytes(data))
        of = self.files.get(inode.ino)
        fd = -1
        try:
            if of is not None:
                fd = self.upper.open_rw(inode.ino)
            self.store.tree.drop_inline(inode)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self.upper.remove(inode.ino)
            raise
        if of is not None:
            of.fd, of.inline = fd, False

    async def truncate(self, node: Inode, size: int) -> bytes | None:
        """Set the file's length (copying it up first); the new inline
        contents for the caller's commit, or None when the file is not inline."""
        if not node.upper:
            await self.make_upper(node, copy=size > 0)
        inline = self.store.tree.inline_data(node.ino)
        if inline is not None and size > INLINE_MAX:
            self._spill(node, inline)
            inline = None
        if inline is not None:
            if size > len(inline) and not self.store.dir.has_room(size - len(inline)):
                raise OSError(errno.ENOSPC, "no room for inline contents")
            inline = inline[:size] + bytes(max(0, size - len(inline)))
        else:
            of = self.files.get(node.ino)
            if of is not None:
                os.ftruncate(of.fd, size)
            else:
                self.upper.truncate(node.ino, size)
        node.size = size
        node.generation += 1
        node.mtime_ns = now_ns()
        return inline

    def open_upper(self, ino: InodeNo) -> OpenFile:
        if self.store.tree.inline_data(ino) is not None:
            return OpenFile(-1, upper=True, inline=True)
        return OpenFile(self.upper.open_rw(ino), upper=True)

    @staticmethod
    def open_saved(path: Path) -> OpenFile:
        """A read-only backing file on a saved object (until the first write copies it up)."""
        return OpenFile(os.open(path, os.O_RDONLY | os.O_CLOEXEC), upper=False)

    def read(self, ino: InodeNo, of: OpenFile, off: int, size: int) -> bytes:
        if of.inline:
            return (self.store.tree.inline_data(ino) or b"")[off : off + size]
        return os.pread(of.fd, size, off)

    async def write(self, node: Inode, of: OpenFile, off: int, buf: bytes) -> int:
        """Write ``buf`` at ``off``; bytes, size, generation and journal entry
        are committed before this returns (for a durable upper file the size
        and generation follow in the next batch: see the durability point).

        The mtime is left alone: with the writeback cache (fsagent.fuse.fs) the
        kernel owns it. It stamps the time of the agent's write() or of the
        first store to a mapped page and hands it over in a SETATTR, which
        may reach us before this page write-back does (mmap's pages are
        written back in the background). A stamp of our own clock here
        replaced the kernel's time, and the file showed another mtime after
        a remount than before it."""
        end = off + len(buf)
        if not node.upper:
            await self.make_upper(node, copy=True)
        if of.inline:
            data = self.store.tree.inline_data(node.ino) or b""
            if end > INLINE_MAX:
                self._spill(node, data)
            else:
                if end > len(data) and not self.store.dir.has_room(end - len(data)):
                    raise OSError(errno.ENOSPC, "no room for inline contents")
                if off > len(data):
                    data += bytes(off - len(data))
                node.size = max(len(data), end)
                node.generation += 1
                self.store.tree.persist(node, touch="write", inline=data[:off] + buf + data[end:])
                return len(buf)
        # Never answer with a short count: FUSE writeback takes any answer
        # without an error for the whole request, so the tail past a short
        # write (the disk just filled) would be lost without a trace, even
        # though the agent's fsync and close succeed. Write the rest, and
        # let ENOSPC reach the kernel as this request's error.
        view = memoryview(buf)
        written = 0
        try:
            while written < len(buf):
                written += os.pwrite(of.fd, view[written:], off + written)
        finally:
            of.unsynced += written
            of.unstarted += written
            if of.unstarted >= WRITEBACK_EVERY:
                of.unstarted = 0
                self.writeback_due[node.ino] = of
                self.writeback_wake.set()
            if written:
                node.size = max(node.size, off + written)
                node.generation += 1
                if self.on_behind is not None and self.store.dir.is_durable(node.ino):
                    self.on_behind(node.ino)
                else:
                    self.store.tree.persist(node, touch="write")
        return written

    async def fsync(self, of: OpenFile) -> None:
        """Make the upper file's data and length durable (the caller syncs the
        store when the inode's records may not be durable yet)."""
        if of.upper and not of.inline:
            unsynced = of.unsynced
            of.unstarted = 0
            await self.pinned(of, os.fdatasync)
            of.unsynced -= unsynced  # what was written meanwhile is still unsynced

    def close_all(self) -> None:
        """After unmount: close every backing fd (every change is already committed)."""
        for of in self.files.values():
            if of.fd >= 0:
                os.close(of.fd)
            for fd in of.retired:
                os.close(fd)
        self.files.clear()
