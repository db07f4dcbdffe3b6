"""Pipelines: a job whose ordered stages each run as a job type of their own.

- ``job_stages``: one row per stage of a pipeline job, written with the job
  (the pipeline's definition frozen at submit: name, type, queue, version,
  attempts, timeout and its share of the job's progress), then kept by the
  state machine's ``Stages`` hook in each transition's own statement: its
  state, attempts, timings, last error and its result. A stage's result is
  keyed by (job, stage, version): a redelivered or re-run stage writes the
  same row.
- ``jobs.pipeline`` / ``jobs.pipeline_version``: the pipeline a job runs
  (NULL for a plain job). ``jobs.type`` is the type that runs now (the
  running stage's), so dispatch, claim, hand-back and parking are the same
  for a stage as for a plain job.
- ``jobs.stage`` / ``jobs.stage_name``: the index and name of the stage that
  runs (or waits) now; ``jobs.stage_base`` / ``jobs.stage_span``: the job's
  progress when that stage starts, and the stage's share of it, so a stage's
  0..1 maps onto the job's 0..1 in the progress statement itself.
- ``job_events.stage``: the stage an event belongs to.
- ``jobs_tenant_pipeline_newest``: ListJobs filtered by a pipeline's name.
- ``job_pipelines``: the topology's pipeline names, written with the routes
  (``jobplane.store.routes``); ``jobplane.submit_job`` refuses them (a
  pipeline job is submitted through SubmitJob, which writes its stages),
  where it would otherwise route the name as a plain job's type.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_UP = """
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS pipeline text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS pipeline_version text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS stage integer;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS stage_name text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS stage_base double precision NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS stage_span double precision NOT NULL DEFAULT 1;
ALTER TABLE job_events ADD COLUMN IF NOT EXISTS stage text;
CREATE TABLE IF NOT EXISTS job_stages (
    job_id          uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    idx             integer NOT NULL CHECK (idx >= 0),
    tenant_id       uuid NOT NULL,
    name            text NOT NULL,
    type            text NOT NULL,
    queue           text NOT NULL,
    version         text NOT NULL DEFAULT '',
    max_attempts    integer NOT NULL CHECK (max_attempts >= 1),
    timeout_seconds double precision NOT NULL,
    -- the job's progress when the stage starts, and the stage's share of it
    base            double precision NOT NULL,
    span            double precision NOT NULL,
    state           text NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'queued', 'running', 'succeeded', 'failed', 'cancelled',
                         'skipped')),
    attempts        integer NOT NULL DEFAULT 0,
    result          jsonb,
    error_code      text,
    error_message   text,
    start_time      timestamptz,
    end_time        timestamptz,
    update_time     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, idx),
    CONSTRAINT job_stages_result_key UNIQUE (job_id, name, version)
);
CREATE TABLE IF NOT EXISTS job_pipelines (
    name text PRIMARY KEY
)
"""

_DOWN = """
DROP TABLE IF EXISTS job_pipelines;
DROP TABLE IF EXISTS job_stages;
ALTER TABLE job_events DROP COLUMN IF EXISTS stage;
ALTER TABLE jobs DROP COLUMN IF EXISTS stage_span;
ALTER TABLE jobs DROP COLUMN IF EXISTS stage_base;
ALTER TABLE jobs DROP COLUMN IF EXISTS stage_name;
ALTER TABLE jobs DROP COLUMN IF EXISTS stage;
ALTER TABLE jobs DROP COLUMN IF EXISTS pipeline_version;
ALTER TABLE jobs DROP COLUMN IF EXISTS pipeline
"""

# jobs holds a row per job ever submitted: built CONCURRENTLY (see 0004).
_BY_PIPELINE = "jobs (tenant_id, pipeline, create_time DESC, id DESC) WHERE pipeline IS NOT NULL"


# 0010's function, refusing a pipeline's name before it looks up a route.
_SUBMIT_JOB = "0011_submit_job.sql"


def upgrade() -> None:
    for statement in filter(str.strip, _UP.split(";\n")):
        op.execute(statement)
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    # CREATE OR REPLACE keeps the function's grants.
    op.execute(frozen_sql(_SUBMIT_JOB, schema))
    with op.get_context().autocommit_block():
        _build_index("jobs_tenant_pipeline_newest", _BY_PIPELINE)


def downgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql("0010_submit_job.sql", schema))
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_tenant_pipeline_newest")
    for statement in filter(str.strip, _DOWN.split(";\n")):
        op.execute(statement)


def _build_index(name: str, definition: str) -> None:
    """CREATE INDEX CONCURRENTLY, dropping an invalid one an interrupted build left."""
    valid = op.get_bind().execute(
        text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
        {"name": name},
    )
    if valid.scalar_one_or_none() is False:
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {definition}")
