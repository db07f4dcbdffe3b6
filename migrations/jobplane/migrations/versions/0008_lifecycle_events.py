"""Lifecycle events: job transitions publish domain events (``job.queued``, …).

- ``jobs.lifecycle_seq``: the job-event seq of the job's latest lifecycle
  event (its id is the version-3 UUID of the job id and that seq);
  ``jobs.lifecycle_cause``: the one before it, the cause of the latest.
  NULL for jobs from before this revision (their next event has no cause).
- ``outbox.order_key`` / ``outbox.order_seq``: an event row of a job carries
  the job and its place among the job's events; the relay publishes no such
  row while one in front of it, of the same key, is unpublished and not
  failed (per-job order on the exchange). Indexed where it is read: the
  unpublished rows that have a key.
- ``submit_settings.lifecycle_events``: whether ``jobplane.submit_job``
  writes ``job.queued``; the servers keep it as ``JOBPLANE_LIFECYCLE_EVENTS``
  says, so both ways of submitting write the same rows.
- ``jobplane.submit_job`` replaced: the same checks and rows as before, plus
  the ``job.queued`` event and its outbox row when lifecycle events are on.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# Constant (NULL) defaults: no table rewrite.
_COLUMNS = """
ALTER TABLE jobs
    ADD COLUMN IF NOT EXISTS lifecycle_seq integer,
    ADD COLUMN IF NOT EXISTS lifecycle_cause integer;
ALTER TABLE outbox
    ADD COLUMN IF NOT EXISTS order_key uuid,
    ADD COLUMN IF NOT EXISTS order_seq bigint;
ALTER TABLE submit_settings
    ADD COLUMN IF NOT EXISTS lifecycle_events boolean NOT NULL DEFAULT true
"""
# Outside the migration's transaction: the outbox takes writes meanwhile.
_ORDER_INDEX = """
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_order_pending ON outbox (order_key, order_seq)
WHERE order_key IS NOT NULL AND published_at IS NULL AND failed_at IS NULL
"""

_SIGNATURE = "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision)"

# 0007's function with job.queued written beside the job.
_SUBMIT_JOB = "0008_submit_job.sql"


def upgrade() -> None:
    for statement in filter(str.strip, _COLUMNS.split(";\n")):
        op.execute(statement)
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    # CREATE OR REPLACE keeps the function's grants.
    op.execute(frozen_sql(_SUBMIT_JOB, schema))
    with op.get_context().autocommit_block():
        op.execute(_ORDER_INDEX)


def downgrade() -> None:
    # The function of revision 0007, which writes no lifecycle event.
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql("0007_submit_job.sql", schema))
    op.execute("DROP INDEX IF EXISTS outbox_order_pending")
    op.execute("ALTER TABLE submit_settings DROP COLUMN IF EXISTS lifecycle_events")
    op.execute(
        "ALTER TABLE outbox DROP COLUMN IF EXISTS order_seq, DROP COLUMN IF EXISTS order_key"
    )
    op.execute(
        "ALTER TABLE jobs DROP COLUMN IF EXISTS lifecycle_cause, "
        "DROP COLUMN IF EXISTS lifecycle_seq"
    )
