"""Durable local state of one mounted collection: the facade over its parts.

:class:`Store` is one open state dir, assembled from one module per job:

``fsagent.state.statedir``  marker, lock, LMDB environment, format upgrade, binding
``fsagent.state.journal``   the change set since the baseline, checkpoint status
``fsagent.state.tree``      inodes and entries, hydration, warm-start merge, recovery
``fsagent.state.records``   the encoding of every persisted record and key
``fsagent.state.content``   the layout of ``upper/<inode>`` (and, for the mount,
                      copy-on-write and inline contents)

LMDB tables: ``meta`` (format, binding, baseline, counters, checkpoint
records), ``inodes``, ``entries``, ``orphans`` and ``inline`` (fsagent.state.tree),
``base`` and ``journal`` (fsagent.state.journal).

Transactions are kept to one FUSE operation each.
"""

from __future__ import annotations

from fsagent.state.content import INLINE_MAX
from fsagent.state.journal import Change, ChangeAction
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
from fsagent.state.statedir import MARKER, ROOT_INODE, STATE_FORMAT, default_state_root
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


class Store(Tree):
    """An open state dir: ``Store.open(root)``; see the parts above for the methods."""
