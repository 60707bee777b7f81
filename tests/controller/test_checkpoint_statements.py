"""The checkpoint commit's SQL does not grow with its files: a commit of a
hundred times more entries sends the database the same statements. Counted
by PostgreSQL itself (``log_statement = all`` on the controller's own
database, read from the cluster's log), over the real API."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import pytest

from tests.controller.test_changeset import put
from tests.support.bridge import Run, start_run
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    bootstrap_tenant,
    world_searchable_tmpdir,
)

T = TypeVar("T")
# One line per statement a session ran: simple-protocol queries and each
# execution of a prepared or unnamed statement.
STATEMENT = re.compile(rb"^\S+ \S+ \S+ \[\d+\] LOG:  (statement|execute [^:]*): ", re.M)
STATEMENT_TEXT = re.compile(rb"^\S+ \S+ \S+ \[\d+\] LOG:  (?:statement|execute [^:]*): (.*)$", re.M)


class StatementLog:
    """The statements PostgreSQL logged for one database, between two points."""

    def __init__(self, cluster: PgCluster, url: str) -> None:
        self.cluster = cluster
        # Only this database logs its statements: the log's statement lines
        # are its sessions' alone.
        cluster.configure_database(url, {"log_statement": "all"})

    def window(self, work: Callable[[], T]) -> tuple[T, bytes]:
        """``work``'s answer and what the log took meanwhile."""
        start = self.cluster.pg.logfile.stat().st_size
        result = work()  # each statement's line is written before it runs
        return result, self.cluster.log_since(start)

    def count(self, work: Callable[[], T]) -> tuple[T, int]:
        result, text = self.window(work)
        return result, len(STATEMENT.findall(text))


@pytest.fixture(scope="module")
def logged(pg_cluster: PgCluster) -> Iterator[tuple[ControllerProcess, StatementLog]]:
    """A controller on a database of its own whose statements are logged."""
    url = pg_cluster.create_database()
    statements = StatementLog(pg_cluster, url)
    ctl = ControllerProcess(url, world_searchable_tmpdir("fsa-stmt-"))
    ctl.start()
    try:
        yield ctl, statements
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


def commit_ok(run: Run, entries: list[dict[str, Any]]) -> dict[str, Any]:
    r = run.commit("task", entries)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_checkpoint_statements_do_not_grow_with_its_files(
    logged: tuple[ControllerProcess, StatementLog],
) -> None:
    ctl, statements = logged
    run = start_run(bootstrap_tenant(ctl))
    digests = []
    for data in (b"first version\n", b"second version\n"):
        up = run.upload("task", data)
        assert up.status_code == 200, up.text
        digests.append(up.json()["digest"])
    one, two = digests

    def shape(n: int, tag: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """A first commit of ``n`` new files in ``n // 10`` new directories, and
        a second that overwrites half of them and deletes a quarter."""
        paths = [f"{tag}{i // 10:04}/f{i:05}.txt" for i in range(n)]
        first = [put(p, one) for p in paths]
        second = [put(p, two) for p in paths[: n // 2]]
        second += [{"op": "delete", "path": p} for p in paths[n // 2 : n // 2 + n // 4]]
        return first, second

    counts: dict[int, list[int]] = {}
    for n in (20, 2000):
        first, second = shape(n, f"s{n}-")
        counts[n] = []
        for entries in (first, second):
            receipt, k = statements.count(partial(commit_ok, run, entries))
            assert receipt["applied"] is True and receipt["entries"] == len(entries)
            counts[n].append(k)
    with ctl.db() as db:
        live = db.execute(
            "SELECT digest, count(*) FROM files WHERE kind = 'file' AND deleted_at IS NULL"
            " AND digest = ANY(%s) GROUP BY digest",
            (digests,),
        ).fetchall()
    # Both sizes: n/2 overwritten, n/4 kept as they were, n/4 deleted.
    assert dict(live) == {two: 10 + 1000, one: 5 + 500}
    small, large = counts[20], counts[2000]
    print(f"\nstatements per commit: 20 files {small}, 2,000 files {large}")
    # A statement per file would add thousands; a chunked plan adds none (a
    # few for noise: another session's statement landing in the window).
    assert min(small) >= 5, counts  # the log is read (its line format is as expected)
    for a, b in zip(small, large, strict=True):
        assert b <= a + 3, counts
    assert max(large) < 80, counts


def test_a_put_is_one_statement_to_authorize_and_one_transaction_to_write(
    logged: tuple[ControllerProcess, StatementLog],
) -> None:
    """A person's PUT of a new file into a folder and directory that exist:
    the authorization (token, membership, folder, store mark) is a single
    statement outside any transaction, the write one transaction of nine
    statements between its BEGIN and COMMIT."""
    ctl, statements = logged
    tenant = bootstrap_tenant(ctl)
    octet = {"Content-Type": "application/octet-stream"}

    with tenant.client() as c:

        def upload(i: int) -> list[bytes]:
            r, text = statements.window(
                lambda: c.put(
                    f"{tenant.my_folder}/content", params={"path": f"d/f{i}"},
                    content=b"%d" % i, headers=octet,
                )
            )  # fmt: skip
            assert r.status_code == 201, r.text
            return STATEMENT_TEXT.findall(text)

        upload(0)  # the folder's first write creates it (and d/)
        windows = [upload(i) for i in range(1, 4)]
    # Another session's statement may land in a window; never fewer.
    assert min(len(w) for w in windows) == 11, windows
    put = next(w for w in windows if len(w) == 11)
    assert b"FROM api_tokens t WHERE t.token_hash" in put[0], put
    assert [t.strip() for t in put[1:]].count(b"BEGIN") == 1, put
    assert put[1].strip() == b"BEGIN" and put[-1].strip() == b"COMMIT", put
