"""Publish a domain event inside the caller's own transaction: ``jobplane.publish_event``.

The sibling of ``jobplane.submit_job`` (0007), in the same schema and under
the same rules: ``SECURITY DEFINER`` with a fixed ``search_path``, EXECUTE
revoked from PUBLIC, the tenant by name, refusals as SQLSTATEs of class
``JP`` whose message starts with the reason PublishEvent gives.

It applies PublishEvent's checks in PublishEvent's order and writes what
PublishEvent writes, in the caller's transaction: the ``events`` row, its
outbox row (kind ``event``, the envelope of docs/events.md as its body, the
correlation, causation and trace context as its headers), and the two
NOTIFYs (the relays' wake-up, and the subscribers' with the tenant), which
Postgres sends at commit and drops on rollback. Idempotent per (tenant,
event_id): the same event returns the stored one and writes nothing; a
different one with that id raises ``EVENT_ID_REUSED`` (JP006).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_SIGNATURE = (
    "jobplane.publish_event(text, text, text, jsonb, timestamp with time zone, text, text, "
    "text, text, text)"
)

# A jsonb value as compact JSON: jsonb's text with the space it writes after
# every ',' and ':' between tokens taken out. Strings are matched whole first,
# so the spaces inside them stay.
_COMPACT_JSON = "0009_compact_json.sql"
_PUBLISH_EVENT = "0009_publish_event.sql"


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql(_COMPACT_JSON))
    op.execute(frozen_sql(_PUBLISH_EVENT, schema))
    # Executable by PUBLIC by default; this one writes events for any tenant.
    op.execute(f"REVOKE ALL ON FUNCTION {_SIGNATURE} FROM PUBLIC")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION IF EXISTS {_SIGNATURE}")
    op.execute("DROP FUNCTION IF EXISTS jobplane.compact_json(jsonb)")
