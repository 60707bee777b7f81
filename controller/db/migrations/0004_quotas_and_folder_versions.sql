-- Per-run quota on uploaded-but-uncommitted bytes: a checkpoint that
-- references an upload marks it committed; uncommitted ones expire.
ALTER TABLE run_uploads ADD COLUMN committed_at timestamptz;
CREATE INDEX run_uploads_pending ON run_uploads (run_id, created_at) WHERE committed_at IS NULL;

-- Versions count per folder (controller/versions.py). Every folder starts at
-- the old global sequence's value, so no version a client holds goes back.
ALTER TABLE folders ADD COLUMN version_counter bigint NOT NULL DEFAULT 0;
UPDATE folders SET version_counter =
    (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM file_version_seq);
