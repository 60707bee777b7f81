-- Repositories (controller/workspaces.py, controller/repos.py).
--
-- A project's workspaces name repositories; every task of the project binds
-- each of them (task_repos) with a checkout name fixed at the first binding.
-- A binding's current repository checkpoint is a manifest object in storage;
-- repo_refs holds the digests that current checkpoint references (its
-- objects and its manifest), kept by diffing the old and the new manifest at
-- each commit, so a commit writes rows for what changed only and GC asks one
-- indexed question per digest.

CREATE TABLE workspaces (
    id             uuid PRIMARY KEY,
    company_id     uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    project_id     uuid NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
    repo_url       text NOT NULL,
    -- The checkout name asked for; NULL derives it from repo_url.
    name           text,
    ref            text,
    is_primary     boolean NOT NULL DEFAULT false,
    setup_command  text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- A removed workspace is bound by no new task and listed to no sandbox;
    -- existing bindings and their saved checkpoints stay.
    removed_at     timestamptz
);
CREATE INDEX workspaces_project ON workspaces (project_id, created_at, id);
CREATE UNIQUE INDEX workspaces_one_primary ON workspaces (project_id)
    WHERE is_primary AND removed_at IS NULL;

-- The branch the task's primary checkout works on (set-task-branch).
ALTER TABLE tasks ADD COLUMN branch text;

CREATE TABLE task_repos (
    task_id        uuid NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    workspace_id   uuid NOT NULL REFERENCES workspaces(id) ON DELETE CASCADE,
    company_id     uuid NOT NULL REFERENCES companies(id) ON DELETE CASCADE,
    -- The directory under $HOME/repos; never changes once given.
    name           text NOT NULL,
    current_id     uuid,
    state          text NOT NULL DEFAULT 'unsaved'
                   CHECK (state IN ('unsaved', 'saving', 'saved', 'failed')),
    error          text,
    last_saved_at  timestamptz,
    bound_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, workspace_id)
);
-- Case-insensitively unique: the checkout may be extracted (the tar
-- download) on a case-insensitive filesystem.
CREATE UNIQUE INDEX task_repos_name ON task_repos (task_id, lower(name));

CREATE TABLE repo_checkpoints (
    id               uuid PRIMARY KEY,
    task_id          uuid NOT NULL,
    workspace_id     uuid NOT NULL,
    company_id       uuid NOT NULL,
    run_id           uuid REFERENCES runs(id) ON DELETE SET NULL,
    operation_id     text NOT NULL,
    fingerprint      text NOT NULL,
    base_id          uuid,
    manifest_digest  text NOT NULL,
    entries          integer NOT NULL,
    files            integer NOT NULL,
    byte_size        bigint NOT NULL,
    -- The receipt, returned again on an idempotent replay.
    result           jsonb NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (task_id, workspace_id) REFERENCES task_repos ON DELETE CASCADE,
    UNIQUE (task_id, workspace_id, operation_id)
);
ALTER TABLE task_repos ADD CONSTRAINT task_repos_current
    FOREIGN KEY (current_id) REFERENCES repo_checkpoints(id) ON DELETE SET NULL;

-- The digests the binding's current checkpoint references, manifest included.
CREATE TABLE repo_refs (
    task_id       uuid NOT NULL,
    workspace_id  uuid NOT NULL,
    company_id    uuid NOT NULL,
    digest        text NOT NULL,
    byte_size     bigint NOT NULL,
    PRIMARY KEY (task_id, workspace_id, digest),
    FOREIGN KEY (task_id, workspace_id) REFERENCES task_repos ON DELETE CASCADE
);
CREATE INDEX repo_refs_task_digest ON repo_refs (task_id, digest);
CREATE INDEX repo_refs_company_digest ON repo_refs (company_id, digest);
