"""Concurrency keys: at most a key's limit of its jobs RUNNING at once (ADR-0040).

- ``jobs.concurrency_key`` and ``jobs.concurrency_limit``: NULL for a job
  without a key (every job before this revision). Keys are per tenant.
- ``jobplane.concurrency_blocker(tenant, key, limit, job, created)``: takes
  the key's advisory lock and says which job a job waits for (NULL: it may
  start). The machine's CLAIM and HOLD transitions call it; only the state
  machine writes the columns it reads.
- ``jobs_concurrency``: the jobs of a key that hold or wait for a slot
  (RUNNING, or QUEUED), for the count under the lock and the release's
  oldest held jobs. Partial: finished jobs and jobs without a key are not in it.

Revision ID: 0018
Revises: 0016
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql
from jobplane.migrations.indexes import build_index

revision = "0018"
down_revision = "0016"
branch_labels = None
depends_on = None

_ADD = """
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS concurrency_key text,
                 ADD COLUMN IF NOT EXISTS concurrency_limit integer
"""
_BLOCKER = "0018_concurrency_blocker.sql"
_SIGNATURE = "jobplane.concurrency_blocker(uuid, text, integer, uuid, timestamp with time zone)"
# jobs holds a row per job ever submitted: built CONCURRENTLY (see 0004).
_CONCURRENCY = (
    "jobs (tenant_id, concurrency_key, create_time, id) "
    "WHERE concurrency_key IS NOT NULL AND state IN ('queued', 'running')"
)


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(_ADD)
    op.execute(frozen_sql(_BLOCKER, schema))
    op.execute(f"REVOKE ALL ON FUNCTION {_SIGNATURE} FROM PUBLIC")
    with op.get_context().autocommit_block():
        build_index("jobs_concurrency", _CONCURRENCY)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_concurrency")
    op.execute(f"DROP FUNCTION IF EXISTS {_SIGNATURE}")
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS concurrency_limit")
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS concurrency_key")
