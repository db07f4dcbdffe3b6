"""Fan-out and join: a pipeline stage runs once per item, in child jobs (ADR-0047).

- ``job_stages.fan_out``, ``job_stages.max_failures``, ``job_stages.fail_fast``:
  a stage that runs as one child job per item of the stage before's result,
  and its failure policy, frozen at submit like the rest of the stage.
- ``jobs.fan_stage`` and ``jobs.fan_size``: the fan-out stage a pipeline job
  waits at (or last waited at) and how many children it spawned (NULL for a
  job that never fanned out): what the join, the progress and RetryJob read.
- ``jobs.deps_tolerate`` and ``jobs.deps_wait_all``: the dependency counts'
  policy beyond ``after_failure``: how many ended other than SUCCEEDED are
  tolerated, and whether a failure decides only once every one has ended.
  A plain dependent keeps 0 and false, so it decides as before.
- ``job_dependencies.idx``: the item an edge to a child is for (NULL for an
  edge of ``after``): the join reads the children's results in item order.
- ``job_dependencies.progress`` and ``jobs.fan_progress``: a running child's
  own progress as last added to its job, and their sum over the children
  not ended: the job's progress counts each child's without reading them all.

Every column is nullable or has a constant default: adding them rewrites
nothing.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

_UP = """
ALTER TABLE job_stages ADD COLUMN IF NOT EXISTS fan_out boolean NOT NULL DEFAULT false,
                       ADD COLUMN IF NOT EXISTS max_failures integer NOT NULL DEFAULT 0,
                       ADD COLUMN IF NOT EXISTS fail_fast boolean NOT NULL DEFAULT false;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS fan_stage integer,
                 ADD COLUMN IF NOT EXISTS fan_size integer,
                 ADD COLUMN IF NOT EXISTS deps_tolerate integer NOT NULL DEFAULT 0,
                 ADD COLUMN IF NOT EXISTS deps_wait_all boolean NOT NULL DEFAULT false,
                 ADD COLUMN IF NOT EXISTS fan_progress double precision NOT NULL DEFAULT 0;
ALTER TABLE job_dependencies ADD COLUMN IF NOT EXISTS idx integer,
                             ADD COLUMN IF NOT EXISTS progress double precision NOT NULL DEFAULT 0
"""
_DOWN = """
ALTER TABLE job_dependencies DROP COLUMN IF EXISTS progress,
                             DROP COLUMN IF EXISTS idx;
ALTER TABLE jobs DROP COLUMN IF EXISTS fan_progress,
                 DROP COLUMN IF EXISTS deps_wait_all,
                 DROP COLUMN IF EXISTS deps_tolerate,
                 DROP COLUMN IF EXISTS fan_size,
                 DROP COLUMN IF EXISTS fan_stage;
ALTER TABLE job_stages DROP COLUMN IF EXISTS fail_fast,
                       DROP COLUMN IF EXISTS max_failures,
                       DROP COLUMN IF EXISTS fan_out
"""


def upgrade() -> None:
    for statement in _UP.split(";"):
        op.execute(statement)


def downgrade() -> None:
    for statement in _DOWN.split(";"):
        op.execute(statement)
