-- Objects a run uploaded through the bridge. A checkpoint of that run may
-- reference them; nothing else may (a hash alone is no key).
CREATE TABLE run_uploads (
    run_id      uuid NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    company_id  uuid NOT NULL,
    digest      text NOT NULL,
    byte_size   bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, digest)
);
CREATE INDEX run_uploads_digest ON run_uploads (company_id, digest);

-- The folder version each run has acknowledged (its sync baseline).
CREATE TABLE sync_baselines (
    run_id      uuid NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    folder_id   bigint NOT NULL REFERENCES folders(id) ON DELETE CASCADE,
    version     bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, folder_id)
);
