-- Live entries per folder, kept by every write in its own transaction under
-- the folder lock (controller/versions.py), so the entry limit costs no scan.
ALTER TABLE folders ADD COLUMN live_entries bigint NOT NULL DEFAULT 0;
UPDATE folders d SET live_entries =
    (SELECT count(*) FROM files f WHERE f.folder_id = d.id AND f.deleted_at IS NULL);

-- An uncommitted bridge upload pins its object until expires_at (set from
-- --pending-upload-ttl when it is recorded); the sweeper honours the pin and
-- a checkpoint may reference the upload only while it holds. Existing rows
-- get the default TTL of one day.
ALTER TABLE run_uploads ADD COLUMN expires_at timestamptz;
UPDATE run_uploads SET expires_at = created_at + interval '1 day';
ALTER TABLE run_uploads ALTER COLUMN expires_at SET DEFAULT now() + interval '1 day';
ALTER TABLE run_uploads ALTER COLUMN expires_at SET NOT NULL;
