-- Operator tokens: a machine's credential (an orchestrator's) for one
-- company's admin routes. Only a SHA-256 of each token is kept; the token is
-- shown once. Listed and revoked by id with the API tokens.
CREATE TABLE operator_tokens (
    id          uuid PRIMARY KEY,
    company_id  uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    name        text NOT NULL,
    token_hash  bytea NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX operator_tokens_company ON operator_tokens (company_id);

-- The admin API lists a company's runs newest first.
CREATE INDEX runs_company_started ON runs (company_id, started_at DESC, id DESC);
