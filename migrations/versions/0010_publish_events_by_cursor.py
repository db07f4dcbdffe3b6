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

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op
from sqlalchemy import text

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


def _revision(name: str) -> ModuleType:
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"jobplane_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _edit(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        if source.count(old) != 1:
            raise RuntimeError(f"migration 0010: expected one {old[:60]!r} in the function")
        source = source.replace(old, new)
    return source


# 0008's submit_job, its job.queued written without an outbox row.
_SUBMIT_OUTBOX_ROW = """                IF FOUND THEN
                    INSERT INTO outbox (id, tenant_id, kind, routing_key, correlation_id, body,
                                        headers, order_key, order_seq)
                    VALUES (gen_random_uuid(), v_tenant, 'event', 'job.queued', v_correlation,
                            convert_to(v_body, 'UTF8'),
                            jsonb_build_object('correlation_id', v_correlation), v_id,
                            1 * 1024 + 1023);
                    PERFORM pg_notify('jobplane_domain_events', v_tenant::text);
                END IF;
"""
_SUBMIT_NOTIFY = """                IF FOUND THEN
                    PERFORM pg_notify('jobplane_domain_events', v_tenant::text);
                END IF;
"""

# 0009's publish_event: the trace context into the events row, no outbox row.
_PUBLISH_INSERT = (
    """                        causation_id, payload, request_hash)
    VALUES (v_tenant, v_event_id::uuid, v_type, v_time, v_project, v_correlation, v_causation,
            v_payload,""",
    """                        causation_id, payload, traceparent, tracestate, request_hash)
    VALUES (v_tenant, v_event_id::uuid, v_type, v_time, v_project, v_correlation, v_causation,
            v_payload, v_traceparent, v_tracestate,""",
)


def _publish_event_sql(previous: str) -> str:
    start = previous.index("    -- The envelope of docs/events.md (jobplane.events.encode)")
    end = previous.index("    PERFORM pg_notify('jobplane_domain_events', v_tenant::text);")
    # The trace context is checked before the insert; the body, headers and
    # outbox row after it go, and with them the relays' outbox wake-up.
    return _edit(previous[:start] + previous[end:], [_PUBLISH_INSERT])


def _submit_job_sql(previous: str) -> str:
    # The envelope's body was the outbox row's; the relay builds it now. A
    # lifecycle event's fingerprint is empty, as the state machine writes it:
    # a PublishEvent taking its id is compared by value.
    start = previous.index("                v_body := '{{\"v\":' || '1'")
    end = previous.index("                INSERT INTO events (tenant_id, event_id, event_type,")
    return _edit(
        previous[:start] + previous[end:],
        [
            (_SUBMIT_OUTBOX_ROW, _SUBMIT_NOTIFY),
            (
                "sha256(convert_to(v_body, 'UTF8'))",
                "CAST('' AS bytea)",
            ),
        ],
    )


def upgrade() -> None:
    op.execute(_COLUMNS)
    op.execute(_FEED)
    op.execute(_START)
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    submit = _revision("0008_lifecycle_events.py")._SUBMIT_JOB
    op.execute(_submit_job_sql(submit).format(schema=schema))
    publish = _revision("0009_publish_event_in_transaction.py")._PUBLISH_EVENT
    # CREATE OR REPLACE keeps both functions' grants.
    op.execute(_publish_event_sql(publish).replace("@SCHEMA@", schema))
    with op.get_context().autocommit_block():
        op.execute(_INDEX)


def downgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(_revision("0008_lifecycle_events.py")._SUBMIT_JOB.format(schema=schema))
    publish = _revision("0009_publish_event_in_transaction.py")._PUBLISH_EVENT
    op.execute(publish.replace("@SCHEMA@", schema))
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
