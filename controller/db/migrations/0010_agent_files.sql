-- The agent folder contract (spec/agent-files.md, controller/agentfiles.py):
-- each agent's instruction entry, per-agent grants, live bytes per folder for
-- the agent folder's storage limits, save receipts and a run's current
-- warnings, the one-time import marker, and task attachments.

-- The instruction entry: one path in the agent's folder, protected from deletion.
ALTER TABLE agents ADD COLUMN entry_path text COLLATE "C" NOT NULL DEFAULT 'AGENTS.md';

-- Uncompressed bytes of the folder's live files, kept like live_entries by
-- every write in its own transaction under the folder lock (versions.py).
ALTER TABLE folders ADD COLUMN live_bytes bigint NOT NULL DEFAULT 0;
UPDATE folders d SET live_bytes =
    (SELECT coalesce(sum(byte_size), 0) FROM files f
      WHERE f.folder_id = d.id AND f.deleted_at IS NULL);

-- Per-agent permissions of people who are not owners or admins. A grant
-- belongs to a membership: removing the member removes its grants.
CREATE TABLE agent_grants (
    company_id  uuid NOT NULL,
    agent_id    uuid NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    user_id     uuid NOT NULL,
    permission  text NOT NULL CHECK (permission IN ('configure')),
    granted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, user_id, permission),
    FOREIGN KEY (company_id, user_id) REFERENCES memberships (company_id, user_id)
        ON DELETE CASCADE
);
CREATE INDEX agent_grants_member ON agent_grants (company_id, user_id);

-- A run's current warnings, one array per folder scope ({"agent": [...]}):
-- replaced by each save receipt of that folder, never an error on the files.
ALTER TABLE runs ADD COLUMN warnings jsonb NOT NULL DEFAULT '{}';

-- Every save attempt of a run (a checkpoint commit, or a failure fsagent
-- reported after its last attempt): history, never overwritten.
CREATE TABLE save_receipts (
    id               bigserial PRIMARY KEY,
    run_id           uuid NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    company_id       uuid NOT NULL,
    scope            text NOT NULL CHECK (scope IN ('task', 'agent', 'user', 'project')),
    owner_id         text NOT NULL,
    operation_id     text,
    outcome          text NOT NULL CHECK (outcome IN ('saved', 'refused', 'failed')),
    code             text,
    error            text,
    details          jsonb,
    warnings         jsonb NOT NULL DEFAULT '[]',
    refused_entries  jsonb NOT NULL DEFAULT '[]',
    files_changed    integer NOT NULL DEFAULT 0,
    final            boolean NOT NULL DEFAULT false,
    at               timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX save_receipts_run ON save_receipts (run_id, id);

-- The one-time import of an existing workspace into an agent folder
-- (controller/agentimport.py): its presence refuses any replay.
CREATE TABLE agent_imports (
    agent_id     uuid PRIMARY KEY REFERENCES agents(id) ON DELETE CASCADE,
    imported_at  timestamptz NOT NULL DEFAULT now(),
    source       text NOT NULL,
    summary      jsonb NOT NULL
);

-- Original uploads of a task. Each becomes an editable working copy in the
-- task folder once (materialized_at), when a run of the task is prepared;
-- the original's object is a GC reference of its own (controller/gc.py).
CREATE TABLE task_attachments (
    id               uuid PRIMARY KEY,
    company_id       uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    task_id          uuid NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    filename         text NOT NULL,
    digest           text NOT NULL,
    byte_size        bigint NOT NULL,
    content_type     text,
    created_by       uuid,
    created_at       timestamptz NOT NULL DEFAULT now(),
    materialized_at  timestamptz
);
CREATE INDEX task_attachments_task ON task_attachments (task_id, created_at, id);
CREATE INDEX task_attachments_digest ON task_attachments (company_id, digest);
