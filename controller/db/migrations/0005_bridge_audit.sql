-- The API bridge's audit trail: one row per request sandbox code made through
-- /bridge/v1/api/... (controller/bridgeaudit.py). The route is the matched
-- route template, NULL when the path matched no API route.
CREATE TABLE bridge_audit (
    id              bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    run_id          uuid NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    company_id      uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    agent_id        uuid NOT NULL,
    lease_epoch     bigint NOT NULL,
    method          text NOT NULL,
    route           text,
    status          integer NOT NULL,
    request_bytes   bigint NOT NULL,
    response_bytes  bigint NOT NULL,
    duration_ms     integer NOT NULL
);
CREATE INDEX bridge_audit_run ON bridge_audit (run_id, id);
