-- Per-run quota on uploaded-but-uncommitted bytes: a checkpoint that
-- references an upload marks it committed; uncommitted ones expire.
ALTER TABLE run_uploads ADD COLUMN committed_at timestamptz;
CREATE INDEX run_uploads_pending ON run_uploads (run_id, created_at) WHERE committed_at IS NULL;
