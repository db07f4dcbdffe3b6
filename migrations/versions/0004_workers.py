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

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_UP = """
CREATE TABLE workers (
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
CREATE INDEX workers_live ON workers (expire_time) WHERE stop_time IS NULL;

ALTER TABLE jobs ADD COLUMN waiting_reason text;
ALTER TABLE jobs ADD COLUMN handbacks integer NOT NULL DEFAULT 0;
CREATE INDEX jobs_parked ON jobs (type, queue) WHERE state = 'queued' AND dispatch_id IS NULL
"""

_DOWN = """
DROP INDEX jobs_parked;
ALTER TABLE jobs DROP COLUMN handbacks;
ALTER TABLE jobs DROP COLUMN waiting_reason;
DROP TABLE workers
"""


def upgrade() -> None:
    for statement in filter(str.strip, _UP.split(";\n")):
        op.execute(statement)


def downgrade() -> None:
    for statement in filter(str.strip, _DOWN.split(";\n")):
        op.execute(statement)
