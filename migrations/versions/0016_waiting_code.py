"""Why a QUEUED job waits, as a stable code beside the message.

- ``jobs.waiting_code``: the UPPER_SNAKE code of ``waiting_reason`` (the
  message a person reads): ``NO_LIVE_WORKER`` (parked), ``HANDED_BACK``,
  ``UNROUTABLE`` (the broker returned the job's dispatch: no queue is bound
  for its type). Set and cleared only by the state machine's transitions,
  always together with the message.
- Reasons written before this revision get the code their transition gives now.
- ``jobs_waiting``: the few jobs with a reason, for the scrape that counts
  them by code (a claim clears the reason, so the index stays small).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_UP = """
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS waiting_code text;
UPDATE jobs SET waiting_code = CASE WHEN dispatch_id IS NULL THEN 'NO_LIVE_WORKER'
                                    ELSE 'HANDED_BACK' END
WHERE waiting_reason IS NOT NULL AND waiting_code IS NULL
"""

_DOWN = """
ALTER TABLE jobs DROP COLUMN IF EXISTS waiting_code
"""

# jobs holds a row per job ever submitted: built CONCURRENTLY (see 0004).
_WAITING = "jobs (waiting_code) WHERE waiting_code IS NOT NULL"


def upgrade() -> None:
    for statement in filter(str.strip, _UP.split(";\n")):
        op.execute(statement)
    with op.get_context().autocommit_block():
        _build_index("jobs_waiting", _WAITING)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_waiting")
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
