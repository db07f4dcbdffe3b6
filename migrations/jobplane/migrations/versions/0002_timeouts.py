"""Per-job attempt timeout.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE jobs ADD COLUMN timeout_seconds double precision NOT NULL DEFAULT 3600 "
        "CHECK (timeout_seconds > 0)"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE jobs DROP COLUMN timeout_seconds")
