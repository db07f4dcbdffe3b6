"""An index of the outbox's due rows that are not job dispatches.

The relay claims job dispatches and the other rows (events parked by the
feed, ADR-0016) apart, each in available_at order. Through ``outbox_due``,
which holds every due row, the claim of the others walked past every due
dispatch to find none: with a backlog of 20,000 dispatches, 20,000 rows
fetched and filtered a claim, and a plan costly enough for Postgres to
compile it (JIT) each time. ``outbox_events_due`` holds only those rows,
almost always none. Partial: dispatches, the outbox's hot path, never enter it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_OTHER_DUE = (
    "outbox (available_at) "
    "WHERE published_at IS NULL AND failed_at IS NULL AND kind <> 'job.dispatch'"
)


def upgrade() -> None:
    # The outbox holds a row per dispatch ever made: built CONCURRENTLY (see 0004).
    with op.get_context().autocommit_block():
        _build_index("outbox_events_due", _OTHER_DUE)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS outbox_events_due")


def _build_index(name: str, definition: str) -> None:
    """CREATE INDEX CONCURRENTLY, dropping an invalid one an interrupted build left."""
    valid = op.get_bind().execute(
        text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
        {"name": name},
    )
    if valid.scalar_one_or_none() is False:
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {definition}")
