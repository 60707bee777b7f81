-- Run lookups that scanned a company's every run (or the whole table).
--
-- The active runs: the company directory's "which folders have an active
-- run" (companies.py: company_id AND active, reading agent, project and task
-- ids) and the active-runs gauge (metrics.py: count of active). Only running
-- runs are in this index, a handful however many runs a company has had, and
-- it holds the columns the directory reads, so both are index-only scans.
CREATE INDEX runs_active ON runs (company_id) INCLUDE (agent_id, project_id, task_id)
    WHERE active;

-- The runs bound to one folder's owner, newest first (/sync, /refresh:
-- runs.bound_runs), and the foreign keys' ON DELETE on these columns.
CREATE INDEX runs_agent_started ON runs (agent_id, started_at DESC);
CREATE INDEX runs_task_started ON runs (task_id, started_at DESC) WHERE task_id IS NOT NULL;
CREATE INDEX runs_project_started ON runs (project_id, started_at DESC)
    WHERE project_id IS NOT NULL;
CREATE INDEX runs_user_started ON runs (user_id, started_at DESC) WHERE user_id IS NOT NULL;
