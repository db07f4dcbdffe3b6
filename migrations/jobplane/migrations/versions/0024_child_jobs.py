"""Child jobs: a handler's submits are linked to its job (docs/workflows.md, ADR-0046).

- ``jobs.parent_id``: the job whose running attempt submitted this one
  (NULL: submitted by a caller). Always a job of the same tenant: the store
  writes it only after locking the parent by (id, tenant) under its
  attempt's fence. No foreign key: retention deletes a parent that ended
  long ago without touching its children's rows (a child then names a job
  that reads NOT_FOUND, as a deleted job does everywhere else). A nullable
  column without a default: adding it rewrites nothing.
- ``jobs_parent``: the children of a job, newest first (ListJobs' ``parent``
  filter, CancelJob's cascade, the per-parent cap). Partial: jobs without a
  parent, nearly all of them, are not in it. Built CONCURRENTLY (see 0004).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

from jobplane.migrations.indexes import build_index

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

_INDEX = "jobs_parent"
_DEFINITION = "jobs (parent_id, create_time DESC, id DESC) WHERE parent_id IS NOT NULL"


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN IF NOT EXISTS parent_id uuid")
    with op.get_context().autocommit_block():
        build_index(_INDEX, _DEFINITION)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {_INDEX}")
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS parent_id")
