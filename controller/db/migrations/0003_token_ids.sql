-- A stable public id for each API token, so an operator can list and revoke
-- tokens without ever seeing one (only the SHA-256 of a token is stored).
ALTER TABLE api_tokens ADD COLUMN id uuid NOT NULL DEFAULT gen_random_uuid();
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_id_key UNIQUE (id);
CREATE INDEX api_tokens_user ON api_tokens (user_id);
CREATE INDEX web_sessions_user ON web_sessions (user_id);
