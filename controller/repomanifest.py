"""Repository checkpoints in memory: the request parsed and validated, the
complete checkpoint planned against its base, and the manifest objects.

No SQL here (that is :mod:`controller.repos`). A manifest is an ordinary
content-addressed object of the company: zstd-compressed JSON, either full,
``{"members": [Member...], "config": [[key, value]...]}`` (members sorted by
path), or a delta on the manifest object of its base checkpoint,
``{"base": digest, "members": [changed...], "removed": [path...], "config"}``.
A delta commit stores a delta, so its cost follows the delta; a chain is at
most :data:`MAX_CHAIN` objects (a full one, then deltas) and its deltas
carry at most a quarter of the members (:data:`MIN_CARRIED` at least), then
the next commit stores a full manifest again. A checkpoint references every
object of its chain (``repo_refs``), so GC keeps them while it is current.
Objects are written once, before the commit that makes them current, and
never changed, so parsed manifests are cached by digest: a delta commit's
base is usually the previous commit's result and costs no storage read.

Validation is :mod:`common.repos`'s rule book, applied here on the host
whatever the sandbox claims: every member a request carries
(:func:`common.repos.member_problem`), and the complete resulting checkpoint
at every commit, delta or not: :func:`common.repos.tree_problem` for a whole
checkpoint, :func:`common.repos.delta_tree_problem` (the same verdict, at
the cost of the delta) for a delta.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import zstandard

from common.errors import UnsafeRepoMember, ValidationError
from common.paths import validate_path
from common.repos import (
    MAX_CONFIG_PAIRS,
    MAX_REPO_ENTRIES,
    RepoMember,
    TreeIndex,
    delta_tree_problem,
    member_problem,
    parse_member,
    portable_config,
    tree_problem,
)
from common.text import operation_id_problem
from controller import foldercore
from controller.storage.base import StorageProvider, object_key

MANIFEST_MAX_RAW = 256 << 20
"""Largest decompressed manifest read back (100,000 members need far less)."""

_UUID_CHARS = frozenset("0123456789abcdef-")


def member_json(member: RepoMember) -> bytes:
    return json.dumps(member.as_json(), separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: path -> member, and its portable config, with
    what a delta on it needs to cost only the delta (:func:`apply_delta`)."""

    members: Mapping[str, RepoMember]
    config: tuple[tuple[str, str], ...]
    encoded: dict[str, bytes] | None = field(compare=False, repr=False)
    """Path -> the member's JSON, when known (filled by :meth:`fragments`)."""
    sizes: dict[str, int] = field(compare=False, repr=False)
    """Digest -> byte size of every file member."""
    counts: dict[str, int] = field(compare=False, repr=False)
    """Digest -> how many file members have it."""
    index: TreeIndex = field(compare=False, repr=False)
    files: int
    byte_size: int
    chain: tuple[str, ...] = ()
    """The manifest objects this one's object is stored on, oldest first: a
    full manifest, then each delta up to this one's base. Empty when this
    one's object is a full manifest (or it is not stored)."""
    carried: int = 0
    """Members and removed paths the deltas of the chain and this one carry."""
    spare: dict[str, Tables] = field(default_factory=dict, compare=False, repr=False)
    """Copies of the tables a delta on this manifest starts from, made ahead
    (:func:`prepare_spare`, after the commit that made it current has been
    answered) and taken by the first delta (:func:`apply_delta`)."""

    @classmethod
    def whole(
        cls,
        members: Mapping[str, RepoMember],
        config: tuple[tuple[str, str], ...],
        encoded: dict[str, bytes] | None = None,
    ) -> Manifest:
        """A manifest of ``members``, its bookkeeping built by one walk."""
        sizes: dict[str, int] = {}
        counts: dict[str, int] = {}
        byte_size = files = 0
        for m in members.values():
            if m.digest is not None:
                sizes[m.digest] = m.byte_size
                counts[m.digest] = counts.get(m.digest, 0) + 1
                files += 1
                byte_size += m.byte_size
        return cls(members, config, encoded, sizes, counts, TreeIndex.of(members), files, byte_size)

    def fragments(self) -> dict[str, bytes]:
        """Every member's JSON by path: encoded once per manifest, so a delta
        on it encodes only what it changes."""
        if self.encoded is None:
            object.__setattr__(
                self, "encoded", {p: member_json(m) for p, m in self.members.items()}
            )
        assert self.encoded is not None
        return self.encoded


class Tables(NamedTuple):
    """A manifest's tables, copied: what a delta on it modifies."""

    members: dict[str, RepoMember]
    encoded: dict[str, bytes] | None
    sizes: dict[str, int]
    counts: dict[str, int]
    tree: TreeIndex


def copy_tables(manifest: Manifest) -> Tables:
    return Tables(
        dict(manifest.members),
        None if manifest.encoded is None else dict(manifest.encoded),
        dict(manifest.sizes),
        dict(manifest.counts),
        manifest.index.copy(),
    )


def prepare_spare(manifest: Manifest) -> None:
    """Copy the tables the next delta on ``manifest`` will change, now rather
    than in that delta's request (at 20,000 members the copies are most of
    a delta commit's work that grows with the checkout). Blocking: run in a
    thread, with nothing waiting on it."""
    if "tables" not in manifest.spare:
        manifest.spare["tables"] = copy_tables(manifest)


@dataclass(frozen=True)
class Delta:
    """A delta applied (:func:`apply_delta`): the complete result, and what it changed."""

    manifest: Manifest
    added_digests: frozenset[str]
    """File digests the result has and its base had not."""
    dropped_digests: frozenset[str]
    """File digests its base had and the result has not."""
    links_changed: bool
    """A symlink was added, changed or removed."""


def apply_delta(
    base: Manifest,
    changed: Mapping[str, RepoMember],
    removed: Sequence[str],
    config: tuple[tuple[str, str], ...],
) -> Delta:
    """``base`` with ``removed`` gone and ``changed`` put: copies of the base's
    tables (C loops; made ahead by :func:`prepare_spare` when it ran), then
    work in proportion to the delta. Refuses a removed
    path not in the base (400) and a member whose digest the result already
    has, or its base had, under another size (``size_mismatch``). The tree
    rules are the caller's (:func:`common.repos.delta_tree_problem`)."""
    # The copies made ahead, if any (dict.pop is atomic: one delta takes them).
    tables = base.spare.pop("tables", None) or copy_tables(base)
    members, encoded, sizes, counts, index = tables
    if encoded is None and base.encoded is not None:
        encoded = dict(base.encoded)  # encoded after the copies were made
    files, byte_size = base.files, base.byte_size
    added: set[str] = set()
    dropped: set[str] = set()
    links_changed = False

    def drop(old: RepoMember) -> None:
        nonlocal files, byte_size, links_changed
        if old.digest is not None:
            files -= 1
            byte_size -= old.byte_size
            left = counts[old.digest] - 1
            if left:
                counts[old.digest] = left
            else:
                del counts[old.digest], sizes[old.digest]
                dropped.add(old.digest)
        elif old.kind == "symlink":
            links_changed = True
            del index.links[old.path]

    for i, path in enumerate(removed):
        old = members.pop(path, None)
        if old is None:
            raise ValidationError.single(
                f"removed[{i}]", "not_in_base", f"{path!r} is not in the base checkpoint"
            )
        if encoded is not None:
            del encoded[path]
        drop(old)
        index.removed(path)
    for path, member in changed.items():
        old = members.get(path)
        if old is None:
            index.added(path)
        else:
            drop(old)
        members[path] = member
        if encoded is not None:
            encoded[path] = member_json(member)
        if member.digest is not None:
            known = sizes.get(member.digest, base.sizes.get(member.digest))
            if known is not None and known != member.byte_size:
                raise UnsafeRepoMember(path, "size_mismatch")
            files += 1
            byte_size += member.byte_size
            seen = counts.get(member.digest, 0)
            if not seen:
                sizes[member.digest] = member.byte_size
                added.add(member.digest)
            counts[member.digest] = seen + 1
        elif member.kind == "symlink":
            links_changed = True
            index.links[path] = member
    both = added & dropped  # dropped by one member, taken again by another
    manifest = Manifest(members, config, encoded, sizes, counts, index, files, byte_size)
    return Delta(manifest, frozenset(added - both), frozenset(dropped - both), links_changed)


EMPTY = Manifest.whole({}, ())


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
    if (problem := operation_id_problem(op_id)) is not None:
        _problem(
            problems, "operationId", problem[0], "operationId must be 1-256 printable characters"
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
    fingerprint = foldercore.fingerprint(
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


MAX_CHAIN = 16
"""Manifest objects a checkpoint's manifest may be read from (a full one and
the deltas on it); the commit after that stores a full manifest again."""
MIN_CARRIED = 2000
"""Members and removed paths a chain's deltas may carry in all, whatever the
checkpoint's size; beyond that, at most a quarter of its members."""


@dataclass(frozen=True)
class Plan:
    """The complete checkpoint a request makes of ``current_id``'s manifest."""

    current_id: str | None
    """The current checkpoint the plan was made against."""
    current: Manifest
    current_objects: tuple[str, ...]
    """The manifest objects the current checkpoint is read from (its chain
    and its own), which the binding references."""
    manifest: Manifest
    added_digests: frozenset[str]
    """File digests of the planned checkpoint that the current one lacks."""
    dropped_digests: frozenset[str]
    """File digests of the current checkpoint that the planned one lacks."""
    changed: tuple[RepoMember, ...]
    removed: tuple[str, ...]
    delta_of: str | None
    """Store the manifest as a delta on this manifest object (the current
    one's); None: store it whole."""

    @property
    def entries(self) -> int:
        return len(self.manifest.members)

    @property
    def files(self) -> int:
        return self.manifest.files

    @property
    def byte_size(self) -> int:
        return self.manifest.byte_size


def plan_checkpoint(
    req: CheckpointRequest,
    current_id: str | None,
    current: Manifest,
    current_digest: str | None = None,
) -> Plan:
    """Apply the request to ``current`` (stored as ``current_digest``) and
    validate the result as the whole checkpoint it is.

    A delta's ``base`` must be ``current_id`` (the caller checks); it costs
    the delta (:func:`apply_delta`, :func:`common.repos.delta_tree_problem`),
    and its manifest is stored as a delta on the current one's object while
    the chain stays within :data:`MAX_CHAIN` objects and its deltas carry at
    most :data:`MIN_CARRIED` or a quarter of the members. Every member that
    reuses a digest of the current checkpoint must declare that digest's
    size; new digests are checked when claimed.
    """
    current_objects = current.chain + ((current_digest,) if current_digest else ())
    if req.base is not None:
        delta = apply_delta(current, req.changed, req.removed, req.config)
        manifest = delta.manifest
        problem = delta_tree_problem(
            manifest.members, manifest.index, req.changed.values(), delta.links_changed
        )
        added, dropped = delta.added_digests, delta.dropped_digests
        carried = current.carried + len(req.changed) + len(req.removed)
        if (
            current_digest is not None
            and len(current_objects) < MAX_CHAIN
            and carried <= max(MIN_CARRIED, len(manifest.members) // 4)
        ):
            object.__setattr__(manifest, "chain", current_objects)
            object.__setattr__(manifest, "carried", carried)
            delta_of: str | None = current_digest
        else:
            delta_of = None
    else:
        sizes: dict[str, int] = {}
        for member in req.changed.values():
            if member.digest is None:
                continue
            known = sizes.setdefault(
                member.digest, current.sizes.get(member.digest, member.byte_size)
            )
            if known != member.byte_size:
                raise UnsafeRepoMember(member.path, "size_mismatch")
        manifest = Manifest.whole(req.changed, req.config)
        problem = tree_problem(manifest.members)
        added = frozenset(manifest.counts.keys() - current.counts.keys())
        dropped = frozenset(current.counts.keys() - manifest.counts.keys())
        delta_of = None
    if problem is not None:
        raise UnsafeRepoMember(*problem)
    return Plan(
        current_id,
        current,
        current_objects,
        manifest,
        added,
        dropped,
        tuple(req.changed.values()),
        req.removed,
        delta_of,
    )


def member_with(manifest: Manifest, digest: str) -> str:
    """The path of a member of ``manifest`` whose content is ``digest``."""
    return next(m.path for m in manifest.members.values() if m.digest == digest)


# --- manifest objects -----------------------------------------------------------


def _compress(raw: bytes) -> bytes:
    # Level 1: digests do not compress further at higher levels, and it is the fastest.
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)


def _config_json(config: tuple[tuple[str, str], ...]) -> bytes:
    return json.dumps([list(pair) for pair in config], ensure_ascii=False).encode()


def encode(manifest: Manifest) -> bytes:
    """A full manifest object's bytes (compressed JSON, members sorted by path)."""
    fragments = manifest.fragments()
    return _compress(
        b"".join(
            (
                b'{"members":[',
                b",".join([fragments[p] for p in sorted(fragments)]),
                b'],"config":',
                _config_json(manifest.config),
                b"}",
            )
        )
    )


def encode_plan(plan: Plan) -> bytes:
    """The planned manifest's object: whole, or as a delta on the current
    one's object, ``{"base": digest, "members": [changed...], "removed":
    [path...], "config": [...]}`` (the members and paths sorted)."""
    if plan.delta_of is None:
        return encode(plan.manifest)
    changed = sorted(plan.changed)
    return _compress(
        b"".join(
            (
                b'{"base":',
                json.dumps(plan.delta_of).encode(),
                b',"members":[',
                b",".join([member_json(m) for m in changed]),
                b'],"removed":',
                json.dumps(sorted(plan.removed), ensure_ascii=False).encode(),
                b',"config":',
                _config_json(plan.manifest.config),
                b"}",
            )
        )
    )


def decode(data: bytes, base: Callable[[str], Manifest] | None = None) -> Manifest:
    """A manifest object this controller wrote; a delta's base manifest comes
    from ``base`` (by the digest the delta names)."""
    raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MANIFEST_MAX_RAW)
    body = json.loads(raw)
    config = tuple((k, v) for k, v in body["config"])
    members = {m["path"]: parse_member(m) for m in body["members"]}
    if "base" not in body:
        return Manifest.whole(members, config)
    if base is None:
        raise ValueError("a delta manifest needs its base")
    base_digest = str(body["base"])
    under = base(base_digest)
    manifest = apply_delta(under, members, list(body["removed"]), config).manifest
    object.__setattr__(manifest, "chain", (*under.chain, base_digest))
    object.__setattr__(manifest, "carried", under.carried + len(members) + len(body["removed"]))
    return manifest


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
    """The manifest stored under ``digest``, a delta applied to its base (read
    the same way, at most :data:`MAX_CHAIN` objects deep). Blocking: run in a
    thread."""
    cached = CACHE.get(company_id, digest)
    if cached is not None:
        return cached
    data = b"".join(storage.read_chunks(object_key(company_id, digest)))
    manifest = decode(data, lambda base: load(storage, company_id, base))
    CACHE.put(company_id, digest, manifest)
    return manifest


def manifest_json(
    storage: StorageProvider, company_id: str, digest: str, checkpoint_id: str
) -> Iterator[bytes]:
    """The manifest route's body, ``{"checkpointId", "members", "config"}``,
    members sorted by path. Blocking: the manifest is loaded here
    (ObjectMissing before any byte is sent), then encoded as it streams."""
    manifest = load(storage, company_id, digest)
    return _manifest_json(manifest, checkpoint_id)


def _manifest_json(manifest: Manifest, checkpoint_id: str) -> Iterator[bytes]:
    fragments = manifest.fragments()
    yield json.dumps({"checkpointId": checkpoint_id})[:-1].encode() + b',"members":['
    paths = sorted(fragments)
    for start in range(0, len(paths), 1000):
        part = b",".join([fragments[p] for p in paths[start : start + 1000]])
        yield part if start == 0 else b"," + part
    yield b'],"config":' + _config_json(manifest.config) + b"}"
