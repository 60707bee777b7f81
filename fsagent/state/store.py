"""Durable local state of one mounted collection: one object composed of its parts.

:class:`Store` is one open state dir; it holds one part per job and calls them:

``Store.dir``      :class:`fsagent.state.statedir.StateDir`: marker, lock, LMDB
                   environment and its tables, format upgrade, binding, mode,
                   disk room, the durability epoch
``Store.journal``  :class:`fsagent.state.journal.Journal` (built on the state
                   dir): the change set since the baseline, acknowledge,
                   pending checkpoint, save status
``Store.tree``     :class:`fsagent.state.tree.Tree` (built on the state dir and
                   the journal): inodes and entries, hydration, warm-start
                   merge, recovery; each of its mutations journals the paths it
                   touched in its own commit

``fsagent.state.records`` is the encoding of every persisted record and key,
``fsagent.state.content`` the layout of ``upper/<inode>``.  The methods here
are the ones that need several parts (the change set resolves paths in the
tree; a checkpoint's acknowledgement compares write generations; a sync covers
the environment and ``upper/``), and the shipper's reads
(fsagent.checkpoint.ship.ShipStore), which a plain directory's
:class:`fsagent.dirmode.store.DirStore` answers too.

LMDB tables: ``meta`` (format, binding, baseline, counters, checkpoint
records), ``inodes``, ``entries``, ``orphans`` and ``inline`` (fsagent.state.tree),
``base`` and ``journal`` (fsagent.state.journal).

Transactions are kept to one FUSE operation each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self

from common.types import Digest, FileVersion
from fsagent.state.content import INLINE_MAX
from fsagent.state.journal import Change, ChangeAction, Journal
from fsagent.state.records import (
    EMPTY_DIGEST,
    BaseEntry,
    Baseline,
    Binding,
    Inode,
    InodeNo,
    JournalSeq,
    Kind,
    ManifestRow,
    now_ns,
)
from fsagent.state.statedir import MARKER, ROOT_INODE, STATE_FORMAT, StateDir, default_state_root
from fsagent.state.tree import Tree

__all__ = [
    "EMPTY_DIGEST",
    "INLINE_MAX",
    "MARKER",
    "ROOT_INODE",
    "STATE_FORMAT",
    "BaseEntry",
    "Baseline",
    "Binding",
    "Change",
    "ChangeAction",
    "Inode",
    "InodeNo",
    "JournalSeq",
    "Kind",
    "ManifestRow",
    "Store",
    "default_state_root",
    "now_ns",
]


def _nothing() -> None:
    """A store no mount serves keeps nothing in memory to commit."""


class Store:
    """An open state dir: ``Store.open(root)``; its parts are ``dir``,
    ``journal`` and ``tree``."""

    def __init__(self, state: StateDir) -> None:
        self.dir = state
        self.journal = Journal(state)
        self.tree = Tree(state, self.journal)
        self.root = state.root
        self.objects = state.objects
        self.readonly = state.readonly
        self.upper = self.tree.upper
        self.commit_behind: Callable[[], None] = _nothing
        """Commit what the mount that serves this store keeps in memory for
        a while (times, a durable file's new size and generation: see
        fsagent.fuse.content); on the mount's loop, before a listing from
        committed records. Raises if the commit fails."""

    @classmethod
    def open(cls, root: Path, *, readonly: bool = False) -> Self:
        """Open (or create) the state dir at ``root`` (:meth:`StateDir.open`)."""
        return cls(StateDir.open(root, readonly=readonly))

    def close(self) -> None:
        self.dir.close()

    def sync(self) -> None:
        """Everything committed, and the names of the upper files, made durable
        against power loss (slow: run in a thread)."""
        self.dir.sync()
        self.tree.upper.sync_directory()

    # --- the change set: the journal, resolved in the tree ----------------------

    def changes_since_baseline(self, *, committed: bool = False) -> list[Change]:
        """:meth:`Journal.changes_since_baseline` against the live tree."""
        return self.journal.changes_since_baseline(self.tree, committed=committed)

    def acknowledge(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], high_water: int
    ) -> int:
        """:meth:`Journal.acknowledge`, comparing uploads with the live inodes."""
        return self.journal.acknowledge(shipped, high_water, self.tree)

    def finish_checkpoint(
        self, shipped: Iterable[tuple[Change, Digest | None, FileVersion]], receipt: dict[str, Any]
    ) -> int:
        """Fold a saved checkpoint into the baseline and clear the pending record.

        The baseline's high-water mark stays where the last manifest put it:
        other writers' changes after it are fetched at the next warm start.
        A crash between the two steps leaves the pending record, whose replay
        answers with the same receipt and acknowledges again (idempotent), so
        the acknowledgement may also be split into several commits
        (:meth:`acknowledge` per part, then :meth:`Journal.close_checkpoint`).
        """
        cleared = self.acknowledge(shipped, self.journal.baseline().high_water)
        self.journal.close_checkpoint(receipt)
        return cleared

    # --- what the shipper reads of the tree (fsagent.checkpoint.ship.ShipStore) ---

    def get(self, ino: int) -> Inode:
        """:meth:`Tree.get`."""
        return self.tree.get(ino)

    def inline_data(self, ino: InodeNo) -> bytes | None:
        """:meth:`Tree.inline_data`."""
        return self.tree.inline_data(ino)
