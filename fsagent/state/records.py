"""The persisted records of a state dir: their keys, encoders and named decoders.

Every value the store writes to LMDB is built and read here, nowhere else.
A record is a compact JSON array whose first element is its record version
(``_V``; a dir-mode ``dirstat`` record is packed, see :class:`LocalEntry`); decoders dispatch on it, so a later layout can be read beside an
older one.  The arrays written before records were versioned (state formats
1 and 2) are version 0: they are still decoded, so a read-only open
(``fsagent status``) of an older state dir works without upgrading it, and
:func:`upgrade_record` rewrites them when the dir is opened for writing.

Keys: an inode number is 8 big-endian bytes; a directory entry is the parent's
inode number followed by the name (at most 255 bytes, so always a valid
LMDB key).  A work path keys the ``base`` and ``journal`` tables: LMDB keys
are at most 511 bytes while a path may be up to 1024 characters (4096 bytes
of UTF-8), so a path longer than the key limit is keyed by a NUL byte plus
the SHA-256 of the path (a path never contains NUL).  Journal values carry
the full path, so a scan of the journal never has to invert a key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple, NewType

from common.types import Digest, FileVersion
from fsagent.errors import StateCorrupt

InodeNo = NewType("InodeNo", int)
JournalSeq = NewType("JournalSeq", int)
Kind = Literal["file", "directory"]

EMPTY_DIGEST: Final = Digest("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
MAX_KEY_BYTES: Final = 511
"""LMDB's key size limit (its compile-time default, which py-lmdb uses)."""
_HASHED_KEY_PREFIX: Final = b"\x00"

_V: Final = 1
"""Version of the records this code writes. 0: the unversioned arrays of formats 1 and 2."""
_V_INODE: Final = 2
"""Inode records: 1 had no owner and no atime (format 3); 2 adds uid, gid and atime."""

_U64 = struct.Struct(">Q")
# One encoder for all records: json.dumps with options builds a new encoder per call,
# which dominated the hydration of large manifests.
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_json_str = json.encoder.encode_basestring
"""A JSON string as ``_encode`` writes it (C, no encoder object per call): the
two hottest records are written field by field, byte for byte what ``_encode``
gives (tests/fsagent/test_fsagent_records.py), at a third of its cost."""


def ikey(ino: int) -> bytes:
    """Key of an inode in ``inodes``, ``orphans`` and ``inline``."""
    return _U64.pack(ino)


def ekey(parent: int, name: str) -> bytes:
    """Key of a directory entry; entries of one directory share the 8-byte prefix."""
    return _U64.pack(parent) + name.encode("utf-8")


def entry_name(key: bytes) -> str:
    """The name in a directory entry's key (after the parent's 8 bytes)."""
    return bytes(key[_U64.size :]).decode("utf-8")


def ino_of(raw: bytes) -> InodeNo:
    """Decode an inode number (an ``entries`` value or an inode key)."""
    return InodeNo(_U64.unpack(raw)[0])


def path_key(path: str) -> bytes:
    """Key of a work path in ``base`` and ``journal``: the path itself when it
    fits the key limit, else NUL + SHA-256 of it (see the module docstring)."""
    raw = path.encode("utf-8")
    if len(raw) <= MAX_KEY_BYTES:
        return raw
    return _HASHED_KEY_PREFIX + hashlib.sha256(raw).digest()


def _load(raw: bytes, what: str) -> list[Any]:
    try:
        rec = json.loads(raw)
    except ValueError as exc:
        raise StateCorrupt(f"unreadable {what} record: {exc}") from exc
    if not isinstance(rec, list):
        raise StateCorrupt(f"unreadable {what} record: {rec!r}")
    return rec


def _version(rec: list[Any], legacy_first: type, known: tuple[int, ...] = (_V,)) -> int:
    """The record version: legacy arrays start with a value of ``legacy_first``'s type."""
    if rec and isinstance(rec[0], legacy_first) and not isinstance(rec[0], bool):
        return 0
    if rec and isinstance(rec[0], int) and not isinstance(rec[0], bool) and rec[0] in known:
        return int(rec[0])
    raise StateCorrupt(f"record of unknown version: {rec[:1]!r}")


@functools.cache
def process_owner() -> tuple[int, int]:
    """The owner of entries whose records predate ownership (and of hydrated ones):
    the daemon's own uid and gid, which is what every entry reported then."""
    return os.getuid(), os.getgid()


@dataclass(slots=True)
class Inode:
    ino: InodeNo
    kind: Kind
    mode: int
    """Permission bits with setuid, setgid and sticky (0o7777); only the owner
    exec bit is part of the saved signature, the rest is local metadata."""
    size: int
    mtime_ns: int
    ctime_ns: int
    parent: InodeNo
    """0 once unlinked (an orphan kept alive by open handles or kernel lookups)."""
    name: str
    digest: Digest | None
    """Saved content this file still shows (in objects/); None once it has an upper copy."""
    upper: bool
    generation: int
    """Bumped on every content change; a shipper compares it before and after upload."""
    uid: int = field(default=-1)
    """Owner (local metadata, never shipped); -1 in the constructor: the daemon's user."""
    gid: int = field(default=-1)
    atime_ns: int = field(default=-1)
    """-1 in the constructor: the same as ``mtime_ns``."""

    def __post_init__(self) -> None:
        if self.uid < 0 or self.gid < 0:
            uid, gid = process_owner()
            self.uid = uid if self.uid < 0 else self.uid
            self.gid = gid if self.gid < 0 else self.gid
        if self.atime_ns < 0:
            self.atime_ns = self.mtime_ns

    @property
    def executable(self) -> bool:
        return bool(self.mode & 0o100)

    def encode(self) -> bytes:
        digest = "null" if self.digest is None else _json_str(self.digest)
        return (
            f"[{_V_INODE},{_json_str(self.kind)},{self.mode},{self.size},"
            f"{self.mtime_ns},{self.ctime_ns},{self.parent},{_json_str(self.name)},"
            f"{digest},{'true' if self.upper else 'false'},{self.generation},"
            f"{self.uid},{self.gid},{self.atime_ns}]"
        ).encode()

    @classmethod
    def decode(cls, ino: int, raw: bytes) -> Inode:
        """Versions 0 and 1 have no owner or atime: the daemon's user, atime = mtime."""
        rec = _load(raw, "inode")
        version = _version(rec, str, (1, _V_INODE))
        fields = rec if version == 0 else rec[1:]
        owner: list[Any] = [-1, -1, -1]
        if version == _V_INODE:
            fields, owner = fields[:10], fields[10:]
        try:
            k, mode, size, mt, ct, parent, name, digest, upper, gen = fields
            uid, gid, at = owner
        except ValueError:
            raise StateCorrupt(f"inode {ino}: malformed record {rec!r}") from None
        return cls(
            InodeNo(ino), k, mode, size, mt, ct, InodeNo(parent), name, digest, upper, gen,
            uid, gid, at,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class BaseEntry:
    """What the controller held at a path when the baseline was taken."""

    kind: Kind
    digest: Digest | None
    size: int
    executable: bool
    version: FileVersion

    def encode(self) -> bytes:
        digest = "null" if self.digest is None else _json_str(self.digest)
        return (
            f"[{_V},{_json_str(self.kind)},{digest},{self.size},"
            f"{'true' if self.executable else 'false'},{self.version}]"
        ).encode()

    @classmethod
    def decode_current(cls, raw: bytes) -> BaseEntry:
        """:meth:`decode`, faster for a record this code wrote (a dir-mode
        daemon reads 100,000 of them at start): the array is split on its
        commas, since kind, digest, size, flag and version hold none; anything
        else goes through :meth:`decode`."""
        parts = bytes(raw).split(b",")
        if len(parts) == 6 and parts[0] == b"[1" and parts[5][-1:] == b"]":
            kind, digest, size, exe, version = parts[1:]
            if kind in (b'"file"', b'"directory"') and exe in (b"true", b"false"):
                try:
                    return cls(
                        "file" if kind == b'"file"' else "directory",
                        None if digest == b"null" else Digest(digest[1:-1].decode("ascii")),
                        int(size),
                        exe == b"true",
                        FileVersion(int(version[:-1])),
                    )
                except ValueError:
                    pass
        return cls.decode(raw)

    @classmethod
    def decode(cls, raw: bytes) -> BaseEntry:
        rec = _load(raw, "baseline")
        fields = rec if _version(rec, str) == 0 else rec[1:]
        try:
            kind, digest, size, exe, version = fields
        except ValueError:
            raise StateCorrupt(f"malformed baseline record {rec!r}") from None
        return cls(kind, digest, size, exe, FileVersion(version))


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """A path touched since the baseline: its last sequence number and operation."""

    path: str
    seq: JournalSeq
    op: str

    def encode(self) -> bytes:
        return _encode([_V, self.seq, self.op, self.path]).encode()

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> JournalEntry:
        """``key`` gives the path of a version-0 record (whose keys were never hashed)."""
        rec = _load(raw, "journal")
        if len(rec) == 2:  # version 0: [seq, op], keyed by the path itself
            seq, op = rec
            return cls(bytes(key).decode("utf-8"), JournalSeq(seq), op)
        try:
            version, seq, op, path = rec
        except ValueError:
            raise StateCorrupt(f"malformed journal record {rec!r}") from None
        if version != _V:
            raise StateCorrupt(f"journal record of unknown version: {version!r}")
        return cls(path, JournalSeq(seq), op)


def upgrade_record(table: str, key: bytes, raw: bytes) -> bytes | None:
    """The current encoding of a record of ``table``, or None when it is current."""
    if table == "inodes":
        new = Inode.decode(ino_of(key), raw).encode()
    elif table == "base":
        new = BaseEntry.decode(raw).encode()
    elif table == "journal":
        new = JournalEntry.decode(key, raw).encode()
    else:
        raise ValueError(table)
    return None if new == bytes(raw) else new


class LocalEntry(NamedTuple):
    """What a scan of a plain-directory collection saw at one path (the
    ``dirstat`` table, fsagent.dirmode.store): its kind, its ``lstat`` key and, for
    a file, the digest of the contents read under that key.

    A tuple, so 100,000 of them load and compare without objects of their
    own. ``verified_ns`` is when the digest was known to match the key (a read
    that began then, or the end of a hydration): the key is trusted for a
    file changed at least a timestamp tick before it (fsagent.dirmode.scan).

    The one record that is not JSON: 100,000 of them are read at every start
    of a dir-mode daemon and by ``fsagent status``, and a packed record
    decodes about five times faster. Its first byte is still its version."""

    kind: Kind
    dev: int
    ino: int
    size: int
    mode: int
    mtime_ns: int
    ctime_ns: int
    digest: Digest | None
    verified_ns: int

    def encode(self, path: str) -> bytes:
        """The record, with the full path (its key may be a hash of it)."""
        digest = bytes.fromhex(self.digest) if self.digest is not None else bytes(32)
        kind = _LOCAL_KINDS.index(self.kind) | (0 if self.digest is not None else _NO_DIGEST)
        return _LOCAL.pack(
            _V, kind, self.dev, self.ino, self.size, self.mode, self.mtime_ns, self.ctime_ns,
            digest, self.verified_ns,
        ) + path.encode("utf-8")  # fmt: skip

    @classmethod
    def decode(cls, raw: bytes) -> tuple[str, LocalEntry]:
        try:
            version, kind, dev, ino, size, mode, mt, ct, digest, verified = _LOCAL.unpack_from(raw)
            path = raw[_LOCAL.size :].decode("utf-8")
            name: Kind = _LOCAL_KINDS[kind & ~_NO_DIGEST]
        except (struct.error, UnicodeDecodeError, IndexError):
            raise StateCorrupt(f"malformed dirstat record {bytes(raw[:16])!r}") from None
        if version != _V:
            raise StateCorrupt(f"dirstat record of unknown version: {version!r}")
        hexdigest = None if kind & _NO_DIGEST else Digest(digest.hex())
        return path, cls(name, dev, ino, size, mode, mt, ct, hexdigest, verified)


_LOCAL: Final = struct.Struct(">BBQQQIqq32sq")
"""version, kind (| _NO_DIGEST), dev, ino, size, mode, mtime_ns, ctime_ns,
SHA-256, verified_ns; then the path (UTF-8)."""
_LOCAL_KINDS: Final[tuple[Kind, Kind]] = ("file", "directory")
_NO_DIGEST: Final = 0x80


@dataclass(frozen=True, slots=True)
class ManifestRow:
    """One live manifest entry, as hydration needs it."""

    path: str
    kind: Kind
    digest: Digest | None
    byte_size: int
    executable: bool
    version: FileVersion

    def base_entry(self) -> BaseEntry:
        return BaseEntry(self.kind, self.digest, self.byte_size, self.executable, self.version)


@dataclass(frozen=True, slots=True)
class Binding:
    """Who the state belongs to. A run with any other binding cannot reuse it."""

    company_id: str
    scope: str
    owner_id: str | None
    owners: dict[str, str | None] = field(default_factory=dict)
    """The run's four bindings (task/agent/user/project -> owner id or None)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "companyId": self.company_id,
            "scope": self.scope,
            "ownerId": self.owner_id,
            "owners": dict(sorted(self.owners.items())),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Binding:
        return cls(data["companyId"], data["scope"], data["ownerId"], dict(data["owners"]))

    def describe(self) -> str:
        owners = ", ".join(f"{k}={v or '-'}" for k, v in sorted(self.owners.items()))
        return f"company {self.company_id}, {self.scope} owner {self.owner_id or '-'} ({owners})"


@dataclass(frozen=True, slots=True)
class Baseline:
    """The ``baseline`` meta value: the manifest high-water mark, and whether hydrated."""

    high_water: int
    hydrated: bool

    def encode(self) -> bytes:
        return encode_json({"highWater": self.high_water, "hydrated": self.hydrated})

    @classmethod
    def decode(cls, raw: bytes | None) -> Baseline:
        if raw is None:
            return cls(0, False)
        data = json.loads(raw)
        return cls(int(data["highWater"]), bool(data["hydrated"]))


def now_ns() -> int:
    """Timestamps in records: nanoseconds since the epoch."""
    return time.time_ns()


def encode_json(data: dict[str, Any]) -> bytes:
    """A ``meta`` value (binding, baseline, pending checkpoint, save status)."""
    return _encode(data).encode()
