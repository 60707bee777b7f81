"""The FUSE operations over the tree (fsagent.state.store) and file contents (fsagent.state.content).

Every mutation goes through the store's tree (``store.tree``,
:class:`fsagent.state.tree.Tree`), which journals the paths it touched in the
same commit; file contents (copy-on-write, inline and upper copies) go
through :class:`fsagent.fuse.content.Content`.

Kernel caching: fsagent is the only writer while a run lasts, so entries,
attributes and data can be cached for a long time (``TIMEOUT``, ``keep_cache``)
and the writeback cache is enabled.  With the writeback cache the kernel owns
file size and mtime while it holds dirty pages and sends them to us at close,
fsync or under memory pressure; it also resolves O_APPEND offsets itself.  A
WRITE we refuse (the disk full) leaves the kernel with pages and a size that
nobody stored, so the file's entry is dropped from its cache (``_refuse``).

Opens: with a pyfuse3 that has "no open" support (``pyfuse3.NO_OPEN_SUPPORT``,
packaging/pyfuse3), :class:`WorkFolderFS` has no ``open`` or ``opendir``
handler.  The kernel then sends no OPEN, RELEASE, OPENDIR or RELEASEDIR at
all (an open of a cached file costs no request), keeps file data and
directory listings cached across opens, and sends O_TRUNC as a SETATTR; every
READ, WRITE, FSYNC and READDIR names its inode.  A file's backing (its upper
copy or saved object) is attached on first use and kept until the kernel
forgets the inode, at most ``MAX_BACKING`` at a time.  With a pyfuse3 without
it, :class:`HandlesFS` answers OPEN and RELEASE with handles.

Name rules (common.paths): a name that is not valid UTF-8, not NFC, contains
control characters or a backslash is refused with EINVAL; the reserved
segment ``.fsagent`` with EPERM; a name over 255 bytes or a path over 1024
characters or deeper than 64 segments with ENAMETOOLONG.  Lookups of such names answer ENOENT: nothing
with that name can exist.  Symlinks, hard links and special files: EPERM.
Limits mirror the controller's, so a refusal shows at write time rather than
at save time: EFBIG past 1 GiB per file, EDQUOT past 100,000 entries. An
agent folder's storage limits (256 MiB per file, 2 GiB in all) are not
mirrored: they are sync-validation limits, checked only when a save commits.

The agent's instruction entry (``protected``, from the run) cannot be
unlinked or renamed away, nor can a directory holding it: EPERM, as the
controller refuses its deletion. Replacing its content (a write, or a
rename of another file over it) is allowed.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import pyfuse3
import trio

from common.errors import InvalidPath
from common.limits import AGENT_LOCAL_MAX_ENTRIES, MAX_ENTRIES, MAX_FILE_BYTES, MAX_PATH_CHARS
from common.paths import MAX_PATH_SEGMENTS, decode_fs_name, is_within
from common.types import Digest
from fsagent.fuse import stats
from fsagent.fuse.content import Content, OpenFile
from fsagent.fuse.glue import (
    TIMEOUT,
    Spinner,
    drop_kernel_entry,
    entry_attributes,
    existing_name,
    fuse_boundary,
    fuse_err,
    name_errno,
    set_metadata,
    statfs_reply,
)
from fsagent.state.hydrate import ContentFetcher
from fsagent.state.statedir import start_writeback
from fsagent.state.store import EMPTY_DIGEST, ROOT_INODE, Inode, InodeNo, Kind, Store, now_ns

log = logging.getLogger("fsagent.fs")


NO_OPEN_SUPPORT: Final = bool(getattr(pyfuse3, "NO_OPEN_SUPPORT", False))
"""Whether this pyfuse3 passes the inode in place of a file handle once the
kernel has stopped sending OPEN (packaging/pyfuse3)."""

MAX_BACKING: Final = 512
"""Backing files (upper copies, saved objects) kept open without an open handle;
past this the oldest idle one is closed and reopened when next used."""

INLINE_FSYNC_BYTES: Final = 1 << 20
"""Bytes written since the last sync up to which an fsync flushes on the FUSE
thread instead of a worker thread (fsagent.fuse.fs, ``fsync``)."""

SPILL_AT_FSYNC: Final = 2
"""The fsync of an inline file, counted from its attach, that moves it out of
line: a file synced again and again is a log or a database (SQLite's WAL
starts inline), and only an upper file's fsync can skip the LMDB sync."""

WRITE_BEHIND_S: Final = 0.01
"""Seconds from a time-only change, or an orphan's last reference, to its
commit (with the others of that moment: one commit for a burst)."""

DIR_LISTINGS: Final = 256
"""Directory listings kept between READDIR requests of one listing."""


@dataclass(slots=True)
class Handle:
    ino: InodeNo
    flags: int


class WorkFolderFS(pyfuse3.Operations):
    """pyfuse3 operations for one collection, in the kernel's "no open" mode:
    file and directory handles are inode numbers."""

    enable_writeback_cache = True
    supports_dot_lookup = True

    def __init__(
        self,
        store: Store,
        fetcher: ContentFetcher,
        *,
        readonly: bool = False,
        spin_ns: int = 0,
        protected: str | None = None,
    ) -> None:
        super().__init__()
        self.protected = protected
        """The agent's instruction entry: no unlink, no rename away (EPERM)."""
        self.max_entries = MAX_ENTRIES if protected is None else AGENT_LOCAL_MAX_ENTRIES
        """Entries past this are refused (EDQUOT). An agent folder under its
        contract takes more: its limit is checked when a save commits."""
        self.spinner = Spinner(spin_ns)
        self.initialized = trio.Event()
        self.store = store
        self.fetcher = fetcher
        self.readonly = readonly
        self.frozen = False
        """Set at the stop (:meth:`freeze`); unlike ``readonly`` it leaves the
        attributes as they are."""
        self.lookups: dict[InodeNo, int] = {}
        self.content = Content(store, fetcher)
        self.files = self.content.files
        self.dirs: dict[int, list[tuple[bytes, InodeNo]]] = {}
        self._unreferenced: set[InodeNo] = set()
        self._times: set[InodeNo] = set()
        """Inodes whose cached record changed and waits for the next batch:
        their times, or a durable upper file's size and generation."""
        self._behind = trio.Event()
        self.content.on_behind = self._record_behind
        store.commit_behind = self.commit_behind_now
        self._refused: set[InodeNo] = set()
        """Files the kernel may show with bytes we refused (``_refuse``), until
        it forgets them."""
        self._entries_to_drop: set[InodeNo] = set()
        self._drop_wake = trio.Event()

    def init(self) -> None:
        """FUSE INIT is being answered (called on the trio thread)."""
        self.initialized.set()

    def _record_behind(self, ino: InodeNo) -> None:
        """A WRITE kept a durable file's new size and generation in memory
        (fsagent.fuse.content): commit them with the next batch."""
        self._times.add(ino)
        self._behind.set()
        stats.FUSE.writes_behind += 1

    # --- helpers ------------------------------------------------------------

    def _inode(self, ino: int) -> Inode:
        try:
            return self.store.tree.get(ino)
        except KeyError:
            raise fuse_err(errno.ENOENT) from None

    def _attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        return entry_attributes(inode, self.readonly, self.store.tree.nlink(inode))

    def _ref(self, inode: Inode) -> pyfuse3.EntryAttributes:
        """Attributes for a reply that gives the kernel a new lookup reference."""
        self._count_lookup(inode.ino)
        return self._attrs(inode)

    def _count_lookup(self, ino: InodeNo) -> None:
        """One more kernel reference to ``ino``. A refused file the kernel still
        holds (open somewhere) gets the new entry tied to its stale inode: that
        entry is dropped too, until the kernel has let go of the inode."""
        held = self.lookups.get(ino, 0)
        self.lookups[ino] = held + 1
        if held and ino in self._refused:
            self._drop_entry_later(ino)

    def _writable(self) -> None:
        if self.readonly or self.frozen:
            raise fuse_err(errno.EROFS)

    def freeze(self) -> None:
        """The stop has begun: every later change is refused (EROFS), so the
        final save holds every write that was answered. Called once the
        kernel's dirty pages have been flushed to us."""
        self.frozen = True

    def _new_name(self, parent: InodeNo, raw: bytes) -> str:
        """Validate a name about to be created under ``parent``."""
        try:
            name = decode_fs_name(raw)
        except InvalidPath as exc:
            raise fuse_err(name_errno(exc)) from None
        ppath = self.store.tree.path_of(parent)
        if ppath is None:
            raise fuse_err(errno.ENOENT)  # the directory itself was removed
        depth = ppath.count("/") + 2 if ppath else 1
        if len(ppath) + 1 + len(name) > MAX_PATH_CHARS or depth > MAX_PATH_SEGMENTS:
            raise fuse_err(errno.ENAMETOOLONG)
        return name

    def _dir(self, ino: InodeNo) -> Inode:
        inode = self._inode(ino)
        if inode.kind != "directory":
            raise fuse_err(errno.ENOTDIR)
        if inode.parent == 0:
            raise fuse_err(errno.ENOENT)
        return inode

    def _holds_entry(self, parent: InodeNo, name: str) -> bool:
        """Whether ``name`` in ``parent`` is the protected entry or a directory above it."""
        if self.protected is None:
            return False
        ppath = self.store.tree.path_of(parent)
        if ppath is None:
            return False
        path = f"{ppath}/{name}" if ppath else name
        return is_within(self.protected, path)

    def _in_use(self, ino: InodeNo) -> bool:
        """Whether the kernel may still send requests for ``ino``: it holds a
        lookup reference (as it does while any file of it is open) or, with
        handles, an open handle."""
        if self.lookups.get(ino, 0) > 0:
            return True
        of = self.files.get(ino)
        return of is not None and of.opens > 0

    # --- lookups and attributes ----------------------------------------------

    @fuse_boundary
    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """Resolve a name; a miss is a cached negative entry (we are the only writer).

        Must increase the lookup count of the returned inode by one.
        """
        parent = InodeNo(parent_inode)
        if name == b".":
            return self._ref(self._inode(parent))
        if name == b"..":
            pinode = self._inode(parent)
            return self._ref(self._inode(pinode.parent or ROOT_INODE))
        try:
            text = decode_fs_name(name)
        except InvalidPath as exc:
            raise fuse_err(
                errno.ENAMETOOLONG if exc.reason == "segment_too_long" else errno.ENOENT
            ) from None
        child = self.store.tree.lookup(parent, text)
        if child is None:
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = TIMEOUT
            return negative
        return self._ref(self._inode(child))

    @fuse_boundary
    async def getattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """Attributes of a known inode; ENOENT if it is gone."""
        return self._attrs(self._inode(inode))

    @fuse_boundary
    async def access(
        self, inode: pyfuse3.InodeT, mode: pyfuse3.ModeT, ctx: pyfuse3.RequestContext
    ) -> bool:
        """access(2) when the kernel does not check modes (root, no --allow-other):
        root may do anything but execute a file without any exec bit."""
        node = self._inode(inode)
        return not (mode & os.X_OK and node.kind == "file" and not node.mode & 0o111)

    @fuse_boundary
    async def setattr(
        self,
        inode: pyfuse3.InodeT,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: pyfuse3.FileHandleT | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """truncate/ftruncate, chmod, chown/chgrp (stored as told: the kernel
        checked them), utimens; mode, owner and times: fuseglue.set_metadata.
        The kernel clears setuid/setgid on write, truncate and chown (it sends
        the new mode).  EROFS when unbound, EFBIG beyond the 1 GiB file limit.
        """
        self._writable()
        node = self._inode(inode)
        f = fields
        if not (f.update_size or f.update_mode or f.update_uid or f.update_gid):
            # Times only: the kernel writing back the c/mtime it owns with the
            # writeback cache (at every close after a write, after each rename
            # and unlink), or utimensat. Times are local metadata, never
            # shipped: the cached inode shows them at once and they are
            # committed in batches (write_behind).  A lone ctime is not even
            # that: losing it at a crash is harmless.
            if f.update_atime or (f.update_mtime and attr.st_mtime_ns != node.mtime_ns):
                set_metadata(node, attr, fields)
                self._times.add(node.ino)
                self._behind.set()
            if f.update_ctime:
                node.ctime_ns = attr.st_ctime_ns
            return self._attrs(node)
        ops: list[str] = []
        inline: bytes | None = None
        if fields.update_size:
            if node.kind == "directory":
                raise fuse_err(errno.EISDIR)
            size = attr.st_size
            if size > MAX_FILE_BYTES:
                raise fuse_err(errno.EFBIG)
            inline = await self.content.truncate(node, size)
            ops.append("truncate")
        if f.update_mode or f.update_uid or f.update_gid:
            self.store.dir.forget_durable()  # the next fsync makes the new mode durable
        ops += set_metadata(node, attr, fields)
        node.ctime_ns = attr.st_ctime_ns if fields.update_ctime else now_ns()
        self.store.tree.persist(node, touch="+".join(ops) if ops else None, inline=inline)
        return self._attrs(node)

    # --- refusals ----------------------------------------------------------------

    @fuse_boundary
    async def symlink(
        self,
        parent_inode: pyfuse3.InodeT,
        name: pyfuse3.FileNameT,
        target: pyfuse3.FileNameT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Always EPERM: scoped files may not be symbolic links."""
        raise fuse_err(errno.EROFS if self.readonly else errno.EPERM)

    @fuse_boundary
    async def link(
        self,
        inode: pyfuse3.InodeT,
        new_parent_inode: pyfuse3.InodeT,
        new_name: pyfuse3.FileNameT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Always EPERM: scoped files may not be hard links."""
        raise fuse_err(errno.EROFS if self.readonly else errno.EPERM)

    @fuse_boundary
    async def mknod(
        self,
        parent_inode: pyfuse3.InodeT,
        name: pyfuse3.FileNameT,
        mode: pyfuse3.ModeT,
        rdev: int,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """A regular file, as ``create`` makes it (in "no open" mode the kernel
        creates files this way: no CREATE, so no RELEASE at close either);
        EPERM for device nodes, FIFOs and sockets."""
        if not stat.S_ISREG(mode):
            raise fuse_err(errno.EROFS if self.readonly else errno.EPERM)
        inode = await self._create_node(parent_inode, name, "file", mode, ctx)
        # Empty and inline (in the same commit): no file is created on disk.
        self.files[inode.ino] = OpenFile(-1, upper=True, inline=True)
        return self._ref(inode)

    @fuse_boundary
    async def readlink(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> bytes:
        """There are no symlinks here."""
        raise fuse_err(errno.EINVAL)

    # --- namespace ----------------------------------------------------------------

    @fuse_boundary
    async def mkdir(
        self,
        parent_inode: pyfuse3.InodeT,
        name: pyfuse3.FileNameT,
        mode: pyfuse3.ModeT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Create a directory; EEXIST if the name is taken. Journals the path."""
        return self._ref(await self._create_node(parent_inode, name, "directory", mode, ctx))

    async def _create_node(
        self, parent_inode: int, raw: bytes, kind: Kind, mode: int, ctx: pyfuse3.RequestContext
    ) -> Inode:
        """A new entry is the caller's, in the caller's group or a setgid
        directory's (a new directory inherits the bit), as on Linux."""
        self._writable()
        parent = InodeNo(parent_inode)
        pnode = self._dir(parent)
        name = self._new_name(parent, raw)
        gid = ctx.gid
        if pnode.mode & stat.S_ISGID:
            gid = pnode.gid
            if kind == "directory":
                mode |= stat.S_ISGID
        if self.store.tree.lookup(parent, name) is not None:
            raise fuse_err(errno.EEXIST)
        if self.store.tree.count_entries() >= self.max_entries:
            # The controller refuses folders over 100,000 entries at save time;
            # saying so now (as a quota) keeps the agent from piling up work
            # that could never be saved. The agent folder's limit is a
            # sync-validation limit instead, checked at commit: the agent
            # may write past it and the save over it is refused with a receipt.
            raise fuse_err(errno.EDQUOT)
        return self.store.tree.create(parent, name, kind, mode, ctx.uid, gid)

    @fuse_boundary
    async def unlink(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        """Remove a file's entry. An open (or still looked-up) file stays readable
        and writable through its handles; its data is freed in ``forget``."""
        self._writable()
        parent = InodeNo(parent_inode)
        text = existing_name(name)
        child = self.store.tree.lookup(parent, text)
        if child is None:
            raise fuse_err(errno.ENOENT)
        if self._inode(child).kind == "directory":
            raise fuse_err(errno.EISDIR)
        if self._holds_entry(parent, text):
            raise fuse_err(errno.EPERM)
        self.store.tree.unlink(parent, text, keep=self._in_use(child))

    @fuse_boundary
    async def rmdir(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        """Remove an empty directory: ENOTEMPTY otherwise, ENOTDIR for a file."""
        self._writable()
        parent = InodeNo(parent_inode)
        text = existing_name(name)
        child = self.store.tree.lookup(parent, text)
        if child is None:
            raise fuse_err(errno.ENOENT)
        if self._inode(child).kind != "directory":
            raise fuse_err(errno.ENOTDIR)
        if self.store.tree.has_children(child):
            raise fuse_err(errno.ENOTEMPTY)
        self.store.tree.unlink(parent, text, keep=self._in_use(child))

    @fuse_boundary
    async def rename(
        self,
        parent_inode_old: pyfuse3.InodeT,
        name_old: pyfuse3.FileNameT,
        parent_inode_new: pyfuse3.InodeT,
        name_new: pyfuse3.FileNameT,
        flags: pyfuse3.FlagT,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        """Atomic rename, replacing an existing target of a compatible kind.

        RENAME_NOREPLACE → EEXIST if the target exists; RENAME_EXCHANGE swaps
        two existing entries; other flags → EINVAL.  A replaced inode that the
        kernel still references stays alive until ``forget``.  Both old and new
        paths of everything moved are journaled.
        """
        self._writable()
        if flags & ~(pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE):
            raise fuse_err(errno.EINVAL)
        old_parent, new_parent = InodeNo(parent_inode_old), InodeNo(parent_inode_new)
        old = existing_name(name_old)
        self._dir(new_parent)
        new = self._new_name(new_parent, name_new)
        src = self.store.tree.lookup(old_parent, old)
        if src is None:
            raise fuse_err(errno.ENOENT)
        src_node = self._inode(src)
        if src_node.kind == "directory" and self.store.tree.is_ancestor(src, new_parent):
            raise fuse_err(errno.EINVAL)
        dst = self.store.tree.lookup(new_parent, new)
        self._check_entry_rename(old_parent, old, src_node, new_parent, new, dst, flags)
        if flags & pyfuse3.RENAME_EXCHANGE:
            if dst is None:
                raise fuse_err(errno.ENOENT)
            dst_node = self._inode(dst)
            if dst_node.kind == "directory" and self.store.tree.is_ancestor(dst, old_parent):
                raise fuse_err(errno.EINVAL)
            if dst != src:
                self.store.tree.exchange(old_parent, old, new_parent, new)
            return
        if dst is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise fuse_err(errno.EEXIST)
            if dst == src:
                return
            dst_node = self._inode(dst)
            if src_node.kind == "directory" and dst_node.kind != "directory":
                raise fuse_err(errno.ENOTDIR)
            if src_node.kind != "directory" and dst_node.kind == "directory":
                raise fuse_err(errno.EISDIR)
            if dst_node.kind == "directory" and self.store.tree.has_children(dst):
                raise fuse_err(errno.ENOTEMPTY)
        self.store.tree.rename(old_parent, old, new_parent, new, keep_replaced=self._in_use)

    def _check_entry_rename(
        self,
        old_parent: InodeNo,
        old: str,
        src_node: Inode,
        new_parent: InodeNo,
        new: str,
        dst: InodeNo | None,
        flags: int,
    ) -> None:
        """EPERM for a rename that takes the instruction entry away: moving it
        or a directory above it. Exchanging the entry with another file keeps a
        file at the entry's path, and so does renaming a file over it."""
        if dst is not None and dst == self.store.tree.lookup(old_parent, old):
            return  # a rename onto itself changes nothing
        src_holds = self._holds_entry(old_parent, old)
        dst_holds = flags & pyfuse3.RENAME_EXCHANGE and self._holds_entry(new_parent, new)
        if not (src_holds or dst_holds):
            return
        if flags & pyfuse3.RENAME_EXCHANGE and dst is not None:
            both_files = src_node.kind == "file" and self._inode(dst).kind == "file"
            if both_files:
                return
        raise fuse_err(errno.EPERM)

    # --- files --------------------------------------------------------------------

    async def _open_file(self, fh: int) -> tuple[InodeNo, OpenFile]:
        """The inode and backing of a file handle (attached on first use)."""
        ino = InodeNo(fh)
        of = self.files.get(ino)
        if of is None:
            of = await self._attach(ino)
        return ino, of

    async def _attach(self, ino: InodeNo) -> OpenFile:
        """Open the backing of file ``ino``: its upper copy, or its saved object,
        fetched first when it is not local yet (only this request waits for
        it).  EIO when the content cannot be fetched or verified."""
        node = self._inode(ino)
        if node.kind == "directory":
            raise fuse_err(errno.EISDIR)
        if node.upper:
            of = self.content.open_upper(ino)
        else:
            try:
                path = await self.fetcher.ensure(Digest(node.digest or EMPTY_DIGEST))
            except Exception as exc:  # any fetch failure is EIO for the reader
                log.error("open of inode %d: content unavailable: %s", ino, exc)
                raise fuse_err(errno.EIO) from None
            if self._inode(ino).upper:  # copied up (e.g. truncated) while we fetched
                of = self.content.open_upper(ino)
            else:
                of = self.content.open_saved(path)
        current = self.files.get(ino)
        if current is not None:  # another request attached it while we fetched
            self.content.release_fd(of, of.fd)
            return current
        self.files[ino] = of
        if len(self.files) > MAX_BACKING:
            self._close_idle_backing()
        return of

    def _close_idle_backing(self) -> None:
        """Close the oldest backing nobody uses right now (no handle, no request
        in flight); the next request for it attaches it again."""
        for ino, of in self.files.items():
            if not of.opens and not of.pins:
                del self.files[ino]
                self.content.release_fd(of, of.fd)
                return

    def _detach(self, ino: InodeNo) -> None:
        """The kernel forgot ``ino``: no request will use its backing any more."""
        of = self.files.get(ino)
        if of is not None and not of.opens:
            del self.files[ino]
            self.content.release_fd(of, of.fd)

    @fuse_boundary
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        """Read from the upper copy or the saved object (short at end of file)."""
        ino, of = await self._open_file(fh)
        return self.content.read(ino, of, off, size)

    @fuse_boundary
    async def write(self, fh: pyfuse3.FileHandleT, off: int, buf: bytes) -> int:
        """Write at ``off`` (holes stay sparse), copying the file up first if needed.

        The bytes, the new size and generation and the journal entry are
        committed before this returns, so they survive a crash of this
        process.  EFBIG beyond 1 GiB, ENOSPC when the disk is full; a refused
        write has the kernel drop the file's entry (``_refuse``).
        """
        self._writable()
        ino, of = await self._open_file(fh)
        try:
            node = self._inode(ino)
            if off + len(buf) > MAX_FILE_BYTES:
                raise fuse_err(errno.EFBIG)
            of.pins += 1  # a copy-up may wait: the backing stays attached meanwhile
            try:
                return await self.content.write(node, of, off, buf)
            finally:
                self.content.unpin(of)
        except Exception:
            self._refuse(ino)
            raise

    def _refuse(self, ino: InodeNo) -> None:
        """A WRITE of ``ino`` is being refused (ENOSPC, EFBIG, EIO).

        With the writeback cache the agent's write() went to the kernel's page
        cache before this WRITE, and the kernel keeps those pages and the size
        they gave the file after we refuse them: the file read back with bytes
        and a length that no save holds (cut short by a full disk, it read back
        whole and was saved empty). So the kernel is told to drop the file's
        directory entry once this reply is out (``_drop_refused_entries``): as soon
        as nothing holds the file open the kernel forgets its inode, and the
        next lookup reads size and bytes from us, exactly what a save ships.
        A file still open somewhere keeps the kernel's view until it is closed
        (the kernel takes the size from us only for an inode it does not hold);
        entries looked up meanwhile are dropped as well (``_count_lookup``).
        """
        if self.frozen:
            return  # the stop: the kernel's cache goes with the mount
        if ino not in self._refused:
            self._refused.add(ino)
            self._drop_entry_later(ino)

    def _drop_entry_later(self, ino: InodeNo) -> None:
        self._entries_to_drop.add(ino)
        self._drop_wake.set()

    async def _drop_refused_entries(self) -> None:
        """Drop the kernel's entries of refused files (runs for the life of the
        mount). Each one blocks until the kernel is done, which may wait for
        our answer to a request on the same directory: from a worker thread,
        never from a handler the kernel would be waiting for."""
        while True:
            await self._drop_wake.wait()
            self._drop_wake = trio.Event()
            inos, self._entries_to_drop = self._entries_to_drop, set()
            for ino in sorted(inos):
                if self.frozen:
                    break
                if ino not in self._refused:
                    continue  # forgotten meanwhile: the kernel holds nothing of it
                entry = self._entry_of(ino)
                if entry is not None:
                    await trio.to_thread.run_sync(drop_kernel_entry, *entry)

    def _entry_of(self, ino: InodeNo) -> tuple[InodeNo, bytes] | None:
        """The directory entry naming ``ino`` (parent, name); None for an orphan,
        which no lookup can reach."""
        try:
            node = self.store.tree.get(ino)
        except KeyError:
            return None
        if node.parent == 0:
            return None
        return node.parent, node.name.encode("utf-8")

    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        """ENOSYS, so the kernel stops sending FLUSH (one round trip less per
        close).  close() still writes back dirty pages and waits for those
        WRITEs, each committed before it is answered: a closed file survives kill -9."""
        raise fuse_err(errno.ENOSYS)

    @fuse_boundary
    async def fsync(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        """Make the upper file and the LMDB environment (the inode, the journal
        and inline contents, committed by write) durable against power loss.
        Once an upper file's records are durable (statedir, ``mark_durable``),
        its own ``fdatasync`` is all a later fsync needs. An inline file's
        contents are in LMDB, so each of its fsyncs syncs the store: one
        synced a second time moves out of line first (``SPILL_AT_FSYNC``)."""
        ino, of = await self._open_file(fh)
        if of.inline:
            of.inline_fsyncs += 1
            if of.inline_fsyncs >= SPILL_AT_FSYNC:
                self._spill_for_fsync(ino)
        out_of_line = of.upper and not of.inline
        if out_of_line and self.store.dir.is_durable(ino):
            if of.unsynced <= INLINE_FSYNC_BYTES:
                # A few pages (a SQLite commit): flushed on this thread, with
                # the GIL released. A hop to a worker thread and back costs
                # more than such a flush, and other requests wait only that long.
                os.fdatasync(of.fd)
                of.unsynced = 0
            else:
                await self.content.fsync(of)
            stats.FUSE.fsync_data_only += 1
            return
        epoch = self.store.dir.durable_epoch()
        # Durable means the journal entry too: a clean file (none since the
        # last save) is not marked, so the WRITE that makes its entry commits
        # and the fsync after it syncs the store. Read before the sync, which
        # covers only what was committed when it began.
        journaled = out_of_line and self._journaled(ino)
        self.flush_behind()
        await self.content.fsync(of)
        await trio.to_thread.run_sync(self.store.sync)
        if journaled:
            self.store.dir.mark_durable(ino, epoch)

    def _journaled(self, ino: InodeNo) -> bool:
        """Whether the journal has an entry at ``ino``'s path."""
        path = self.store.tree.path_of(ino)
        return path is not None and path != "" and self.store.journal.has_entry(path)

    def _spill_for_fsync(self, ino: InodeNo) -> None:
        """Move inline file ``ino`` out of line before its fsync (``SPILL_AT_FSYNC``):
        this fsync still syncs the store, the next ones are the file's own
        ``fdatasync``. Where the move fails (the disk full) the file stays
        inline and this fsync takes the inline path, as it would have."""
        try:
            self.content.spill(self._inode(ino))
        except OSError as exc:
            log.info("inode %d stays inline for its fsync: %s", ino, exc)

    @fuse_boundary
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        """Not sent without handles (no OPEN, no CREATE): a file's backing stays
        attached until the kernel forgets the inode."""

    def _maybe_free(self, ino: InodeNo) -> None:
        """Nobody references ``ino`` any more: drop it from the cache, or free
        it if it is an orphan.  Its upper file goes at once; its records are
        freed with others by ``write_behind`` (an ``rm -rf`` then commits once
        per batch of FORGETs, not once per file)."""
        if self._in_use(ino):
            return
        try:
            node = self.store.tree.get(ino)
        except KeyError:
            return
        if node.parent == 0 and ino != ROOT_INODE:
            self.store.tree.drop_orphan_copy(ino)
            self._unreferenced.add(ino)
            self._behind.set()
        else:
            if ino in self._times:  # the cache is about to forget them
                self.flush_behind()
                if ino in self._times:
                    # Not committed (the disk full): the cached record is the
                    # only one with a durable file's new size and generation,
                    # so it stays cached until a later batch commits it.
                    return
            self.store.tree.evict(ino)

    async def write_behind(self) -> None:
        """The work done behind the requests, for the life of the mount: times
        and orphans committed in batches, the kernel's entries of refused files
        dropped, large writes started on their way to disk."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._commit_behind)
            nursery.start_soon(self._drop_refused_entries)
            nursery.start_soon(self._write_back_uppers)

    async def _write_back_uppers(self) -> None:
        """Start writing to disk the dirty pages of each upper file that took
        ``WRITEBACK_EVERY`` bytes since its last fsync or start (fsagent.fuse.content),
        from a worker thread, while the agent writes on: a later fsync then
        waits for what is left, not for the whole file. A failure is logged;
        the fsync writes those pages, nothing is lost."""
        content = self.content
        while True:
            await content.writeback_wake.wait()
            content.writeback_wake = trio.Event()
            due, content.writeback_due = content.writeback_due, {}
            for ino, of in due.items():
                if content.files.get(ino) is not of or of.fd < 0 or of.inline or not of.upper:
                    continue  # closed, or replaced, since
                try:
                    await content.pinned(of, start_writeback)
                    stats.FUSE.upper_writebacks += 1
                except OSError as exc:
                    log.warning("starting the writeback of inode %d failed: %s", ino, exc)

    async def _commit_behind(self) -> None:
        """Commit what waits (times, orphans to free) ``WRITE_BEHIND_S`` after
        the first of a batch, in one commit."""
        while True:
            await self._behind.wait()
            await trio.sleep(WRITE_BEHIND_S)
            self._behind = trio.Event()
            self.flush_behind()

    def flush_behind(self) -> None:
        """Commit the records changed since the last flush (times, durable
        files' sizes and generations) and free the orphans nobody references,
        together.  A failed commit (the disk full) is logged and keeps them
        for the next flush: it must not end the daemon."""
        try:
            self.commit_behind_now()
        except Exception:
            log.exception("committing records and freeing orphans failed; kept for later")

    def commit_behind_now(self) -> None:
        """:meth:`flush_behind`, raising its failure (what waited is kept).
        Also the store's ``commit_behind``: a listing from committed records
        (the ship thread's) must see every answered write's generation, or
        it would take the file's new bytes for a change made while they were
        uploaded and leave it for a later save."""
        times, self._times = self._times, set()
        orphans, self._unreferenced = self._unreferenced, set()
        if not (times or orphans):
            return
        try:
            self.store.tree.write_behind(sorted(times), sorted(orphans))
        except BaseException:
            self._times |= times
            self._unreferenced |= orphans
            raise

    # --- directories ---------------------------------------------------------------

    def _listing(self, fh: int, start_id: int) -> list[tuple[bytes, InodeNo]]:
        """The entries of directory ``fh`` (an inode), sorted by name: a new
        snapshot at offset 0, the same one for the rest of that listing.

        A snapshot keeps offsets stable while the directory changes: entries
        added or removed meanwhile may or may not show, none is skipped or
        listed twice.  It is dropped once listed to the end (or, if a listing
        is abandoned, when ``DIR_LISTINGS`` newer ones push it out).
        """
        entries = None if start_id == 0 else self.dirs.get(fh)
        if entries is None:
            ino = InodeNo(fh)
            self._dir(ino)
            entries = [
                (name.encode("utf-8"), child) for name, child in self.store.tree.children(ino)
            ]
            self.dirs.pop(fh, None)
            self.dirs[fh] = entries
            if len(self.dirs) > DIR_LISTINGS:
                del self.dirs[next(iter(self.dirs))]
        elif start_id >= len(entries):  # the request that finds the end
            del self.dirs[fh]
        return entries

    @fuse_boundary
    async def readdir(
        self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken
    ) -> None:
        """List entries from offset ``start_id``; each accepted entry is a lookup reference."""
        entries = self._listing(fh, start_id)
        get = self.store.tree.get
        lookups = self.lookups
        refused = self._refused
        for i in range(start_id, len(entries)):
            name, child = entries[i]
            try:
                node = get(child)
            except KeyError:
                continue  # removed since the snapshot
            if not pyfuse3.readdir_reply(token, name, self._attrs(node), i + 1):
                return
            if refused and child in refused:
                self._count_lookup(child)
            else:
                lookups[child] = lookups.get(child, 0) + 1

    @fuse_boundary
    async def fsyncdir(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        """Directory changes are already committed; make them power-loss durable."""
        self.flush_behind()
        await trio.to_thread.run_sync(self.store.sync)

    @fuse_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """Space of the disk holding the state dir (where the upper layer lives)."""
        return statfs_reply(
            os.statvfs(self.store.root), self.readonly, self.store.tree.count_inodes()
        )

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        """Drop kernel references; free orphans nobody uses any more.

        Must never raise: there is no request to report an error to.
        """
        started = stats.now_ns()
        failed = False
        for inode, nlookup in inode_list:
            try:
                ino = InodeNo(inode)
                left = self.lookups.get(ino, 0) - nlookup
                if left > 0:
                    self.lookups[ino] = left
                    continue
                self.lookups.pop(ino, None)
                self._refused.discard(ino)  # a lookup now takes size and bytes from us
                self._detach(ino)
                self._maybe_free(ino)
            except Exception:
                failed = True
                log.exception("forget of inode %d failed", inode)
        stats.FUSE.record("forget", stats.now_ns() - started, failed)

    def shutdown(self) -> None:
        """After unmount: close every backing fd and free the orphans left
        (every change is already committed)."""
        self.content.close_all()
        self.flush_behind()


class HandlesFS(WorkFolderFS):
    """For a pyfuse3 without "no open" support: the kernel sends OPEN and
    RELEASE for every open of a file, OPENDIR and RELEASEDIR for every
    directory listing, and each handle maps to its inode here."""

    def __init__(
        self,
        store: Store,
        fetcher: ContentFetcher,
        *,
        readonly: bool = False,
        spin_ns: int = 0,
        protected: str | None = None,
    ) -> None:
        super().__init__(store, fetcher, readonly=readonly, spin_ns=spin_ns, protected=protected)
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1

    def _handle_for(self, ino: InodeNo, flags: int) -> int:
        """A new handle of ``ino``, whose backing is attached."""
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(ino, flags)
        self.files[ino].opens += 1
        return fh

    async def _open_file(self, fh: int) -> tuple[InodeNo, OpenFile]:
        h = self.handles.get(fh)
        if h is None:
            raise fuse_err(errno.EBADF)
        return h.ino, self.files[h.ino]

    @fuse_boundary
    async def create(
        self,
        parent_inode: pyfuse3.InodeT,
        name: pyfuse3.FileNameT,
        mode: pyfuse3.ModeT,
        flags: pyfuse3.FlagT,
        ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        """Create and open a new empty file (its upper file starts empty).

        EEXIST if the name is taken (the kernel has already applied O_EXCL
        semantics through lookup; this closes the race).  Journals the path.
        Only with handles: without, the kernel's fallback (MKNOD, then an open
        it does not send) saves the RELEASE of every new file.
        """
        inode = await self._create_node(parent_inode, name, "file", mode, ctx)
        # Empty and inline (in the same commit): no file is created on disk.
        self.files[inode.ino] = OpenFile(-1, upper=True, inline=True)
        return pyfuse3.FileInfo(fh=self._handle_for(inode.ino, flags), keep_cache=True), self._ref(
            inode
        )

    @fuse_boundary
    async def open(
        self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        """Open a file. A file whose saved content is not local yet is fetched
        first; this open waits for that one object only.  O_TRUNC truncates
        here (the kernel leaves it to open with the writeback cache).  EROFS
        for writing when unbound; EIO when the content cannot be fetched or
        verified.
        """
        ino = InodeNo(inode)
        node = self._inode(ino)
        if node.kind == "directory":
            raise fuse_err(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self._writable()
            if flags & os.O_TRUNC and node.size:
                inline = await self.content.truncate(node, 0)
                self.store.tree.persist(node, touch="truncate", inline=inline)
        if ino not in self.files:
            await self._attach(ino)
        return pyfuse3.FileInfo(fh=self._handle_for(ino, flags), keep_cache=True)

    @fuse_boundary
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        """Last close of a handle: close the backing fd when no handle of the
        inode remains (every change is already committed)."""
        h = self.handles.pop(fh, None)
        if h is None:
            return
        of = self.files[h.ino]
        of.opens -= 1
        if of.opens <= 0:
            del self.files[h.ino]
            self.content.release_fd(of, of.fd)
            self._maybe_free(h.ino)

    @fuse_boundary
    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> int:
        """Snapshot the directory's entries (sorted by name); readdir pages over it."""
        ino = InodeNo(inode)
        self._dir(ino)
        fh = self._next_fh
        self._next_fh += 1
        self.dirs[fh] = [
            (name.encode("utf-8"), child) for name, child in self.store.tree.children(ino)
        ]
        return fh

    def _listing(self, fh: int, start_id: int) -> list[tuple[bytes, InodeNo]]:
        entries = self.dirs.get(fh)
        if entries is None:
            raise fuse_err(errno.EBADF)
        return entries

    @fuse_boundary
    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        """Drop the snapshot."""
        self.dirs.pop(fh, None)

    def shutdown(self) -> None:
        super().shutdown()
        self.handles.clear()


def make_fs(
    store: Store,
    fetcher: ContentFetcher,
    *,
    readonly: bool = False,
    spin_ns: int = 0,
    handles: bool = not NO_OPEN_SUPPORT,
    protected: str | None = None,
) -> WorkFolderFS:
    """The operations for one mount: "no open" mode when pyfuse3 supports it,
    unless ``handles`` (``FSAGENT_FUSE_HANDLES=1`` in the daemon's environment:
    tests run both modes with one pyfuse3). ``protected``: see WorkFolderFS."""
    cls = HandlesFS if handles else WorkFolderFS
    return cls(store, fetcher, readonly=readonly, spin_ns=spin_ns, protected=protected)
