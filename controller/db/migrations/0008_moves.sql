-- A move takes a row off its old path without trashing it. The old path is
-- kept here with the version of the move, so "changes since" readers (the
-- bridge manifest, the Files page's live listing) learn that it went away.
CREATE TABLE path_tombstones (
    folder_id   bigint NOT NULL REFERENCES folders(id) ON DELETE CASCADE,
    path        text COLLATE "C" NOT NULL,
    parent      text COLLATE "C" NOT NULL,
    kind        text NOT NULL CHECK (kind IN ('file', 'directory')),
    digest      text,
    version     bigint NOT NULL,
    moved_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX path_tombstones_version ON path_tombstones (folder_id, version);
