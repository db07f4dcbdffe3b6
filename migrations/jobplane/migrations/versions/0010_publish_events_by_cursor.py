"""Events reach the broker through a cursor over ``events``, not one outbox row each.

- ``event_relay``: one row, the position (``txid``, ``seq``) of the last
  event the relays have published, in the commit order of ADR-0011. A relay
  holding the feed's advisory lock reads the settled events after it,
  publishes them in that order and moves it on (ADR-0016).
- ``events_cursor``: the index that read walks, (txid, seq) across tenants.
- ``events.traceparent`` / ``events.tracestate``: the W3C trace context the
  outbox row's headers carried, now kept with the event.
- ``jobplane.submit_job`` and ``jobplane.publish_event`` write the event row
  alone (no outbox row, no body: the relay builds it) and wake the relays
  with the subscribers' NOTIFY; ``job.queued``'s fingerprint is empty, as
  the state machine's.

The position starts at the oldest transaction still running: events of
older ones have outbox rows of their own, which the relay still publishes
as before; those of transactions that span the upgrade are published by the
feed (a few perhaps by both: at least once).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Nullable and without a default: no table rewrite.
_COLUMNS = (
    "ALTER TABLE events ADD COLUMN IF NOT EXISTS traceparent text, "
    "ADD COLUMN IF NOT EXISTS tracestate text"
)
_FEED = """
CREATE TABLE IF NOT EXISTS event_relay (
    id           boolean PRIMARY KEY DEFAULT true CHECK (id),
    txid         xid8 NOT NULL,
    seq          bigint NOT NULL,
    -- when the position last moved
    moved_at     timestamptz NOT NULL DEFAULT now()
)
"""
# The oldest transaction still running: every event of an older one has an
# outbox row (it was written before this migration), and a transaction still
# running may write its events after it with the functions below, which
# write none. Starting there publishes a few events twice at most (at least
# once allows it), never skips one, and reads no row of the table.
_START = """
INSERT INTO event_relay (txid, seq)
VALUES (pg_snapshot_xmin(pg_current_snapshot()), 0)
ON CONFLICT (id) DO NOTHING
"""
# Outside the migration's transaction: events are written meanwhile.
_INDEX = "CREATE INDEX CONCURRENTLY IF NOT EXISTS events_cursor ON events (txid, seq)"


# The functions as 0008 (submit_job) and 0009 (publish_event) wrote them,
# with these changes. submit_job: job.queued's envelope body was its outbox
# row's, and the relay builds it now, so neither is written; its
# fingerprint is empty, as the state machine writes a lifecycle event's (a
# PublishEvent taking its id is compared by value). publish_event: the trace
# context, checked before the insert, goes into the events row; the body,
# headers and outbox row after it go, and with them the relays' outbox
# wake-up.
_SUBMIT_JOB = "0010_submit_job.sql"
_PUBLISH_EVENT = "0010_publish_event.sql"


def upgrade() -> None:
    op.execute(_COLUMNS)
    op.execute(_FEED)
    op.execute(_START)
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    # CREATE OR REPLACE keeps both functions' grants.
    op.execute(frozen_sql(_SUBMIT_JOB, schema))
    op.execute(frozen_sql(_PUBLISH_EVENT, schema))
    with op.get_context().autocommit_block():
        op.execute(_INDEX)


def downgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql("0008_submit_job.sql", schema))
    op.execute(frozen_sql("0009_publish_event.sql", schema))
    # Events after the position were never published through an outbox row:
    # give them one, so the relay of revision 0009 publishes them.
    op.execute(
        """
        INSERT INTO outbox (id, tenant_id, kind, routing_key, correlation_id, body, headers,
                            order_key, order_seq)
        SELECT gen_random_uuid(), e.tenant_id, 'event', e.event_type, e.correlation_id,
               convert_to(json_build_object(
                   'v', 1, 'event_id', e.event_id, 'event_type', e.event_type,
                   'timestamp', replace(to_char(e.event_time AT TIME ZONE 'UTC',
                                'YYYY-MM-DD"T"HH24#MI#SS.US"Z"'), '#', ':'),
                   'tenant_id', e.tenant_id, 'project_id', e.project_id,
                   'correlation_id', e.correlation_id, 'causation_id', e.causation_id,
                   'payload', e.payload)::text, 'UTF8'),
               jsonb_strip_nulls(jsonb_build_object(
                   'correlation_id', e.correlation_id, 'causation_id', e.causation_id,
                   'traceparent', e.traceparent, 'tracestate', e.tracestate)),
               -- in front of anything a 0009 writer adds later (seq * 1024 + k)
               e.job_id, e.seq - (SELECT max(seq) FROM events) - 1
        FROM events e, event_relay r
        WHERE (e.txid, e.seq) > (r.txid, r.seq)
        ORDER BY e.txid, e.seq
        """
    )
    op.execute("DROP INDEX IF EXISTS events_cursor")
    op.execute("DROP TABLE IF EXISTS event_relay")
    op.execute(
        "ALTER TABLE events DROP COLUMN IF EXISTS tracestate, DROP COLUMN IF EXISTS traceparent"
    )
