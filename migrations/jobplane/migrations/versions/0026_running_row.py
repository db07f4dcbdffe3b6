"""The running row: a RUNNING job's heartbeats and progress are HOT updates (ADR-0051).

A heap-only tuple (HOT) update writes the new row version on the same page
and no index entry at all; Postgres takes it only when no column an index
names (in its key or its predicate) changes and the page has room. The
updates of a RUNNING job that repeat for as long as it runs are its
heartbeats (``lease_expires_at``) and its progress (``progress``,
``progress_message``, ``last_seq``, ``update_time``).

- ``jobs_running``: RUNNING jobs by id, in place of ``jobs_running_lease``
  (by ``lease_expires_at``): no index names the lease any more, so a
  heartbeat changes no indexed column. The sweeper's expired leases and the
  workers' running counts read the RUNNING jobs through it and check their
  leases on the rows: as many rows as attempts run at once, which the
  workers' slots bound, whatever the table holds. Built CONCURRENTLY before
  the old one is dropped, so the sweeper always has an index (see 0004).
- ``fillfactor = 80`` on ``jobs``: inserts leave a fifth of each page free,
  for the row versions its jobs' updates write there. The setting applies
  to pages written from now on; the pages already full keep their rows
  (old jobs, mostly ended, that are no longer updated). Setting it rewrites
  nothing and takes a lock that submits and updates go on under (SHARE
  UPDATE EXCLUSIVE).

Revision ID: 0026
Revises: 0024
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

from jobplane.migrations.indexes import build_index

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

_RUNNING = "jobs_running"
_RUNNING_DEFINITION = "jobs (id) WHERE state = 'running'"
_LEASE = "jobs_running_lease"
_LEASE_DEFINITION = "jobs (lease_expires_at) WHERE state = 'running'"
FILLFACTOR = 80


def upgrade() -> None:
    op.execute(f"ALTER TABLE jobs SET (fillfactor = {FILLFACTOR})")
    with op.get_context().autocommit_block():
        build_index(_RUNNING, _RUNNING_DEFINITION)
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {_LEASE}")


def downgrade() -> None:
    with op.get_context().autocommit_block():
        build_index(_LEASE, _LEASE_DEFINITION)
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {_RUNNING}")
    op.execute("ALTER TABLE jobs RESET (fillfactor)")
