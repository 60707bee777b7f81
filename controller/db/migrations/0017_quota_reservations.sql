-- Bytes an upload in flight holds against its run's allowance and its
-- company's storage quota, between the check and the transaction that
-- registers the upload (controller/quotas.py: reserve_uploads). The check
-- and the insert run under one advisory lock per run and per company, so
-- uploads on any number of replicas see each other's reservations; the
-- registering transaction deletes the row as it adds the uploads, so the
-- bytes are counted once. A row whose holder died (kill -9) stops counting
-- at expires_at.
CREATE TABLE quota_reservations (
    id             bigserial PRIMARY KEY,
    company_id     uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    run_id         uuid REFERENCES runs(id) ON DELETE CASCADE,
    run_bytes      bigint NOT NULL CHECK (run_bytes >= 0),
    company_bytes  bigint NOT NULL CHECK (company_bytes >= 0),
    expires_at     timestamptz NOT NULL
);
CREATE INDEX quota_reservations_run ON quota_reservations (run_id) WHERE run_id IS NOT NULL;
CREATE INDEX quota_reservations_company ON quota_reservations (company_id);
