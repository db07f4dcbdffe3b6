"""Dispatch repair: failed outbox rows, returns, re-publishes.

- ``outbox.failed_at``: the relay gave up on the row (the broker can never
  accept it, or it came back unroutable for too long); its job was failed in
  the same transaction. Such a row is no longer due.
- ``outbox.returns`` / ``first_returned_at``: the row's publishes that the
  broker returned as unroutable, and since when.
- ``outbox.republish_count``: how often the sweeper made a published row due
  again because its QUEUED job was never claimed; each re-publish doubles the
  wait before the next.
- ``jobs_queued_dispatch``: the sweeper's way to the QUEUED jobs and their
  current dispatch without reading finished jobs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_UP = """
ALTER TABLE outbox
    ADD COLUMN failed_at timestamptz,
    ADD COLUMN returns integer NOT NULL DEFAULT 0,
    ADD COLUMN first_returned_at timestamptz,
    ADD COLUMN republish_count integer NOT NULL DEFAULT 0;
DROP INDEX outbox_due;
CREATE INDEX outbox_due ON outbox (available_at) WHERE published_at IS NULL AND failed_at IS NULL;
CREATE INDEX jobs_queued_dispatch ON jobs (dispatch_id) WHERE state = 'queued'
"""

_DOWN = """
UPDATE outbox SET published_at = failed_at WHERE failed_at IS NOT NULL AND published_at IS NULL;
DROP INDEX jobs_queued_dispatch;
DROP INDEX outbox_due;
CREATE INDEX outbox_due ON outbox (available_at) WHERE published_at IS NULL;
ALTER TABLE outbox
    DROP COLUMN republish_count,
    DROP COLUMN first_returned_at,
    DROP COLUMN returns,
    DROP COLUMN failed_at
"""


def upgrade() -> None:
    for statement in filter(str.strip, _UP.split(";\n")):
        op.execute(statement)


def downgrade() -> None:
    for statement in filter(str.strip, _DOWN.split(";\n")):
        op.execute(statement)
