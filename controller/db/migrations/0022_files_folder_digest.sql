-- A checkpoint's pins are checked by folder and digest
-- (controller.checkpoint.claim_contents: does this folder reference the
-- digest?). files_digest alone walks every folder's rows of a common digest
-- (an empty file), and the folder's own indexes walk the folder.
CREATE INDEX files_folder_digest ON files (folder_id, digest) WHERE digest IS NOT NULL;
