"""Durable local state of one mounted collection: the facade over its parts.

:class:`Store` is one open state dir, assembled from one module per job:

``fsagent.statedir``  marker, lock, LMDB environment, format upgrade, binding
``fsagent.journal``   the change set since the baseline, checkpoint status
``fsagent.tree``      inodes and entries, hydration, warm-start merge, recovery
``fsagent.records``   the encoding of every persisted record and key
``fsagent.content``   the layout of ``upper/<inode>`` (and, for the mount,
                      copy-on-write and inline contents)

LMDB tables: ``meta`` (format, binding, baseline, counters, checkpoint
records), ``inodes``, ``entries``, ``orphans`` and ``inline`` (fsagent.tree),
``base`` and ``journal`` (fsagent.journal).

Transactions are kept to one FUSE operation each.
"""

from __future__ import annotations

from fsagent.content import INLINE_MAX
from fsagent.journal import Change, ChangeAction
from fsagent.records import (
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
from fsagent.statedir import MARKER, ROOT_INODE, STATE_FORMAT, default_state_root
from fsagent.tree import Tree

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


class Store(Tree):
    """An open state dir: ``Store.open(root)``; see the parts above for the methods."""
