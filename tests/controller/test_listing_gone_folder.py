"""A listing of a folder removed after it was opened answers an empty page."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
from psycopg.rows import dict_row

from controller import foldercore, folders
from controller.db import migrate
from tests.support.controller import PgCluster


def test_a_folder_removed_meanwhile_lists_nothing(pg_cluster: PgCluster) -> None:
    url = pg_cluster.create_database()
    migrate(url)
    gone = foldercore.Folder(2**40, str(uuid.uuid4()), "user", str(uuid.uuid4()))

    async def main() -> folders.EntryPage:
        async with await psycopg.AsyncConnection.connect(url, row_factory=dict_row) as conn:
            return await folders.list_entries(
                conn, gone, parent=None, trash=False, limit=10, after=None
            )

    page = asyncio.run(main())
    assert page == folders.EntryPage([], False, None, 0, 0)
