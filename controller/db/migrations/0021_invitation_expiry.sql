-- A pending invitation lapses (controller.invitations.INVITATION_TTL, 14
-- days; inviting again renews it). Those pending at this upgrade get the
-- full 14 days from it.
ALTER TABLE invitations ADD COLUMN expires_at timestamptz;
UPDATE invitations SET expires_at = now() + interval '14 days';
ALTER TABLE invitations ALTER COLUMN expires_at SET NOT NULL;
