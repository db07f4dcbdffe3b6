"""Dependencies: a job that runs after other jobs of its tenant have ended (ADR-0045).

- ``job_dependencies``: one row per edge, the job (``job_id``), the job it
  waits for (``depends_on``), its tenant, and the outcome that job ended with
  once it did (NULL until then; each edge counts its dependency's first end).
  Keyed by (job_id, depends_on); indexed the other way round for the ends,
  which look up the jobs that wait for the job that ended, and partially on
  the open edges for the sweeper's repair.
- ``jobs.after_ids`` and ``jobs.after_failure``: the jobs a job runs after and
  its policy, as submitted (NULL for a job without); ``jobs.deps_waiting``
  (of those, the jobs not ended yet), ``jobs.deps_failed`` (those ended other
  than SUCCEEDED, the first named by ``jobs.deps_failed_on``): the counts the
  ends keep and the machine decides by; ``jobs.has_dependents``: a job some
  job runs after, whose end settles them in its transaction.
- ``jobs_waiting_dependencies``: QUEUED jobs waiting for dependencies, for
  the sweeper's repair (built CONCURRENTLY: jobs holds every job ever).
- ``jobplane.submit_job`` takes ``after`` and ``after_failure``: its signature
  grows (two parameters at the end, with defaults), so the old function is
  dropped first, its EXECUTE grants carried over.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql
from jobplane.migrations.indexes import build_index

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

_UP = """
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS after_ids uuid[],
                 ADD COLUMN IF NOT EXISTS after_failure text,
                 ADD COLUMN IF NOT EXISTS deps_waiting integer NOT NULL DEFAULT 0,
                 ADD COLUMN IF NOT EXISTS deps_failed integer NOT NULL DEFAULT 0,
                 ADD COLUMN IF NOT EXISTS deps_failed_on uuid,
                 ADD COLUMN IF NOT EXISTS has_dependents boolean NOT NULL DEFAULT false;
CREATE TABLE IF NOT EXISTS job_dependencies (
    job_id     uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    depends_on uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    tenant_id  uuid NOT NULL,
    outcome    text CHECK (outcome IN ('succeeded', 'failed', 'cancelled')),
    PRIMARY KEY (job_id, depends_on)
);
CREATE INDEX IF NOT EXISTS job_dependencies_depends_on ON job_dependencies (depends_on, job_id);
CREATE INDEX IF NOT EXISTS job_dependencies_open ON job_dependencies (depends_on)
    WHERE outcome IS NULL
"""
_SUBMIT_JOB = "0023_submit_job.sql"
_SUBMIT_BEFORE = "0022_submit_job.sql"
_SUBMIT_OLD = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text, timestamptz, interval)"
)
_SUBMIT_NEW = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text, timestamptz, interval, uuid[], text)"
)
# The roles granted EXECUTE on a function (its owner aside), as GRANT names them.
_GRANTEES = """
SELECT string_agg(DISTINCT quote_ident(r.rolname), ', ')
FROM pg_proc p, aclexplode(p.proacl) a JOIN pg_roles r ON r.oid = a.grantee
WHERE p.oid = to_regprocedure(:signature) AND a.privilege_type = 'EXECUTE'
  AND a.grantee <> p.proowner
"""
# The roles that may update jobs (the owner aside), as in 0018.
_RUNTIME_ROLES = """
SELECT string_agg(DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                ELSE quote_ident(r.rolname) END, ', ')
FROM pg_class c, aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
WHERE c.oid = to_regclass('jobs') AND a.privilege_type = 'UPDATE'
  AND a.grantee <> c.relowner
"""
_INDEXES = {
    "jobs_waiting_dependencies": (
        "jobs (id) WHERE state = 'queued' AND waiting_code = 'DEPENDENCIES'"
    ),
}
# Jobs waiting for dependencies have no dispatch, and nothing before 0023
# decides them: parked instead, a worker of their type dispatches them when
# it starts (UNPARK), as the workers before 0023 do.
_UNWAIT = """
UPDATE jobs SET waiting_code = 'NO_LIVE_WORKER',
       waiting_reason = 'dependencies removed: dispatched when a worker of its type starts'
WHERE state = 'queued' AND dispatch_id IS NULL AND waiting_code = 'DEPENDENCIES'
"""


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for statement in _UP.split(";\n"):
        if statement.strip():
            op.execute(statement)
    roles = op.get_bind().execute(text(_RUNTIME_ROLES)).scalar_one_or_none()
    if roles:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON job_dependencies TO {roles}")
    _replace_function(_SUBMIT_OLD, _SUBMIT_NEW, frozen_sql(_SUBMIT_JOB, schema))
    with op.get_context().autocommit_block():
        for name, definition in _INDEXES.items():
            build_index(name, definition)


def downgrade() -> None:
    op.execute(_UNWAIT)
    with op.get_context().autocommit_block():
        for name in _INDEXES:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    _replace_function(_SUBMIT_NEW, _SUBMIT_OLD, frozen_sql(_SUBMIT_BEFORE, schema))
    op.execute("DROP TABLE IF EXISTS job_dependencies")
    for column in (
        "has_dependents",
        "deps_failed_on",
        "deps_failed",
        "deps_waiting",
        "after_failure",
        "after_ids",
    ):
        op.execute(f"ALTER TABLE jobs DROP COLUMN IF EXISTS {column}")


def _replace_function(old: str, new: str, definition: str) -> None:
    """Drop ``old``, create ``new`` from ``definition``: EXECUTE revoked from
    PUBLIC, granted to the roles that had it on ``old``."""
    grantees = op.get_bind().execute(text(_GRANTEES), {"signature": old}).scalar_one_or_none()
    op.execute(f"DROP FUNCTION IF EXISTS {old}")
    op.execute(definition)
    op.execute(f"REVOKE ALL ON FUNCTION {new} FROM PUBLIC")
    if grantees:
        op.execute(f"GRANT EXECUTE ON FUNCTION {new} TO {grantees}")
