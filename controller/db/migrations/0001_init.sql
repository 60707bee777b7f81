-- Tenancy, people and tokens.
CREATE TABLE companies (
    id          uuid PRIMARY KEY,
    name        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE users (
    id          uuid PRIMARY KEY,
    email       text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE memberships (
    company_id  uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    user_id     uuid NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    role        text NOT NULL CHECK (role IN ('owner', 'admin', 'member', 'viewer')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (company_id, user_id)
);

-- Only a SHA-256 of each token is kept; the token itself is shown once.
CREATE TABLE api_tokens (
    token_hash  bytea PRIMARY KEY,
    user_id     uuid NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

CREATE TABLE agents (
    id          uuid PRIMARY KEY,
    company_id  uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    name        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE projects (
    id          uuid PRIMARY KEY,
    company_id  uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    name        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE tasks (
    id          uuid PRIMARY KEY,
    company_id  uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    project_id  uuid NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
    title       text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Runs: one agent execution in one sandbox, with the folders it is bound to.
CREATE TABLE runs (
    id                     uuid PRIMARY KEY,
    company_id             uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    agent_id               uuid NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    task_id                uuid REFERENCES tasks(id) ON DELETE SET NULL,
    project_id             uuid REFERENCES projects(id) ON DELETE SET NULL,
    user_id                uuid REFERENCES users(id) ON DELETE SET NULL,
    sandbox_key            text NOT NULL,
    lease_epoch            bigint NOT NULL,
    token_hash             bytea NOT NULL UNIQUE,
    state                  text NOT NULL DEFAULT 'starting'
                           CHECK (state IN ('starting', 'saving', 'saved', 'failed')),
    active                 boolean NOT NULL DEFAULT true,
    error                  text,
    last_saved_at          timestamptz,
    final_checkpoint_at    timestamptz,
    refresh_requested      boolean NOT NULL DEFAULT false,
    started_at             timestamptz NOT NULL DEFAULT now(),
    ended_at               timestamptz
);
CREATE INDEX runs_sandbox ON runs (company_id, sandbox_key);

-- One row per (company, scope, owner) work folder, created on first use.
CREATE TABLE folders (
    id                  bigserial PRIMARY KEY,
    company_id          uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    scope               text NOT NULL CHECK (scope IN ('task', 'agent', 'user', 'project')),
    owner_id            text NOT NULL,
    last_operation_at   timestamptz,
    -- Versions at or below this may have lost trash rows to a purge, so a
    -- "changes since" manifest older than it must be read again in full.
    purge_floor         bigint NOT NULL DEFAULT 0,
    UNIQUE (company_id, scope, owner_id)
);

-- Server versions are global and strictly increasing in commit order within
-- a folder (writes to one folder are serialized by an advisory lock).
CREATE SEQUENCE file_version_seq;

CREATE TABLE files (
    id            uuid PRIMARY KEY,
    folder_id     bigint NOT NULL REFERENCES folders(id) ON DELETE CASCADE,
    -- Byte order (COLLATE "C") keeps listings and cursors stable everywhere.
    path          text COLLATE "C" NOT NULL,
    parent        text COLLATE "C" NOT NULL,
    kind          text NOT NULL CHECK (kind IN ('file', 'directory')),
    digest        text,
    byte_size     bigint NOT NULL DEFAULT 0,
    executable    boolean NOT NULL DEFAULT false,
    content_type  text,
    version       bigint NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    deleted_at    timestamptz,
    -- The file id the delete was issued on; restore/purge act on the batch.
    trash_root    uuid,
    CHECK ((kind = 'file') = (digest IS NOT NULL))
);
CREATE UNIQUE INDEX files_live_path ON files (folder_id, path) WHERE deleted_at IS NULL;
CREATE INDEX files_children ON files (folder_id, parent, path) WHERE deleted_at IS NULL;
CREATE INDEX files_folder_version ON files (folder_id, version);
CREATE INDEX files_trash ON files (folder_id, trash_root) WHERE deleted_at IS NOT NULL;
CREATE INDEX files_digest ON files (digest) WHERE digest IS NOT NULL;

-- Stored content objects, one per (company, digest). A row exists while the
-- object may be referenced; the GC sweeper deletes both under a row lock.
CREATE TABLE objects (
    company_id  uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    digest      text NOT NULL,
    byte_size   bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (company_id, digest)
);

-- Superseded and purged objects wait here until not_before.
CREATE TABLE deletion_journal (
    id          bigserial PRIMARY KEY,
    company_id  uuid NOT NULL,
    digest      text NOT NULL,
    reason      text NOT NULL,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    not_before  timestamptz NOT NULL,
    done_at     timestamptz,
    outcome     text
);
CREATE INDEX deletion_journal_due ON deletion_journal (not_before) WHERE done_at IS NULL;

-- Receipts for idempotent operations, keyed by (folder, operation id).
CREATE TABLE receipts (
    folder_id     bigint NOT NULL REFERENCES folders(id) ON DELETE CASCADE,
    operation_id  text NOT NULL,
    fingerprint   text NOT NULL,
    result        jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (folder_id, operation_id)
);

-- Signed-in sessions of the Files page (cookie holds the secret; only its hash is kept).
CREATE TABLE web_sessions (
    session_hash  bytea PRIMARY KEY,
    user_id       uuid NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    csrf_token    text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL
);
