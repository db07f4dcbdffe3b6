"""Flow-controlled dispatch: each dispatch's queue, each tenant's weight (ADR-0042).

- ``outbox.queue``: the queue that takes a dispatch's job (``jobs.queue``, the
  topology's route at submit), written with every dispatch by the state
  machine and by ``jobplane.submit_job``. Other kinds of rows leave it ''.
  NOT NULL DEFAULT '': added without rewriting the table; the dispatches
  still waiting are given their job's queue here, and a dispatch written by
  a server not yet upgraded ('' still) is claimed as before, outside any
  queue's credit.
- ``tenants.dispatch_weight``: the tenant's share of a queue's credit against
  the other tenants with dispatches waiting there (1 to 1000, default 1;
  ``jobplane tenants set-weight``).
- ``outbox_dispatch_fair``: the waiting dispatches by (queue, tenant, due
  time). The relay walks it tenant by tenant (a loose index scan) and takes
  each tenant's share from its front: a claim reads a few rows per tenant
  however long the backlog is. Partial: published and failed rows, and rows
  of other kinds, never enter it. Built CONCURRENTLY (see 0004).
- ``jobplane.submit_job`` writes its dispatch's queue. Same signature: CREATE
  OR REPLACE keeps its grants.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql
from jobplane.migrations.indexes import build_index

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_ADD = """
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS queue text NOT NULL DEFAULT '';
ALTER TABLE tenants ADD COLUMN IF NOT EXISTS dispatch_weight integer NOT NULL DEFAULT 1
    CONSTRAINT tenants_dispatch_weight CHECK (dispatch_weight BETWEEN 1 AND 1000);
UPDATE outbox o SET queue = j.queue FROM jobs j
WHERE o.job_id = j.id AND o.kind = 'job.dispatch' AND o.queue = ''
  AND o.published_at IS NULL AND o.failed_at IS NULL
"""
_SUBMIT_JOB = "0020_submit_job.sql"
_SUBMIT_BEFORE = "0018_submit_job.sql"
_FAIR = (
    "outbox (queue, tenant_id, available_at) "
    "WHERE kind = 'job.dispatch' AND published_at IS NULL AND failed_at IS NULL"
)


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for statement in filter(str.strip, _ADD.split(";\n")):
        op.execute(statement)
    op.execute(frozen_sql(_SUBMIT_JOB, schema))
    with op.get_context().autocommit_block():
        build_index("outbox_dispatch_fair", _FAIR)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS outbox_dispatch_fair")
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql(_SUBMIT_BEFORE, schema))
    op.execute("ALTER TABLE tenants DROP COLUMN IF EXISTS dispatch_weight")
    op.execute("ALTER TABLE outbox DROP COLUMN IF EXISTS queue")
