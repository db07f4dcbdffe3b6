"""Delayed jobs: a job may be submitted to start later (docs/scheduling.md, ADR-0039).

- ``jobs.schedule_time``: when the job may first start (NULL: submitted
  without one). The job's dispatch is written with it, due then
  (``outbox.available_at``); every later dispatch is due no earlier. Nothing
  is written when the time comes: a QUEUED job whose time is ahead reads as
  waiting, ``SCHEDULED``, at read time. A nullable column without a default:
  adding it rewrites nothing.
- ``submit_settings.max_schedule_seconds``: how far ahead a job may be
  scheduled, for ``jobplane.submit_job`` (the servers write theirs).
- ``jobplane.submit_job`` takes ``schedule_time`` and ``schedule_delay``,
  after its other arguments. A new argument is a new signature: the old
  function is dropped and the new one created, and the roles that could
  execute the old one are granted the new one.

No index: the relay's claim of due dispatches is a range scan of
``outbox_due_unfailed`` up to now(), which stops at the first row not due,
however many wait behind it (EXPLAIN in ADR-0039).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_UP = """
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS schedule_time timestamptz;
ALTER TABLE submit_settings ADD COLUMN IF NOT EXISTS max_schedule_seconds double precision
    NOT NULL DEFAULT 31622400 CHECK (max_schedule_seconds > 0)
"""
_DOWN = """
ALTER TABLE submit_settings DROP COLUMN IF EXISTS max_schedule_seconds;
ALTER TABLE jobs DROP COLUMN IF EXISTS schedule_time
"""

_OLD = "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision)"
_NEW = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval)"
)

# The roles that may execute the function now, kept across its new signature
# (DROP FUNCTION drops its grants; CREATE OR REPLACE would keep them, but
# makes an overload when the arguments change).
_KEEP_GRANTS = """
CREATE TEMP TABLE jobplane_submit_job_grants ON COMMIT DROP AS
SELECT a.grantee FROM pg_proc p, aclexplode(p.proacl) a
WHERE p.oid = to_regprocedure('{signature}') AND a.privilege_type = 'EXECUTE'
  AND a.grantee <> 0
"""
_GRANT_KEPT = """
DO $grants$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT grantee FROM jobplane_submit_job_grants LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION {signature} TO %s', r.grantee::regrole);
    END LOOP;
END
$grants$
"""


def _statements(sql: str) -> list[str]:
    return [s for s in sql.split(";\n") if s.strip()]


def _replace_function(old: str, new: str, frozen: str) -> None:
    """Drop ``old``, create ``new`` from the frozen copy, grant it to those who had ``old``."""
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(_KEEP_GRANTS.format(signature=old))
    op.execute(f"DROP FUNCTION IF EXISTS {old}")
    op.execute(frozen_sql(frozen, schema))
    # Functions are executable by PUBLIC by default; this one writes jobs
    # for any tenant, so only roles granted it may call it.
    op.execute(f"REVOKE ALL ON FUNCTION {new} FROM PUBLIC")
    op.execute(_GRANT_KEPT.format(signature=new))
    op.execute("DROP TABLE jobplane_submit_job_grants")


def upgrade() -> None:
    for statement in _statements(_UP):
        op.execute(statement)
    _replace_function(_OLD, _NEW, "0017_submit_job.sql")


def downgrade() -> None:
    _replace_function(_NEW, _OLD, "0011_submit_job.sql")
    for statement in _statements(_DOWN):
        op.execute(statement)
