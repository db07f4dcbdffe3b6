"""Concurrency keys: at most a key's limit of its jobs RUNNING at once (ADR-0040).

- ``jobs.concurrency_key`` and ``jobs.concurrency_limit``: NULL for a job
  without a key (every job before this revision). Keys are per tenant.
- ``jobplane.concurrency_blocker(tenant, key, limit, job, created)``: takes
  the key's advisory lock and says which job a job waits for (NULL: it may
  start). The machine's CLAIM and HOLD transitions call it; only the state
  machine writes the columns it reads. The runtime role names it in every
  claim, keyed or not (Postgres checks a function's privileges when the
  statement starts, whatever a CASE then skips): EXECUTE is revoked from
  PUBLIC and granted, with USAGE on schema ``jobplane``, to the roles that
  may already update ``jobs`` (docs/security.md's runtime role). It runs
  as its caller (SECURITY INVOKER): it reads no more than the caller may.
- ``jobplane.submit_job`` takes a key, its limit and its mode, with
  SubmitJob's checks, and refuses a full key in reject mode (SQLSTATE JP007,
  ``CONCURRENCY_LIMIT_REACHED``) under the key's lock. Its signature grows,
  so the old function is dropped first (two overloads would make a call with
  the old arguments ambiguous); EXECUTE stays revoked from PUBLIC, and the
  roles an operator granted EXECUTE on the old one get it on the new one.
- ``jobs_concurrency``: the jobs of a key that hold or wait for a slot
  (RUNNING, or QUEUED), for the count under the lock and the release's
  oldest held jobs. Partial: finished jobs and jobs without a key are not in it.
- ``jobs_concurrency_running``: a key's RUNNING jobs, and
  ``jobs_concurrency_waiting``: its jobs waiting for a slot (held, or made
  due and not claimed yet), in line order. The blocker's bounded counts and
  the sweeper's walk over the keys with held jobs read one each, whatever
  else the key has queued.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql
from jobplane.migrations.indexes import build_index

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_ADD = """
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS concurrency_key text,
                 ADD COLUMN IF NOT EXISTS concurrency_limit integer
"""
_BLOCKER = "0018_concurrency_blocker.sql"
_SUBMIT_JOB = "0018_submit_job.sql"
_SUBMIT_BEFORE = "0017_submit_job.sql"
# The signature 0017 (delayed jobs) created, and this one's: three more at the end.
_SUBMIT_OLD = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval)"
)
_SUBMIT_NEW = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text)"
)
_SIGNATURE = "jobplane.concurrency_blocker(uuid, text, integer, uuid, timestamp with time zone)"
# The roles granted EXECUTE on a function (its owner aside), as GRANT names them.
_GRANTEES = """
SELECT string_agg(DISTINCT quote_ident(r.rolname), ', ')
FROM pg_proc p, aclexplode(p.proacl) a JOIN pg_roles r ON r.oid = a.grantee
WHERE p.oid = to_regprocedure(:signature) AND a.privilege_type = 'EXECUTE'
  AND a.grantee <> p.proowner
"""
# The roles that may update jobs (the owner aside): the runtime role of
# docs/security.md, which claims, so must call concurrency_blocker. PUBLIC
# (grantee 0), if an operator granted it that, is named as GRANT names it.
_RUNTIME_ROLES = """
SELECT string_agg(DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                ELSE quote_ident(r.rolname) END, ', ')
FROM pg_class c, aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
WHERE c.oid = to_regclass('jobs') AND a.privilege_type = 'UPDATE'
  AND a.grantee <> c.relowner
"""
# jobs holds a row per job ever submitted: built CONCURRENTLY (see 0004).
_CONCURRENCY = (
    "jobs (tenant_id, concurrency_key, create_time, id) "
    "WHERE concurrency_key IS NOT NULL AND state IN ('queued', 'running')"
)

_RUNNING = (
    "jobs (tenant_id, concurrency_key, create_time, id) "
    "WHERE concurrency_key IS NOT NULL AND state = 'running'"
)
_WAITING = (
    "jobs (tenant_id, concurrency_key, create_time, id) "
    "WHERE concurrency_key IS NOT NULL AND state = 'queued' "
    "AND waiting_code = 'CONCURRENCY_LIMIT'"
)
_INDEXES = {
    "jobs_concurrency": _CONCURRENCY,
    "jobs_concurrency_running": _RUNNING,
    "jobs_concurrency_waiting": _WAITING,
}


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(_ADD)
    op.execute(frozen_sql(_BLOCKER, schema))
    op.execute(f"REVOKE ALL ON FUNCTION {_SIGNATURE} FROM PUBLIC")
    _grant_runtime_roles()
    _replace_function(_SUBMIT_OLD, _SUBMIT_NEW, frozen_sql(_SUBMIT_JOB, schema))
    with op.get_context().autocommit_block():
        for name, definition in _INDEXES.items():
            build_index(name, definition)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name in _INDEXES:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    _replace_function(_SUBMIT_NEW, _SUBMIT_OLD, frozen_sql(_SUBMIT_BEFORE, schema))
    op.execute(f"DROP FUNCTION IF EXISTS {_SIGNATURE}")
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS concurrency_limit")
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS concurrency_key")


def _grant_runtime_roles() -> None:
    """EXECUTE on the blocker (and USAGE on its schema) for the roles that
    claim: every claim names it, so without it no job could start."""
    roles = op.get_bind().execute(text(_RUNTIME_ROLES)).scalar_one_or_none()
    if roles:
        op.execute(f"GRANT USAGE ON SCHEMA jobplane TO {roles}")
        op.execute(f"GRANT EXECUTE ON FUNCTION {_SIGNATURE} TO {roles}")


def _replace_function(old: str, new: str, definition: str) -> None:
    """Drop ``old``, create ``new`` from ``definition``: EXECUTE revoked from
    PUBLIC, granted to the roles that had it on ``old``."""
    grantees = op.get_bind().execute(text(_GRANTEES), {"signature": old}).scalar_one_or_none()
    op.execute(f"DROP FUNCTION IF EXISTS {old}")
    op.execute(definition)
    op.execute(f"REVOKE ALL ON FUNCTION {new} FROM PUBLIC")
    if grantees:
        op.execute(f"GRANT EXECUTE ON FUNCTION {new} TO {grantees}")
