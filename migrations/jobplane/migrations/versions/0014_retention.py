"""Per-tenant retention horizon; an index for the outbox's event rows of a tenant.

- ``tenants.retention_days``: how long a tenant's finished jobs, their events
  and its published events are kept; NULL (every tenant so far) keeps them
  for ever. ``maintenance.retention`` deletes what is older (ADR-0022).
- ``outbox_tenant_events``: the outbox rows that belong to no job (kind
  ``event``: events parked by the feed, ADR-0016) by tenant and age, so that
  retention and erasure find them without reading the whole outbox. Partial:
  job dispatches, the outbox's hot path, never enter it.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# Nullable without a default: no table rewrite, and a short lock on tenants.
_COLUMN = """
ALTER TABLE tenants ADD COLUMN IF NOT EXISTS retention_days integer
    CONSTRAINT tenants_retention_days CHECK (retention_days BETWEEN 1 AND 36500)
"""
_EVENT_ROWS = "outbox (tenant_id, create_time) WHERE job_id IS NULL"


def upgrade() -> None:
    op.execute(_COLUMN)
    # The outbox holds a row per dispatch ever made: built CONCURRENTLY (see 0004).
    with op.get_context().autocommit_block():
        _build_index("outbox_tenant_events", _EVENT_ROWS)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS outbox_tenant_events")
    op.execute("ALTER TABLE tenants DROP COLUMN IF EXISTS retention_days")


def _build_index(name: str, definition: str) -> None:
    """CREATE INDEX CONCURRENTLY, dropping an invalid one an interrupted build left."""
    valid = op.get_bind().execute(
        text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
        {"name": name},
    )
    if valid.scalar_one_or_none() is False:
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {definition}")
