"""Flow limits: the topology's ``[[rate_limits]]`` and a queue's ``max_running_per_tenant``,
decided at the claim (ADR-0043).

- ``flow_limits``: the topology's ``[[rate_limits]]``, in the file's order
  (``rank``), each with its patterns as POSIX regexes over ``'.' || type``;
  ``queue_limits``: each queue's ``max_running_per_tenant``. Written by the
  same sync as ``job_routes`` (``jobplane migrate``, ``jobplane topology
  apply``, every server start); read by every claim of a limited job.
- ``flow_buckets``: one row per rate budget (a limit, or a limit and a
  tenant): the GCRA's theoretical arrival time of the next start (``tat``)
  and the end of the starts reserved by held jobs (``booked``).
- ``jobs.flow_key``: the budget a QUEUED job waits for (NULL: none);
  ``jobs.flow_slots``: the keys of the RUNNING limits its claim counted it
  against, so it holds a slot of each while RUNNING and its end frees them.
- ``jobplane.flow_check``, ``flow_taken``, ``flow_free``, ``flow_keys``:
  the decisions, under each budget's advisory lock. As for
  ``concurrency_blocker`` (0018), every claim names ``flow_check``:
  EXECUTE is revoked from PUBLIC and granted, with the tables, to the roles
  that may update ``jobs``.
- ``jobs_flow_running``: RUNNING jobs by the slots they hold (GIN);
  ``jobs_flow_waiting``: QUEUED jobs waiting for a budget, in line order.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-08
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql
from jobplane.migrations.indexes import build_index

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

_UP = """
CREATE TABLE IF NOT EXISTS flow_limits (
    name        text PRIMARY KEY,
    rank        integer NOT NULL UNIQUE,
    patterns    text[] NOT NULL,
    regexes     text[] NOT NULL,
    per_second  double precision CHECK (per_second > 0),
    burst       double precision NOT NULL DEFAULT 1 CHECK (burst >= 1),
    max_running integer CHECK (max_running > 0),
    per_tenant  boolean NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS queue_limits (
    queue                  text PRIMARY KEY,
    max_running_per_tenant integer NOT NULL CHECK (max_running_per_tenant > 0)
);
CREATE TABLE IF NOT EXISTS flow_buckets (
    key    text PRIMARY KEY,
    tat    timestamptz NOT NULL,
    booked timestamptz NOT NULL
);
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS flow_key text,
                 ADD COLUMN IF NOT EXISTS flow_slots text[];
"""
# flow_taken first: the others call it.
_FILES = ("flow_taken", "flow_check", "flow_free", "flow_keys")
_TABLES = ("flow_limits", "queue_limits", "flow_buckets")
_FUNCTIONS = (
    "jobplane.flow_taken(text, integer, uuid, timestamp with time zone)",
    "jobplane.flow_check(uuid, text, text, uuid, timestamp with time zone, text, boolean)",
    "jobplane.flow_free(text)",
    "jobplane.flow_keys(uuid, text, text)",
)
# The roles that may update jobs (the owner aside), as in 0018.
_RUNTIME_ROLES = """
SELECT string_agg(DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                ELSE quote_ident(r.rolname) END, ', ')
FROM pg_class c, aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
WHERE c.oid = to_regclass('jobs') AND a.privilege_type = 'UPDATE'
  AND a.grantee <> c.relowner
"""
_INDEXES = {
    "jobs_flow_running": (
        "jobs USING gin (flow_slots) WHERE state = 'running' AND flow_slots IS NOT NULL"
    ),
    "jobs_flow_waiting": (
        "jobs (flow_key, create_time, id) WHERE state = 'queued' AND flow_key IS NOT NULL"
    ),
}


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for statement in _UP.split(";\n"):
        if statement.strip():
            op.execute(statement)
    for name in _FILES:
        op.execute(frozen_sql(f"0021_{name}.sql", schema))
    roles = op.get_bind().execute(text(_RUNTIME_ROLES)).scalar_one_or_none()
    for signature in _FUNCTIONS:
        op.execute(f"REVOKE ALL ON FUNCTION {signature} FROM PUBLIC")
        if roles:
            op.execute(f"GRANT EXECUTE ON FUNCTION {signature} TO {roles}")
    if roles:
        op.execute(f"GRANT USAGE ON SCHEMA jobplane TO {roles}")
        for table in _TABLES:
            op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {roles}")
    with op.get_context().autocommit_block():
        for name, definition in _INDEXES.items():
            build_index(name, definition)


# Jobs held for a RUNNING slot have no dispatch, and nothing before 0021
# releases them: parked instead, a worker of their type dispatches them when it
# starts (UNPARK), as the workers of the code before 0021 do.
_UNHOLD = """
UPDATE jobs SET waiting_code = 'NO_LIVE_WORKER',
       waiting_reason = 'flow limits removed: dispatched when a worker of its type starts'
WHERE state = 'queued' AND dispatch_id IS NULL
  AND waiting_code IN ('RATE_LIMITED', 'TENANT_LIMIT')
"""


def downgrade() -> None:
    op.execute(_UNHOLD)
    with op.get_context().autocommit_block():
        for name in _INDEXES:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    for signature in _FUNCTIONS:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS flow_slots")
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS flow_key")
    for table in reversed(_TABLES):
        op.execute(f"DROP TABLE IF EXISTS {table}")
