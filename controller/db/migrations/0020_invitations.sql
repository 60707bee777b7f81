-- A company's invitation of an existing person: they become a member only
-- by accepting it (their consent). One pending invitation per company and
-- person; accepting, declining or withdrawing it deletes the row.
CREATE TABLE invitations (
    id          uuid PRIMARY KEY,
    company_id  uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    user_id     uuid NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    role        text NOT NULL CHECK (role IN ('owner', 'admin', 'member', 'viewer')),
    invited_by  uuid REFERENCES users(id) ON DELETE SET NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (company_id, user_id)
);
CREATE INDEX invitations_user ON invitations (user_id);

-- When the company last ended this member's Files page sessions: a session
-- signed in at or before it no longer reaches this company (and only this one).
ALTER TABLE memberships ADD COLUMN sessions_ended_at timestamptz;
