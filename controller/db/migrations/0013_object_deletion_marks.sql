-- A writer that stored an object's bytes and then registers it must know
-- whether a GC sweep may have deleted those bytes in between, without asking
-- storage (a HEAD per file on S3). It draws a mark from this sequence before
-- it stores; a sweep stamps each deletion with a later value, drawn after the
-- bytes are gone (controller/foldercore.py: take_store_mark, upsert_objects). Not
-- cached (CACHE 1, the default), so values are drawn in one global order.
CREATE SEQUENCE object_deletion_marks;
ALTER TABLE deletion_journal ADD COLUMN deleted_mark bigint;
-- Deletions before this migration precede every mark (marks start at 1); a
-- deleted entry without a mark counts as recent.
UPDATE deletion_journal SET deleted_mark = 0 WHERE outcome = 'deleted';

-- The journal entries of one object that can mean its bytes are gone: due
-- and not yet settled (a sweep may have deleted them and failed before it
-- recorded so), or deleted. Also serves the sweeper settling an object's
-- entries.
CREATE INDEX deletion_journal_object ON deletion_journal (company_id, digest)
    WHERE done_at IS NULL OR outcome = 'deleted';
