"""Persisted records: versioned encodings, long-path keys, the in-place format upgrade."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.types import Digest, FileVersion
from fsagent.errors import StateCorrupt
from fsagent.state.records import MAX_KEY_BYTES, BaseEntry, Inode, InodeNo, JournalEntry, path_key
from fsagent.state.store import MARKER, ROOT_INODE, STATE_FORMAT, ManifestRow, Store

FIXTURE = Path(__file__).parent / "fixtures" / "state-format-2.tar.gz"
"""A state dir written by the format-2 code: hydrated with docs/, docs/a.txt and
docs/run.sh; docs/new.txt created with inline contents b"hello"; docs/a.txt
unlinked; a pending checkpoint "op-1"."""


def unpack_format_2(tmp_path: Path) -> Path:
    root = tmp_path / "state"
    root.mkdir()
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(root, filter="data")
    return root


def raw_records(root: Path, table: bytes) -> dict[bytes, bytes]:
    env = lmdb.open(str(root / "db"), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=env.open_db(table, txn=txn))}
    finally:
        env.close()


def summary(store: Store) -> list[tuple[str, str, int, str | None]]:
    return [(c.path, c.action, c.size, c.digest) for c in store.changes_since_baseline()]


def test_records_round_trip_with_a_version_and_reject_unknown_ones() -> None:
    inode = Inode(InodeNo(7), "file", 0o644, 3, 1, 2, ROOT_INODE, "n", None, True, 4)
    assert json.loads(inode.encode())[0] == 2
    assert Inode.decode(7, inode.encode()) == inode
    base = BaseEntry("file", Digest("ab" * 32), 3, True, FileVersion(9))
    assert BaseEntry.decode(base.encode()) == base
    entry = JournalEntry("a/b", 5, "write")  # type: ignore[arg-type]
    assert JournalEntry.decode(path_key("a/b"), entry.encode()) == entry
    with pytest.raises(StateCorrupt, match="unknown version"):
        Inode.decode(7, b'[3,"file"]')
    with pytest.raises(StateCorrupt, match="malformed"):
        BaseEntry.decode(b'[1,"file"]')


def test_long_paths_are_keyed_by_their_hash() -> None:
    short = "d/" + "a" * (MAX_KEY_BYTES - 2)
    assert path_key(short) == short.encode()
    long = "d/" + "é" * 500  # 1002 bytes of UTF-8
    key = path_key(long)
    assert len(key) == 33 and key[0] == 0 and key != path_key(long + "x")


def test_format_2_state_dir_is_read_as_is_and_upgraded_in_place(tmp_path: Path) -> None:
    root = unpack_format_2(tmp_path)
    expected = [
        ("docs/a.txt", "delete", 0, None),
        ("docs/new.txt", "upload", 5, None),
    ]
    # Read-only (fsagent status) reads the old records and changes nothing.
    before = raw_records(root, b"inodes")
    ro = Store.open(root, readonly=True)
    assert summary(ro) == expected
    ro.close()
    assert raw_records(root, b"inodes") == before
    assert json.loads((root / MARKER).read_text())["format"] == 2

    Store.open(root).close()
    assert json.loads((root / MARKER).read_text())["format"] == STATE_FORMAT == 5
    assert raw_records(root, b"meta")[b"format"] == b"5"
    for table, version in ((b"inodes", 2), (b"base", 1), (b"journal", 1)):
        records = raw_records(root, table)
        assert records and all(json.loads(v)[0] == version for v in records.values()), table
    store = Store.open(root)
    assert summary(store) == expected
    docs = store.tree.lookup(ROOT_INODE, "docs")
    assert docs is not None
    new = store.tree.lookup(docs, "new.txt")
    run = store.tree.lookup(docs, "run.sh")
    assert new is not None and run is not None
    assert store.inline_data(new) == b"hello"
    assert store.get(run).executable and store.get(run).digest == "cd" * 32
    base = store.journal.base_entry("docs/run.sh")
    assert base is not None and base.version == 3 and base.executable
    assert store.journal.baseline().high_water == 3 and store.journal.baseline().hydrated
    assert store.journal.pending_checkpoint() == {"operationId": "op-1", "state": "uploading"}
    assert store.journal.entries()[0][0] == "docs/a.txt"
    store.close()
    again = Store.open(root)  # a current dir opens without another upgrade
    assert summary(again) == expected
    again.close()


def test_every_table_takes_paths_up_to_the_limit(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    deep = "/".join(["d" * 200] * 4)  # 803 bytes: over the LMDB key limit
    store.tree.hydrate([ManifestRow(f"{deep}/old", "file", Digest("ab" * 32), 1, False,
                               FileVersion(1))], high_water=1)  # fmt: skip
    parent = ROOT_INODE
    for name in deep.split("/"):
        found = store.tree.lookup(parent, name)
        assert found is not None
        parent = found
    store.tree.create(parent, "é" * 90, "file", 0o644)  # 180 bytes more
    store.tree.unlink(parent, "old", keep=False)
    changes = store.changes_since_baseline()
    assert [(c.path, c.action) for c in changes] == [
        (f"{deep}/old", "delete"),
        (f"{deep}/{'é' * 90}", "upload"),
    ]
    assert store.journal.base_entry(f"{deep}/old") is not None
    store.acknowledge([(c, None, FileVersion(2)) for c in changes], high_water=2)
    assert store.changes_since_baseline() == []
    assert store.journal.base_entry(f"{deep}/old") is None
    assert store.journal.base_entry(f"{deep}/{'é' * 90}") is not None
    store.close()


_names = st.text(min_size=1, max_size=40)  # any text: quotes, backslashes, controls, non-BMP
_ints = st.integers(min_value=0, max_value=2**63 - 1)


@settings(max_examples=500, deadline=None)
@given(
    kind=st.sampled_from(["file", "directory", "symlink"]),
    mode=st.integers(0, 0o7777),
    size=_ints,
    times=st.tuples(_ints, _ints, _ints),
    parent=_ints,
    name=_names,
    digest=st.one_of(st.none(), st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)),
    upper=st.booleans(),
    generation=_ints,
    owner=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
)
def test_records_are_written_as_the_json_encoder_writes_them(
    kind: Any, mode: int, size: int, times: tuple[int, int, int], parent: int, name: str,
    digest: str | None, upper: bool, generation: int, owner: tuple[int, int],
) -> None:  # fmt: skip
    """Inode and BaseEntry records are built field by field: byte for byte the
    JSON array the generic encoder writes, so every reader (and every state
    dir written before) agrees, and each decodes back to the same record."""
    from fsagent.state.records import _V, _V_INODE, _encode

    inode = Inode(
        InodeNo(7), kind, mode, size, times[0], times[1], InodeNo(parent), name, digest,
        upper, generation, owner[0], owner[1], times[2],
    )  # fmt: skip
    fields = [_V_INODE, kind, mode, size, times[0], times[1], parent, name, digest, upper,
              generation, owner[0], owner[1], times[2]]  # fmt: skip
    assert inode.encode() == _encode(fields).encode()
    assert Inode.decode(7, inode.encode()) == inode
    base = BaseEntry(kind, digest, size, upper, FileVersion(generation))
    assert base.encode() == _encode([_V, kind, digest, size, upper, generation]).encode()
    assert BaseEntry.decode(base.encode()) == base
