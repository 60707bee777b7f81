"""A checkpoint's entries applied as one change set: planned in memory, written
with a few multi-row statements.

Semantics are those of applying the entries one by one, in order, with
last-writer-wins: a put or mkdir creates missing parents; a file in the way
of a parent, or a server entry of the other kind at the path itself, goes to
trash (its whole subtree, with one shared ``trash_root``); a delete sends the
subtree to trash. Instead of one statement per entry, the folder's rows that
the entries can touch are read first (the named paths and their ancestors in
one query, the subtrees of the directories that may go to trash in another),
the entries run against that model, and the result is written back: one
UPDATE per chunk of changed rows, one INSERT per chunk of new rows, one
journal insert. Rows created and sent to trash by the same checkpoint are
kept in trash, as one by one.

Versions: every row the checkpoint changes gets exactly one new version,
in the order of its last change (a trashed subtree in path order), so the
versions one checkpoint draws are contiguous and follow the entries.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection

from common.paths import ancestors, parent_of
from controller.foldercore import Folder, Row, journal_deletion, live_rows_query

CHUNK = 5000
"""Rows per UPDATE or INSERT statement."""

_COLUMNS = "id, path, kind, digest, byte_size, executable, content_type"


@dataclass(frozen=True)
class Entry:
    """One checkpoint entry: ``put`` (with digest), ``mkdir`` or ``delete``."""

    op: str
    path: str
    digest: str | None = None
    executable: bool = False


@dataclass(eq=False)
class Node:
    id: uuid.UUID
    path: str
    kind: str
    digest: str | None
    byte_size: int
    executable: bool
    content_type: str | None
    stored: Row | None
    """The row as it was in the database, or None for a new row."""
    kids: set[str] = field(default_factory=set)
    trash_root: uuid.UUID | None = None
    seq: int = 0
    """Order of the last change (0: unchanged)."""
    rewritten: bool = False


@dataclass
class Outcome:
    changed: int
    """Rows written (each with a new version)."""
    entries_delta: int
    """Live entries added (negative: removed)."""
    bytes_delta: int = 0
    """Live file bytes added (negative: removed)."""
    largest_written: tuple[int, str] | None = None
    """The largest file the change set wrote: (size, path)."""


class Plan:
    """The folder's live rows the checkpoint can touch, and what it does to them."""

    def __init__(self, rows: Iterable[Row], sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.live: dict[str, Node] = {}
        self.nodes: list[Node] = []
        self.seq = 0
        for row in rows:
            if row["path"] in self.live:
                continue
            node = Node(
                row["id"],
                row["path"],
                row["kind"],
                row["digest"],
                int(row["byte_size"]),
                row["executable"],
                row["content_type"],
                row,
            )
            self.live[node.path] = node
            self.nodes.append(node)
        for node in self.nodes:
            parent = self.live.get(parent_of(node.path) or "")
            if parent is not None:
                parent.kids.add(node.path)

    def _touch(self, node: Node) -> None:
        self.seq += 1
        node.seq = self.seq

    def _create(self, path: str, kind: str, digest: str | None, executable: bool) -> Node:
        size = self.sizes[digest] if digest is not None else 0
        node = Node(uuid.uuid4(), path, kind, digest, size, executable, None, None)
        self.live[path] = node
        self.nodes.append(node)
        parent = self.live.get(parent_of(path) or "")
        if parent is not None:
            parent.kids.add(path)
        self._touch(node)
        return node

    def _trash(self, top: Node) -> None:
        self.seq += 1
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(self.live[k] for k in node.kids)
            node.kids = set()
            node.trash_root = top.id
            node.seq = self.seq
            del self.live[node.path]
        parent = self.live.get(parent_of(top.path) or "")
        if parent is not None:
            parent.kids.discard(top.path)

    def _parents(self, path: str) -> None:
        for anc in ancestors(path):
            node = self.live.get(anc)
            if node is not None and node.kind != "directory":
                self._trash(node)
                node = None
            if node is None:
                self._create(anc, "directory", None, False)

    def put(self, path: str, digest: str, executable: bool) -> None:
        self._parents(path)
        node = self.live.get(path)
        if node is not None and node.kind != "file":
            self._trash(node)
            node = None
        if node is None:
            self._create(path, "file", digest, executable)
            return
        node.digest, node.byte_size = digest, self.sizes[digest]
        node.executable, node.content_type, node.rewritten = executable, None, True
        self._touch(node)

    def mkdir(self, path: str) -> None:
        self._parents(path)
        node = self.live.get(path)
        if node is not None and node.kind != "directory":
            self._trash(node)
            node = None
        if node is None:
            self._create(path, "directory", None, False)

    def delete(self, path: str) -> None:
        node = self.live.get(path)
        if node is not None:
            self._trash(node)

    def changed(self) -> list[Node]:
        """Changed rows in version order."""
        return sorted((n for n in self.nodes if n.seq), key=lambda n: (n.seq, n.path))


def live_on_their_own(changes: Sequence[Entry]) -> int:
    """The entries ``changes`` leave live when applied to an empty folder: each
    put's and mkdir's path and the parents they create, less what later
    entries send to the trash. No database work (before the folder lock).

    A lower bound of the live entries they leave in any folder: applied to
    existing rows, every entry does the same to the paths this change set
    creates (a file in the way of a parent is replaced by a directory, a
    delete or a kind conflict trashes the same subtree of them), so what was
    there before can only come in addition."""
    plan = Plan([], _NoSizes())
    for c in changes:
        if c.op == "put":
            assert c.digest is not None
            plan.put(c.path, c.digest, c.executable)
        elif c.op == "mkdir":
            plan.mkdir(c.path)
        else:
            plan.delete(c.path)
    return len(plan.live)


class _NoSizes(dict[str, int]):
    """Sizes for a plan that counts entries only: every digest is 0 bytes."""

    def __missing__(self, key: str) -> int:
        return 0


def _trash_roots(changes: Sequence[Entry], rows: dict[str, Row]) -> list[str]:
    """Directories in the database whose subtree an entry may send to trash:
    the targets of deletes and puts. Nested roots are covered by their top."""
    roots = sorted(
        {
            c.path
            for c in changes
            if c.op in ("put", "delete") and c.path in rows and rows[c.path]["kind"] == "directory"
        }
    )
    top: list[str] = []
    for root in roots:
        if not top or not root.startswith(top[-1] + "/"):
            top.append(root)
    return top


async def _load(conn: AsyncConnection[Any], folder: Folder, changes: Sequence[Entry]) -> list[Row]:
    named: set[str] = set()
    for c in changes:
        named.add(c.path)
        named.update(ancestors(c.path))
    cur = await conn.execute(*live_rows_query(folder.id, sorted(named), _COLUMNS))
    rows = {r["path"]: r for r in await cur.fetchall()}
    roots = _trash_roots(changes, rows)
    found = list(rows.values())
    if roots:
        # A subtree is the byte range (root + '/', root + '0'): '/' is 0x2f.
        cur = await conn.execute(
            f"SELECT {', '.join('f.' + c for c in _COLUMNS.split(', '))} FROM files f"
            " JOIN unnest(%s::text[]) AS r(root)"
            " ON f.path > (r.root || '/') COLLATE \"C\" AND f.path < (r.root || '0') COLLATE \"C\""
            " WHERE f.folder_id = %s AND f.deleted_at IS NULL",
            (roots, folder.id),
        )
        found.extend(await cur.fetchall())
    return found


def _chunks(items: list[Node]) -> Iterable[list[Node]]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


async def apply_changes(
    conn: AsyncConnection[Any],
    folder: Folder,
    changes: Sequence[Entry],
    sizes: dict[str, int],
    gc_delay: timedelta,
) -> Outcome:
    """Apply ``changes`` in order under the folder lock (the caller holds it
    and has checked every digest in ``sizes``)."""
    plan = Plan(await _load(conn, folder, changes), sizes)
    for c in changes:
        if c.op == "put":
            assert c.digest is not None
            plan.put(c.path, c.digest, c.executable)
        elif c.op == "mkdir":
            plan.mkdir(c.path)
        else:
            plan.delete(c.path)
    changed = plan.changed()
    first = folder.counters.take(len(changed)) if changed else 0
    versions = {id(n): first + i for i, n in enumerate(changed)}
    existing = [n for n in changed if n.stored is not None]
    new = [n for n in changed if n.stored is None]
    for part in _chunks(existing):
        await conn.execute(
            "UPDATE files f SET digest = v.digest, byte_size = v.byte_size,"
            " executable = v.executable, content_type = v.content_type, version = v.version,"
            " updated_at = CASE WHEN v.rewritten THEN now() ELSE f.updated_at END,"
            " deleted_at = CASE WHEN v.trash_root IS NULL THEN NULL ELSE now() END,"
            " trash_root = v.trash_root"
            " FROM unnest(%s::uuid[], %s::text[], %s::bigint[], %s::bool[], %s::text[],"
            "  %s::bigint[], %s::bool[], %s::uuid[])"
            " AS v(id, digest, byte_size, executable, content_type, version, rewritten, trash_root)"
            " WHERE f.id = v.id",
            (
                [n.id for n in part],
                [n.digest for n in part],
                [n.byte_size for n in part],
                [n.executable for n in part],
                [n.content_type for n in part],
                [versions[id(n)] for n in part],
                [n.rewritten for n in part],
                [n.trash_root for n in part],
            ),
        )
    for part in _chunks(new):
        await conn.execute(
            "INSERT INTO files (id, folder_id, path, parent, kind, digest, byte_size,"
            " executable, version, deleted_at, trash_root)"
            " SELECT v.id, %s, v.path, v.parent, v.kind, v.digest, v.byte_size, v.executable,"
            "  v.version, CASE WHEN v.trash_root IS NULL THEN NULL ELSE now() END, v.trash_root"
            " FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::text[], %s::text[],"
            "  %s::bigint[], %s::bool[], %s::bigint[], %s::uuid[])"
            " AS v(id, path, parent, kind, digest, byte_size, executable, version, trash_root)",
            (
                folder.id,
                [n.id for n in part],
                [n.path for n in part],
                [parent_of(n.path) or "" for n in part],
                [n.kind for n in part],
                [n.digest for n in part],
                [n.byte_size for n in part],
                [n.executable for n in part],
                [versions[id(n)] for n in part],
                [n.trash_root for n in part],
            ),
        )
    superseded = [
        n.stored["digest"]
        for n in existing
        if n.stored is not None and n.stored["digest"] and n.stored["digest"] != n.digest
    ]
    await journal_deletion(conn, folder.company_id, superseded, "superseded", gc_delay)
    trashed_stored = [n for n in existing if n.trash_root is not None]
    live_new = [n for n in new if n.trash_root is None]
    kept = [n for n in existing if n.trash_root is None]
    nbytes = (
        sum(n.byte_size for n in live_new)
        - sum(int(n.stored["byte_size"]) for n in trashed_stored if n.stored is not None)
        + sum(n.byte_size - int(n.stored["byte_size"]) for n in kept if n.stored is not None)
    )
    written = [(n.byte_size, n.path) for n in live_new if n.kind == "file"]
    written += [(n.byte_size, n.path) for n in kept if n.rewritten]
    return Outcome(
        len(changed),
        len(live_new) - len(trashed_stored),
        nbytes,
        max(written) if written else None,
    )
