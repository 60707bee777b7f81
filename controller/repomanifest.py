"""Repository checkpoints in memory: the request parsed and validated, the
complete checkpoint planned against its base, and the manifest objects.

No SQL here (that is :mod:`controller.repos`). A manifest is an ordinary
content-addressed object of the company: zstd-compressed JSON
``{"members": [Member...], "config": [[key, value]...]}``, members sorted by
path. It is written once, before the commit that makes it current, and never
changed, so parsed manifests are cached by digest: a delta commit's base is
usually the previous commit's result and costs no storage read.

Validation is :mod:`common.repos`'s rule book, applied here on the host
whatever the sandbox claims: every member a request carries
(:func:`common.repos.member_problem`), and the complete resulting checkpoint
(:func:`common.repos.tree_problem`) at every commit, delta or not.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zstandard

from common.errors import UnsafeRepoMember, ValidationError
from common.paths import validate_path
from common.repos import (
    MAX_CONFIG_PAIRS,
    MAX_REPO_ENTRIES,
    RepoMember,
    member_problem,
    parse_member,
    portable_config,
    tree_problem,
)
from controller import apply
from controller.storage.base import StorageProvider, object_key

MANIFEST_MAX_RAW = 256 << 20
"""Largest decompressed manifest read back (100,000 members need far less)."""

_UUID_CHARS = frozenset("0123456789abcdef-")


def member_json(member: RepoMember) -> bytes:
    return json.dumps(member.as_json(), separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: path -> member, and its portable config."""

    members: Mapping[str, RepoMember]
    config: tuple[tuple[str, str], ...]
    encoded: dict[str, bytes] | None = field(default=None, compare=False, repr=False)
    """Path -> the member's JSON, when known (filled by :meth:`fragments`)."""
    sizes: dict[str, int] = field(init=False, compare=False, repr=False)
    """Digest -> byte size of every file member."""

    def __post_init__(self) -> None:
        sizes = {m.digest: m.byte_size for m in self.members.values() if m.digest is not None}
        object.__setattr__(self, "sizes", sizes)

    def fragments(self) -> dict[str, bytes]:
        """Every member's JSON by path: encoded once per manifest, so a delta
        on it encodes only what it changes."""
        if self.encoded is None:
            object.__setattr__(
                self, "encoded", {p: member_json(m) for p, m in self.members.items()}
            )
        assert self.encoded is not None
        return self.encoded


EMPTY = Manifest({}, ())


# --- the request ---------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointRequest:
    operation_id: str
    lease_epoch: int
    base: str | None
    changed: dict[str, RepoMember]
    """The members the body carries, by path, in body order."""
    removed: tuple[str, ...]
    config: tuple[tuple[str, str], ...]
    """The portable pairs only (:func:`common.repos.portable_config`)."""
    fingerprint: str


def _problem(problems: list[dict[str, Any]], field_: str, code: str, message: str) -> None:
    problems.append({"field": field_, "code": code, "message": message})


def parse_request(body: dict[str, Any]) -> CheckpointRequest:
    """The body's shape (ValidationError, 400) and every member it carries
    (UnsafeRepoMember, 422, for the first member refused). CPU work: runs in
    a worker thread."""
    problems: list[dict[str, Any]] = []
    fields = {"operationId", "leaseEpoch", "base", "members", "removed", "config"}
    for extra in sorted(set(body) - fields):
        _problem(problems, extra, "unexpected_field", f"{extra} is not allowed")
    op_id = body.get("operationId")
    if not isinstance(op_id, str) or not 1 <= len(op_id) <= 256 or not op_id.isprintable():
        _problem(
            problems, "operationId", "invalid", "operationId must be 1-256 printable characters"
        )
    epoch = body.get("leaseEpoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
        _problem(problems, "leaseEpoch", "invalid", "leaseEpoch must be a positive integer")
    base = body.get("base")
    if base is not None and (
        not isinstance(base, str) or len(base) != 36 or not set(base) <= _UUID_CHARS
    ):
        _problem(problems, "base", "invalid", "base must be a checkpoint id or null")
    members = body.get("members")
    if not isinstance(members, list):
        _problem(problems, "members", "invalid", "members must be a list")
        members = []
    removed = body.get("removed", [])
    if not isinstance(removed, list) or len(removed) > MAX_REPO_ENTRIES:
        _problem(
            problems,
            "removed",
            "invalid",
            f"removed must be a list of at most {MAX_REPO_ENTRIES} paths",
        )
        removed = []
    elif removed and base is None:
        _problem(problems, "removed", "invalid", "a checkpoint without a base removes nothing")
    for i, path in enumerate(removed):
        try:
            validate_path(path, f"removed[{i}]")
        except ValidationError as exc:
            problems.extend(exc.details or [])
    config = body.get("config", [])
    if (
        not isinstance(config, list)
        or len(config) > MAX_CONFIG_PAIRS
        or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in config
        )
    ):
        _problem(
            problems,
            "config",
            "invalid",
            f"config must be a list of at most {MAX_CONFIG_PAIRS} [key, value] string pairs",
        )
        config = []
    if problems:
        raise ValidationError(problems[:100])
    assert isinstance(op_id, str) and isinstance(epoch, int)
    if len(members) > MAX_REPO_ENTRIES:
        raise UnsafeRepoMember(None, "too_many_members")
    changed: dict[str, RepoMember] = {}
    for raw in members:
        rule = member_problem(raw)
        path = raw.get("path") if isinstance(raw, dict) else None
        where = path if isinstance(path, str) else None
        if rule is not None:
            raise UnsafeRepoMember(where, rule)
        member = parse_member(raw)
        if member.path in changed:
            raise UnsafeRepoMember(member.path, "duplicate_member")
        changed[member.path] = member
    gone: set[str] = set()
    for path in removed:
        if path in gone or path in changed:
            raise UnsafeRepoMember(path, "duplicate_member")
        gone.add(path)
    fingerprint = apply.fingerprint(
        action="repo-checkpoint",
        base=base,
        members=[m.as_json() for m in changed.values()],
        removed=removed,
        config=config,
    )
    return CheckpointRequest(
        op_id,
        epoch,
        base,
        changed,
        tuple(removed),
        tuple(portable_config((k, v) for k, v in config)),
        fingerprint,
    )


# --- the plan -------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The complete checkpoint a request makes of ``current_id``'s manifest."""

    current_id: str | None
    """The current checkpoint the plan was made against."""
    manifest: Manifest
    old_digests: frozenset[str]
    """File digests of the current checkpoint (which this binding references)."""
    new_digests: frozenset[str]
    """File digests of the planned checkpoint."""
    entries: int
    files: int
    byte_size: int


def plan_checkpoint(req: CheckpointRequest, current_id: str | None, current: Manifest) -> Plan:
    """Apply the request to ``current`` and validate the result whole.

    A delta's ``base`` must be ``current_id`` (the caller checks). Every
    member of a delta that reuses a digest of the current checkpoint must
    declare that digest's size; new digests are checked when claimed.
    """
    encoded = None
    if req.base is not None:
        members = dict(current.members)
        encoded = dict(current.fragments())
        for i, path in enumerate(req.removed):
            if members.pop(path, None) is None:
                raise ValidationError.single(
                    f"removed[{i}]", "not_in_base", f"{path!r} is not in the base checkpoint"
                )
            del encoded[path]
        members.update(req.changed)
        encoded.update((p, member_json(m)) for p, m in req.changed.items())
    else:
        members = req.changed
    problem = tree_problem(members)
    if problem is not None:
        raise UnsafeRepoMember(*problem)
    sizes: dict[str, int] = {}
    byte_size = files = 0
    for member in req.changed.values():
        if member.digest is None:
            continue
        known = sizes.setdefault(member.digest, current.sizes.get(member.digest, member.byte_size))
        if known != member.byte_size:
            raise UnsafeRepoMember(member.path, "size_mismatch")
    manifest = Manifest(members, req.config, encoded)
    for member in members.values():
        if member.kind == "file":
            files += 1
            byte_size += member.byte_size
    return Plan(
        current_id,
        manifest,
        frozenset(current.sizes),
        frozenset(manifest.sizes),
        len(members),
        files,
        byte_size,
    )


def member_with(manifest: Manifest, digest: str) -> str:
    """The path of a member of ``manifest`` whose content is ``digest``."""
    return next(m.path for m in manifest.members.values() if m.digest == digest)


# --- manifest objects -----------------------------------------------------------


def encode(manifest: Manifest) -> bytes:
    """The manifest object's bytes (compressed JSON, members sorted by path)."""
    fragments = manifest.fragments()
    config = json.dumps([list(pair) for pair in manifest.config], ensure_ascii=False)
    raw = b"".join(
        (
            b'{"members":[',
            b",".join([fragments[p] for p in sorted(fragments)]),
            b'],"config":',
            config.encode(),
            b"}",
        )
    )
    # Level 1: digests do not compress further at higher levels, and it is the fastest.
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)


def decode(data: bytes) -> Manifest:
    """A manifest object this controller wrote."""
    raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MANIFEST_MAX_RAW)
    body = json.loads(raw)
    members = {m["path"]: parse_member(m) for m in body["members"]}
    return Manifest(members, tuple((k, v) for k, v in body["config"]))


class ManifestCache:
    """Parsed manifests by (company, digest), least recently used out first;
    at most ``max_members`` members in all (a 20,000-member manifest with its
    members' JSON takes about 15 MB, so the default bounds the cache near
    75 MB)."""

    def __init__(self, max_members: int = MAX_REPO_ENTRIES) -> None:
        self.max_members = max_members
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, str], Manifest] = OrderedDict()
        self._members = 0

    def get(self, company_id: str, digest: str) -> Manifest | None:
        with self._lock:
            found = self._items.get((company_id, digest))
            if found is not None:
                self._items.move_to_end((company_id, digest))
            return found

    def put(self, company_id: str, digest: str, manifest: Manifest) -> None:
        key = (company_id, digest)
        with self._lock:
            if key in self._items or len(manifest.members) > self.max_members:
                return
            self._items[key] = manifest
            self._members += len(manifest.members)
            while self._members > self.max_members:
                _, dropped = self._items.popitem(last=False)
                self._members -= len(dropped.members)


CACHE = ManifestCache()


def load(storage: StorageProvider, company_id: str, digest: str) -> Manifest:
    """The manifest stored under ``digest`` (blocking: run in a thread)."""
    cached = CACHE.get(company_id, digest)
    if cached is not None:
        return cached
    data = b"".join(storage.read_chunks(object_key(company_id, digest)))
    manifest = decode(data)
    CACHE.put(company_id, digest, manifest)
    return manifest


def manifest_json(
    storage: StorageProvider, company_id: str, digest: str, checkpoint_id: str
) -> Iterator[bytes]:
    """The manifest route's body, ``{"checkpointId", "members", "config"}``,
    decompressed from storage as it streams. Blocking: the object is opened
    here (ObjectMissing before any byte is sent), the rest as it is read."""
    chunks = storage.read_chunks(object_key(company_id, digest))
    return _manifest_json(chunks, checkpoint_id)


def _manifest_json(chunks: Iterator[bytes], checkpoint_id: str) -> Iterator[bytes]:
    dobj = zstandard.ZstdDecompressor().decompressobj()
    yield json.dumps({"checkpointId": checkpoint_id})[:-1].encode() + b","
    first = True
    for chunk in chunks:
        out = dobj.decompress(chunk)
        if first and out:
            out, first = out[1:], False  # the stored object's own "{"
        if out:
            yield out
