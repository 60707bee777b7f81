"""The change set since the baseline: the journal, the baseline and checkpoint status.

The journal is a set of *touched paths*, not a replay log: the change set
since the baseline is derived by comparing, for each touched path, the live
tree with ``base`` (:meth:`Journal.changes_since_baseline`).  That gives the
coalescing rules for free: a file created and deleted between checkpoints
compares equal to "absent at baseline" and ships nothing; an unchanged file
renamed elsewhere has a digest but no upper copy, so it ships as a reference;
and the cost of listing grows with the number of touched paths, not with the
size of the collection.  Each touch takes a new sequence number, so a shipper
can tell whether a path was touched again while its checkpoint was in flight
(:meth:`Journal.acknowledge`).

Only this module (and the tree's bulk loaders, which write ``base`` rows of a
manifest) writes the ``journal`` and ``base`` tables and the checkpoint
records in ``meta``.

:class:`Journal` is built on the :class:`fsagent.state.statedir.StateDir`; the
store holds it as ``journal``.  The tree journals each mutation through
:meth:`Journal.touch_in`, inside the mutation's own write transaction; the
change set and acknowledge read the live tree they are handed
(:class:`LiveTree`).  A plain-directory collection uses it for its baseline
and checkpoint records (fsagent.dirmode.store).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from common.types import Digest, FileVersion
from fsagent.state.records import (
    BaseEntry,
    Baseline,
    Inode,
    InodeNo,
    JournalEntry,
    JournalSeq,
    encode_json,
    path_key,
)
from fsagent.state.statedir import StateDir

ChangeAction = Literal["upload", "reference", "mkdir", "delete"]


@dataclass(frozen=True, slots=True)
class Change:
    """One path whose live state differs from the baseline.

    ``upload``     new content in the upper layer (size, executable, generation)
    ``reference``  a file showing saved content ``digest`` (a renamed unchanged
                   file, or an exec-bit change): ships without bytes
    ``mkdir``      a directory that the baseline did not have as a directory
    ``delete``     the baseline had ``base.kind`` here; nothing is there now
    """

    path: str
    action: ChangeAction
    seq: JournalSeq
    base: BaseEntry | None
    inode: InodeNo | None = None
    digest: Digest | None = None
    size: int = 0
    executable: bool = False
    generation: int = 0


_Pathed = TypeVar("_Pathed", JournalEntry, Change)


class LiveTree(Protocol):
    """How a path and an inode resolve in the live tree (fsagent.state.tree.Tree)."""

    def resolve(self, txn: Any, path: str, *, committed: bool = False) -> Inode | None:
        """The live inode at ``path``; ``committed`` reads the record as last
        committed, never the in-memory cache."""
        ...

    def live_inode(self, txn: Any, ino: InodeNo) -> Inode | None:
        """The live record of ``ino``, cached or stored."""
        ...


class Journal:
    """The journal and baseline tables of an open state dir; the tree
    (:class:`LiveTree`) supplies how a path resolves."""

    def __init__(self, state: StateDir) -> None:
        self._state = state
        self._env = state.env
        self._meta = state.meta_db
        self._base = state.base_db
        self._journal = state.journal_db

    def touch_in(self, txn: Any, paths: Iterable[str], op: str) -> None:
        """Journal ``paths`` under ``op`` in the caller's write transaction."""
        self.touch_all_in(txn, [(paths, op)])

    def touch_all_in(self, txn: Any, groups: Iterable[tuple[Iterable[str], str]]) -> None:
        """Journal each group's paths under its operation, in order, in the
        caller's write transaction."""
        seq = int(txn.get(b"seq", db=self._meta))
        for paths, op in groups:
            for path in paths:
                if not path:
                    continue  # the root itself is never a work path
                seq += 1
                entry = JournalEntry(path, JournalSeq(seq), op)
                txn.put(path_key(path), entry.encode(), db=self._journal)
        txn.put(b"seq", str(seq).encode(), db=self._meta)

    def touch(self, paths: Iterable[str], op: str) -> None:
        with self._env.begin(write=True) as txn:
            self.touch_in(txn, paths, op)

    def has_entry(self, path: str) -> bool:
        """Whether ``path`` was touched since the baseline (its entry committed)."""
        with self._env.begin() as txn:
            return txn.get(path_key(path), db=self._journal) is not None

    def entries(self) -> list[tuple[str, JournalSeq, str]]:
        """Raw journal: every path touched since the baseline, with its last operation."""
        with self._env.begin() as txn:
            entries = [JournalEntry.decode(k, v) for k, v in txn.cursor(db=self._journal)]
        return [(e.path, e.seq, e.op) for e in _by_path(entries)]

    def baseline(self) -> Baseline:
        with self._env.begin() as txn:
            return Baseline.decode(txn.get(b"baseline", db=self._meta))

    def base_entry(self, path: str) -> BaseEntry | None:
        """What the controller held at ``path`` as of the baseline."""
        with self._env.begin() as txn:
            raw = txn.get(path_key(path), db=self._base)
        return None if raw is None else BaseEntry.decode(raw)

    def changes_since_baseline(self, live: LiveTree, *, committed: bool = False) -> list[Change]:
        """The exact, coalesced change set since the baseline, parents before children.

        Sizes and generations come from the live (in-memory) inodes, so a file
        still open for writing shows its current state; the shipper must use
        :meth:`acknowledge` to clear what it has shipped.  ``committed`` reads
        only committed records (one LMDB snapshot, no in-memory state), which
        is what a thread other than the mount's may do.
        """
        out: list[Change] = []
        with self._env.begin() as txn:
            for key, val in txn.cursor(db=self._journal):
                entry = JournalEntry.decode(key, val)
                braw = txn.get(key, db=self._base)
                base = BaseEntry.decode(braw) if braw is not None else None
                cur = live.resolve(txn, entry.path, committed=committed)
                change = _compare(entry.path, entry.seq, base, cur)
                if change is not None:
                    out.append(change)
        return _by_path(out)

    def acknowledge(
        self,
        shipped: Iterable[tuple[Change, Digest | None, FileVersion]],
        high_water: int,
        live: LiveTree,
    ) -> int:
        """Fold what a checkpoint saved into the baseline; returns paths cleared.

        For each shipped change, ``base`` becomes what was saved (with the
        server's version, and the digest the server computed for uploads).  The
        journal entry is removed only when nothing touched the path since the
        change was listed (same sequence number) and, for uploads, the file's
        generation is unchanged: otherwise the path stays dirty for the next
        checkpoint and torn content is never taken as saved.
        """
        cleared = 0
        self._state.forget_durable()  # a journal entry cleared here is re-added by the next write
        with self._env.begin(write=True) as txn:
            for change, digest, version in shipped:
                key = path_key(change.path)
                if change.action == "delete":
                    txn.delete(key, db=self._base)
                elif change.action == "mkdir":
                    txn.put(
                        key, BaseEntry("directory", None, 0, False, version).encode(), db=self._base
                    )
                else:
                    entry = BaseEntry(
                        "file", digest or change.digest, change.size, change.executable, version
                    )
                    txn.put(key, entry.encode(), db=self._base)
                raw = txn.get(key, db=self._journal)
                if raw is None or JournalEntry.decode(key, raw).seq != change.seq:
                    continue
                if change.action == "upload" and change.inode is not None:
                    now = live.live_inode(txn, change.inode)
                    if now is None or now.generation != change.generation:
                        continue
                txn.delete(key, db=self._journal)
                cleared += 1
            txn.put(b"baseline", Baseline(high_water, True).encode(), db=self._meta)
        return cleared

    # --- checkpoints ----------------------------------------------------------

    def pending_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint in flight: its operation id, and once committing, its exact body."""
        with self._env.begin() as txn:
            raw = txn.get(b"pending_checkpoint", db=self._meta)
        return None if raw is None else dict(json.loads(raw))

    def set_pending_checkpoint(self, record: dict[str, Any] | None) -> None:
        """Persist (or clear) the pending checkpoint, durable before any byte is sent.

        Touches no in-memory state: safe from a thread other than the mount's
        (LMDB serializes it with the mount's own commits)."""
        raw = None if record is None else encode_json(record)  # outside the write lock
        with self._env.begin(write=True) as txn:
            if raw is None:
                txn.delete(b"pending_checkpoint", db=self._meta)
            else:
                txn.put(b"pending_checkpoint", raw, db=self._meta)
        # The whole point is surviving power loss between here and the request.
        self._env.sync(True)

    def close_checkpoint(self, receipt: dict[str, Any]) -> None:
        """After every part is acknowledged: record the save and clear the pending
        record, durably. Touches no in-memory state (safe from another thread)."""
        status = self.save_status()
        status["lastSave"] = {
            "at": time.time(),
            "operationId": receipt.get("operationId"),
            "entries": receipt.get("entries"),
            "savedAt": receipt.get("savedAt"),
        }
        status.pop("lastError", None)
        with self._env.begin(write=True) as txn:
            txn.delete(b"pending_checkpoint", db=self._meta)
            txn.put(b"save_status", encode_json(status), db=self._meta)
        self._env.sync(True)

    def record_save_error(self, message: str, code: str | None = None) -> None:
        """``code``: the controller's stable code of a refusal (or fsagent's
        own use of one, e.g. ``upload_over_allowance``), shown by ``fsagent
        status`` as ``lastError.code``. Touches no in-memory state (safe from
        another thread)."""
        status = self.save_status()
        status["lastError"] = {"at": time.time(), "message": message[:2000], "code": code}
        with self._env.begin(write=True) as txn:
            txn.put(b"save_status", encode_json(status), db=self._meta)

    def save_status(self) -> dict[str, Any]:
        """``{"lastSave": {...}, "lastError": {...}}`` (either may be missing)."""
        with self._env.begin() as txn:
            raw = txn.get(b"save_status", db=self._meta)
        return {} if raw is None else dict(json.loads(raw))


def _by_path(items: list[_Pathed]) -> list[_Pathed]:
    """Sorted by path bytes, so parents come before children.

    Journal keys sort that way except hashed ones (fsagent.state.records.path_key),
    so the order is restored here rather than relied upon from the cursor.
    """
    return sorted(items, key=lambda item: item.path.encode("utf-8"))


def _compare(
    path: str, seq: JournalSeq, base: BaseEntry | None, cur: Inode | None
) -> Change | None:
    if cur is None:
        return None if base is None else Change(path, "delete", seq, base)
    if cur.kind == "directory":
        if base is not None and base.kind == "directory":
            return None
        return Change(path, "mkdir", seq, base, inode=cur.ino)
    exe = cur.executable
    if cur.upper:
        return Change(
            path,
            "upload",
            seq,
            base,
            inode=cur.ino,
            size=cur.size,
            executable=exe,
            generation=cur.generation,
        )
    if (
        base is not None
        and base.kind == "file"
        and base.digest == cur.digest
        and base.executable == exe
    ):
        return None
    return Change(
        path,
        "reference",
        seq,
        base,
        inode=cur.ino,
        digest=cur.digest,
        size=cur.size,
        executable=exe,
    )
