"""Deadlines: the time by which a job must have ended (docs/scheduling.md#deadlines, ADR-0044).

- ``jobs.deadline``: NULL for a job without one (every job before this
  revision). A nullable column without a default: adding it rewrites nothing.
- ``jobs_deadline_due``: the jobs not ended that have a deadline, by
  deadline. The sweeper's deadline pass reads the due ones a page at a time
  (an index range scan up to now(), stopping at the first not due) and the
  earliest one ahead (one index probe), however many jobs have ended or
  have none. Partial: finished jobs and jobs without a deadline are not in it.
- ``jobplane.submit_job`` takes ``deadline`` and ``deadline_after`` after its
  other arguments, with SubmitJob's checks. Its signature grows, so the old
  function is dropped first (two overloads would make a call with the old
  arguments ambiguous); a call with the old arguments works as before.
  EXECUTE stays revoked from PUBLIC, and the roles granted EXECUTE on the
  old one get it on the new one.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql
from jobplane.migrations.indexes import build_index

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

_SUBMIT_JOB = "0022_submit_job.sql"
_SUBMIT_BEFORE = "0020_submit_job.sql"
# The signature 0018 (concurrency keys) created, and this one's: two more at the end.
_SUBMIT_OLD = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text)"
)
_SUBMIT_NEW = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text, timestamptz, interval)"
)
# The roles granted EXECUTE on a function (its owner aside), as GRANT names them.
_GRANTEES = """
SELECT string_agg(DISTINCT quote_ident(r.rolname), ', ')
FROM pg_proc p, aclexplode(p.proacl) a JOIN pg_roles r ON r.oid = a.grantee
WHERE p.oid = to_regprocedure(:signature) AND a.privilege_type = 'EXECUTE'
  AND a.grantee <> p.proowner
"""
# jobs holds a row per job ever submitted: built CONCURRENTLY (see 0004).
_INDEX = "jobs_deadline_due"
_DUE = "jobs (deadline) WHERE deadline IS NOT NULL AND state IN ('queued', 'running')"


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute("ALTER TABLE jobs ADD COLUMN IF NOT EXISTS deadline timestamptz")
    _replace_function(_SUBMIT_OLD, _SUBMIT_NEW, frozen_sql(_SUBMIT_JOB, schema))
    with op.get_context().autocommit_block():
        build_index(_INDEX, _DUE)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {_INDEX}")
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    _replace_function(_SUBMIT_NEW, _SUBMIT_OLD, frozen_sql(_SUBMIT_BEFORE, schema))
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS deadline")


def _replace_function(old: str, new: str, definition: str) -> None:
    """Drop ``old``, create ``new`` from ``definition``: EXECUTE revoked from
    PUBLIC, granted to the roles that had it on ``old``."""
    grantees = op.get_bind().execute(text(_GRANTEES), {"signature": old}).scalar_one_or_none()
    op.execute(f"DROP FUNCTION IF EXISTS {old}")
    op.execute(definition)
    op.execute(f"REVOKE ALL ON FUNCTION {new} FROM PUBLIC")
    if grantees:
        op.execute(f"GRANT EXECUTE ON FUNCTION {new} TO {grantees}")
