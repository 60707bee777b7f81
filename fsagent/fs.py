"""The FUSE operations over the tree (fsagent.store) and file contents (fsagent.content).

Every mutation goes through :class:`fsagent.store.Store`, which journals the
paths it touched; file contents (copy-on-write, inline and upper copies) go
through :class:`fsagent.content.Content`.

Kernel caching: fsagent is the only writer while a run lasts, so entries,
attributes and data can be cached for a long time (``TIMEOUT``, ``keep_cache``)
and the writeback cache is enabled.  With the writeback cache the kernel owns
file size and mtime while it holds dirty pages and sends them to us at close,
fsync or under memory pressure; it also resolves O_APPEND offsets itself.

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

import pyfuse3
import trio

from common.errors import InvalidPath
from common.limits import MAX_ENTRIES, MAX_FILE_BYTES, MAX_PATH_CHARS
from common.paths import MAX_PATH_SEGMENTS, decode_fs_name, is_within
from common.types import Digest
from fsagent.content import Content, OpenFile
from fsagent.fuseglue import (
    TIMEOUT,
    Spinner,
    entry_attributes,
    existing_name,
    fuse_boundary,
    fuse_err,
    name_errno,
    set_metadata,
    statfs_reply,
)
from fsagent.hydrate import ContentFetcher
from fsagent.store import EMPTY_DIGEST, ROOT_INODE, Inode, InodeNo, Kind, Store, now_ns

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Handle:
    ino: InodeNo
    flags: int


class WorkFolderFS(pyfuse3.Operations):
    """pyfuse3 operations for one collection."""

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
        self.spinner = Spinner(spin_ns)
        self.initialized = trio.Event()
        self.store = store
        self.fetcher = fetcher
        self.readonly = readonly
        self.lookups: dict[InodeNo, int] = {}
        self.content = Content(store, fetcher)
        self.files = self.content.files
        self.handles: dict[int, Handle] = {}
        self.dirs: dict[int, list[tuple[bytes, InodeNo]]] = {}
        self._next_fh = 1

    def init(self) -> None:
        """FUSE INIT is being answered (called on the trio thread)."""
        self.initialized.set()

    # --- helpers ------------------------------------------------------------

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _inode(self, ino: int) -> Inode:
        try:
            return self.store.get(ino)
        except KeyError:
            raise fuse_err(errno.ENOENT) from None

    def _attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        return entry_attributes(inode, self.readonly)

    def _ref(self, inode: Inode) -> pyfuse3.EntryAttributes:
        """Attributes for a reply that gives the kernel a new lookup reference."""
        self.lookups[inode.ino] = self.lookups.get(inode.ino, 0) + 1
        return self._attrs(inode)

    def _writable(self) -> None:
        if self.readonly:
            raise fuse_err(errno.EROFS)

    def _new_name(self, parent: InodeNo, raw: bytes) -> str:
        """Validate a name about to be created under ``parent``."""
        try:
            name = decode_fs_name(raw)
        except InvalidPath as exc:
            raise fuse_err(name_errno(exc)) from None
        ppath = self.store.path_of(parent)
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
        ppath = self.store.path_of(parent)
        if ppath is None:
            return False
        path = f"{ppath}/{name}" if ppath else name
        return is_within(self.protected, path)

    def _in_use(self, ino: InodeNo) -> bool:
        return self.lookups.get(ino, 0) > 0 or ino in self.files

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
        child = self.store.lookup(parent, text)
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
        changes = f.update_size or f.update_mode or f.update_uid or f.update_gid
        if not (changes or f.update_atime) and (
            not f.update_mtime or attr.st_mtime_ns == node.mtime_ns
        ):
            # The kernel writing back its own ctime after a rename or unlink (it
            # owns c/mtime with the writeback cache): nothing to save or journal.
            # The cached inode shows the new ctime; losing it at a crash is harmless.
            if fields.update_ctime:
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
            self.store.forget_durable()  # the next fsync makes the new mode durable
        ops += set_metadata(node, attr, fields)
        node.ctime_ns = attr.st_ctime_ns if fields.update_ctime else now_ns()
        self.store.persist(node, touch="+".join(ops) if ops else None, inline=inline)
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
        """Always EPERM: scoped files may not be symbolic links (spec)."""
        raise fuse_err(errno.EROFS if self.readonly else errno.EPERM)

    @fuse_boundary
    async def link(
        self,
        inode: pyfuse3.InodeT,
        new_parent_inode: pyfuse3.InodeT,
        new_name: pyfuse3.FileNameT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Always EPERM: scoped files may not be hard links (spec)."""
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
        """Always EPERM: no device nodes, FIFOs or sockets (regular files use create)."""
        raise fuse_err(errno.EROFS if self.readonly else errno.EPERM)

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
        if self.store.lookup(parent, name) is not None:
            raise fuse_err(errno.EEXIST)
        if self.store.count_entries() >= MAX_ENTRIES:
            # The controller refuses folders over 100,000 entries at save time;
            # saying so now (as a quota) keeps the agent from piling up work
            # that could never be saved.
            raise fuse_err(errno.EDQUOT)
        return self.store.create(parent, name, kind, mode, ctx.uid, gid)

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
        """
        inode = await self._create_node(parent_inode, name, "file", mode, ctx)
        # Empty and inline (in the same commit): no file is created on disk.
        self.files[inode.ino] = OpenFile(-1, upper=True, inline=True, opens=1)
        fh = self._new_fh()
        self.handles[fh] = Handle(inode.ino, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), self._ref(inode)

    @fuse_boundary
    async def unlink(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        """Remove a file's entry. An open (or still looked-up) file stays readable
        and writable through its handles; its data is freed in ``forget``."""
        self._writable()
        parent = InodeNo(parent_inode)
        text = existing_name(name)
        child = self.store.lookup(parent, text)
        if child is None:
            raise fuse_err(errno.ENOENT)
        if self._inode(child).kind == "directory":
            raise fuse_err(errno.EISDIR)
        if self._holds_entry(parent, text):
            raise fuse_err(errno.EPERM)
        self.store.unlink(parent, text, keep=self._in_use(child))

    @fuse_boundary
    async def rmdir(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        """Remove an empty directory: ENOTEMPTY otherwise, ENOTDIR for a file."""
        self._writable()
        parent = InodeNo(parent_inode)
        text = existing_name(name)
        child = self.store.lookup(parent, text)
        if child is None:
            raise fuse_err(errno.ENOENT)
        if self._inode(child).kind != "directory":
            raise fuse_err(errno.ENOTDIR)
        if self.store.has_children(child):
            raise fuse_err(errno.ENOTEMPTY)
        self.store.unlink(parent, text, keep=self._in_use(child))

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
        src = self.store.lookup(old_parent, old)
        if src is None:
            raise fuse_err(errno.ENOENT)
        src_node = self._inode(src)
        if src_node.kind == "directory" and self.store.is_ancestor(src, new_parent):
            raise fuse_err(errno.EINVAL)
        dst = self.store.lookup(new_parent, new)
        self._check_entry_rename(old_parent, old, src_node, new_parent, new, dst, flags)
        if flags & pyfuse3.RENAME_EXCHANGE:
            if dst is None:
                raise fuse_err(errno.ENOENT)
            dst_node = self._inode(dst)
            if dst_node.kind == "directory" and self.store.is_ancestor(dst, old_parent):
                raise fuse_err(errno.EINVAL)
            if dst != src:
                self.store.exchange(old_parent, old, new_parent, new)
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
            if dst_node.kind == "directory" and self.store.has_children(dst):
                raise fuse_err(errno.ENOTEMPTY)
        self.store.rename(old_parent, old, new_parent, new, keep_replaced=self._in_use)

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
        if dst is not None and dst == self.store.lookup(old_parent, old):
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
                self.store.persist(node, touch="truncate", inline=inline)
        if ino not in self.files:
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
            if ino in self.files:  # another open won the race while we fetched
                self.content.release_fd(of, of.fd)
            else:
                self.files[ino] = of
        self.files[ino].opens += 1
        fh = self._new_fh()
        self.handles[fh] = Handle(ino, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    def _handle(self, fh: int) -> tuple[Handle, OpenFile]:
        h = self.handles.get(fh)
        if h is None:
            raise fuse_err(errno.EBADF)
        return h, self.files[h.ino]

    @fuse_boundary
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        """Read from the upper copy or the saved object (short at end of file)."""
        h, of = self._handle(fh)
        return self.content.read(h.ino, of, off, size)

    @fuse_boundary
    async def write(self, fh: pyfuse3.FileHandleT, off: int, buf: bytes) -> int:
        """Write at ``off`` (holes stay sparse), copying the file up first if needed.

        The bytes, the new size and generation and the journal entry are
        committed before this returns, so they survive a crash of this
        process.  EFBIG beyond 1 GiB, ENOSPC when the disk is full.
        """
        self._writable()
        h, of = self._handle(fh)
        node = self._inode(h.ino)
        end = off + len(buf)
        if end > MAX_FILE_BYTES:
            raise fuse_err(errno.EFBIG)
        return await self.content.write(node, of, off, buf)

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
        its own ``fdatasync`` is all a later fsync needs."""
        h, of = self._handle(fh)
        out_of_line = of.upper and not of.inline
        if out_of_line and self.store.is_durable(h.ino):
            await self.content.fsync(of)
            return
        epoch = self.store.durable_epoch()
        await self.content.fsync(of)
        await trio.to_thread.run_sync(self.store.sync)
        if out_of_line:
            self.store.mark_durable(h.ino, epoch)

    @fuse_boundary
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        """Last close of a handle: commit, and close the backing fd when no handle
        of the inode remains.  Errors here reach nobody, so they are only logged."""
        h, of = self._handle(fh)
        del self.handles[fh]
        of.opens -= 1
        if of.opens <= 0:
            del self.files[h.ino]
            self.content.release_fd(of, of.fd)
            self._maybe_free(h.ino)

    def _maybe_free(self, ino: InodeNo) -> None:
        if self._in_use(ino):
            return
        try:
            node = self.store.get(ino)
        except KeyError:
            return
        if node.parent == 0 and ino != ROOT_INODE:
            self.store.free_orphan(ino)
        else:
            self.store.evict(ino)

    # --- directories ---------------------------------------------------------------

    @fuse_boundary
    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> int:
        """Snapshot the directory's entries (sorted by name); readdir pages over it.

        A snapshot keeps offsets stable while the directory changes: entries
        added or removed meanwhile may or may not show, none is skipped or
        listed twice.
        """
        ino = InodeNo(inode)
        self._dir(ino)
        fh = self._new_fh()
        self.dirs[fh] = [(name.encode("utf-8"), child) for name, child in self.store.children(ino)]
        return fh

    @fuse_boundary
    async def readdir(
        self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken
    ) -> None:
        """List entries from offset ``start_id``; each accepted entry is a lookup reference."""
        entries = self.dirs.get(fh)
        if entries is None:
            raise fuse_err(errno.EBADF)
        for i in range(start_id, len(entries)):
            name, child = entries[i]
            try:
                node = self.store.get(child)
            except KeyError:
                continue  # removed since opendir
            if not pyfuse3.readdir_reply(token, name, self._attrs(node), i + 1):
                return
            self.lookups[child] = self.lookups.get(child, 0) + 1

    @fuse_boundary
    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        """Drop the snapshot."""
        self.dirs.pop(fh, None)

    @fuse_boundary
    async def fsyncdir(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        """Directory changes are already committed; make them power-loss durable."""
        await trio.to_thread.run_sync(self.store.sync)

    @fuse_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """Space of the disk holding the state dir (where the upper layer lives)."""
        return statfs_reply(os.statvfs(self.store.root), self.readonly, self.store.count_inodes())

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        """Drop kernel references; free orphans nobody uses any more.

        Must never raise: there is no request to report an error to.
        """
        for inode, nlookup in inode_list:
            try:
                ino = InodeNo(inode)
                left = self.lookups.get(ino, 0) - nlookup
                if left > 0:
                    self.lookups[ino] = left
                    continue
                self.lookups.pop(ino, None)
                self._maybe_free(ino)
            except Exception:
                log.exception("forget of inode %d failed", inode)

    def shutdown(self) -> None:
        """After unmount: close every backing fd (every change is already committed)."""
        self.content.close_all()
        self.handles.clear()
