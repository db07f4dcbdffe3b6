"""Lifecycle events reach the broker only where the topology says (ADR-0052).

- ``events.lifecycle``: true on a lifecycle event's row (``job.queued``,
  ``job.started``, ...), written by the transitions' statements and
  ``jobplane.submit_job``; false on every other (PublishEvent,
  ``jobplane.publish_event``, a handler's ``ctx.emit``), including a
  tenant's own ``job.*`` events. A constant default: adding the column
  rewrites nothing. Rows written before keep false, so the feed publishes
  the ones it has not passed yet as it always did.
- ``lifecycle_publish``: one row, the topology's ``[events]
  publish_lifecycle`` patterns and the lifecycle types they match. Written
  by the same sync as ``job_routes`` (``jobplane migrate``, ``jobplane
  topology apply``, every server start); read by every pass of the relays'
  event feed, which publishes a lifecycle event only when its type is there
  and moves past the others. Empty: none is published.
- ``jobplane.submit_job`` marks its ``job.queued`` as a lifecycle event.
  Its signature does not change: replaced in place, its grants kept.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-09
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

_UP = """
ALTER TABLE events ADD COLUMN IF NOT EXISTS lifecycle boolean NOT NULL DEFAULT false;
CREATE TABLE IF NOT EXISTS lifecycle_publish (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    patterns    text[] NOT NULL DEFAULT '{}',
    event_types text[] NOT NULL DEFAULT '{}',
    update_time timestamptz NOT NULL DEFAULT now()
);
INSERT INTO lifecycle_publish (singleton) VALUES (true) ON CONFLICT DO NOTHING
"""
_SUBMIT_JOB = "0027_submit_job.sql"
_SUBMIT_BEFORE = "0023_submit_job.sql"
# The roles that may update jobs (the owner aside), as in 0018: the servers
# write the row, the relays read it.
_RUNTIME_ROLES = """
SELECT string_agg(DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                ELSE quote_ident(r.rolname) END, ', ')
FROM pg_class c, aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
WHERE c.oid = to_regclass('jobs') AND a.privilege_type = 'UPDATE'
  AND a.grantee <> c.relowner
"""


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for statement in _UP.split(";\n"):
        if statement.strip():
            op.execute(statement)
    roles = op.get_bind().execute(text(_RUNTIME_ROLES)).scalar_one_or_none()
    if roles:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON lifecycle_publish TO {roles}")
    op.execute(frozen_sql(_SUBMIT_JOB, schema))


def downgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql(_SUBMIT_BEFORE, schema))
    op.execute("DROP TABLE IF EXISTS lifecycle_publish")
    op.execute("ALTER TABLE events DROP COLUMN IF EXISTS lifecycle")
