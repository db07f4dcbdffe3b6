"""Worker registrations; jobs waiting for a worker that can run them.

- ``workers``: one row per worker process (what it runs, where, until when it
  is live). Not tenant data: workers serve every tenant.
- ``jobs.waiting_reason``: why a QUEUED job has not started (handed back by
  workers without its handler, or parked because no live worker handles it).
- ``jobs.handbacks``: hand-backs since the last claim; spaces them out.
- A QUEUED job with no ``dispatch_id`` is parked: no message or outbox row
  stands for it until a worker that handles its type and queue is live.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_UP = """
CREATE TABLE IF NOT EXISTS workers (
    id             uuid PRIMARY KEY,
    host           text NOT NULL,
    pid            integer NOT NULL,
    types          text[] NOT NULL,
    queues         text[] NOT NULL,
    concurrency    integer NOT NULL,
    version        text NOT NULL DEFAULT '',
    start_time     timestamptz NOT NULL DEFAULT now(),
    heartbeat_time timestamptz NOT NULL DEFAULT now(),
    -- live while stop_time IS NULL AND expire_time > now()
    expire_time    timestamptz NOT NULL,
    stop_time      timestamptz
);
CREATE INDEX IF NOT EXISTS workers_live ON workers (expire_time) WHERE stop_time IS NULL;

ALTER TABLE jobs ADD COLUMN IF NOT EXISTS waiting_reason text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS handbacks integer NOT NULL DEFAULT 0
"""

_DOWN = """
ALTER TABLE jobs DROP COLUMN IF EXISTS handbacks;
ALTER TABLE jobs DROP COLUMN IF EXISTS waiting_reason;
DROP TABLE IF EXISTS workers
"""

# jobs holds a row per job ever submitted: a plain CREATE INDEX would block
# every submit and claim for the whole build. Built CONCURRENTLY, outside the
# migration's transaction; every step can be run again after an interruption.
_PARKED = "jobs (type, queue) WHERE state = 'queued' AND dispatch_id IS NULL"


def upgrade() -> None:
    for statement in filter(str.strip, _UP.split(";\n")):
        op.execute(statement)
    with op.get_context().autocommit_block():
        _build_index("jobs_parked", _PARKED)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_parked")
    for statement in filter(str.strip, _DOWN.split(";\n")):
        op.execute(statement)


def _build_index(name: str, definition: str) -> None:
    """CREATE INDEX CONCURRENTLY, inside an autocommit block.

    A concurrent build that was interrupted leaves an invalid index of that
    name, which IF NOT EXISTS would keep for ever: it is dropped first.
    """
    valid = op.get_bind().execute(
        text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
        {"name": name},
    )
    if valid.scalar_one_or_none() is False:
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {definition}")
