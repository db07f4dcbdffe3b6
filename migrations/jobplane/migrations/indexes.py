"""Indexes a migration builds on tables too large to lock while it reads them.

``jobs`` and ``outbox`` hold a row per job ever submitted: their indexes are
built CONCURRENTLY, outside the migration's
transaction, so submits and claims go on while Postgres reads the table.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text


def build_index(name: str, definition: str) -> None:
    """CREATE INDEX CONCURRENTLY ``name`` ON ``definition``, dropping an invalid one
    an interrupted build left (IF NOT EXISTS would keep it, unused, for good).

    Call it inside ``op.get_context().autocommit_block()``.
    """
    valid = op.get_bind().execute(
        text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
        {"name": name},
    )
    if valid.scalar_one_or_none() is False:
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {definition}")
