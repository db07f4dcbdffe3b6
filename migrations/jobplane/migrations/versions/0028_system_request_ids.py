"""``jobplane.submit_job`` refuses the system's request_ids, as SubmitJob does.

A request_id that starts with ``fan:`` (a fan-out's children,
``fan:{job}:{stage}:{attempt}:{item}``, ADR-0047) or ``child:`` (child jobs,
``child:{job}:{key}``, ADR-0046) is refused in SubmitJob's words:
SQLSTATE ``JP001``, column ``request_id``. A caller's job with one would be
taken for that child, or make its submit fail. Jobs written before keep
their request_ids. Its signature does not change: replaced in place, its
grants kept.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-09
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

_SUBMIT_JOB = "0028_submit_job.sql"
_SUBMIT_BEFORE = "0027_submit_job.sql"


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql(_SUBMIT_JOB, schema))


def downgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql(_SUBMIT_BEFORE, schema))
