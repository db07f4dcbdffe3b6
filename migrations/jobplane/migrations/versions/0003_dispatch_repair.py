"""Dispatch repair: failed outbox rows, returns, re-publishes.

- ``outbox.failed_at``: the relay gave up on the row (the broker can never
  accept it, or it came back unroutable for too long); its job was failed in
  the same transaction. Such a row is no longer due.
- ``outbox.returns`` / ``first_returned_at``: the row's publishes that the
  broker returned as unroutable in a row, and since when (any other outcome
  starts the count again).
- ``outbox.republish_count``: how often the sweeper made a published row due
  again because its QUEUED job was never claimed; each re-publish doubles the
  wait before the next.
- ``jobs_queued_dispatch``: the sweeper's way to the QUEUED jobs and their
  current dispatch without reading finished jobs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_COLUMNS = """
ALTER TABLE outbox
    ADD COLUMN IF NOT EXISTS failed_at timestamptz,
    ADD COLUMN IF NOT EXISTS returns integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS first_returned_at timestamptz,
    ADD COLUMN IF NOT EXISTS republish_count integer NOT NULL DEFAULT 0
"""

_DROP_COLUMNS = """
ALTER TABLE outbox
    DROP COLUMN IF EXISTS republish_count,
    DROP COLUMN IF EXISTS first_returned_at,
    DROP COLUMN IF EXISTS returns,
    DROP COLUMN IF EXISTS failed_at
"""

# outbox and jobs hold a row per job ever submitted. A plain CREATE INDEX
# blocks every write to its table (every submit, every claim) for the whole
# build, so the indexes are built CONCURRENTLY, outside the migration's
# transaction; each step can be run again after an interruption.
_UNFAILED_DUE = "outbox (available_at) WHERE published_at IS NULL AND failed_at IS NULL"
_ALL_DUE = "outbox (available_at) WHERE published_at IS NULL"


def upgrade() -> None:
    op.execute(_COLUMNS)
    with op.get_context().autocommit_block():
        _replace_index("outbox_due", _UNFAILED_DUE)
        _build_index("jobs_queued_dispatch", "jobs (dispatch_id) WHERE state = 'queued'")


def downgrade() -> None:
    op.execute(
        "UPDATE outbox SET published_at = failed_at "
        "WHERE failed_at IS NOT NULL AND published_at IS NULL"
    )
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_queued_dispatch")
        _replace_index("outbox_due", _ALL_DUE)
    op.execute(_DROP_COLUMNS)


def _replace_index(name: str, definition: str) -> None:
    """``name`` rebuilt as ``definition`` without blocking writes: build, drop, rename."""
    _build_index(f"{name}_next", definition)
    op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"ALTER INDEX {name}_next RENAME TO {name}")


def _build_index(name: str, definition: str) -> None:
    """CREATE INDEX CONCURRENTLY, inside an autocommit block.

    A concurrent build that was interrupted leaves an invalid index of that
    name, which IF NOT EXISTS would keep for ever: it is dropped first.
    """
    valid = op.get_bind().execute(
        text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
        {"name": name},
    )
    if valid.scalar_one_or_none() is False:
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {definition}")
