"""Objects as files under one directory on the controller's own disk.

Layout under ``root``::

    objects/<company>/<first two hex digits>/<sha256>   one file per object
    tmp/<random>                                         uploads in progress

An object's file holds its stored form (``packed``): compressed when that
pays, else the bytes as they are.

Durability and atomicity come from the classic sequence: write the bytes to a
temporary file on the same filesystem, fsync it, hard-link it into place, fsync
the directory. ``link`` (unlike ``rename``) fails when the target exists, so two
concurrent writers of one key cannot both claim to have created it, and a
reader either sees no file or the whole, synced one.

Paths are resolved one component at a time with ``O_NOFOLLOW`` relative to a
directory descriptor, so a symlink planted anywhere in the tree (by a bug, an
operator's mistake or an attacker with local write access) is refused rather
than followed outside ``root``. The key format check already rules out ``..``
and absolute paths; this is the second line of defence.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import IO

from common.errors import StorageUnavailable

from . import packed
from .base import (
    DEFAULT_CHUNK_SIZE,
    ObjectMissing,
    SourceMismatch,
    Span,
    StorageProvider,
    check_put_arguments,
    check_range,
    is_object_key,
    open_stream,
    validate_key,
)

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


try:
    from controller.storage import _objfile
except ImportError:  # built without a compiler: the Python steps
    _objfile = None  # type: ignore[assignment]

_put_new = None if _objfile is None else _objfile.put_new
"""``put_bytes``'s steps in C with the GIL released once (controller/storage/_objfile.c),
where the extension was built: 1 stored, 0 exists, -1 a directory to make,
-2 no anonymous files here. In Python each of its sixteen system calls
hands the GIL over to the event loop's thread and back."""
_FAILED = -3
"""The C store's answer for a failure; its errno comes with it."""
STORE_THREADS = 4
"""Threads of the C store's own (``put_bytes_async``): stores run at once."""


class _NativeStores:
    """The C store on threads of its own, answering on the event loop.

    A worker thread of Python's takes the GIL to start each store and again
    to hand its answer back, each a wait for the busy event loop's thread.
    These threads never take it: the loop submits a store and collects the
    answers when the module's eventfd says some wait, and each goes to the
    future of its store. One loop watches the eventfd at a time (the
    controller has one); a store submitted from another loop while that
    one runs goes through a worker thread instead.
    """

    def __init__(self) -> None:
        assert _objfile is not None
        self._fd = _objfile.start(STORE_THREADS)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _watching(self, loop: asyncio.AbstractEventLoop) -> bool:
        if self._loop is loop:
            return True
        old = self._loop
        if old is not None and not old.is_closed():
            if old.is_running():
                return False
            old.remove_reader(self._fd)
        loop.add_reader(self._fd, self._collect)
        self._loop = loop
        return True

    def _collect(self) -> None:
        for future, answer, error in _objfile.collect():
            loop = future.get_loop()
            if loop is self._loop:
                _answer(future, answer, error)
            else:
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    loop.call_soon_threadsafe(_answer, future, answer, error)

    async def store(
        self, root: str, parts: Sequence[str], name: str, body: bytes
    ) -> tuple[int, int] | None:
        """``put_new``'s answer and errno; None where this loop cannot be watched."""
        loop = asyncio.get_running_loop()
        if not self._watching(loop):
            return None
        future: asyncio.Future[tuple[int, int]] = loop.create_future()
        _objfile.submit(future, root, parts, name, body)
        return await future


def _answer(future: asyncio.Future[tuple[int, int]], answer: int, error: int) -> None:
    if not future.done():  # not cancelled meanwhile
        future.set_result((answer, error))


_native: _NativeStores | None = None


def _native_stores() -> _NativeStores | None:
    """The C store's threads, started on first use; None without the extension."""
    global _native
    if _native is None and _objfile is not None:
        _native = _NativeStores()
    return _native


_COPY_CHUNK = 1 << 20
_TMP_DIR = "tmp"
_OBJECTS_DIR = "objects"


class LocalDiskProvider(StorageProvider):
    name = "local_disk"

    # A temp file this old belongs to a put that died (crash, kill); live puts
    # finish far sooner. Younger files may belong to another process sharing the
    # root, so they are left alone.
    stale_temp_age = 3600.0

    def __init__(self, root: Path) -> None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.root = root.resolve(strict=True)
            with self._temp_directory():
                pass
        except OSError as exc:
            raise StorageUnavailable(f"cannot prepare object directory {root}: {exc}") from exc
        self._sweep_stale_temps()

    def __repr__(self) -> str:
        return f"LocalDiskProvider({str(self.root)!r})"

    # -- path resolution -------------------------------------------------

    @contextlib.contextmanager
    def _directory(
        self, parts: Sequence[str], *, create: bool, sync_new: bool = True
    ) -> Iterator[int]:
        """A descriptor for ``root/parts...``, reached without following any symlink.

        With ``create`` missing directories are made, and each new entry is made
        durable by syncing its parent (unless ``sync_new`` is False: the caller
        syncs the whole filesystem before it reports success), so a synced
        object file is never left in a directory that a crash could forget.
        """
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts:
                child = _child_directory(fd, part, create=create, sync_new=sync_new)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _free_slot(self, key: str) -> Iterator[tuple[int, str, int] | None]:
        """Where a new object ``key`` goes: its directory (made if missing),
        its name there and the temp directory, as (dir_fd, name, tmp_fd);
        None when an object is already there."""
        dirs, name = self._split(key)
        with self._directory(dirs, create=True) as dir_fd:
            if _lexists(name, dir_fd):
                yield None
                return
            with self._temp_directory() as tmp_fd:
                yield dir_fd, name, tmp_fd

    def _temp_directory(self) -> contextlib.AbstractContextManager[int]:
        """The temp directory of named temp files (made if missing)."""
        return self._directory([_TMP_DIR], create=True)

    @staticmethod
    def _split(key: str) -> tuple[list[str], str]:
        parts = validate_key(key).split("/")
        return parts[:-1], parts[-1]

    def _unavailable(self, action: str, key: str, exc: OSError) -> StorageUnavailable:
        return StorageUnavailable(f"local storage: cannot {action} {key} under {self.root}: {exc}")

    # -- StorageProvider -------------------------------------------------

    def put_file(self, key: str, src: Path, size: int, sha256_hex: str) -> bool:
        check_put_arguments(key, size, sha256_hex)
        try:
            with self._free_slot(key) as slot:
                if slot is None:
                    return False
                dir_fd, name, tmp_fd = slot
                tmp_name = _write_packed_temp(src, size, sha256_hex, tmp_fd)
                if tmp_name is None:
                    tmp_name = _write_synced_temp(src, size, sha256_hex, tmp_fd)
                try:
                    return _link_into_place(tmp_name, tmp_fd, name, dir_fd)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp_name, dir_fd=tmp_fd)
        except OSError as exc:
            raise self._unavailable("store", key, exc) from exc

    def adopt_file(self, key: str, src: Path, size: int, sha256_hex: str) -> bool:
        """Store the caller's spool file packed when that pays (``packed``),
        else link it into place: no copy, no second hash (the caller hashed
        these bytes as it wrote them; packing checks only their size).

        One fsync of the data and one of the directory, as for a copied put;
        a spool on another filesystem is copied.
        """
        check_put_arguments(key, size, sha256_hex)
        try:
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    raise SourceMismatch(f"{src} is not a {size}-byte regular file")
                with self._free_slot(key) as slot:
                    if slot is None:
                        return False
                    dir_fd, name, tmp_fd = slot
                    tmp_name = _write_packed_temp(src, size, sha256_hex, tmp_fd, hashed=True)
                    if tmp_name is None and os.fstat(dir_fd).st_dev != st.st_dev:
                        tmp_name = _write_synced_temp(src, size, sha256_hex, tmp_fd)
                    if tmp_name is not None:
                        try:
                            return _link_into_place(tmp_name, tmp_fd, name, dir_fd)
                        finally:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(tmp_name, dir_fd=tmp_fd)
                    os.fsync(fd)
                    return _link_into_place(str(src), None, name, dir_fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._unavailable("store", key, exc) from exc

    def put_bytes(self, key: str, data: bytes, sha256_hex: str) -> bool:
        """Store bytes in memory (packed when that pays) as an anonymous file
        in the object's own directory, synced, then linked into place: no
        temp name to remove, and no spool file either. One fsync of the data
        and one of the directory, as for a put from a file. The temp
        directory is opened only where the filesystem makes no anonymous
        files."""
        check_put_arguments(key, len(data), sha256_hex)
        body = packed.stored_form(data, sha256_hex)
        dirs, name = self._split(key)
        if _put_new is not None:
            try:
                made = _put_new(str(self.root), dirs, name, body)
            except OSError as exc:
                raise self._unavailable("store", key, exc) from exc
            if made >= 0:
                return made == 1
        return self._put_stored_form(key, dirs, name, body)

    def _put_stored_form(self, key: str, dirs: list[str], name: str, body: bytes) -> bool:
        """``put_bytes``'s steps in Python for its packed ``body``: they make
        missing directories, and use a named temp file where the filesystem
        makes no anonymous files (the two cases the C store leaves here)."""
        try:
            with self._directory(dirs, create=True) as dir_fd:
                if _lexists(name, dir_fd):
                    return False
                if not _link_new(body, self._temp_directory, name, dir_fd, sync=True):
                    return False  # a concurrent put of the same content won
                _sync_link(name, dir_fd)
                return True
        except OSError as exc:
            raise self._unavailable("store", key, exc) from exc

    async def put_bytes_async(self, key: str, data: bytes, sha256_hex: str) -> bool:
        """``put_bytes`` from the event loop: packed here, then stored by the
        C store's own threads (``_NativeStores``), so no thread takes the
        GIL for it. A directory to make, or a filesystem without anonymous
        files, takes the Python steps in a worker thread; a tree built
        without the extension, or a second running loop, all of
        ``put_bytes``."""
        stores = _native_stores()
        if stores is None:
            return await asyncio.to_thread(self.put_bytes, key, data, sha256_hex)
        check_put_arguments(key, len(data), sha256_hex)
        body = packed.stored_form(data, sha256_hex)
        dirs, name = self._split(key)
        answer = await stores.store(str(self.root), dirs, name, body)
        if answer is None:  # another event loop watches the threads
            return await asyncio.to_thread(self.put_bytes, key, data, sha256_hex)
        made, error = answer
        if made == _FAILED:
            raise self._unavailable("store", key, OSError(error, os.strerror(error)))
        if made >= 0:
            return made == 1
        return await asyncio.to_thread(self._put_stored_form, key, dirs, name, body)

    def put_spans(self, src: Path, spans: Sequence[Span]) -> list[bool]:
        """Write every new object (packed where that pays) as an anonymous
        file in its own directory (``O_TMPFILE``), link each into place, then
        make them all durable with one ``syncfs`` of the object filesystem.
        If that sync fails the objects this call linked are removed again.

        A span of up to one packed frame (:data:`packed.FRAME_BYTES`: every
        batch member) is read whole, hashed once and given its stored form in
        memory (``packed.stored_form``), then written with one call; a larger
        one is streamed. Each fan-out directory is opened once per call,
        relative to its company's directory."""
        for span in spans:
            check_put_arguments(span.key, span.size, span.sha256_hex)
        created: list[bool] = []
        linked: list[tuple[int, str]] = []
        with contextlib.ExitStack() as dirs_open:
            dir_fds: dict[str, int] = {}
            try:
                tmp_fd = dirs_open.enter_context(self._temp_directory())

                def temp_dir() -> contextlib.AbstractContextManager[int]:
                    return contextlib.nullcontext(tmp_fd)

                with open(src, "rb") as source:
                    for span in spans:
                        # The key was checked above: objects/<company>/<fanout>/<digest>.
                        where, name = span.key.rsplit("/", 1)
                        dir_fd = dir_fds.get(where)
                        if dir_fd is None:
                            company, fanout = where.rsplit("/", 1)
                            parent_fd = dir_fds.get(company)
                            if parent_fd is None:
                                parent_fd = dirs_open.enter_context(
                                    self._directory(company.split("/"), create=True, sync_new=False)
                                )
                                dir_fds[company] = parent_fd
                            dir_fd = _child_directory(
                                parent_fd, fanout, create=True, sync_new=False
                            )
                            dirs_open.callback(os.close, dir_fd)
                            dir_fds[where] = dir_fd
                        made = not _lexists(name, dir_fd) and _link_new(
                            _span_content(source.fileno(), span), temp_dir, name, dir_fd
                        )
                        created.append(made)
                        if made:
                            linked.append((dir_fd, name))
                if linked:
                    _syncfs(tmp_fd)
            except BaseException as exc:
                for dir_fd, name in linked:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dir_fd)
                if isinstance(exc, OSError):
                    raise self._unavailable("store", spans[0].key, exc) from exc
                raise
        return created

    def read_chunks(
        self, key: str, start: int = 0, end: int | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> Iterator[bytes]:
        dirs, name = self._split(key)
        check_range(start, end, chunk_size)

        def open_raw(raw_start: int, raw_end: int | None) -> Iterator[bytes]:
            return open_stream(self._stream(key, dirs, name, raw_start, raw_end, chunk_size))

        return open_stream(packed.read_logical(open_raw, key, start, end, chunk_size))

    def _stream(
        self, key: str, dirs: list[str], name: str, start: int, end: int | None, chunk_size: int
    ) -> Generator[bytes, None, None]:
        try:
            with self._directory(dirs, create=False) as dir_fd:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError as exc:
            raise ObjectMissing(f"object {key} is missing from {self.root}") from exc
        except OSError as exc:
            raise self._unavailable("open", key, exc) from exc
        try:
            try:
                st = os.fstat(fd)
            except OSError as exc:
                raise self._unavailable("stat", key, exc) from exc
            if not stat.S_ISREG(st.st_mode):
                raise StorageUnavailable(f"local storage: {key} is not a regular file")
            stop = st.st_size if end is None else min(end, st.st_size)
            yield b""
            pos = start
            while pos < stop:
                try:
                    chunk = os.pread(fd, min(chunk_size, stop - pos), pos)
                except OSError as exc:
                    raise self._unavailable("read", key, exc) from exc
                if not chunk:
                    # Objects are immutable; a short file here means someone
                    # truncated it behind our back, and silently returning fewer
                    # bytes than the metadata promises would corrupt downloads.
                    raise StorageUnavailable(f"local storage: {key} ended early at byte {pos}")
                pos += len(chunk)
                yield chunk
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        """The logical size: a packed object's header says it."""
        dirs, name = self._split(key)
        try:
            with self._directory(dirs, create=False) as dir_fd:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise StorageUnavailable(f"local storage: {key} is not a regular file")
                head = os.pread(fd, packed.HEADER_LEN, 0)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._unavailable("stat", key, exc) from exc
        return packed.logical_size(head, st.st_size, name)

    def exists(self, key: str) -> bool:
        dirs, name = self._split(key)
        try:
            with self._directory(dirs, create=False) as dir_fd:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._unavailable("stat", key, exc) from exc
        if not stat.S_ISREG(st.st_mode):
            raise StorageUnavailable(f"local storage: {key} is not a regular file")
        return True

    def delete(self, key: str) -> None:
        dirs, name = self._split(key)
        try:
            with self._directory(dirs, create=False) as dir_fd:
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    return
                # Without this a crash could bring the object back; harmless for
                # correctness, but GC would already have forgotten about it.
                os.fsync(dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._unavailable("delete", key, exc) from exc

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        try:
            yield from self._walk(_OBJECTS_DIR, prefix, depth=3)
        except OSError as exc:
            raise StorageUnavailable(f"local storage: cannot list {self.root}: {exc}") from exc

    def _walk(self, rel: str, prefix: str, depth: int) -> Iterator[str]:
        try:
            with os.scandir(self.root / rel) as it:
                entries = sorted(it, key=lambda entry: entry.name)
        except FileNotFoundError:
            return
        for entry in entries:
            path = f"{rel}/{entry.name}"
            if depth > 1:
                # Descend only where keys with this prefix can live; never into symlinks.
                if entry.is_dir(follow_symlinks=False) and _may_hold(path + "/", prefix):
                    yield from self._walk(path, prefix, depth - 1)
            elif (
                path.startswith(prefix)
                and entry.is_file(follow_symlinks=False)
                and is_object_key(path)
            ):
                yield path

    def check(self) -> None:
        probe = f".probe-{secrets.token_hex(8)}"
        try:
            with self._temp_directory() as tmp_fd:
                fd = os.open(
                    probe,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=tmp_fd,
                )
                try:
                    os.write(fd, b"probe")
                    os.fsync(fd)
                finally:
                    os.close(fd)
                    os.unlink(probe, dir_fd=tmp_fd)
        except OSError as exc:
            raise StorageUnavailable(
                f"local storage under {self.root} is not writable: {exc}"
            ) from exc

    def sweep_abandoned_writes(self, started_before: float) -> int:
        """Temp files of puts that died: a put's temp file lives for one put,
        and an anonymous one (``O_TMPFILE``) vanishes with its process."""
        removed = 0
        try:
            with self._temp_directory() as tmp_fd:
                for name in os.listdir(tmp_fd):
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and st.st_mtime < started_before:
                            os.unlink(name, dir_fd=tmp_fd)
                            removed += 1
        except OSError as exc:
            raise StorageUnavailable(f"local storage: cannot sweep {self.root}/tmp: {exc}") from exc
        if removed:
            log.info("removed %d stale temp files under %s", removed, self.root)
        return removed

    def _sweep_stale_temps(self) -> None:
        try:
            self.sweep_abandoned_writes(time.time() - self.stale_temp_age)
        except StorageUnavailable as exc:
            # Leftover temps only waste space; not a reason to refuse to start.
            log.warning("could not sweep stale temp files: %s", exc)


def _child_directory(fd: int, part: str, *, create: bool, sync_new: bool) -> int:
    """A descriptor for the directory ``part`` of ``fd``, never through a
    symlink; with ``create`` made if missing (``fd`` synced after, unless
    ``sync_new`` is False: see ``LocalDiskProvider._directory``)."""
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(part, 0o700, dir_fd=fd)
    except FileExistsError:
        pass  # a concurrent put made it first; either way it exists
    else:
        if sync_new:
            os.fsync(fd)
    return os.open(part, _DIR_FLAGS, dir_fd=fd)


def _new_temp(tmp_fd: int, access: int) -> tuple[str, int]:
    """A new file of a random ``put-`` name in the temp directory ``tmp_fd``,
    opened with ``access`` (never through a symlink): (name, fd)."""
    name = f"put-{secrets.token_hex(16)}"
    flags = access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return name, os.open(name, flags, 0o600, dir_fd=tmp_fd)


def _lexists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _may_hold(dir_prefix: str, prefix: str) -> bool:
    """Whether keys under ``dir_prefix`` can start with ``prefix``."""
    return dir_prefix.startswith(prefix) or prefix.startswith(dir_prefix)


def _write_packed_temp(
    src: Path, size: int, sha256_hex: str, tmp_fd: int, *, hashed: bool = False
) -> str | None:
    """``src`` packed into a new, synced file in the temp directory; its name,
    or None when packing does not pay (``packed``) and nothing is left.
    ``hashed``: ``src`` is a spool file the caller hashed (``packed.pack``).
    A large ``src`` that ``packed.may_pay`` rules out gets no temp file."""
    if not packed.worth_packing(size):
        return None
    with src.open("rb") as source:
        if not packed.may_pay(source.fileno(), size):
            return None
        tmp_name, fd = _new_temp(tmp_fd, os.O_RDWR)
        kept = False
        try:
            with open(fd, "w+b", closefd=True) as out:
                if packed.pack(source.read, size, sha256_hex, out, hashed=hashed) is None:
                    return None
                out.flush()
                os.fsync(out.fileno())
                kept = True
        finally:
            if not kept:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp_name, dir_fd=tmp_fd)
    return tmp_name


def _write_synced_temp(src: Path, size: int, sha256_hex: str, tmp_fd: int) -> str:
    """Copy ``src`` into a new file in the temp directory, verify it, fsync it; return its name.

    The copy is hashed as it is written, so what gets linked into place is
    exactly what was verified, even if ``src`` changes while we read it.
    """
    tmp_name, fd = _new_temp(tmp_fd, os.O_WRONLY)
    try:
        digest = hashlib.sha256()
        copied = 0
        with open(fd, "wb", closefd=True) as out, src.open("rb") as source:
            while copied <= size:
                chunk = source.read(_COPY_CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
                copied += len(chunk)
                out.write(chunk)
            if copied != size:
                raise SourceMismatch(f"{src} is not {size} bytes long (read {copied})")
            if digest.hexdigest() != sha256_hex:
                raise SourceMismatch(f"{src} does not hash to {sha256_hex}")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name, dir_fd=tmp_fd)
        raise
    return tmp_name


class _SpanWriter:
    """Writes a span of the source as the object's stored form: packed when
    that pays, else a streamed copy; hashed either way (SourceMismatch)."""

    def __init__(self, fd: int, span: Span) -> None:
        self.fd, self.span = fd, span

    def _reader(self) -> Callable[[int], bytes]:
        pos, end = self.span.offset, self.span.offset + self.span.size

        def read(n: int) -> bytes:
            nonlocal pos
            data = os.pread(self.fd, min(n, end - pos), pos) if pos < end else b""
            pos += len(data)
            return data

        return read

    def __call__(self, out: IO[bytes]) -> None:
        span = self.span
        if packed.worth_packing(span.size) and packed.may_pay(self.fd, span.size, span.offset):
            if packed.pack(self._reader(), span.size, span.sha256_hex, out) is not None:
                return
            out.seek(0)
            out.truncate()
        read, digest, left = self._reader(), hashlib.sha256(), span.size
        while left:
            chunk = read(min(_COPY_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            out.write(chunk)
            left -= len(chunk)
        if left or digest.hexdigest() != span.sha256_hex:
            raise SourceMismatch(f"bytes at {span.offset} are not {span.sha256_hex}")


def _span_content(fd: int, span: Span) -> bytes | _SpanWriter:
    """What ``_link_new`` writes for ``span`` of the source ``fd``: a small
    span's stored form, made in memory (SourceMismatch unless its bytes are
    ``span.size`` bytes hashing to its digest), else a writer streaming it."""
    if span.size > packed.FRAME_BYTES:
        return _SpanWriter(fd, span)
    data = os.pread(fd, span.size, span.offset) if span.size else b""
    if len(data) != span.size:
        raise SourceMismatch(f"bytes at {span.offset} are not {span.sha256_hex}")
    return packed.stored_form(data, span.sha256_hex)


Fill = bytes | Callable[[IO[bytes]], object]
"""A new file's content: its bytes, or a function writing them to the file."""


def _fill(fd: int, fill: Fill) -> None:
    if isinstance(fill, bytes):
        view = memoryview(fill)
        while view:
            view = view[os.write(fd, view) :]
        return
    with open(fd, "w+b", closefd=False) as out:
        fill(out)


def _link_new(
    fill: Fill,
    temp_dir: Callable[[], contextlib.AbstractContextManager[int]],
    name: str,
    dir_fd: int,
    *,
    sync: bool = False,
) -> bool:
    """Write a new file with ``fill`` and link it into place as ``name``;
    with ``sync`` its data is synced before the link, else it is left
    unsynced (the caller syncs the filesystem once for many). The file is
    anonymous (:func:`_link_anonymous`) where the filesystem supports it,
    else a named temp file in the temp directory, which ``temp_dir()``
    opens only then."""
    made = _link_anonymous(fill, name, dir_fd, sync=sync)
    if made is None:
        with temp_dir() as tmp_fd:
            return _link_named(fill, tmp_fd, name, dir_fd, sync=sync)
    return made


def _link_anonymous(fill: Fill, name: str, dir_fd: int, *, sync: bool) -> bool | None:
    """:func:`_link_new` with an anonymous file (``O_TMPFILE`` in the target
    directory): whether it was linked (False: ``name`` exists already), or
    None when the filesystem makes no anonymous files."""
    try:
        fd = os.open(".", os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        return None
    try:
        _fill(fd, fill)
        if sync:
            os.fsync(fd)
        try:
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
        except FileExistsError:
            return False
    finally:
        os.close(fd)
    return True


def _link_named(fill: Fill, tmp_fd: int, name: str, dir_fd: int, *, sync: bool) -> bool:
    tmp_name, fd = _new_temp(tmp_fd, os.O_RDWR)
    try:
        try:
            _fill(fd, fill)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp_name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name, dir_fd=tmp_fd)


_libc = ctypes.CDLL(None, use_errno=True)


def _syncfs(fd: int) -> None:
    """Flush the whole filesystem holding ``fd``: one sync for many new files."""
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _link_into_place(tmp_name: str, tmp_fd: int | None, name: str, dir_fd: int) -> bool:
    try:
        os.link(tmp_name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        return False  # a concurrent put of the same content won
    _sync_link(name, dir_fd)
    return True


def _sync_link(name: str, dir_fd: int) -> None:
    """Make the new entry ``name`` durable (its data already is)."""
    try:
        os.fsync(dir_fd)
    except OSError:
        # The caller will be told the put failed and will retry; a retry must
        # not find a visible but possibly non-durable object and report "exists".
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
