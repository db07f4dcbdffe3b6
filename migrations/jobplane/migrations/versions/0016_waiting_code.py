"""Why a QUEUED job waits, as a stable code beside the message.

- ``jobs.waiting_code``: the UPPER_SNAKE code of ``waiting_reason`` (the
  message a person reads): ``NO_LIVE_WORKER`` (parked), ``HANDED_BACK``,
  ``UNROUTABLE`` (the broker returned the job's dispatch: no queue is bound
  for its type). Set and cleared only by the state machine's transitions,
  always together with the message.
- Reasons written before this revision get the code their transition gives now,
  after the column is committed: ADD COLUMN takes ``jobs``' exclusive lock for
  an instant only if nothing else runs in its transaction. The backfill reads
  the QUEUED jobs only (only they have a reason, and ``jobs_queued_dispatch``
  finds them), a batch a transaction, so no lock is held for long.
- ``jobs_waiting``: the few jobs with a reason, for the scrape that counts
  them by code (a claim clears the reason, so the index stays small).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.indexes import build_index

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_ADD = "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS waiting_code text"

# One batch of the backfill: state = 'queued' lets jobs_queued_dispatch (a
# partial index on it) find the rows instead of a scan of every job ever run.
BACKFILL = """
UPDATE jobs SET waiting_code = CASE WHEN dispatch_id IS NULL THEN 'NO_LIVE_WORKER'
                                    ELSE 'HANDED_BACK' END
WHERE id IN (SELECT id FROM jobs
             WHERE state = 'queued' AND waiting_reason IS NOT NULL AND waiting_code IS NULL
             LIMIT :batch)
"""
_BATCH = 1000

_DOWN = """
ALTER TABLE jobs DROP COLUMN IF EXISTS waiting_code
"""

# jobs holds a row per job ever submitted: built CONCURRENTLY (see 0004).
_WAITING = "jobs (waiting_code) WHERE waiting_code IS NOT NULL"


def upgrade() -> None:
    op.execute(_ADD)
    # The block commits the ALTER (and its lock) first; each batch after it
    # is a transaction of its own.
    with op.get_context().autocommit_block():
        bind = op.get_bind()
        while bind.execute(text(BACKFILL), {"batch": _BATCH}).rowcount:
            pass
        build_index("jobs_waiting", _WAITING)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_waiting")
    for statement in filter(str.strip, _DOWN.split(";\n")):
        op.execute(statement)
