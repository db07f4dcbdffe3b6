"""Worker keys: API keys scoped to WorkerService, for the whole deployment.

- ``api_keys.scope``: ``tenant`` (every key so far: JobService and
  EventService for its tenant) or ``worker`` (WorkerService only, for the
  jobs of every tenant, as the Python worker's database role; ADR-0018).
- ``api_keys.tenant_id`` is NULL exactly for worker keys.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE api_keys ADD COLUMN scope text NOT NULL DEFAULT 'tenant'")
    op.execute(
        "ALTER TABLE api_keys ADD CONSTRAINT api_keys_scope CHECK (scope IN ('tenant', 'worker'))"
    )
    op.execute("ALTER TABLE api_keys ALTER COLUMN tenant_id DROP NOT NULL")
    op.execute(
        "ALTER TABLE api_keys ADD CONSTRAINT api_keys_scope_tenant "
        "CHECK ((scope = 'tenant') = (tenant_id IS NOT NULL))"
    )


def downgrade() -> None:
    # Worker keys have no tenant to keep them under: they go.
    op.execute("DELETE FROM api_keys WHERE scope = 'worker'")
    op.execute("ALTER TABLE api_keys DROP CONSTRAINT api_keys_scope_tenant")
    op.execute("ALTER TABLE api_keys ALTER COLUMN tenant_id SET NOT NULL")
    op.execute("ALTER TABLE api_keys DROP CONSTRAINT api_keys_scope")
    op.execute("ALTER TABLE api_keys DROP COLUMN scope")
